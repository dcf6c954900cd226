"""benchmarks.kernels without a GPU: the back-to-back timing checks the payloads it made, the Triton rows are
measured through every timing but the kernel-only one on CPU tensors (interpreted), and the markdown reports
each timing's verdicts."""

from __future__ import annotations

import threading

import pytest
import torch

from benchmarks import kernels
from noloco.quant import QuantSpec
from noloco.quant import triton_kernels as tk


def test_back_to_back_time_checks_every_payload_after_the_loop(monkeypatch):
    monkeypatch.setattr(tk, "_DEFER_DEVICES", frozenset({"cpu", "cuda"}))  # verdicts deferred, as on CUDA
    monkeypatch.setattr(tk, "_TLS", threading.local())
    x = torch.randn(512)
    fn = kernels.make_op("quantize", QuantSpec.parse("int8"), x, "triton")
    assert kernels.back_to_back_time(fn, "cpu", calls=3, reps=1) > 0
    x[100] = float("nan")  # the calls themselves do not raise; the check after the loop does
    with pytest.raises(ValueError, match="non-finite"):
        kernels.back_to_back_time(fn, "cpu", calls=3, reps=1)


def test_rows_and_markdown_report_idle_start_back_to_back_and_kernel_verdicts(monkeypatch):
    monkeypatch.setattr(kernels, "FORMATS", ["int4", "mxfp8"])
    monkeypatch.setattr(kernels, "HOST_LOG2N", 8)
    monkeypatch.setattr(kernels, "B2B_CALLS", 2)
    host_time = kernels.host_time
    monkeypatch.setattr(kernels, "host_time", lambda fn, device, reps: host_time(fn, device, reps=2, warmup=1))
    info = {"rows": []}
    kernels.measure_triton_rows(info, [torch.bfloat16], 300, ceiling=1.0, quick=True, device="cpu")
    rows = info["rows"]
    assert len(rows) == 2 * len(kernels.OPS) and not [r for r in rows if "error" in r]
    assert all(r["b2b_ms"] > 0 and r["ms"] > 0 and r["host_us"] > 0 for r in rows)

    # a GPU-like run: ceiling 100 GB/s, one row per verdict pattern (idle start, back-to-back, kernel)
    def row(fmt, op, api, b2b, kernel):
        r = dict(
            kernels._row(fmt, torch.bfloat16, op, "triton"),
            ms=1.0,
            GBps=api,
            pct_copy=api,
            b2b_ms=1.0,
            b2b_GBps=b2b,
            b2b_pct_copy=b2b,
        )
        return r if kernel is None else dict(r, kernel_ms=1.0, kernel_pct_copy=kernel)

    info = {
        "machine": "1× NVIDIA H200 (CUDA 13.0), Triton 3.6.0",
        "gpu": "NVIDIA H200",
        "torch": torch.__version__,
        "triton": "3.6.0",
        "n": 1 << 28,
        "copy_GBps": 100.0,
        "command": "python -m benchmarks.kernels",
        "b2b_calls": 20,
        "config": dict(tk.CONFIG),
        "rows": [
            row("int4", "quantize", 50.0, 85.0, 90.0),  # target 80 %: no / yes / yes
            row("int8", "quantize+ef", 81.0, 79.0, None),  # yes / no / (none)
            row("mxfp4", "quantize", 60.0, 65.0, 71.0),  # target 70 %: no / no / yes
            row("int4", "dequantize", 10.0, 10.0, 10.0),  # no target
            dict(kernels._row("int8", torch.bfloat16, "quantize", "triton"), error="RuntimeError: boom"),
        ],
    }
    md = kernels.gpu_markdown(info, {}, "docs/results/kernels.json")
    assert "**Met: API idle start 1/3, API back-to-back 1/3, kernel 2/3.**" in md
    header = next(line for line in md.splitlines() if line.startswith("| format |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[cells.index("target") + 1 : cells.index("target") + 4] == [
        "met (API idle start)",
        "met (API back-to-back)",
        "met (kernel)",
    ]
    table = [line for line in md.splitlines() if line.startswith("| int") or line.startswith("| mx")]
    verdicts = [[c.strip() for c in line.strip("|").split("|")][15:18] for line in table]
    assert verdicts == [["**no**", "yes", "yes"], ["yes", "**no**", ""], ["**no**", "**no**", "yes"], ["", "", ""]]
    assert len({line.count("|") for line in [header, *table]}) == 1
    assert "checked (`Packed.check`) after the timed loop" in md and "RuntimeError: boom" in md
    assert "## GPU: fused Triton kernels on one NVIDIA H200" in md and "Machine: 1× NVIDIA H200" in md


def test_config_literal_is_python_that_rebuilds_the_config():
    text = kernels.config_literal(tk.CONFIG)
    scope: dict = {}
    exec(text, scope)  # noqa: S102 - our own output
    assert scope["CONFIG"] == tk.CONFIG and "quantize_mx/paired" in scope["CONFIG"]
    assert set(kernels.SWEEP_ROWS) == set(tk.CONFIG)
