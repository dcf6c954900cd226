"""Throughput of the noloco.quant kernels (issue 3; docs/design.md §4).

GPU mode (default), one call on the device machine: the HBM copy ceiling, then for int4, int8, mxfp4, mxfp8 and
each op -- quantize, quantize+EF, dequantize, dequantize-accumulate (k=2 inputs), dequantize-accumulate-requantize
(acc + 1 input) -- on 2**28 bf16 and fp32 elements, four timings of the fused Triton path:

- **API (idle start)**: median of CUDA-event-timed single calls of the public function, each starting on an idle
  GPU (a sync before each): the host work before the launch is not hidden behind anything (Python, allocation,
  launch, and for the quantizing ops the queued 4-byte copy of the non-finite flag; its verdict is read when the
  payload is first used, not by the call);
- **API (back-to-back)**: ``B2B_CALLS`` calls of the public function issued back to back with CUDA events around the
  whole loop, divided by the number of calls (median of ``B2B_REPS`` loops), as ``triton.testing.do_bench``-style
  throughput is measured: a call's host work hides behind the previous call's kernel unless the call waits for the
  device. The payloads of the quantizing ops are kept and checked (``Packed.check``, their deferred NaN/Inf
  verdicts) after the timed loop. ``ErrorFeedback.quantize`` on one key reads the previous call's verdict before
  it reuses the residual, so its loop waits for each previous kernel (host and device alternate);
- **kernel**: the same call captured in a CUDA graph and replayed (mean): device time of the op's kernels alone
  (the flag copy is left out of the capture);
- **host**: wall time per call of the same public function on 2**16 elements, back to back (the kernel is ~µs):
  the host cost of one call (the payloads are dropped unchecked; a one-key ``ErrorFeedback`` waits as above);

then, as time allows (``--budget`` seconds from the start), torch eager of the torch reference for every row and
``torch.compile`` of it for a subset (the docs/design.md §4 anchors first). GB/s counts bytes read + written; % is
of the copy ceiling; targets are the issue's. ``--cpu`` measures the CPU path (the torch reference) at 2**22 instead.
``--host`` prints only the per-call host cost (on a CPU-only machine: Triton's real launcher logic against a
stand-in driver, launches themselves stubbed).

Writes ``<out>/kernels.json`` and ``<out>/kernels.md`` (default out: runs/benchmarks/kernels/; ``--out
docs/results`` rewrites the committed ones). In GPU mode the markdown's GPU section is regenerated and its
``## CPU`` section kept; ``--cpu`` regenerates only the ``## CPU`` section (the part kept comes from
``docs/results/kernels.md`` when ``<out>`` has none). The previous ``docs/results/kernels.json`` supplies the
"before" columns.

    python -m benchmarks.kernels [--out DIR] [--quick] [--cpu] [--host] [--log2n 28] [--no-compile]
                                 [--triton-only] [--sweep] [--budget SECONDS] [--previous JSON]

``--quick`` (< 2 min): bf16 input only, Triton rows only, fewer repetitions. ``--sweep`` first times each fused
kernel's launch configurations (``noloco.quant.triton_kernels.CONFIG``, kernel-only time) on the rows of
``SWEEP_ROWS`` (MX quantize has its own keys, decided by the bf16 MX quantize rows), keeps the fastest per key for
the table, records the sweep in the JSON and prints the chosen ``CONFIG`` as a dict ready to paste into
``triton_kernels.py`` (about 4 more minutes: run it as a separate call, ``--sweep --triton-only``). A full run is
budgeted to finish within 8 minutes on an H200: the Triton rows take about a minute, torch eager rows a few
seconds, and torch.compile rows are started only until ``--budget`` seconds (default 330) have passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/kernels.py`: rerun as `python -m benchmarks.kernels`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.kernels", *sys.argv[1:]])

import torch

from benchmarks import common

ROOT = common.ROOT

FORMATS = ["int4", "int8", "mxfp4", "mxfp8"]
OPS = ["quantize", "quantize+ef", "dequantize", "deq-acc(k=2)", "deq-acc-requant"]
SWEEP_CANDIDATES = [(1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)]
SWEEP_ROWS = {  # CONFIG key -> (format, input dtype, op) rows whose time decides it
    "quantize/paired": [("int4", "bfloat16", "quantize")],
    "quantize/paired:fp32": [("int4", "float32", "quantize")],
    "quantize/flat": [("int8", "bfloat16", "quantize"), ("int8", "float32", "quantize")],
    "quantize_mx/paired": [("mxfp4", "bfloat16", "quantize")],
    "quantize_mx/paired:fp32": [("mxfp4", "float32", "quantize")],
    "quantize_mx/flat": [("mxfp8", "bfloat16", "quantize")],
    "quantize_ef/paired": [("int4", "float32", "quantize+ef"), ("mxfp4", "bfloat16", "quantize+ef")],
    "quantize_ef/flat": [("int8", "float32", "quantize+ef"), ("mxfp8", "bfloat16", "quantize+ef")],
    "dequantize/paired": [("int4", "bfloat16", "dequantize"), ("mxfp4", "float32", "deq-acc(k=2)")],
    "dequantize/flat": [("int8", "float32", "deq-acc(k=2)"), ("mxfp8", "bfloat16", "dequantize")],
    "requantize/paired": [("int4", "bfloat16", "deq-acc-requant"), ("mxfp4", "float32", "deq-acc-requant")],
    "requantize/flat": [("int8", "bfloat16", "deq-acc-requant"), ("mxfp8", "float32", "deq-acc-requant")],
}
TARGETS = {"quantize": 0.80, "quantize+ef": 0.80, "dequantize": None, "deq-acc(k=2)": 0.85, "deq-acc-requant": 0.75}
MX_TARGET = 0.70
#: torch.compile rows, most important first (docs/design.md §4's anchors are int4 quantize/dequantize of bf16 input)
COMPILE_ORDER = [(f, "bfloat16", op) for f in FORMATS for op in ("quantize", "dequantize")] + [
    (f, "bfloat16", op) for op in ("quantize+ef", "deq-acc(k=2)", "deq-acc-requant") for f in FORMATS
]
HOST_LOG2N = 16
#: back-to-back API timing: calls per timed loop and loops (median)
B2B_CALLS = 20
B2B_REPS = 5


def target(fmt: str, op: str) -> float | None:
    """The issue's target (fraction of the copy ceiling) for a row, None where it sets none."""
    return MX_TARGET if fmt.startswith("mx") else TARGETS[op]


