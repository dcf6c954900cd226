"""Throughput of the noloco.quant kernels (issue 3; DESIGN §4).

GPU mode (default): measures the HBM copy ceiling, then for int4, int8, mxfp4, mxfp8 and each op --
quantize, quantize+EF, dequantize, dequantize-accumulate (k=2 inputs), dequantize-accumulate-requantize
(acc + 1 input) -- on 2**28 bf16 and fp32 elements: time, GB/s (bytes read + written) and % of the copy
ceiling for the fused Triton kernels, next to torch eager and (for a subset, to bound compile time)
torch.compile of the torch reference. ``--cpu`` reports the CPU path (the torch reference) at 2**22.

Writes ``<out>/kernels.json`` and ``<out>/kernels.md`` (default out: docs/results).

    python benchmarks/kernels.py [--out DIR] [--cpu] [--log2n 28] [--no-compile] [--triton-only] [--sweep]
                                  [--kernel-time]

``--sweep`` first times each fused kernel's launch configurations (elements and warps per program,
``noloco.quant.triton_kernels.CONFIG``) on two representative rows each, keeps the fastest per kernel for
the table and records the sweep in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from noloco.quant import (  # noqa: E402
    ErrorFeedback,
    QuantSpec,
    dequantize,
    dequantize_accumulate,
    dequantize_accumulate_requantize,
    quantize,
)

FORMATS = ["int4", "int8", "mxfp4", "mxfp8"]
OPS = ["quantize", "quantize+ef", "dequantize", "deq-acc(k=2)", "deq-acc-requant"]
SWEEP_CANDIDATES = [(1024, 8), (2048, 4), (4096, 4), (4096, 8)]
SWEEP_ROWS = {  # CONFIG key -> (format, input dtype, op) rows whose time decides it
    "quantize/paired": [("int4", "bfloat16", "quantize"), ("mxfp4", "float32", "quantize")],
    "quantize/flat": [("int8", "bfloat16", "quantize"), ("mxfp8", "float32", "quantize")],
    "quantize_ef/paired": [("int4", "float32", "quantize+ef"), ("mxfp4", "bfloat16", "quantize+ef")],
    "quantize_ef/flat": [("int8", "float32", "quantize+ef"), ("mxfp8", "bfloat16", "quantize+ef")],
    "dequantize/paired": [("int4", "bfloat16", "dequantize"), ("mxfp4", "float32", "deq-acc(k=2)")],
    "dequantize/flat": [("int8", "float32", "deq-acc(k=2)"), ("mxfp8", "bfloat16", "dequantize")],
    "requantize/paired": [("int4", "bfloat16", "deq-acc-requant"), ("mxfp4", "float32", "deq-acc-requant")],
    "requantize/flat": [("int8", "bfloat16", "deq-acc-requant"), ("mxfp8", "float32", "deq-acc-requant")],
}
TARGETS = {"quantize": 0.80, "quantize+ef": 0.80, "dequantize": None, "deq-acc(k=2)": 0.85,
           "deq-acc-requant": 0.75}


def timeit(fn, device: str, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds per call."""
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


def graph_time(fn, reps: int = 20) -> float | None:
    """Mean seconds per call of ``fn`` replayed from a CUDA graph (reps replays): the device time of the
    op's kernels alone (no Python, launch or allocation cost; the quantize ops' non-finite flag is
    still written but its host read, which needs a sync, is left out). None if it cannot be captured."""
    from noloco.quant import triton_kernels as tk

    saved = tk._raise_if_flagged
    tk._raise_if_flagged = lambda flag: None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
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
        tk._raise_if_flagged = saved


def op_bytes(op: str, spec: QuantSpec, n: int, in_bytes: int) -> int:
    payload = spec.payload_nbytes(n)
    return {
        "quantize": n * in_bytes + payload,
        "quantize+ef": n * in_bytes + 4 * n + payload + 4 * n,
        "dequantize": payload + 4 * n,
        "deq-acc(k=2)": 4 * n + 2 * payload + 4 * n,
        "deq-acc-requant": 4 * n + payload + payload,
    }[op]


