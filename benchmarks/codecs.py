"""Bits on the wire and error of the low-bit and sparse codecs, and what error-feedback decay does (issue 30).

Two tables, CPU, torch reference:

1. Per codec, bits per value measured from the encoded payload (``len(quantize(x, spec).to_bytes())`` × 8 / n,
   header and checksum included) and the relative L2 error ``||deq(Q(x)) - x|| / ||x||`` for a Gaussian vector
   of ``--n`` values (default 2^20).
2. Error feedback (:class:`noloco.quant.ErrorFeedback`) over ``--calls`` calls of a stream of correlated
   gradients, ``x_t = m + n_t`` with a fixed direction ``m`` (RMS 0.3) and AR(1) noise
   ``n_t = 0.9 n_(t-1) + sqrt(1 - 0.9^2) ξ_t``, for decay 1.0 and 0.95: the residual's RMS relative to the
   inputs' (mean over the second half of the calls), and how much of the inputs never arrived:
   ``||Σ x_t - Σ sent_t|| / ||Σ x_t||`` over all calls and over the last 100.

    python -m benchmarks.codecs [--n 1048576] [--calls 1000] [--out DIR]   # DIR: runs/benchmarks/codecs/
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/codecs.py`: rerun as a module, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.codecs", *sys.argv[1:]])

import torch

from benchmarks import common
from noloco.quant import ErrorFeedback, dequantize, quantize

CODECS = [
    "fp32",
    "bf16",
    "int8",
    "int4",
    "int3",
    "int2",
    "sign",
    "topk:64/4096+int2",
    "topk:128/4096+int2",
    "topk:256/4096+int2",
    "topk:64/4096+int4",
    "topk:128/4096+int4",
    "topk:256/4096+int4",
    "topk:64/4096+sign",
    "topk:64/4096+dct+int2",
    "topk:8/4096+dct+sign",
]
FEEDBACK_SPECS = ["topk:64/4096+int2", "int2", "sign"]


def codec_table(n: int, seed: int = 0) -> list[dict]:
    """Bits per value and relative L2 error of every codec of :data:`CODECS` on one Gaussian vector of ``n``."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    rows = []
    for spec in CODECS:
        p = quantize(x, spec)
        y = dequantize(p)
        rows.append(
            {"codec": spec, "bits_per_value": 8 * len(p.to_bytes()) / n, "rel_l2": float((y - x).norm() / x.norm())}
        )
    return rows


def feedback_run(spec: str, decay: float, calls: int, n: int = 1 << 16, seed: int = 0) -> dict:
    """Error feedback over a stream of correlated gradients (module docstring); returns the three figures."""
    gen = torch.Generator().manual_seed(seed)
    m = 0.3 * torch.randn(n, generator=gen)
    noise = torch.randn(n, generator=gen)
    ef = ErrorFeedback(spec, decay=decay)
    total_in, total_sent = torch.zeros(n), torch.zeros(n)
    window_in, window_sent = torch.zeros(n), torch.zeros(n)
    ratios = []
    for t in range(calls):
        noise = 0.9 * noise + (1 - 0.81) ** 0.5 * torch.randn(n, generator=gen)
        x = m + noise
        sent = dequantize(ef.quantize(x, "g"))
        total_in += x
        total_sent += sent
        if t >= calls - 100:
            window_in += x
            window_sent += sent
        if t >= calls // 2:
            ratios.append(float(ef.residual("g").norm() / x.norm()))
    return {
        "codec": spec,
        "decay": decay,
        "residual_over_input": sum(ratios) / len(ratios),
        "missing_all": float((total_in - total_sent).norm() / total_in.norm()),
        "missing_last100": float((window_in - window_sent).norm() / window_in.norm()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codecs", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1 << 20, help="values of the Gaussian vector (default 2^20)")
    parser.add_argument("--calls", type=int, default=1000, help="error-feedback calls (default 1000)")
    common.add_out(parser, "codecs")
    args = parser.parse_args(argv)
    if args.n < 1 or args.calls < 200:
        print("error: --n must be >= 1 and --calls >= 200", file=sys.stderr)
        return 2
    rows = codec_table(args.n)
    lines = [
        f"# Codecs: bits per value and error (Gaussian, n = {args.n})",
        "",
        "| codec | bits/value (payload) | relative L2 error |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{r['codec']}` | {r['bits_per_value']:.4f} | {r['rel_l2']:.4f} |" for r in rows]
    print("\n".join(lines))
    fb = [feedback_run(spec, decay, args.calls) for spec in FEEDBACK_SPECS for decay in (1.0, 0.95)]
    more = [
        "",
        f"## Error feedback over {args.calls} calls of correlated gradients",
        "",
        "| codec | decay | residual RMS / input RMS | missing, all calls | missing, last 100 |",
        "|---|---:|---:|---:|---:|",
    ]
    more += [
        f"| `{r['codec']}` | {r['decay']} | {r['residual_over_input']:.3f} | {r['missing_all']:.5f} | "
        f"{r['missing_last100']:.4f} |"
        for r in fb
    ]
    print("\n".join(more))
    cmd = common.command("codecs", argv)
    md, _ = common.write_report(
        args.out,
        "codecs",
        lines + more + ["", f"`{cmd}` on {common.machine()}"],
        {"codecs": rows, "feedback": fb},
        command=cmd,
        machine=common.machine(),
    )
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
