"""noloco's benchmarks: each writes a markdown report and its JSON, with the command and the machine.

Run them from the repository root as modules (``python benchmarks/<name>.py`` reruns itself that way)::

    python -m benchmarks.compare        # training algorithms (and codecs, outer knobs) on one budget, in-process
    python -m benchmarks.throttled      # DDP / DiLoCo / NoLoCo on rate-limited links (as root: network namespaces)
    python -m benchmarks.collectives    # accuracy, bytes and speed of the compressed all-reduce; --nccl on 2 GPUs
    python -m benchmarks.kernels        # throughput of the noloco.quant kernels on a GPU; --cpu, --host
    python -m benchmarks.quantizers     # relative error of the noloco.quant formats
    python -m benchmarks.swarm          # the hivemind swarm exchange vs hivemind's own averager
    python -m benchmarks.gpu_train      # training throughput on one GPU (needs CUDA)

``--help`` on each says what it measures and takes. Reports go to ``runs/benchmarks/<name>/`` unless ``--out DIR``
says otherwise; ``--out docs/results`` rewrites the committed results. :mod:`benchmarks.common` holds what they
share (the machine description, the command line, ``--out``, the report writer).
"""
