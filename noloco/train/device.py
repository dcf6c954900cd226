"""Where a worker runs and in what precision: device placement, bf16 autocast, compile, MFU.

``device``: ``auto`` (CUDA when a GPU is visible, else the CPU), ``cpu``, ``cuda`` (workers placed
round robin over the visible GPUs by their index on this host) or ``cuda:N`` (every worker of this
process on GPU N). ``precision``: ``auto`` (bf16 on CUDA, fp32 on the CPU), ``bf16`` (autocast of
the forward and backward in bfloat16; the weights, gradients, AdamW state and every outer buffer
stay fp32: "fp32 master weights") or ``fp32``. ``compile: true`` wraps the module the loop calls in
``torch.compile`` (:class:`CompiledForward`). A GPU asked for on a machine without one is a config error (exit 2), found
before any work.

MFU (model FLOPs utilisation) counts ``6·N + 12·layers·dim·seq`` FLOPs per trained token (N the
parameters without the input embedding's lookup: the forward and backward matmuls, plus attention)
against ``log.peak_tflops``, by default the dense bf16 matmul rate measured on an H100/H200
(790 TFLOP/s, docs/design.md §8); on other devices MFU is reported only when ``log.peak_tflops``
is set.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading

import torch

from noloco.models.hf import ModelError

#: dense bf16 matmul TFLOP/s measured on one H200 (docs/design.md §8); H100 SXM is within a few %
MEASURED_PEAK_TFLOPS = {"H200": 790.0, "H100": 790.0}


class DeviceError(ValueError):
    """A device or precision this machine cannot provide; the message is one line for the user."""


#: bytes a worker holds per parameter at the least: fp32 weights, gradients and AdamW's two moments
TRAINING_BYTES_PER_PARAMETER = 16


def available_memory(name: str) -> tuple[int, str]:
    """(bytes, what they are) a model on device ``name`` can use: the memory of the GPUs it runs on (``cuda``: all
    visible ones, ``cuda:N``: that one), else the host memory available now (``MemAvailable``)."""
    if name.startswith("cuda") or (name == "auto" and torch.cuda.is_available()):
        indices = [int(name[5:])] if name.startswith("cuda:") else range(torch.cuda.device_count())
        total = sum(torch.cuda.get_device_properties(i).total_memory for i in indices)
        return total, f"the memory of {len(indices)} GPU(s)"
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "the host memory available"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host memory"


def check_model_memory(cfg, parameters: int, buffers: int = 0, bytes_per_parameter: int = TRAINING_BYTES_PER_PARAMETER,
                       copies: int = 1, what: str = "model") -> None:  # fmt: skip
    """ModelError unless ``copies`` models of ``parameters`` (each holding ``bytes_per_parameter`` a parameter and
    ``buffers`` fp32 values) fit in ``model.max_memory_gb`` (``auto``: :func:`available_memory` of ``cfg.device``).

    Called with sizes read from a config or a file, before anything of that size is allocated."""
    need = copies * (parameters * bytes_per_parameter + 4 * buffers)
    limit = cfg.model.get("max_memory_gb", "auto")
    if limit == "auto":
        have, source = available_memory(str(cfg.device))
        key = "set model.max_memory_gb to"
    else:
        have, source = int(float(limit) * 2**30), f"model.max_memory_gb={limit}"
        key = "raise model.max_memory_gb to"
    if need > have:
        raise ModelError(f"the {what} ({parameters:,} parameters{f' × {copies} workers' if copies > 1 else ''}) "
                         f"needs at least {need / 2**30:,.1f} GB, more than {source} ({have / 2**30:,.1f} GB): "
                         f"make it smaller or {key} a larger bound if it fits")  # fmt: skip


def check_device(name: str) -> None:
    """Raise :class:`DeviceError` unless ``name`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) can run here."""
    if name in ("auto", "cpu"):
        return
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise DeviceError(f"device={name!r} is not one of auto, cpu, cuda, cuda:N")
    # device_count asks NVML where it can, which leaves CUDA uninitialized: a supervisor (run.restarts) checks the
    # config before it forks the run, and a process that has initialized CUDA cannot use it in a forked child
    count = torch.cuda.device_count()
    if count == 0:
        raise DeviceError(f"device={name} but no CUDA GPU is visible here (torch.cuda.device_count() is 0); "
                          "use device=cpu or device=auto")  # fmt: skip
    if name.startswith("cuda:") and int(name[5:]) >= count:
        raise DeviceError(f"device={name} but this machine has {count} visible GPU(s)")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (taskset, cgroups' cpusets, ``noloco-fleet
    --cpus-per-host``) where the OS reports one, else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS and Windows have no affinity call
        return os.cpu_count() or 1


def local_index(rank: int) -> int:
    """This worker's index among the workers of its host: ``LOCAL_RANK`` under torchrun, else ``rank``."""
    return int(os.environ.get("LOCAL_RANK", rank))


def worker_device(name: str, index: int) -> torch.device:
    """The device of the worker with host-local ``index`` (round robin over the visible GPUs)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device(name)


def warm_device(name: str) -> threading.Thread:
    """Start CUDA for device ``name`` in a thread of its own, returned started; join it before the worker's first
    use (and before the process forks). A restarted swarm peer does this beside its checkpoint check, so that its
    worker finds the GPU's context and a cuBLAS handle made (about a second on an H100) instead of making them before
    its first step. Where the worker's GPU is not known yet (``cuda``/``auto`` with several GPUs: a peer's index
    comes from its id) only the driver starts. Beside it, on every device, a second thread imports torch's compiler
    stack (``torch._dynamo``: about a second), which the first AdamW's construction imports (torch wraps
    ``add_param_group`` in it) and ``compile=true`` needs; the returned thread ends after both. Nothing of CUDA on a
    CPU; a failure here is left to show, with its message, where the worker starts."""

    def compiler() -> None:
        with contextlib.suppress(Exception):
            import torch._dynamo  # noqa: F401

    def run() -> None:
        imports = threading.Thread(target=compiler, name="noloco-warm-imports", daemon=True)
        imports.start()
        try:
            _start_cuda(name)
        finally:
            imports.join()

    thread = threading.Thread(target=run, name="noloco-warm-device", daemon=True)
    thread.start()
    return thread


def _start_cuda(name: str) -> None:
    """The CUDA context, the allocator and a cuBLAS handle for ``name`` (only the driver where its index is unknown)."""
    if name == "cpu" or not torch.cuda.is_available():
        return
    with contextlib.suppress(Exception):
        count = torch.cuda.device_count()
        index = int(name[5:]) if name.startswith("cuda:") and name[5:].isdigit() else (0 if count == 1 else None)
        if index is None or index >= count:
            torch.cuda.init()
            return
        square = torch.ones(64, 64, device=torch.device("cuda", index), dtype=torch.bfloat16)
        (square @ square).sum().item()  # the context, the allocator and this thread's cuBLAS handle (pooled)


#: held while a compiled module of this process runs forward or backward (see :class:`CompiledForward`)
COMPILE_LOCK = threading.Lock()


#: compiled functions shared by the identical models of one process (see :class:`CompiledForward`)
_SHARED_GRAPHS: dict[tuple, object] = {}


def _signature(module: torch.nn.Module) -> tuple:
    """What makes two modules interchangeable for one compiled graph: class, names, shapes, dtypes, devices."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return (type(module), tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in tensors))


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s structure with every parameter and buffer on the meta device: no memory, and no worker's tensors.

    The shared graph's template must own none of the tensors a worker passes in: a worker whose tensors are the
    template's own makes dynamo guard on that identity (``tensors[name] is template._buffers[name]``), and the
    next worker then compiles a second graph.
    """
    memo: dict[int, torch.Tensor] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        is_parameter = isinstance(t, torch.nn.Parameter)
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if is_parameter else meta
    return copy.deepcopy(module, memo)


def _shared_graph(module: torch.nn.Module):
    """One ``torch.compile``'d functional call per model signature in this process; a meta copy of ``module`` is
    the template."""
    key = _signature(module)
    with COMPILE_LOCK:
        if key not in _SHARED_GRAPHS:
            template = _meta_copy(module)

            def run(tensors: dict, *args, **kwargs):
                return torch.func.functional_call(template, tensors, args, kwargs, tie_weights=False)

            _SHARED_GRAPHS[key] = torch.compile(run)
        return _SHARED_GRAPHS[key]


class CompiledForward:
    """``torch.compile(module)`` that K worker threads of one process can share safely, compiled once.

    K simulated workers (``backend=local``) hold K models of one structure. Compiling each would cost K
    compilations, one after another (compilation holds the GIL), so the models share one compiled graph: a
    functional call of the first model's code with each worker's own parameters and buffers as inputs
    (``shared``; a model wrapped in DDP, whose hooks need the module itself, compiles alone). While
    torch.compile traces it sets a process-wide flag, and a compiled module called from another thread
    meanwhile fails ("using FX to symbolically trace a dynamo-optimized function"), so every forward and
    backward of a compiled model runs under one lock: only the host-side launch is serialized (the GIL
    serializes it anyway); the GPU work stays asynchronous.
    """

    def __init__(self, module: torch.nn.Module, shared: bool = True):
        self.module = module
        self.shared = shared and not isinstance(module, torch.nn.parallel.DistributedDataParallel)
        self.compiled = _shared_graph(module) if self.shared else torch.compile(module)
        # this worker's own tensors, by name (tied weights under both names), gathered once: training and
        # checkpoint loads write into them in place, so the dict stays valid and no step walks the module
        self.tensors = {**dict(module.named_parameters(remove_duplicate=False)),
                        **dict(module.named_buffers(remove_duplicate=False))} if self.shared else None  # fmt: skip

    def __call__(self, *args, **kwargs):
        if self.shared:
            with COMPILE_LOCK:
                return self.compiled(self.tensors, *args, **kwargs)
        with COMPILE_LOCK:
            return self.compiled(*args, **kwargs)

    @staticmethod
    def backward(loss: torch.Tensor) -> None:
        with COMPILE_LOCK:  # the first backward compiles the backward graph
            loss.backward()


def backward(forward, loss: torch.Tensor) -> None:
    """``loss.backward()``, under :data:`COMPILE_LOCK` when ``forward`` is a :class:`CompiledForward`."""
    if isinstance(forward, CompiledForward):
        forward.backward(loss)
    else:
        loss.backward()


def worker_stream(device: torch.device):
    """The context a worker runs in: on CUDA, a stream of its own for everything this thread queues.

    K simulated workers share one GPU (``backend=local``): on one shared stream, every host read of one
    worker (its loss, the outer step's checks and its message copies) would wait for all the kernels the
    other workers had queued before it. On its own stream a worker waits for its own work only, and the
    GPU still runs the K streams' kernels back to back. A no-op on the CPU.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def synchronize(device: torch.device) -> None:
    """Wait for the work this thread queued on ``device`` (its stream, not the whole GPU); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` → ``bf16`` on CUDA, ``fp32`` on the CPU; ``bf16``/``fp32`` as given."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(device: torch.device, precision: str):
    """The context the forward and backward run in: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def flops_per_token(params: int, embedding_params: int, layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·(N − input embedding) + 12·layers·dim·seq (forward + backward)."""
    return 6.0 * (params - embedding_params) + 12.0 * layers * dim * seq_len


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """The peak MFU is measured against: ``configured``, else the measured rate of a known GPU, else None."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in MEASURED_PEAK_TFLOPS.items() if key in name), None)
