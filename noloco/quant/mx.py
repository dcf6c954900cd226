"""MX (microscaling) formats, plain-torch reference: MXFP4 (E2M1), MXFP6 (E3M2), MXFP8 (E4M3).

Implements the OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project, 2023), §5-6:
blocks of k = 32 elements share one E8M0 scale 2**X, with

    X = clamp(floor(log2(max|v|)) - emax_elem, -127, 127)     # E8M0 byte = X + 127 (255 = NaN, unused)
    P_i = to_element(v_i / 2**X)                               # round-half-to-even, saturating at ±max

emax_elem is the exponent of the element format's largest normal (E2M1: 2, max 6.0; E3M2: 4, max 28.0;
E4M3: 8, max 448.0). An all-zero block gets X = -127 and zero elements. The ``:ceil`` spec option replaces the
floor by the smallest X with amax / 2**X <= max (no clipping of the block max; see :func:`shared_exponent` and
docs/quant.md for when that lowers the error); decoding does not depend on the choice. ``floor(log2(.))`` is read from
the fp32 exponent field, so it is exact. For MXFP6 we pick E3M2 (range ±28, 2 mantissa bits) over E2M3
(range ±7.5, 3 mantissa bits): after the shared scale puts a block's max near the top of the range,
E3M2's extra binade keeps small elements of the block out of the subnormals, which matters more for
gradients than a third mantissa bit. -0 is encoded as +0.

Element code layout: sign | exponent field | mantissa (E2M1: s eem... i.e. bit 3 sign, bits 2-1 exp,
bit 0 mantissa). Codes pack as: MXFP4 element 2i in the low nibble of byte i, 2i+1 in the high nibble;
MXFP6 elements 4i..4i+3 as the 24-bit little-endian word e0 | e1<<6 | e2<<12 | e3<<18 in bytes 3i..3i+2;
MXFP8 one byte per element. Padding elements are 0.

Encoding a magnitude a (already divided by 2**X and clamped to max): with e = max(floor(log2 a), emin)
and n = rne(a * 2**(M - e)), the code is ``(e - emin) * 2**M + n``; this single formula covers
subnormals and the carry into the next binade.
"""

from __future__ import annotations

import torch

from .base import MX_ELEMENTS, QuantSpec
from .intq import check_finite, pack_nibbles, unpack_nibbles

BLOCK = 32


