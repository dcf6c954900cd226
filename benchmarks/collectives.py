"""Accuracy, bytes and speed of noloco's compressed all-reduce (issue 4; docs/design.md §3.4).

Modes (any combination; default all but --speed's larger sizes):

- ``--accuracy``: normalized error ``||out - mean||/||mean||`` vs the exact float64 mean, group sizes
  2..64 on the in-process fabric, for two_phase / ring / naive_ring x int4 / int8 / mxfp4, on Gaussian
  data and on real pseudo-gradients (a tiny ``noloco.models.llama.LLaMA`` pre-trained briefly on text,
  then each member trains 5 AdamW steps on its own slice of text: ``Δ_j = θ_j − φ``). Also: the error
  of one quantization of the exact mean, and bytes sent per member vs theory.
- ``--speed``: 2 processes over gloo on loopback (CPU): our int4/int8 two-phase and fp32 vs
  ``dist.all_reduce`` fp32 at 1..64 MiB of fp32 input.
- ``--repeat``: 1000 successive int4 two-phase calls on fresh Gaussian inputs, with and without
  error feedback: the norm of the accumulated error ``Σ_t (out_t − mean_t)``.
- ``--threshold``: per-message cost of encode+decode vs fp32, and the link speed below which
  compression pays (the basis of ``SMALL_MESSAGE_NUMEL``).
- ``--nccl`` (needs ≥ 2 GPUs; run alone): 2 processes, one GPU each, NCCL. For 2^19..2^29 values
  (1 MiB..1 GiB of bf16), largest first: ``dist.all_reduce`` (AVG) in bf16 and fp32 against
  :func:`noloco.collectives.device.allreduce_device` (mean) in int4, int8 and mxfp4 on bf16 and on fp32
  input; CUDA-event times (warm-up, then the median of ``--nccl-reps``, a barrier before each), the
  speed-up of int4 over NCCL bf16 and the crossover size, the error vs the exact mean and whether both
  ranks agree bit for bit (once per size and method), bytes sent per rank, and at the largest size the
  time of each phase (run one after the other) to explain the total. A size that fails (e.g. out of
  memory) is recorded and skipped; sizes stop when ``--nccl-budget`` seconds are spent.

Writes ``<out>/collectives.json`` and ``<out>/collectives.md`` (default out: runs/benchmarks/collectives/;
``--out docs/results`` rewrites the committed ones). ``--nccl`` writes ``<out>/collectives_nccl.json`` and
replaces only the NCCL section of ``<out>/collectives.md``; the other modes keep that section when they rewrite
the file (both take ``docs/results/collectives.md`` as the base when ``<out>`` has none).

    python -m benchmarks.collectives --accuracy --repeat --threshold --speed
    python -m benchmarks.collectives --nccl --out $OUT      # on a machine with >= 2 GPUs
    python -m benchmarks.collectives --out docs/results    # the committed docs/results/collectives.*
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/collectives.py`: rerun as `python -m benchmarks.collectives`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.collectives", *sys.argv[1:]])

import torch

from benchmarks import common
from noloco.collectives import HEADER_BYTES, REDUCTIONS, ReductionErrorFeedback, allreduce
from noloco.comm import LocalFabric
from noloco.quant import Packed, QuantSpec, dequantize, quantize

NCCL_BEGIN, NCCL_END = "<!-- nccl:begin -->", "<!-- nccl:end -->"

CODECS = ["int4", "int8", "mxfp4"]
SIZES = [2, 4, 8, 16, 32, 64]
ROOT = common.ROOT


def rel(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).norm() / exact.norm())


def pseudo_gradients(members: int, steps: int = 5) -> list[torch.Tensor]:
    """``members`` pseudo-gradients of a tiny LLaMA from one shared start, each on its own text."""
    from noloco.models.llama import LLaMA, ModelConfig

    text = b"".join(p.read_bytes() for p in sorted((ROOT / "noloco").rglob("*.py")))
    text += (ROOT / "docs" / "architecture.md").read_bytes()
    tokens = torch.tensor(list(text), dtype=torch.long)
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    seq, batch = 64, 8

    def batch_at(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
        rows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def train(model: LLaMA, gen: torch.Generator, n: int) -> None:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(n):
            x, y = batch_at(gen)
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    start = LLaMA(cfg, seed=0)
    train(start, torch.Generator().manual_seed(0), 20)  # off the init, like a slow model mid-run
    phi = torch.nn.utils.parameters_to_vector(start.parameters()).detach().clone()
    out = []
    for member in range(members):
        model = LLaMA(cfg, seed=0)
        torch.nn.utils.vector_to_parameters(phi.clone(), model.parameters())  # it aliases the vector
        train(model, torch.Generator().manual_seed(1000 + member), steps)
        out.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach() - phi)
    return out


def accuracy(report: dict) -> list[str]:
    torch.set_num_threads(1)
    data = {"gaussian": None, "pseudo-gradient": pseudo_gradients(max(SIZES))}
    numel_gauss = 64 * 1024
    gen = torch.Generator().manual_seed(0)
    data["gaussian"] = [torch.randn(numel_gauss, generator=gen) for _ in range(max(SIZES))]
    rows, results = [], []
    for dataset, pool in data.items():
        for n in SIZES:
            xs = pool[:n]
            exact = torch.stack([x.double() for x in xs]).mean(0)
            for codec in CODECS:
                one_q = rel(dequantize(quantize(exact.float(), codec)), exact)
                for algorithm in REDUCTIONS:  # the "algorithm" of the report: comm.reduction
                    fabric = LocalFabric(n)
                    t0 = time.perf_counter()
                    outs = fabric.run(
                        lambda t, xs=xs, codec=codec, reduction=algorithm: allreduce(
                            xs[t.rank], t, codec=codec, reduction=reduction, min_compress_numel=0, timeout=300
                        )
                    )
                    wall = time.perf_counter() - t0
                    identical = all(torch.equal(o, outs[0]) for o in outs)
                    sent = statistics.mean(t.counter.bytes_sent for t in fabric.transports)
                    numel = xs[0].numel()
                    bits = QuantSpec.parse(codec).bits_per_element(numel // n)
                    theory = 2 * (n - 1) / n * numel * bits / 8  # payload only, two-phase schedule
                    results.append(
                        dict(
                            dataset=dataset,
                            n=n,
                            codec=codec,
                            algorithm=algorithm,
                            error=rel(outs[0], exact),
                            one_quantization=one_q,
                            bytes_per_member=sent,
                            theory_bytes=theory,
                            numel=numel,
                            identical=identical,
                            seconds=wall,
                        )
                    )
                    print(
                        f"{dataset:15s} n={n:2d} {codec:5s} {algorithm:10s} err={results[-1]['error']:.4f} "
                        f"oneQ={one_q:.4f} bytes={sent:.0f} theory={theory:.0f} identical={identical} {wall:.1f}s",
                        flush=True,
                    )
    report["accuracy"] = results

    def err(dataset: str, n: int, codec: str, algorithm: str) -> float:
        return next(
            r["error"]
            for r in results
            if (r["dataset"], r["n"], r["codec"], r["algorithm"]) == (dataset, n, codec, algorithm)
        )

    for dataset in data:
        rows.append(f"\n#### {dataset} ({data[dataset][0].numel()} values per member)\n")
        rows.append("| codec | algorithm | " + " | ".join(f"n={n}" for n in SIZES) + " |")
        rows.append("|---|---|" + "---|" * len(SIZES))
        for codec in CODECS:
            for algorithm in REDUCTIONS:
                cells = " | ".join(f"{err(dataset, n, codec, algorithm):.4f}" for n in SIZES)
                rows.append(f"| {codec} | {algorithm} | {cells} |")
            one = {r["n"]: r["one_quantization"] for r in results if r["dataset"] == dataset and r["codec"] == codec}
            cells = " | ".join(f"{one[n]:.4f}" for n in SIZES)
            rows.append(f"| {codec} | *one quantization of the exact mean* | {cells} |")
        rows.append("\nTargets (issue 4):\n")
        rows.append(
            "| codec | two_phase n=64 / n=2 (≤ 1.2) | max over n of two_phase / one quantization (≤ 1.5) "
            "| ring / two_phase at n=16 (≤ 1.3) | naive_ring n=64 / n=2 |"
        )
        rows.append("|---|---|---|---|---|")
        for codec in CODECS:
            growth = err(dataset, 64, codec, "two_phase") / err(dataset, 2, codec, "two_phase")
            vs_one = max(
                err(dataset, n, codec, "two_phase")
                / next(
                    r["one_quantization"]
                    for r in results
                    if r["dataset"] == dataset and r["n"] == n and r["codec"] == codec
                )
                for n in SIZES
            )
            ring = err(dataset, 16, codec, "ring") / err(dataset, 16, codec, "two_phase")
            naive = err(dataset, 64, codec, "naive_ring") / err(dataset, 2, codec, "naive_ring")
            rows.append(f"| {codec} | {growth:.2f} | {vs_one:.2f} | {ring:.2f} | {naive:.2f} |")
    rows.append("\n#### Bytes sent per member (Gaussian, 65536 values), measured vs theory\n")
    rows.append(
        "Theory: two-phase sends `2 (n-1)/n · numel · bits/8` payload bytes per member (bits per element of "
        f"the codec at that segment size, scales included); measured adds one {HEADER_BYTES}-byte protocol "
        "header and one noloco.quant wire header (~30 bytes) per message. The rings send as many messages; "
        "`ring` pays for its wider partial sums.\n"
    )
    rows.append("| codec | n | two_phase | ring | naive_ring | theory (two-phase) | fp32 two-phase |")
    rows.append("|---|---|---|---|---|---|---|")
    for codec in CODECS:
        for n in (2, 16, 64):
            pick = {
                r["algorithm"]: r for r in results if r["dataset"] == "gaussian" and r["n"] == n and r["codec"] == codec
            }
            fp32 = 2 * (n - 1) / n * numel_gauss * 4
            rows.append(
                f"| {codec} | {n} | {pick['two_phase']['bytes_per_member']:.0f} | "
                f"{pick['ring']['bytes_per_member']:.0f} | {pick['naive_ring']['bytes_per_member']:.0f} | "
                f"{pick['two_phase']['theory_bytes']:.0f} | {fp32:.0f} |"
            )
    identical = all(r["identical"] for r in results)
    rows.append(f"\nEvery member returned bit-identical results in every run: **{identical}**.")
    return rows


def repeat(report: dict, calls: int = 1000, world: int = 4, numel: int = 8192) -> list[str]:
    torch.set_num_threads(1)
    checkpoints = [1, 10, 30, 100, 300, 1000]
    curves = {}
    for label, use_ef in (("no error feedback", False), ("error feedback", True)):
        fabric = LocalFabric(world)
        gen = torch.Generator().manual_seed(7)
        inputs = [[torch.randn(numel, generator=gen) for _ in range(world)] for _ in range(calls)]

        def fn(t, inputs=inputs, use_ef=use_ef):
            ef = ReductionErrorFeedback() if use_ef else None
            drift, curve = torch.zeros(numel, dtype=torch.float64), {}
            for call in range(calls):
                xs = inputs[call]
                exact = torch.stack([x.double() for x in xs]).mean(0)
                out = allreduce(xs[t.rank], t, codec="int4", error_feedback=ef, min_compress_numel=0, tag=f"r{call}")
                drift += out.double() - exact
                if call + 1 in checkpoints:
                    curve[call + 1] = float(drift.norm() / exact.norm())
            return curve

        t0 = time.perf_counter()
        curves[label] = fabric.run(fn)[0]
        print(f"repeat {label}: {curves[label]} ({time.perf_counter() - t0:.1f}s)", flush=True)
    report["repeat"] = {k: {str(c): v for c, v in curve.items()} for k, curve in curves.items()}
    rows = [
        f"\n{world} members, int4 two-phase, {numel} fresh Gaussian values per member per call. Entry: "
        "`||Σ_t (out_t − mean_t)|| / ||mean_T||` after T calls (one call's error alone is ~0.14).\n",
        "| T | " + " | ".join(curves) + " |",
        "|---|" + "---|" * len(curves),
    ]
    for c in checkpoints:
        rows.append(f"| {c} | " + " | ".join(f"{curves[k][c]:.3f}" for k in curves) + " |")
    return rows


def threshold(report: dict) -> list[str]:
    torch.set_num_threads(1)
    rows = [
        "\nOne message: encode (quantize + to_bytes) + decode (from_bytes + dequantize) vs fp32 bytes, one "
        "thread. *Pays below*: link speed under which the bytes saved outweigh the codec time "
        "`(4n − encoded) / (t_codec − t_fp32)`.\n",
        "| codec | values | codec µs | fp32 µs | bytes | fp32 bytes | pays below (MB/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    out = []
    for spec in ("int8", "int4", "mxfp4"):
        for n in (256, 1024, 4096, 16384, 65536, 262144):
            x = torch.randn(n)

            def codec(x=x, spec=spec, n=n):
                return dequantize(Packed.from_bytes(quantize(x, spec).to_bytes(), max_numel=n))

            def raw(x=x):
                return torch.frombuffer(bytearray(x.numpy().tobytes()), dtype=torch.float32)

            reps = max(5, min(500, 100000 // n))
            times = []
            for fn in (codec, raw):
                fn()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times.append((time.perf_counter() - t0) / reps)
            nbytes = len(quantize(x, spec).to_bytes())
            pays = (4 * n - nbytes) / max(times[0] - times[1], 1e-9) / 1e6
            out.append(dict(codec=spec, numel=n, codec_s=times[0], fp32_s=times[1], bytes=nbytes, pays_below_MBps=pays))
            rows.append(
                f"| {spec} | {n} | {times[0] * 1e6:.0f} | {times[1] * 1e6:.1f} | {nbytes} | {4 * n} | {pays:.1f} |"
            )
    report["threshold"] = out
    return rows


def _speed_worker(t, sizes_mib, reps):
    import torch.distributed as dist

    torch.set_num_threads(1)
    res = []
    for mib in sizes_mib:
        numel = mib * (1 << 20) // 4
        x = torch.randn(numel)
        for name in ("dist.all_reduce fp32", "dist.all_reduce bf16", "noloco fp32", "noloco int8", "noloco int4"):
            times = []
            for rep in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                if name.startswith("dist"):
                    y = x.clone() if "fp32" in name else x.to(torch.bfloat16)
                    dist.all_reduce(y)
                else:
                    allreduce(x, t, codec=name.split()[1], timeout=300, tag=f"speed/{mib}/{name}/{rep}")
                times.append(time.perf_counter() - t0)
            res.append(dict(mib=mib, method=name, seconds=statistics.median(times)))
    return res


def speed(report: dict, sizes_mib: list[int], reps: int) -> list[str]:
    from noloco.comm.torchdist import launch_local

    res = launch_local(_speed_worker, 2, sizes_mib, reps, timeout=600)[0]
    report["speed"] = res
    methods = list(dict.fromkeys(r["method"] for r in res))
    rows = [
        "\n2 processes over gloo on loopback, 1 thread each, median of "
        f"{reps}; milliseconds per all-reduce of the given fp32 input size.\n",
        "| size | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for mib in sizes_mib:
        cells = [next(r["seconds"] for r in res if r["mib"] == mib and r["method"] == m) * 1e3 for m in methods]
        rows.append(f"| {mib} MiB | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return rows


# ---- NCCL on 2 GPUs (--nccl) ------------------------------------------------------------------------

#: (label, "nccl" or a codec, input dtype); the first is the baseline of the speed-up column
NCCL_METHODS = [
    ("NCCL bf16", "nccl", torch.bfloat16),
    ("NCCL fp32", "nccl", torch.float32),
    ("int4 (bf16 in)", "int4", torch.bfloat16),
    ("int8 (bf16 in)", "int8", torch.bfloat16),
    ("mxfp4 (bf16 in)", "mxfp4", torch.bfloat16),
    ("int4 (fp32 in)", "int4", torch.float32),
    ("int8 (fp32 in)", "int8", torch.float32),
    ("mxfp4 (fp32 in)", "mxfp4", torch.float32),
]
#: methods whose phases are timed at the largest size
NCCL_PHASED = ["int4 (bf16 in)", "int8 (bf16 in)", "int4 (fp32 in)"]
TARGET_SPEEDUP, ANCHOR_MS = 2.0, 3.34  # issue 4: int4 vs NCCL bf16 at 1 GiB; NCCL bf16 measured on 2xH200


def _median_ms(fn, reps: int, warmup: int, rank: int, cuda: bool) -> float:
    """Median milliseconds of ``fn``: CUDA events on the current stream, a barrier and a sync before each
    repetition (``cuda=False``: the host clock, for the CPU smoke run)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _errors(out: torch.Tensor, inputs: list[torch.Tensor]) -> dict:
    """Relative L2 and relative max error of ``out`` vs the exact (float64) mean of ``inputs``."""
    exact = inputs[0].double()
    for x in inputs[1:]:
        exact += x.double()
    exact /= len(inputs)
    diff = out.double() - exact
    rel = float(diff.norm() / exact.norm())
    rel_max = float(diff.abs().max() / exact.abs().max())
    return {"rel_l2": rel, "rel_max": rel_max}


