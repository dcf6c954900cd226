"""Randomized block Hadamard rotation (spreads outliers before quantizing; DESIGN §3.3).

The flat vector is zero-padded to a multiple of the block size B (a power of two), cut into blocks,
and each block row-vector x is mapped to ``y = (x * d) @ H`` with H the Sylvester Hadamard matrix scaled
by 1/sqrt(B) (orthonormal and symmetric) and d a vector of B random signs drawn from a CPU
``torch.Generator`` seeded with the spec's ``hadamard_seed``; the same d serves every block. The
inverse is ``x = (y @ H) * d``. Both ends derive d from the seed in the spec, so nothing extra travels.
This follows the randomized Hadamard transforms of QuIP#/QuaRot (arXiv 2402.04396, 2404.00456).
"""

from __future__ import annotations

import functools

import torch

from .base import QuantSpec


@functools.lru_cache(maxsize=32)
def _cpu_factors(block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = (h / block**0.5).float()
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (block,), generator=gen).float() * 2 - 1
    return h, signs


_device_cache: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def factors(spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, d) for the spec on ``device``: H (B, B) fp32 orthonormal, d (B,) fp32 of ±1."""
    key = (spec.hadamard_block, spec.hadamard_seed, str(device))
    if key not in _device_cache:
        h, d = _cpu_factors(spec.hadamard_block, spec.hadamard_seed)
        _device_cache[key] = (h.to(device), d.to(device))
    return _device_cache[key]


def rotate(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Rotate flat fp32 ``v`` (n,) -> flat fp32 (spec.padded_numel(n),)."""
    n, block = v.numel(), spec.hadamard_block
    if n == 0:
        return v.float()
    h, d = factors(spec, v.device)
    padded = torch.zeros(spec.padded_numel(n), dtype=torch.float32, device=v.device)
    padded[:n] = v
    return ((padded.view(-1, block) * d) @ h).view(-1)


def unrotate(y: torch.Tensor, spec: QuantSpec, n: int) -> torch.Tensor:
    """Inverse of :func:`rotate`: flat fp32 (padded,) -> flat fp32 (n,)."""
    if n == 0:
        return y[:0]
    h, d = factors(spec, y.device)
    return ((y.view(-1, spec.hadamard_block) @ h) * d).view(-1)[:n]