def make_op(op: str, spec: QuantSpec, x: torch.Tensor, backend: str):
    n = x.numel()
    p = quantize(x, spec, backend="torch" if backend == "torch" else None)
    p2 = quantize(x * 0.5, spec, backend="torch" if backend == "torch" else None)
    acc = torch.zeros(n, dtype=torch.float32, device=x.device)
    ef = ErrorFeedback(spec, backend=backend)
    return {
        "quantize": lambda: quantize(x, spec, backend=backend),
        "quantize+ef": lambda: ef.quantize(x),
        "dequantize": lambda: dequantize(p, backend=backend),
        "deq-acc(k=2)": lambda: dequantize_accumulate(acc, [p, p2], backend=backend),
        "deq-acc-requant": lambda: dequantize_accumulate_requantize(acc, [p], spec, backend=backend),
    }[op]


def copy_ceiling(n: int, device: str) -> float:
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device)
    return 2 * 4 * n / t / 1e9


def sweep(n: int, ceiling: float, device: str = "cuda") -> list[dict]:
    """Time every SWEEP_CANDIDATES config of every CONFIG key; leave the fastest in CONFIG."""
    from noloco.quant import triton_kernels as tk

    g = torch.Generator(device=device).manual_seed(1)
    xs = {"float32": torch.randn(n, device=device, generator=g)}
    xs["bfloat16"] = xs["float32"].to(torch.bfloat16)
    results = []
    for key, rows in SWEEP_ROWS.items():
        best = None
        for cand in SWEEP_CANDIDATES:
            tk.CONFIG[key] = cand
            total, parts = 0.0, []
            try:
                for fmt, dt, op in rows:
                    spec = QuantSpec.parse(fmt)
                    t = timeit(make_op(op, spec, xs[dt], "triton"), device, reps=5 if device == "cuda" else 3,
                               warmup=2 if device == "cuda" else 1)
                    pct = 100 * op_bytes(op, spec, n, xs[dt].element_size()) / t / 1e9 / ceiling
                    parts.append(f"{fmt}/{dt}/{op} {t * 1e3:.3f} ms {pct:.1f}%")
                    total += t
            except Exception as err:  # a config that fails to compile or run is skipped
                parts.append(f"error {type(err).__name__}: {err}"[:160])
                total = float("inf")
            results.append({"key": key, "elems": cand[0], "warps": cand[1], "total_ms": total * 1e3,
                            "rows": parts})
            print(f"sweep {key:20} {cand!s:11} {total * 1e3:8.3f} ms  " + "; ".join(parts))
            sys.stdout.flush()
            if best is None or total < best[0]:
                best = (total, cand)
        tk.CONFIG[key] = best[1]
    del xs
    if device == "cuda":
        torch.cuda.empty_cache()
    print("chosen CONFIG:", json.dumps(tk.CONFIG))
    return results