def _nccl_size(rank: int, world: int, numel: int, cfg: dict, report: dict) -> dict:
    """Time and check every method at ``numel`` values on this rank; returns this rank's row."""
    import torch.distributed as dist

    from noloco.collectives.device import allreduce_device
    from noloco.comm.base import ByteCounter

    cuda = cfg["device"] == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    row: dict = {"numel": numel, "ms": {}, "errors": {}, "checksum": {}, "bytes_sent": {}, "failed": {}}
    gen = torch.Generator(device=dev)
    inputs32 = [torch.randn(numel, device=dev, generator=gen.manual_seed(1000 + r)) for r in range(world)]
    inputs = {torch.float32: inputs32, torch.bfloat16: [x.to(torch.bfloat16) for x in inputs32]}
    reps = cfg["reps"] if numel >= 1 << 26 else 2 * cfg["reps"]
    avg = dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM  # gloo has no AVG
    for label, method, dtype in NCCL_METHODS:
        mine = inputs[dtype][rank]
        ok = True
        try:
            if method == "nccl":
                check = mine.clone()
                dist.all_reduce(check, op=avg)
                out = check.float() / (1 if avg == dist.ReduceOp.AVG else world)
                buf = mine.clone()
                row["ms"][label] = _median_ms(lambda buf=buf: dist.all_reduce(buf, op=avg), reps, 2, rank, cuda)
                row["bytes_sent"][label] = 2 * (world - 1) * mine.numel() * mine.element_size() // world  # ring
                del buf, check
            else:
                counter = ByteCounter()
                out = allreduce_device(mine, codec=method, min_compress_numel=0, counter=counter)
                row["bytes_sent"][label] = counter.bytes_sent
                run = lambda m=mine, c=method: allreduce_device(m, codec=c, min_compress_numel=0)  # noqa: E731
                row["ms"][label] = _median_ms(run, reps, 3, rank, cuda)
                if numel == cfg["largest"] and label in NCCL_PHASED:
                    runs = []
                    for _ in range(5):
                        phases: dict[str, float] = {}
                        allreduce_device(mine, codec=method, min_compress_numel=0, timings=phases)
                        runs.append(phases)
                    row.setdefault("phases", {})[label] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row["errors"][label] = _errors(out, inputs[dtype])
            bits = out.contiguous().view(torch.int32)
            row["checksum"][label] = [int(bits.sum(dtype=torch.int64)), int(bits[::7].sum(dtype=torch.int64))]
            del out
        except Exception as exc:  # noqa: BLE001 - recorded, the next method and size still run
            ok = False
            row["failed"][label] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            torch.cuda.empty_cache()
        agree = torch.tensor([1 if ok else 0], device=dev)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)  # both ranks go on to the next method together
    del inputs, inputs32
    torch.cuda.empty_cache()
    return row