# ------------------------------------------------------------------------------------------------ timing


def timeit(fn, device: str, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds per call, each call timed on its own (CUDA events around it, then a sync)."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def back_to_back_time(fn, device: str, calls: int | None = None, reps: int | None = None) -> float:
    """Seconds per call of ``fn`` issued ``calls`` times back to back: CUDA events around the whole loop, divided
    by ``calls``; the median of ``reps`` loops (defaults: ``B2B_CALLS``, ``B2B_REPS``).

    This is how ``triton.testing.do_bench``-style throughput is measured: nothing waits between calls, so a call's
    host work overlaps the previous call's kernel unless the call itself waits for the device. Payloads returned
    by ``fn`` (the quantizing ops) are kept until the loop ends and then checked (:meth:`Packed.check`, their
    deferred NaN/Inf verdicts), outside the timing; other outputs are dropped as they come. One untimed loop first
    lets the allocator cache the blocks of the kept payloads.
    """
    from noloco.quant import Packed

    calls = B2B_CALLS if calls is None else calls
    reps = B2B_REPS if reps is None else reps

    def loop() -> list:
        kept = []
        for _ in range(calls):
            out = fn()
            if isinstance(out, Packed):
                kept.append(out)
        return kept

    for p in loop():
        p.check()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            kept = loop()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            kept = loop()
            times.append((time.perf_counter() - t0) / calls)
        for p in kept:  # after the timing: every payload's verdict (raises if an input held NaN/Inf)
            p.check()
        del kept
    times.sort()
    return times[len(times) // 2]


def graph_time(fn, reps: int = 20) -> float | None:
    """Mean seconds per call of ``fn`` replayed from a CUDA graph: the device time of the op's kernels alone.

    The quantizing ops' deferred non-finite check (a flag copy and an event after the kernel, not capturable) is
    switched off during warm-up and capture; the kernels still compute and write the flag. None if capture fails.
    """
    from noloco.quant import triton_kernels as tk

    saved = tk._verdict
    tk._verdict = lambda flag, call_id, defer, device: None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up on the capture stream: plans, flag words and compiled kernels exist before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / reps
    except Exception as err:  # report, keep going
        print(f"graph capture failed: {type(err).__name__}: {err}"[:200])
        return None
    finally:
        tk._verdict = saved


def host_time(fn, device: str, reps: int = 200, warmup: int = 20) -> float:
    """Wall seconds per call of ``fn`` called back to back (on a small tensor the host is the bottleneck)."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def op_bytes(op: str, spec, n: int, in_bytes: int) -> int:
    """Bytes an op must read and write: input values, payload(s), fp32 accumulator / residual."""
    payload = spec.payload_nbytes(n)
    return {
        "quantize": n * in_bytes + payload,
        "quantize+ef": n * in_bytes + 4 * n + payload + 4 * n,
        "dequantize": payload + 4 * n,
        "deq-acc(k=2)": 4 * n + 2 * payload + 4 * n,
        "deq-acc-requant": 4 * n + payload + payload,
    }[op]


def make_op(op: str, spec, x: torch.Tensor, backend: str, check_finite: bool = True):
    """A no-argument callable running ``op`` through the public API on ``x`` (inputs prepared outside)."""
    from noloco.quant import (
        ErrorFeedback,
        dequantize,
        dequantize_accumulate,
        dequantize_accumulate_requantize,
        quantize,
    )

    n = x.numel()
    be = "torch" if backend == "torch" else None
    p = quantize(x, spec, backend=be)
    p2 = quantize(x * 0.5, spec, backend=be)
    acc = torch.zeros(n, dtype=torch.float32, device=x.device)
    ef = ErrorFeedback(spec, backend=backend)
    return {
        "quantize": lambda: quantize(x, spec, backend=backend, check_finite=check_finite),
        "quantize+ef": lambda: ef.quantize(x),
        "dequantize": lambda: dequantize(p, backend=backend),
        "deq-acc(k=2)": lambda: dequantize_accumulate(acc, [p, p2], backend=backend),
        "deq-acc-requant": lambda: dequantize_accumulate_requantize(
            acc, [p], spec, backend=backend, check_finite=check_finite
        ),
    }[op]


def copy_ceiling(n: int, device: str) -> float:
    """GB/s of an fp32 device-to-device copy (bytes read + written)."""
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device)
    return 2 * 4 * n / t / 1e9


def make_input(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(n, device=device, generator=g).to(dtype)


# ------------------------------------------------------------------------------------------------- sweep


def sweep(n: int, ceiling: float, device: str = "cuda") -> list[dict]:
    """Time every SWEEP_CANDIDATES config of every CONFIG key; leave the fastest in CONFIG."""
    from noloco.quant import QuantSpec
    from noloco.quant import triton_kernels as tk

    xs = {"float32": make_input(n, torch.float32, device)}
    xs["bfloat16"] = xs["float32"].to(torch.bfloat16)
    results = []
    for key, rows in SWEEP_ROWS.items():
        best = None
        for cand in SWEEP_CANDIDATES:
            tk.CONFIG[key] = cand  # plans are keyed by the CONFIG entry: no stale launch parameters
            total, parts = 0.0, []
            try:
                for fmt, dt, op in rows:
                    spec = QuantSpec.parse(fmt)
                    fn = make_op(op, spec, xs[dt], "triton")
                    t = graph_time(fn, reps=10) or timeit(fn, device, reps=5, warmup=2)
                    pct = 100 * op_bytes(op, spec, n, xs[dt].element_size()) / t / 1e9 / ceiling
                    parts.append(f"{fmt}/{dt}/{op} {t * 1e3:.3f} ms {pct:.1f}%")
                    total += t
            except Exception as err:  # a config that fails to compile or run is skipped
                parts.append(f"error {type(err).__name__}: {err}"[:160])
                total = float("inf")
            results.append({"key": key, "elems": cand[0], "warps": cand[1], "total_ms": total * 1e3, "rows": parts})
            print(f"sweep {key:20} {cand!s:11} {total * 1e3:8.3f} ms  " + "; ".join(parts))
            sys.stdout.flush()
            if best is None or total < best[0]:
                best = (total, cand)
        tk.CONFIG[key] = best[1]
    del xs
    torch.cuda.empty_cache()
    print("chosen CONFIG (paste into noloco/quant/triton_kernels.py):")
    print(config_literal(tk.CONFIG))
    return results


def config_literal(config: dict) -> str:
    """``config`` as the Python source of ``triton_kernels.CONFIG``, ready to paste."""
    body = "".join(f"    {json.dumps(key)}: ({elems}, {warps}),\n" for key, (elems, warps) in config.items())
    return "CONFIG: dict[str, tuple[int, int]] = {\n" + body + "}"


# ---------------------------------------------------------------------------------------------- GPU run


def _row(fmt: str, dtype: torch.dtype, op: str, backend: str) -> dict:
    return {"format": fmt, "dtype": str(dtype).replace("torch.", ""), "op": op, "backend": backend}


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['format']:6} {r['dtype']:8} {r['op']:16} {r['backend']:13} ERROR {r['error']}")
        return
    extra = ""
    if "b2b_ms" in r:
        extra += f"  b2b {r['b2b_ms']:.3f} ms {r['b2b_pct_copy']:5.1f}%"
    if "kernel_ms" in r:
        extra += f"  kernel {r['kernel_ms']:.3f} ms {r['kernel_pct_copy']:5.1f}%"
    if "host_us" in r:
        extra += f"  host {r['host_us']:6.1f} us"
    print(
        f"{r['format']:6} {r['dtype']:8} {r['op']:16} {r['backend']:13} {r['ms']:9.3f} {r['GBps']:8.0f} "
        f"{r['pct_copy']:6.1f}{extra}"
    )
    sys.stdout.flush()


def measure_triton_rows(info: dict, dtypes, n: int, ceiling: float, quick: bool, device: str = "cuda") -> None:
    """API (idle start and back-to-back), kernel-only and host time of every (dtype, format, op) through the fused
    Triton path.

    ``device="cpu"`` (under TRITON_INTERPRET, tiny n) only exercises this code; it has no kernel-only time."""
    from noloco.quant import QuantSpec

    n_small = 1 << HOST_LOG2N
    for dtype in dtypes:
        x = make_input(n, dtype, device)
        xs = make_input(n_small, dtype, device)
        for fmt in FORMATS:
            spec = QuantSpec.parse(fmt)
            for op in OPS:
                nbytes = op_bytes(op, spec, n, x.element_size())
                row = _row(fmt, dtype, op, "triton")
                try:
                    fn = make_op(op, spec, x, "triton")
                    t = timeit(fn, device, reps=5 if quick else 10, warmup=2 if quick else 3)
                    row.update(
                        ms=t * 1e3, GBps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / 1e9 / ceiling, bytes=nbytes
                    )
                    tb = back_to_back_time(fn, device, reps=3 if quick else None)
                    row.update(
                        b2b_ms=tb * 1e3, b2b_GBps=nbytes / tb / 1e9, b2b_pct_copy=100 * nbytes / tb / 1e9 / ceiling
                    )
                    tg = graph_time(fn, reps=10 if quick else 20) if device == "cuda" else None
                    if tg is not None:
                        row.update(kernel_ms=tg * 1e3, kernel_pct_copy=100 * nbytes / tg / 1e9 / ceiling)
                    del fn
                    row["host_us"] = (
                        host_time(make_op(op, spec, xs, "triton"), device, reps=100 if quick else 200) * 1e6
                    )
                except Exception as err:  # keep going; report the failure in the table
                    row["error"] = f"{type(err).__name__}: {err}"[:200]
                info["rows"].append(row)
                _print_row(row)
        del x, xs
        if device == "cuda":
            torch.cuda.empty_cache()


def _baseline_row(
    row: dict, make_fn, nbytes: int, ceiling: float, device: str, warmup: int, setup_key: str | None = None
) -> dict:
    """``row`` with the timing of ``make_fn()`` (a torch reference op, eager or compiled), or with the error it
    raised; ``setup_key``: where to record the seconds from building the op to the end of its timing."""
    try:
        t0 = time.time()
        fn = make_fn()
        t = timeit(fn, device, reps=3, warmup=warmup)
        row.update(ms=t * 1e3, GBps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / 1e9 / ceiling, bytes=nbytes)
        if setup_key:
            row[setup_key] = time.time() - t0
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"[:200]
    return row


def measure_baselines(info: dict, dtypes, n: int, ceiling: float, args, t_start: float, device: str = "cuda") -> None:
    """torch eager (every row) then torch.compile (COMPILE_ORDER) of the reference, until the time budget."""
    from noloco.quant import QuantSpec

    skipped = 0
    for dtype in dtypes:
        x = make_input(n, dtype, device)
        for fmt in FORMATS:
            spec = QuantSpec.parse(fmt)
            for op in OPS:
                if time.time() - t_start > args.budget:
                    skipped += 1
                    continue
                eager = lambda op=op, spec=spec, x=x: make_op(op, spec, x, "torch")  # noqa: E731
                row = _baseline_row(
                    _row(fmt, dtype, op, "torch"),
                    eager,
                    op_bytes(op, spec, n, x.element_size()),
                    ceiling,
                    device,
                    warmup=1,
                )
                info["rows"].append(row)
                _print_row(row)
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    if not args.no_compile:
        x = {}
        for fmt, dt, op in COMPILE_ORDER:
            dtype = getattr(torch, dt)
            if dtype not in dtypes:
                continue
            if time.time() - t_start > args.budget:
                skipped += 1
                continue
            if dt not in x:
                x[dt] = make_input(n, dtype, device)
            spec = QuantSpec.parse(fmt)

            def compiled(op=op, spec=spec, dt=dt):
                torch._dynamo.reset()  # a fresh cache per row, or later rows would hit the recompile limit
                return torch.compile(make_op(op, spec, x[dt], "torch"))

            row = _baseline_row(
                _row(fmt, dtype, op, "torch.compile"),
                compiled,
                op_bytes(op, spec, n, x[dt].element_size()),
                ceiling,
                device,
                warmup=2,
                setup_key="compile_s",
            )
            info["rows"].append(row)
            _print_row(row)
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    info["baselines_skipped_for_budget"] = skipped


def _gpu_details() -> str:
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            .stdout.strip()
            .splitlines()[0]
        )
        driver, clock = (s.strip() for s in out.split(","))
        return f"driver {driver}, max SM clock {clock}"
    except Exception:
        return "driver unknown"


def run_gpu(args) -> dict:
    from noloco.quant import triton_kernels as tk

    t_start = time.time()
    n = 1 << args.log2n
    import triton

    info = {
        "device": "cuda",
        "machine": common.machine(),
        "gpu": torch.cuda.get_device_name(0),
        "details": _gpu_details(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "n": n,
        "host_n": 1 << HOST_LOG2N,
        "b2b_calls": B2B_CALLS,
        "command": common.command("kernels"),
        "rows": [],
        "direct_launch": tk._DIRECT,
    }
    ceiling = copy_ceiling(n, "cuda")
    info["copy_GBps"] = ceiling
    print(f"# {info['machine']} ({info['details']})  n = 2^{args.log2n}")
    print(f"copy ceiling: {ceiling:.0f} GB/s (fp32 copy, bytes read + written)")
    if args.sweep:
        info["sweep"] = sweep(n, ceiling)
    info["config"] = dict(tk.CONFIG)
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    print(f"{'fmt':6} {'dtype':8} {'op':16} {'backend':13} {'API ms':>9} {'GB/s':>8} {'%copy':>6}")
    measure_triton_rows(info, dtypes, n, ceiling, args.quick)
    info["triton_rows_s"] = time.time() - t_start
    if not args.triton_only and not args.quick:
        measure_baselines(info, dtypes, n, ceiling, args, t_start)
    info["total_s"] = time.time() - t_start
    plans = list(tk._PLANS.values())
    info["plans_launched_directly"] = f"{sum(bool(p.compiled) for p in plans)}/{len(plans)}"
    print(
        f"total {info['total_s']:.0f} s; plans with a directly launched compiled kernel: "
        f"{info['plans_launched_directly']}"
    )
    if args.sweep:  # again at the end, where it is easy to find
        print("chosen CONFIG (paste into noloco/quant/triton_kernels.py):")
        print(config_literal(tk.CONFIG))
    return info


# ---------------------------------------------------------------------------------------------- markdown


def _previous_rows(path: Path) -> dict:
    """(format, dtype, op, backend) -> row of a previous GPU run (incl. its recorded baselines), if any."""
    try:
        prev = json.loads(path.read_text())
    except Exception:
        return {}
    if prev.get("device") != "cuda":
        return {}
    rows = list(prev.get("baselines_previous_run", {}).get("rows", [])) + list(prev.get("rows", []))
    return {(r["format"], r["dtype"], r["op"], r["backend"]): r for r in rows if "error" not in r}


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def _met(pct: float | None, tgt: float | None) -> str:
    """Verdict cell: "yes", "**no**", or "" where there is no target or no measurement."""
    if tgt is None or pct is None:
        return ""
    return "yes" if pct >= 100 * tgt else "**no**"


def gpu_markdown(info: dict, prev: dict, prev_path: str) -> str:
    """The GPU section of docs/results/kernels.md."""
    cur = {(r["format"], r["dtype"], r["op"], r["backend"]): r for r in info["rows"] if "error" not in r}
    errors = [r for r in info["rows"] if "error" in r]
    ceiling = info["copy_GBps"]
    timings = ("pct_copy", "b2b_pct_copy", "kernel_pct_copy")  # API idle start, API back-to-back, kernel
    met = dict.fromkeys(timings, 0)
    n_targets = 0
    borrowed = False
    lines = []
    for r in info["rows"]:
        if r["backend"] != "triton" or "error" in r:
            continue
        key = (r["format"], r["dtype"], r["op"])
        tgt = target(r["format"], r["op"])
        n_targets += tgt is not None
        verdicts = {t: _met(r.get(t), tgt) for t in timings}
        for t, v in verdicts.items():
            met[t] += v == "yes"
        base = {}
        for be in ("torch", "torch.compile"):
            b = cur.get(key + (be,))
            mark = ""
            if b is None and key + (be,) in prev:
                b, mark, borrowed = prev[key + (be,)], "*", True
            base[be] = "" if b is None else f"{b['GBps']:.0f}{mark}"
        before = prev.get(key + ("triton",), {})
        lines.append(
            f"| {r['format']} | {r['dtype']} | {r['op']} | {_fmt(before.get('ms'), '.3f')} "
            f"| {_fmt(before.get('b2b_ms'), '.3f')} | {_fmt(before.get('kernel_ms'), '.3f')} "
            f"| {r['ms']:.3f} | {r['GBps']:.0f} | {r['pct_copy']:.1f} "
            f"| {_fmt(r.get('b2b_ms'), '.3f')} | {_fmt(r.get('b2b_pct_copy'), '.1f')} "
            f"| {_fmt(r.get('kernel_ms'), '.3f')} | {_fmt(r.get('kernel_pct_copy'), '.1f')} "
            f"| {_fmt(r.get('host_us'), '.0f')} | {'' if tgt is None else f'{100 * tgt:.0f}%'} "
            f"| {verdicts['pct_copy']} | {verdicts['b2b_pct_copy']} | {verdicts['kernel_pct_copy']} "
            f"| {base['torch']} | {base['torch.compile']} |"
        )
    out = [
        "# Kernel throughput (noloco.quant, issue 3)",
        "",
        f"## GPU: fused Triton kernels on one {info.get('gpu', info['machine'])}",
        "",
        "Command (device machine, repo root), after `python -m pytest -m gpu tests/quant -q`:",
        "",
        f"    {info['command']}",
        "",
        f"Machine: {info['machine']} ({info.get('details', '')}), "
        f"n = {info['n']} elements (host column: {info.get('host_n', '')}). Copy ceiling (fp32 device-to-device "
        f"copy, bytes read + written): **{ceiling:.0f} GB/s**. Run time: {info.get('total_s', 0):.0f} s "
        f"(Triton rows {info.get('triton_rows_s', 0):.0f} s). Direct launches of compiled kernels: "
        f"{'on' if info.get('direct_launch') else 'off'} ({info.get('plans_launched_directly', '?')} launch plans "
        "used them).",
        "",
        "GB/s counts the bytes each op must read and write (input values, payload, fp32 accumulator, fp32 "
        "residual). Timings per row, all of the public function (`quantize`, `ErrorFeedback.quantize`, "
        "`dequantize`, `dequantize_accumulate` with k = 2, `dequantize_accumulate_requantize` with an fp32 "
        "accumulator and one input) except the kernel column:",
        "",
        "- **API (idle start)**: median of CUDA-event-timed single calls, each starting on an idle GPU (a sync "
        "before each): the call's host work (Python, allocation, launch) is not hidden behind anything. The "
        "quantizing ops queue a 4-byte copy of the non-finite flag after their kernel; the verdict is read when "
        "the payload is first used (`Packed.check`, called by `to_bytes`, the decoders and the collectives), not by "
        "the call, so it is not timed here.",
        f"- **API (back-to-back)**: {info.get('b2b_calls', B2B_CALLS)} calls issued back to back with CUDA events "
        "around the whole loop, divided by the number of calls (median of several loops), as "
        "`triton.testing.do_bench`-style throughput is measured: a call's host work hides behind the previous "
        "call's kernel unless the call waits for the device. The quantizing ops' payloads are checked "
        "(`Packed.check`) after the timed loop. `ErrorFeedback.quantize` on one key reads the previous call's "
        "verdict before reusing the residual, so its loop waits for each previous kernel.",
        "- **kernel**: the same call captured in a CUDA graph and replayed (mean): the op's kernels alone (the "
        "flag copy is not captured).",
        f"- **host µs**: wall time per call on {info.get('host_n', 0)} elements, called back to back (the kernels "
        "take a few µs): the host cost of one call (payloads dropped unchecked).",
        "- **before**: the same columns of the previous run (`" + prev_path + "`; empty where it did not measure "
        "them).",
        '- **torch eager / torch.compile**: the torch reference (`backend="torch"`) in GB/s; `torch.compile` for '
        "the rows the time budget allowed (docs/design.md §4 anchors first)"
        + ("; `*`: not measured in this run, value from the previous run." if borrowed else "."),
        "",
        f"Targets from the issue: quantize(+EF) int4/int8 >= 80 % of copy, dequantize-accumulate >= 85 %, "
        f"dequantize-accumulate-requantize >= 75 %, MX formats >= 70 %. **Met: API idle start "
        f"{met['pct_copy']}/{n_targets}, API back-to-back {met['b2b_pct_copy']}/{n_targets}, kernel "
        f"{met['kernel_pct_copy']}/{n_targets}.**",
        "",
        "| format | input | op | before API ms | before b2b ms | before kernel ms | API ms | API GB/s | API % copy "
        "| b2b ms | b2b % copy | kernel ms | kernel % copy | host µs | target | met (API idle start) "
        "| met (API back-to-back) | met (kernel) | torch eager GB/s | torch.compile GB/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|:---:|:---:|---:|---:|",
        *lines,
        "",
        f"Launch configuration (`triton_kernels.CONFIG`): `{json.dumps(info.get('config', {}))}`. "
        "Raw rows (and the sweep, if run): `kernels.json`.",
    ]
    if errors:
        out += ["", "Errors:", ""] + [
            f"- {r['format']} {r['dtype']} {r['op']} {r['backend']}: {r['error']}" for r in errors
        ]
    if info.get("baselines_skipped_for_budget"):
        out += ["", f"{info['baselines_skipped_for_budget']} baseline rows skipped (time budget)."]
    return "\n".join(out) + "\n"


def cpu_markdown(info: dict) -> str:
    """The ``## CPU`` section of docs/results/kernels.md."""
    lines = [
        "## CPU: the path used on CPU (torch reference)",
        "",
        f"Command: `{info['command']}` on {info['machine']} (n = {info['n']} fp32). Copy ceiling measured "
        f"{info['copy_GBps']:.0f} GB/s. Each row is the median "
        "of 9 calls after 2 warm-up calls; throughput in MB/s of bytes read + written:",
        "",
        "| format | op | ms | MB/s |",
        "|---|---|---:|---:|",
    ]
    for r in info["rows"]:
        if "error" in r:
            lines.append(f"| {r['format']} | {r['op']} | error: {r['error'][:80]} | |")
        else:
            lines.append(f"| {r['format']} | {r['op']} | {r['ms']:.1f} | {r['GBps'] * 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, gpu: str | None = None, cpu: str | None = None) -> None:
    """Replace the GPU part (everything before ``## CPU``) and/or the ``## CPU`` section of ``path``; the other
    part is kept from ``path`` or, for a fresh output folder, from the repository's docs/results/kernels.md."""
    base = path if path.exists() else common.RESULTS / "kernels.md"
    old = base.read_text() if base.exists() else ""
    cut = old.find("\n## CPU")
    old_gpu, old_cpu = (old, "") if cut < 0 else (old[: cut + 1], old[cut + 1 :])
    gpu = gpu if gpu is not None else old_gpu
    cpu = cpu if cpu is not None else old_cpu
    path.write_text(gpu.rstrip("\n") + "\n\n" + cpu if cpu else gpu)


# ---------------------------------------------------------------------------------------------- CPU runs


def run_cpu(args) -> dict:
    """The torch reference on the CPU (the path ``backend=None`` takes for CPU tensors)."""
    from noloco.quant import QuantSpec

    n = 1 << args.log2n
    info = {
        "device": "cpu",
        "machine": common.machine(),
        "torch": torch.__version__,
        "n": n,
        "command": common.command("kernels"),
        "rows": [],
    }
    info["copy_GBps"] = copy_ceiling(n, "cpu")
    x = make_input(n, torch.float32, "cpu")
    for fmt in FORMATS:
        spec = QuantSpec.parse(fmt)
        for op in OPS:
            nbytes = op_bytes(op, spec, n, 4)
            row = _row(fmt, torch.float32, op, "torch")
            try:
                t = timeit(make_op(op, spec, x, "torch"), "cpu", reps=9, warmup=2)
                row.update(ms=t * 1e3, GBps=nbytes / t / 1e9, bytes=nbytes)
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:200]
            info["rows"].append(row)
            print(
                f"{fmt:6} {op:16} "
                + (row["error"] if "error" in row else f"{row['ms']:8.1f} ms {row['GBps'] * 1e3:7.0f} MB/s")
            )
    return info


def _fake_device_launches() -> None:
    """CPU-only measurement of the host path: Triton's real launcher logic (binding, specialization, cache
    lookup) runs against a stand-in driver, compilation returns a no-op compiled kernel, so every Python step of a
    call is timed and only the C launcher and the CUDA driver are left out."""
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import CompiledKernel
    from triton.runtime import driver

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def is_active(self):
            return True

    class Compiled(CompiledKernel):
        def __init__(self):
            self.function, self.packed_metadata = 0, (4, 1, 0)

        def launch_metadata(self, *args):
            return None

        def run(self, *args):
            pass

    driver.set_active(Driver())
    from noloco.quant import triton_kernels as tk

    tk._raw_stream = lambda index: 0
    for kernel in (tk._quantize_kernel, tk._dequantize_kernel, tk._requantize_kernel):

        def compile_stub(key, signature, device, constexprs, options, attrs, warmup, _k=kernel):
            ck = _k.device_caches[device][0][key] = Compiled()
            return ck

        kernel._do_compile = compile_stub


def run_host(args) -> dict:
    """Host cost per call of each public op on the Triton path (2**16 elements)."""
    from noloco.quant import QuantSpec

    device = "cpu" if args.cpu else "cuda"
    if device == "cpu":
        _fake_device_launches()
    n = 1 << HOST_LOG2N
    info = {
        "device": device,
        "mode": "host",
        "n": n,
        "command": common.command("kernels"),
        "rows": [],
        "machine": common.machine(),
    }
    backend = "triton" if device == "cpu" else None
    print(
        f"host time per call, n = 2^{HOST_LOG2N}, {device}"
        + (" (stand-in driver, launches stubbed)" if device == "cpu" else "")
    )
    for dtype in (torch.bfloat16, torch.float32):
        x = make_input(n, dtype, device)
        for fmt in FORMATS:
            spec = QuantSpec.parse(fmt)
            for op in OPS:
                variants = [True, False] if op in ("quantize", "deq-acc-requant") else [True]
                for check in variants:
                    us = host_time(make_op(op, spec, x, backend, check_finite=check), device, reps=1000) * 1e6
                    row = dict(_row(fmt, dtype, op, "triton"), host_us=us, check_finite=check)
                    info["rows"].append(row)
                    print(f"{fmt:6} {row['dtype']:8} {op:16} {'' if check else '(check_finite=False)':20} {us:7.1f} us")
    return info


def _write_json(path: Path, info: dict) -> None:
    common.write_json(path, info, command=info["command"], machine=info["machine"])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    common.add_out(ap, "kernels")
    ap.add_argument("--quick", action="store_true", help="GPU: bf16 input, Triton rows only, fewer reps (< 2 min)")
    ap.add_argument("--cpu", action="store_true", help="measure the CPU path (torch reference)")
    ap.add_argument("--host", action="store_true", help="only the host cost per call of each op")
    ap.add_argument("--log2n", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="GPU: skip the torch.compile baselines")
    ap.add_argument("--triton-only", action="store_true", help="GPU: skip the torch baselines")
    ap.add_argument("--kernel-time", action="store_true", help="(always on; kept for old command lines)")
    ap.add_argument("--sweep", action="store_true", help="GPU: tune the kernels' launch configurations first")
    ap.add_argument(
        "--formats",
        default=None,
        metavar="LIST",
        help="comma-separated specs to time instead of int4,int8,mxfp4,mxfp8, e.g. "
        "int2,int3,sign,topk:64/4096+int2 (the low-bit kernels and top-k)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=330.0,
        help="seconds from the start after which no further baseline row is started",
    )
    ap.add_argument(
        "--previous",
        default=str(common.RESULTS / "kernels.json"),
        help="JSON of a previous GPU run, for the 'before' columns",
    )
    args = ap.parse_args()
    if args.formats:
        from noloco.quant import QuantSpec

        try:
            FORMATS[:] = [str(QuantSpec.parse(f)) for f in args.formats.split(",")]
        except ValueError as err:
            print(f"error: --formats: {err}", file=sys.stderr)
            sys.exit(2)
    if args.log2n is None:
        args.log2n = 22 if args.cpu else 28
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --cpu")
    out = common.out_dir(args.out)
    if args.host:
        info = run_host(args)
        _write_json(out / "kernels_host.json", info)
        print(f"wrote {out / 'kernels_host.json'}")
        return
    if args.cpu:
        info = run_cpu(args)
        _write_json(out / "kernels_cpu.json", info)
        write_markdown(out / "kernels.md", cpu=cpu_markdown(info))
        print(f"wrote {out / 'kernels_cpu.json'} and the CPU section of {out / 'kernels.md'}")
        return
    prev_path = Path(args.previous)
    prev = _previous_rows(prev_path)  # read before a run with --out docs/results overwrites it
    info = run_gpu(args)
    _write_json(out / "kernels.json", info)
    try:
        shown = str(prev_path.resolve().relative_to(ROOT))
    except ValueError:
        shown = str(prev_path)
    write_markdown(out / "kernels.md", gpu=gpu_markdown(info, prev, shown))
    print(f"wrote {out / 'kernels.json'} and {out / 'kernels.md'}")


if __name__ == "__main__":
    main()