def element_params(name: str) -> dict[str, int]:
    """Constants of an MX element format: exponent/mantissa bits, bias, emin, emax, max code."""
    e_bits, m_bits = MX_ELEMENTS[name]
    bias = (1 << (e_bits - 1)) - 1
    emin = 1 - bias
    # E4M3 (OCP "FN" variant) reserves S.1111.111 for NaN, so its top binade has mantissa up to 110.
    emax = {"mxfp4": 2, "mxfp6": 4, "mxfp8": 8}[name]
    top_mant = (1 << m_bits) - 2 if name == "mxfp8" else (1 << m_bits) - 1
    max_code = ((emax - emin + 1) << m_bits) + top_mant
    max_value = (1.0 + top_mant / (1 << m_bits)) * 2.0**emax
    return {
        "e_bits": e_bits,
        "m_bits": m_bits,
        "bias": bias,
        "emin": emin,
        "emax": emax,
        "max_code": max_code,
        "max_value": max_value,
    }


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for integer k in [-126, 127] (exact, built from the exponent field)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def element_table(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Value of every element code (index = code incl. sign bit), fp32, exact."""
    p = element_params(name)
    codes = torch.arange(1 << (1 + p["e_bits"] + p["m_bits"]), dtype=torch.int32)
    m_bits = p["m_bits"]
    e_field = (codes >> m_bits) & ((1 << p["e_bits"]) - 1)
    mant = codes & ((1 << m_bits) - 1)
    sign = (codes >> (p["e_bits"] + m_bits)) & 1
    sub = mant.float() * 2.0 ** (p["emin"] - m_bits)
    norm = (mant + (1 << m_bits)).float() * _pow2(e_field - p["bias"] - m_bits)
    mag = torch.where(e_field == 0, sub, norm)
    return torch.where(sign == 1, -mag, mag).to(device)


def shared_exponent(amax: torch.Tensor, name: str, ceil: bool = False) -> torch.Tensor:
    """X per block (int32) from the block's max magnitude (fp32, finite).

    ``ceil=False`` is the OCP v1.0 rule ``X = floor(log2 amax) - emax``: amax / 2**X lies in [2**emax, 2**(emax+1)),
    so the part of that binade above the element format's max (6 of [4, 8) for E2M1, 448 of [256, 512) for E4M3)
    saturates. ``ceil=True`` adds 1 exactly when amax / 2**X exceeds that max, i.e. X = ceil(log2(amax / max)), the
    smallest scale that clips nothing (capped at 127 - emax, the largest scale a decoder accepts).
    """
    p = element_params(name)
    e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    X = (e - p["emax"]).clamp(-127, 127)
    if ceil:
        X = torch.where(amax * _pow2(-X) > p["max_value"], X + 1, X).clamp(max=127 - p["emax"])
    return X


def encode_elements(w: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 values already divided by the block scale -> element codes (int32, sign bit included)."""
    p = element_params(name)
    m_bits = p["m_bits"]
    a = w.abs().clamp_max(p["max_value"])
    e = (((a.view(torch.int32) >> 23) & 0xFF) - 127).clamp_min(p["emin"])
    n = torch.round(a * _pow2(m_bits - e))
    code = ((e - p["emin"]) << m_bits) + n.to(torch.int32)
    code = code.clamp_max(p["max_code"])
    sign = (w < 0).to(torch.int32) << (p["e_bits"] + m_bits)
    return torch.where(code == 0, code, code | sign)


def pack_6bit(q: torch.Tensor) -> torch.Tensor:
    """Pack 6-bit codes: elements 4i..4i+3 -> little-endian 24-bit word in bytes 3i..3i+2."""
    q = q.to(torch.int32)
    pad = (-q.numel()) % 4
    if pad:
        q = torch.cat([q, q.new_zeros(pad)])
    q = q.view(-1, 4)
    word = q[:, 0] | (q[:, 1] << 6) | (q[:, 2] << 12) | (q[:, 3] << 18)
    return torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=1).view(-1).to(torch.uint8)


def unpack_6bit(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_6bit`: the first ``n`` codes (int32)."""
    b = codes.to(torch.int32).view(-1, 3)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return torch.stack([(word >> (6 * i)) & 63 for i in range(4)], dim=1).view(-1)[:n]


def quantize_mx(v: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Quantize flat fp32 ``v`` (shape (n,)) to an MX format.

    Returns ``codes`` (uint8, packed as in the module docstring) and ``scales`` (uint8 E8M0, one per
    block of 32). Raises ``ValueError`` on NaN/±Inf input.
    """
    check_finite(v)
    n = v.numel()
    dev = v.device
    blocks = -(-n // BLOCK)
    x = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=dev)
    x[:n] = v.float()
    x = x.view(blocks, BLOCK)
    X = shared_exponent(x.abs().amax(dim=1) if n else x.new_zeros(0), spec.name, ceil=spec.mx_scale == "ceil")
    w = x * _pow2(-X)[:, None]
    q = encode_elements(w, spec.name).view(-1)[:n]
    codes = {4: pack_nibbles, 6: pack_6bit, 8: lambda c: c.to(torch.uint8)}[spec.bits](q)
    return {"codes": codes, "scales": (X + 127).to(torch.uint8)}


def scale_multiply(vals: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """vals * 2**X, done as two exact power-of-two multiplies so X in [-127, 127] never leaves range."""
    a = X >> 1
    return (vals * _pow2(a)) * _pow2(X - a)


def dequantize_mx(sections: dict[str, torch.Tensor], spec: QuantSpec, n: int) -> torch.Tensor:
    """Decode MX payload sections into a flat fp32 tensor of ``n`` elements."""
    codes = sections["codes"]
    dev = codes.device
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=dev)
    if spec.bits == 4:
        q = unpack_nibbles(codes, n).long()
    elif spec.bits == 6:
        q = unpack_6bit(codes, n).long()
    else:
        q = codes[:n].long()
    blocks = -(-n // BLOCK)
    vals = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=dev)
    vals[:n] = element_table(spec.name, dev)[q]
    X = sections["scales"].to(torch.int32) - 127
    return scale_multiply(vals.view(blocks, BLOCK), X[:, None]).view(-1)[:n]