def _nccl_worker(rank: int, world: int, port: int, cfg: dict, path: str) -> None:
    """One rank of ``--nccl``: every size, largest first; rank 0 rewrites ``path`` after each size."""
    from datetime import timedelta

    import torch.distributed as dist

    from noloco.quant import ops as quant_ops

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["timeout"]),
    )
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    started = time.perf_counter()
    report: dict = {"rows": [], "skipped": [], "kernels": quant_ops.pick_backend(None, dev, QuantSpec.parse("int4"))}
    try:
        for numel in cfg["sizes"]:
            over = torch.tensor([1 if time.perf_counter() - started > cfg["budget"] else 0], device=dev)
            free = torch.cuda.mem_get_info()[0] if cuda else float("inf")
            short = torch.tensor([1 if 48 * numel > 0.9 * free else 0], device=dev)
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
            dist.all_reduce(short, op=dist.ReduceOp.MAX)
            if over.item() or short.item():
                report["skipped"].append(
                    {"numel": numel, "why": "time budget spent" if over.item() else "not enough GPU memory"}
                )
                continue
            t0 = time.perf_counter()
            row = _nccl_size(rank, world, numel, cfg, report)
            rows: list = [None] * world
            dist.all_gather_object(rows, row)
            if rank == 0:
                merged = _merge_rows(rows)
                merged["seconds"] = time.perf_counter() - t0
                report["rows"].append(merged)
                report["seconds"] = time.perf_counter() - started
                Path(path).write_text(json.dumps(report, indent=1))
                print(_nccl_progress_line(merged), flush=True)
    finally:
        if rank == 0:
            report["seconds"] = time.perf_counter() - started
            Path(path).write_text(json.dumps(report, indent=1))
        if cuda:
            torch.cuda.synchronize()
        dist.destroy_process_group()


