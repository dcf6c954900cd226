"""Shared inputs and independent float64 references for the quant tests."""

from __future__ import annotations

import math

import torch

ALL_SPECS = [
    "int4",
    "int8",
    "int4:g64",
    "int4:sym",
    "int4:naive",
    "int4:stochastic",
    "int8:sym",
    "int8:naive",
    "mxfp4",
    "mxfp6",
    "mxfp8",
    "bf16",
    "fp16",
    "fp32",
    "int4+hadamard",
    "int8+hadamard",
    "mxfp4+hadamard",
    "bf16+hadamard",
]
AWKWARD_SIZES = [0, 1, 127, 129, 10**6 + 3]


def awkward(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """fp32 test vectors: 'gauss', 'zeros', 'outlier' (one huge value), 'student' (heavy-tailed)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(n)
    x = torch.randn(n, generator=g)
    if kind == "outlier" and n:
        x[n // 2] = 1e4
    if kind == "student":  # Student's t, 2 degrees of freedom: z / sqrt(chi2_2 / 2), chi2_2 = -2 log u (seeded)
        u = torch.rand(n, generator=g).clamp_min(torch.finfo(torch.float32).tiny)
        x = x / torch.sqrt(-torch.log(u))
    return x


def bound_for(spec: str, x: torch.Tensor) -> float:
    """A loose relative-L2 error bound per spec for Gaussian data (sanity, not precision)."""
    base = spec.split("+")[0].split(":")[0]
    return {
        "int4": 0.2,
        "int8": 0.012,
        "mxfp4": 0.2,
        "mxfp6": 0.08,
        "mxfp8": 0.05,
        "bf16": 0.005,
        "fp16": 0.001,
        "fp32": 1e-6,
    }[base]


def rel_l2(y: torch.Tensor, x: torch.Tensor) -> float:
    x64, y64 = x.double(), y.double()
    d = x64.norm().item()
    return (y64 - x64).norm().item() / d if d else (y64 - x64).norm().item()


def mx_grid(e_bits: int, m_bits: int, top_mant: int) -> list[float]:
    """All non-negative values of a minifloat, float64, computed from first principles."""
    bias = 2 ** (e_bits - 1) - 1
    vals = []
    for ef in range(2**e_bits):
        for m in range(2**m_bits):
            if ef == 2**e_bits - 1 and m > top_mant:
                continue
            if ef == 0:
                vals.append(m / 2**m_bits * 2.0 ** (1 - bias))
            else:
                vals.append((1 + m / 2**m_bits) * 2.0 ** (ef - bias))
    return sorted(vals)


def mx_reference(x: torch.Tensor, e_bits: int, m_bits: int, emax: int, top_mant: int) -> torch.Tensor:
    """Float64 OCP MX quantize-dequantize: per block of 32, X = floor(log2 amax) - emax, then the
    nearest grid value (ties: either neighbour is accepted by the caller)."""
    grid = torch.tensor(mx_grid(e_bits, m_bits, top_mant), dtype=torch.float64)
    x64 = x.double().reshape(-1)
    out = torch.zeros_like(x64)
    for b in range(0, x64.numel(), 32):
        blk = x64[b : b + 32]
        amax = blk.abs().max().item()
        if amax == 0:
            continue
        X = max(min(math.floor(math.log2(amax)) - emax, 127), -127)
        w = (blk / 2.0**X).clamp(-grid[-1], grid[-1])
        idx = (w.abs()[:, None] - grid[None, :]).abs().argmin(dim=1)
        out[b : b + 32] = torch.sign(w) * grid[idx] * 2.0**X
    return out
