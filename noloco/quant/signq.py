"""One-bit sign quantization with a per-group scale, plain-torch reference (the Triton kernel matches it bit for bit).

For each group of g values (the valid ones of a partial last group), send the sign bits and one bf16 scale::

    s  = bf16_rne(sum(|x|) / count)          # mean |x| of the group, the L2-optimal scale for a sign code
    b  = 1 if x < 0 else 0                   # zero (and -0) is sent as positive
    x̂  = -s if b else s

``argmin_s sum (x_i - s·sign_i)^2 = sum |x_i| / g`` whatever the signs, so the mean magnitude minimises the
L2 error of the group (signSGD with a per-group scale, Bernstein et al. arXiv 1802.04434; DeMo arXiv 2411.19870
sends the signs of its top-k coefficients). Zero decodes to +s (the group's mean magnitude), an all-zero group
to exact zeros (s = 0).

The sum is exact, so it is the same in any summation order (what lets the Triton kernel match): with
E the biased exponent field of the group's max |x|, every |x| is scaled by 2**(167 - E) (as two exact
power-of-two multiplies), truncated to an int64 (< 2**41), summed in int64 (g ≤ 4096, so no overflow),
converted back to fp32 (round to nearest even), scaled by 2**(E - 167) and divided by the count (one IEEE
division). Parts of a magnitude below 2**-40 of the group's max are dropped by the truncation (relative
2**-40 of the scale, far below bf16's 2**-9). Bits: element i is bit i % 8 of byte i // 8. NaN/Inf input
raises ``ValueError``.
"""

from __future__ import annotations

import torch

from .base import QuantSpec
from .intq import check_finite, pack_bits, unpack_bits

#: bf16 pattern of +Inf: a scale at or above it is refused (encoder) or rejected (decoder)
BF16_INF_BITS = 0x7F80


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e (fp32, exact) for int32 e in [-126, 127]."""
    return ((e + 127) << 23).view(torch.float32)


def sign_scales(a: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int32) of the mean of each row of the magnitudes ``a`` (groups, g) over ``counts``."""
    amax = a.amax(dim=1)
    e = amax.view(torch.int32) >> 23  # biased exponent field, 0..254
    sh = 167 - e
    s1 = torch.div(sh, 2, rounding_mode="floor")
    s2 = sh - s1
    t = a * _pow2(s1)[:, None] * _pow2(s2)[:, None]
    total = t.to(torch.int64).sum(dim=1)
    mean = total.to(torch.float32) * _pow2(-s1) * _pow2(-s2) / counts.to(torch.float32)
    bits = mean.view(torch.int32)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def quantize_sign(v: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Quantize flat fp32 ``v`` (shape (n,)): ``codes`` (uint8, ceil(n/8) bytes) and ``scales`` (int16 bf16 bits).

    Raises:
        ValueError: ``v`` holds NaN or ±Inf, or a group's mean magnitude rounds beyond bf16's range.
    """
    check_finite(v)
    n, g, dev = v.numel(), spec.group, v.device
    if n == 0:
        return {
            "codes": torch.empty(0, dtype=torch.uint8, device=dev),
            "scales": torch.empty(0, dtype=torch.int16, device=dev),
        }
    groups = -(-n // g)
    a = torch.zeros(groups * g, dtype=torch.float32, device=dev)
    a[:n] = v.abs()
    counts = torch.full((groups,), g, dtype=torch.int32, device=dev)
    counts[-1] = n - (groups - 1) * g
    scales = sign_scales(a.view(groups, g), counts)
    if bool((scales >= BF16_INF_BITS).any()):
        raise ValueError("cannot quantize: a group's mean magnitude is beyond the bf16 range")
    return {"codes": pack_bits((v < 0).to(torch.int32), 1), "scales": scales.to(torch.int16)}


def dequantize_sign(sections: dict[str, torch.Tensor], spec: QuantSpec, n: int) -> torch.Tensor:
    """Decode sign payload sections into a flat fp32 tensor of ``n`` elements."""
    codes = sections["codes"]
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=codes.device)
    s = (sections["scales"].to(torch.int32) << 16).view(torch.float32)
    s = s.repeat_interleave(spec.group)[:n]
    neg = unpack_bits(codes, n, 1).bool()
    return torch.where(neg, -s, s)