def _merge_rows(rows: list[dict]) -> dict:
    """One row from every rank's: the slowest rank's time, rank 0's errors, whether checksums agree."""
    first = rows[0]
    merged = {
        "numel": first["numel"],
        "ms": {},
        "errors": first["errors"],
        "bytes_sent": first["bytes_sent"],
        "identical": {},
        "failed": {},
    }
    for row in rows:
        merged["failed"].update(row["failed"])
    for label in first["ms"]:
        if all(label in row["ms"] for row in rows):
            merged["ms"][label] = max(row["ms"][label] for row in rows)
    for label in first["checksum"]:
        merged["identical"][label] = all(row["checksum"].get(label) == first["checksum"][label] for row in rows)
    if "phases" in first:
        merged["phases"] = {
            label: {k: max(row["phases"][label][k] for row in rows if label in row.get("phases", {})) for k in phases}
            for label, phases in first["phases"].items()
        }
    return merged


def _size_label(numel: int) -> str:
    mib = numel * 2 / (1 << 20)
    return f"{mib / 1024:g} GiB" if mib >= 1024 else f"{mib:g} MiB"


def _nccl_progress_line(row: dict) -> str:
    cells = " ".join(f"{label}={ms:.3f}" for label, ms in row["ms"].items())
    return f"nccl 2^{row['numel'].bit_length() - 1} ({_size_label(row['numel'])} bf16): {cells} ms"