def run(args) -> dict:
    device = "cpu" if args.cpu else "cuda"
    n = 1 << args.log2n
    machine = (torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine())
    info = {"device": device, "machine": machine, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "n": n, "command": " ".join(["python"] + sys.argv), "rows": []}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    ceiling = copy_ceiling(n, device)
    info["copy_GBps"] = ceiling
    print(f"# {machine}  torch {torch.__version__}  triton {info['triton']}  n = 2^{args.log2n}")
    print(f"copy ceiling: {ceiling:.0f} GB/s (fp32 copy, bytes read + written)")
    if device == "cuda":
        from noloco.quant import triton_kernels as tk

        if args.sweep:
            info["sweep"] = sweep(n, ceiling)
        info["config"] = dict(tk.CONFIG)
    backends = ["torch"] if device == "cpu" else (["triton"] if args.triton_only else ["triton", "torch"])
    compile_subset = {("int4", "quantize"), ("int4", "dequantize")}  # DESIGN §4's anchors
    dtypes = [torch.bfloat16, torch.float32] if device == "cuda" else [torch.float32]
    t_start = time.time()
    header = f"{'fmt':6} {'dtype':5} {'op':16} {'backend':14} {'ms':>9} {'GB/s':>8} {'%copy':>6}"
    print(header)
    for dtype in dtypes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(n, device=device, generator=g).to(dtype)
        for fmt in FORMATS:
            spec = QuantSpec.parse(fmt)
            for op in OPS:
                nbytes = op_bytes(op, spec, n, x.element_size())
                variants = list(backends)
                if device == "cuda" and not args.no_compile and dtype == torch.bfloat16 \
                        and (fmt, op) in compile_subset:
                    variants.append("torch.compile")
                if time.time() - t_start > args.budget:  # keep the fused kernels' rows, drop baselines
                    variants = variants[:1]
                for be in variants:
                    try:
                        if be == "torch.compile":
                            fn = torch.compile(make_op(op, spec, x, "torch"))
                        else:
                            fn = make_op(op, spec, x, be)
                        t = timeit(fn, device, reps=5 if be != "triton" else 10,
                                   warmup=2 if be != "torch.compile" else 3)
                        gbps = nbytes / t / 1e9
                        row = {"format": fmt, "dtype": str(dtype).replace("torch.", ""), "op": op,
                               "backend": be, "ms": t * 1e3, "GBps": gbps, "pct_copy": 100 * gbps / ceiling,
                               "bytes": nbytes}
                        if be == "triton" and device == "cuda" and args.kernel_time:
                            tg = graph_time(fn)
                            if tg is not None:
                                row.update(kernel_ms=tg * 1e3, kernel_pct_copy=100 * nbytes / tg / 1e9 / ceiling)
                    except Exception as err:  # keep going; report the failure in the table
                        row = {"format": fmt, "dtype": str(dtype).replace("torch.", ""), "op": op,
                               "backend": be, "error": f"{type(err).__name__}: {err}"[:200]}
                    info["rows"].append(row)
                    if "error" in row:
                        print(f"{fmt:6} {row['dtype']:5} {op:16} {be:14} ERROR {row['error']}")
                    else:
                        kern = (f"  kernel {row['kernel_ms']:.3f} ms {row['kernel_pct_copy']:5.1f}%"
                                if "kernel_ms" in row else "")
                        print(f"{fmt:6} {row['dtype']:5} {op:16} {be:14} {row['ms']:9.3f} {row['GBps']:8.0f} "
                              f"{row['pct_copy']:6.1f}{kern}")
                    sys.stdout.flush()
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    return info


def to_markdown(info: dict) -> str:
    lines = [f"# Kernel throughput ({info['device']})", "",
             f"Command: `{info['command']}`  ",
             f"Machine: {info['machine']}, {info['cpu_count']} CPUs; torch {info['torch']}, "
             f"triton {info['triton']}; n = {info['n']} elements.  ",
             f"Copy ceiling (fp32 device copy, bytes read + written): **{info['copy_GBps']:.0f} GB/s**.", "",
             "GB/s counts bytes read + written by the op (input values, payload, accumulator, residual).", "",
             "| format | input | op | backend | ms | GB/s | % of copy |", "|---|---|---|---|---:|---:|---:|"]
    for r in info["rows"]:
        if "error" in r:
            lines.append(f"| {r['format']} | {r['dtype']} | {r['op']} | {r['backend']} | error: "
                         f"{r['error'][:80]} | | |")
        else:
            lines.append(f"| {r['format']} | {r['dtype']} | {r['op']} | {r['backend']} | {r['ms']:.3f} | "
                         f"{r['GBps']:.0f} | {r['pct_copy']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"))
    ap.add_argument("--cpu", action="store_true", help="measure the CPU path (torch reference)")
    ap.add_argument("--log2n", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--triton-only", action="store_true", help="GPU: time only the fused kernels")
    ap.add_argument("--kernel-time", action="store_true",
                    help="GPU: also time the fused kernels alone (CUDA-graph replay, no host overhead)")
    ap.add_argument("--sweep", action="store_true", help="GPU: tune the kernels' launch configurations first")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds after which only the fused kernels are measured")
    args = ap.parse_args()
    if args.log2n is None:
        args.log2n = 22 if args.cpu else 28
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --cpu")
    info = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "kernels_cpu" if args.cpu else "kernels"
    (out / f"{stem}.json").write_text(json.dumps(info, indent=1))
    (out / f"{stem}.md").write_text(to_markdown(info))
    print(f"wrote {out / stem}.md and .json")


if __name__ == "__main__":
    main()