def _crossover(rows: list[dict], ours: str, baseline: str) -> int | None:
    """Smallest numel from which ``ours`` is faster than ``baseline`` at every measured larger size."""
    best = None
    for row in sorted(rows, key=lambda r: -r["numel"]):
        if ours in row["ms"] and baseline in row["ms"] and row["ms"][ours] < row["ms"][baseline]:
            best = row["numel"]
        else:
            break
    return best


def _nccl_markdown(report: dict) -> list[str]:
    rows = sorted(report.get("rows", []), key=lambda r: r["numel"])
    lines = [NCCL_BEGIN, "### NCCL on 2 GPUs (`--nccl`)", ""]
    lines.append(
        f"Machine: {report.get('machine', '?')}. Command: `{report.get('command', '?')}` "
        f"({report.get('seconds', 0):.0f} s). Quantization kernels: {report.get('kernels', '?')}."
    )
    if report.get("topology"):
        lines += ["", "GPU link (`nvidia-smi topo -m`):", "", "```", report["topology"].rstrip(), "```"]
    if not rows:
        lines += ["", f"**No size completed.** {report.get('failure', '')}", NCCL_END]
        return lines
    labels = [m[0] for m in NCCL_METHODS]
    lines += [
        "",
        "Milliseconds per all-reduce of the mean of 2 ranks (median over repetitions, slowest rank; "
        "CUDA events, a barrier before each). NCCL is `dist.all_reduce(AVG)` in place in its input dtype; "
        "ours is `allreduce_device` (two-phase, reduce-scatter by `all_to_all_single`, all-gather of the "
        "encoded reduced segments) and returns fp32.",
        "",
        "| values | bf16 size | " + " | ".join(labels) + " | int4 / NCCL bf16 | int4 (fp32 in) / NCCL fp32 |",
        "|---|---|" + "---|" * (len(labels) + 2),
    ]
    for row in rows:
        ms = row["ms"]
        cells = [f"{ms[label]:.3f}" if label in ms else "—" for label in labels]

        def ratio(a: str, b: str, ms: dict = ms) -> str:
            return f"{ms[b] / ms[a]:.2f}×" if a in ms and b in ms else "—"

        lines.append(
            f"| 2^{row['numel'].bit_length() - 1} | {_size_label(row['numel'])} | "
            + " | ".join(cells)
            + f" | {ratio('int4 (bf16 in)', 'NCCL bf16')} | {ratio('int4 (fp32 in)', 'NCCL fp32')} |"
        )
    lines.append("")
    for ours, base in (
        ("int4 (bf16 in)", "NCCL bf16"),
        ("int8 (bf16 in)", "NCCL bf16"),
        ("int4 (fp32 in)", "NCCL fp32"),
    ):
        cross = _crossover(rows, ours, base)
        where = (
            f"from {_size_label(cross)} of bf16 (2^{cross.bit_length() - 1} values) up"
            if cross
            else "at no measured size"
        )
        lines.append(f"- Crossover: {ours} is faster than {base} {where}.")
    top = rows[-1]
    if "int4 (bf16 in)" in top["ms"] and "NCCL bf16" in top["ms"]:
        speedup = top["ms"]["NCCL bf16"] / top["ms"]["int4 (bf16 in)"]
        verdict = "**met**" if speedup >= TARGET_SPEEDUP else "**not met**"
        lines.append(
            f"- Target (issue 4) at {_size_label(top['numel'])}: int4 ≥ {TARGET_SPEEDUP}× faster than NCCL "
            f"bf16: {speedup:.2f}× ({top['ms']['int4 (bf16 in)']:.3f} ms vs {top['ms']['NCCL bf16']:.3f} ms; "
            f"anchor for NCCL bf16 {ANCHOR_MS} ms) — {verdict}."
        )
    identical = all(all(r["identical"].values()) for r in rows)
    lines.append(
        f"- Both ranks returned bit-identical results for every size and method: **{identical}** "
        "(two checksums of the output bits)."
    )
    failed = {(r["numel"], k): v for r in rows for k, v in r["failed"].items()}
    for (numel, label), why in failed.items():
        lines.append(f"- Failed: {label} at 2^{numel.bit_length() - 1}: `{why}`.")
    for skipped in report.get("skipped", []):
        lines.append(f"- Skipped 2^{skipped['numel'].bit_length() - 1}: {skipped['why']}.")
    if report.get("failure"):
        lines.append(f"- The run ended early: {report['failure']}")
    lines += [
        "",
        f"Error vs the exact mean and bytes sent per rank at {_size_label(top['numel'])} "
        f"(the largest size; relative L2 / relative max error):",
        "",
        "| method | rel. L2 error | rel. max error | MB sent per rank |",
        "|---|---|---|---|",
    ]
    for label in labels:
        if label in top["errors"]:
            e = top["errors"][label]
            lines.append(
                f"| {label} | {e['rel_l2']:.2e} | {e['rel_max']:.2e} | {top['bytes_sent'].get(label, 0) / 1e6:.1f} |"
            )
    worst = {
        label: max(r["errors"][label]["rel_l2"] for r in rows if label in r["errors"])
        for label in labels
        if any(label in r["errors"] for r in rows)
    }
    lines.append(
        "\nLargest relative L2 error over all sizes: "
        + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
        + ". NCCL bytes are the ring's `2 (n-1)/n · size`."
    )
    phased = next((r for r in reversed(rows) if "phases" in r), None)
    if phased:
        names = list(dict.fromkeys(k for p in phased["phases"].values() for k in p))
        lines += [
            "",
            f"Phases at {_size_label(phased['numel'])} (ms, run one after the other with no overlap of "
            "communication and compute, median of 5, slowest rank). `check` is the per-call all-gather of "
            "(numel, dtype, op, codec, encode ok); `own to fp32` converts the owner's unencoded segment for "
            "the fused decode-accumulate-requantize kernel (`requantize`); `decode` writes the fp32 output.",
            "",
            "| method | " + " | ".join(names) + " | sum | overlapped total |",
            "|---|" + "---|" * (len(names) + 2),
        ]
        for label, phases in phased["phases"].items():
            cells = " | ".join(f"{phases.get(k, 0.0):.3f}" for k in names)
            lines.append(f"| {label} | {cells} | {sum(phases.values()):.3f} | {phased['ms'].get(label, 0):.3f} |")
    lines.append(NCCL_END)
    return lines


def _splice_nccl(text: str, section: list[str]) -> str:
    """``text`` with its NCCL section replaced by ``section`` (appended if it has none)."""
    block = "\n".join(section)
    if NCCL_BEGIN in text and NCCL_END in text:
        head, rest = text.split(NCCL_BEGIN, 1)
        return head + block + rest.split(NCCL_END, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def nccl(out: Path, cfg: dict, command: str) -> None:
    """``--nccl``: spawn 2 NCCL ranks, wait (at most ``cfg['deadline']`` s), render whatever they measured."""
    import subprocess

    import torch.multiprocessing as mp

    from noloco.comm.torchdist import free_port

    # this machine's rule: NVLink multicast stays off (setdefault: never turns it on)
    for key, value in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ.setdefault(key, value)
    smoke = cfg["device"] == "cpu"
    if not smoke and torch.cuda.device_count() < 2:
        raise SystemExit(f"--nccl needs at least 2 GPUs; this machine has {torch.cuda.device_count()}")
    world = 2
    json_path = out / "collectives_nccl.json"
    json_path.unlink(missing_ok=True)
    started = time.perf_counter()
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_nccl_worker, args=(rank, world, port, cfg, str(json_path)), daemon=False)
        for rank in range(world)
    ]
    failure = ""
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(max(1.0, cfg["deadline"] - (time.perf_counter() - started)))
        if any(proc.is_alive() for proc in procs):
            failure = f"stopped after the {cfg['deadline']} s deadline"
        elif any(proc.exitcode for proc in procs):
            failure = f"worker exit codes {[proc.exitcode for proc in procs]}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
    report = json.loads(json_path.read_text()) if json_path.exists() else {}
    try:
        topology = (
            ""
            if smoke
            else subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
        )
    except Exception:  # noqa: BLE001 - informative only
        topology = ""
    if smoke:
        machine = f"SMOKE RUN of the benchmark code: 2 gloo processes on CPU, not a measurement; {common.machine()}"
    else:
        try:
            version = torch.cuda.nccl.version()
            nccl_version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - informative only
            nccl_version = "?"
        machine = f"{common.machine()}, NCCL {nccl_version} ({world} GPUs used)"
    report.update(
        command=command, failure=failure, topology=topology, wall_seconds=time.perf_counter() - started, machine=machine
    )
    report.setdefault("seconds", report["wall_seconds"])
    common.write_json(json_path, report, command=command, machine=machine)
    section = _nccl_markdown(report)
    base = out / "collectives.md"
    if not base.exists():
        base = common.RESULTS / "collectives.md"
    text = base.read_text() if base.exists() else ""
    (out / "collectives.md").write_text(_splice_nccl(text, section))
    print("\n".join(section))


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--repeat", action="store_true")
    parser.add_argument("--threshold", action="store_true")
    parser.add_argument("--speed-sizes", default="1,4,16,64", help="MiB of fp32 input, comma-separated")
    parser.add_argument("--speed-reps", type=int, default=3)
    parser.add_argument("--nccl", action="store_true", help="2 GPUs over NCCL: allreduce_device vs dist.all_reduce")
    parser.add_argument(
        "--nccl-smoke",
        action="store_true",
        help="the --nccl code on CPU over gloo, small sizes (checks the script, measures nothing)",
    )
    parser.add_argument("--nccl-sizes", default="19-29", help="log2 of the element counts, e.g. 19-29 or 20,24,29")
    parser.add_argument("--nccl-reps", type=int, default=10, help="timed repetitions (twice as many below 2^26)")
    parser.add_argument("--nccl-budget", type=float, default=300.0, help="seconds after which no new size starts")
    parser.add_argument("--nccl-deadline", type=float, default=450.0, help="seconds after which the ranks are killed")
    common.add_out(parser, "collectives")
    args = parser.parse_args()
    out = common.out_dir(args.out)
    command = common.command("collectives")
    if args.nccl or args.nccl_smoke:
        if args.nccl_smoke and args.nccl_sizes == "19-29":
            args.nccl_sizes = "12-14"
        if "-" in args.nccl_sizes:
            lo, hi = (int(v) for v in args.nccl_sizes.split("-"))
            logs = list(range(lo, hi + 1))
        else:
            logs = [int(v) for v in args.nccl_sizes.split(",")]
        sizes = [1 << k for k in sorted(logs, reverse=True)]  # largest first: the target size is measured first
        cfg = dict(
            sizes=sizes,
            largest=sizes[0],
            reps=args.nccl_reps,
            budget=args.nccl_budget,
            deadline=args.nccl_deadline,
            timeout=120,
            device="cpu" if args.nccl_smoke else "cuda",
        )
        nccl(out, cfg, command)
        if not (args.accuracy or args.speed or args.repeat or args.threshold):
            return
    if not (args.accuracy or args.speed or args.repeat or args.threshold):
        args.accuracy = args.repeat = args.threshold = args.speed = True
    machine = common.machine()
    report: dict = {"machine": machine, "command": command}
    sections = []
    t0 = time.perf_counter()
    if args.threshold:
        sections += ["\n### Small-message threshold (`--threshold`)"] + threshold(report)
    if args.accuracy:
        sections += ["\n### Accuracy and bytes (`--accuracy`)"] + accuracy(report)
    if args.repeat:
        sections += ["\n### Error feedback over 1000 calls (`--repeat`)"] + repeat(report)
    if args.speed:
        sizes = [int(s) for s in args.speed_sizes.split(",")]
        sections += ["\n### Speed (`--speed`, gloo on loopback, CPU)"] + speed(report, sizes, args.speed_reps)
        sections.append(
            "\nThe NCCL comparison on 2 GPUs (int4 vs `dist.all_reduce` bf16 at 1 MiB…1 GiB, target ≥ 2× "
            "at 1 GiB) is the `--nccl` section below."
        )
    report["seconds"] = time.perf_counter() - t0
    common.write_json(out / "collectives.json", report, command=command, machine=machine)
    text = [
        f"<!-- generated by benchmarks/collectives.py; `{command}` -->",
        "## Raw output of benchmarks/collectives.py",
        f"\nMachine: {machine}. Command: `{command}` ({report['seconds']:.0f} s).",
        *sections,
    ]
    base = out / "collectives.md"
    if not base.exists():
        base = common.RESULTS / "collectives.md"
    previous = base.read_text() if base.exists() else ""
    document = "\n".join(text) + "\n"
    if NCCL_BEGIN in previous and NCCL_END in previous:  # keep the GPU section this CPU run cannot redo
        document = _splice_nccl(
            document, [NCCL_BEGIN + previous.split(NCCL_BEGIN, 1)[1].split(NCCL_END, 1)[0] + NCCL_END]
        )
    (out / "collectives.md").write_text(document)
    print("\n".join(text))


if __name__ == "__main__":
    main()
