"""Triton kernels for the low-bit formats: int2 / int3 (zero-aware, round to nearest) and the 1-bit sign code.

Bit-exact twins of the torch references (``intq.py`` for int2/int3, ``signq.py`` for sign): the same fp32
operations in the same order, ``div_rn`` for the one division per group, FMA contraction off at launch.

- ``quantize``: a program takes a tile of whole groups ``[GPP, g]``, computes each group's statistics (int:
  min/max; sign: the max magnitude and the exact int64 sum of the magnitudes scaled to fixed point, so the
  sum does not depend on the reduction order), the codes, and packs them in registers: int2 four codes per
  byte, int3 eight codes per 24-bit word (three bytes), sign eight bits per byte -- the bit streams of
  docs/quant.md. A group of g ≥ 16 values fills whole bytes, so programs never share a byte; elements past
  n get code 0 (the stream's zero padding).
- ``dequantize``: one element per lane, reading the one or two bytes its bits lie in.

Non-finite input is refused on the host before the launch (one device read per call, unlike the fused
kernels' deferred check; docs/quant.md). A group whose range would overflow fp32 on decoding is refused
after the launch (same read). Modes other than zero-aware round-to-nearest (``:sym``, ``:naive``,
``:stochastic``) use the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .base import QuantSpec
from .intq import check_finite, inv_steps, max_scale_bits16
from .signq import BF16_INF_BITS
from .triton_kernels import _RNE_MAGIC, _RNE_MAGIC_BITS, _TINY, _div, _pow2

#: groups per program of the quantize kernel, and elements per program of the dequantize kernel
GROUPS_PER_PROGRAM = 4
DEQ_BLOCK = 1024


def supports(spec: QuantSpec) -> bool:
    """Whether these kernels serve ``spec``: int2/int3 zero-aware round-to-nearest, and sign."""
    if spec.kind == "int":
        return spec.bits in (2, 3) and spec.mode == "zero" and not spec.stochastic
    return spec.kind == "sign"


@triton.jit
def _pack(q, GPP: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    """Pack a [GPP, G] int32 code tile: int3 -> [GPP, G / 8] 24-bit words (8 codes each); 1 or 2 bits -> its
    bytes [GPP, G * BITS / 8] (values 0..255, in order). Distinct bit fields, so the sums are ORs."""
    PER: tl.constexpr = 8 if BITS == 3 else 8 // BITS
    return tl.sum(tl.reshape(q, (GPP, G // PER, PER)) << (BITS * tl.arange(0, PER))[None, None, :], axis=2)


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zp_ptr,
    n,
    nbytes,
    G: tl.constexpr,
    GPP: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    INV_STEPS: tl.constexpr,
    BF16: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    g = pid * GPP + tl.arange(0, GPP)[:, None]
    e = g * G + tl.arange(0, G)[None, :]
    valid = e < n
    if BF16:  # bf16 bits (read as int16) shifted into an fp32 pattern: exact, subnormals included
        v = (tl.load(x_ptr + e, mask=valid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(x_ptr + e, mask=valid, other=0.0).to(tl.float32)
    gmask = g * G < n
    if KIND == 0:
        lo = tl.minimum(tl.min(v, axis=1, keep_dims=True), 0.0)
        hi = tl.maximum(tl.max(v, axis=1, keep_dims=True), 0.0)
        s_raw = tl.maximum((hi - lo) * INV_STEPS, _TINY)
        sb = (s_raw.to(tl.int32, bitcast=True) + 0xFFFF) & -65536
        s = sb.to(tl.float32, bitcast=True)
        inv = _div(tl.full(s.shape, 1.0, tl.float32), s)
        zf = tl.minimum(tl.maximum(((-lo * inv) + _RNE_MAGIC) - _RNE_MAGIC, 0.0), LEVELS * 1.0)
        z = zf.to(tl.int32)
        r = (v * inv + _RNE_MAGIC).to(tl.int32, bitcast=True) - _RNE_MAGIC_BITS
        q = tl.where(valid, tl.minimum(tl.maximum(r + z, 0), LEVELS), 0)
        tl.store(zp_ptr + g, z.to(tl.uint8), mask=gmask)
        tl.store(scales_ptr + g, (sb >> 16).to(tl.int16), mask=gmask)
    else:
        a = tl.abs(v)
        eb = tl.max(a, axis=1, keep_dims=True).to(tl.int32, bitcast=True) >> 23
        sh = 167 - eb
        s1 = sh >> 1
        s2 = sh - s1
        t = a * _pow2(s1) * _pow2(s2)
        total = tl.sum(t.to(tl.int64), axis=1, keep_dims=True)
        count = tl.minimum(n - g * G, G).to(tl.float32)
        mean = _div(total.to(tl.float32) * _pow2(-s1) * _pow2(-s2), count)
        bits = mean.to(tl.int32, bitcast=True)
        sb16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(scales_ptr + g, sb16.to(tl.int16), mask=gmask)
        q = tl.where(valid & (v < 0), 1, 0)
    packed = _pack(q, GPP, G, BITS)
    if BITS == 3:
        W: tl.constexpr = G // 8
        off = 3 * (g * W + tl.arange(0, W)[None, :])
        tl.store(codes_ptr + off, (packed & 255).to(tl.uint8), mask=off < nbytes)
        tl.store(codes_ptr + off + 1, ((packed >> 8) & 255).to(tl.uint8), mask=off + 1 < nbytes)
        tl.store(codes_ptr + off + 2, (packed >> 16).to(tl.uint8), mask=off + 2 < nbytes)
    else:
        W2: tl.constexpr = G * BITS // 8
        off2 = g * W2 + tl.arange(0, W2)[None, :]
        tl.store(codes_ptr + off2, packed.to(tl.uint8), mask=off2 < nbytes)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    zp_ptr,
    out_ptr,
    n,
    nbytes,
    G: tl.constexpr,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    valid = e < n
    bit = e * BITS
    byte = bit >> 3
    lo = tl.load(codes_ptr + byte, mask=valid, other=0).to(tl.int32)
    hi = tl.load(codes_ptr + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
    q = ((lo | (hi << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)
    g = e // G
    s = (tl.load(scales_ptr + g, mask=valid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    if KIND == 0:
        z = tl.load(zp_ptr + g, mask=valid, other=0).to(tl.int32)
        y = (q - z).to(tl.float32) * s
    else:
        y = tl.where(q != 0, -s, s)
    tl.store(out_ptr + e, y, mask=valid)


def _consts(spec: QuantSpec) -> dict:
    if spec.kind == "int":
        return dict(KIND=0, BITS=spec.bits, LEVELS=spec.levels, INV_STEPS=inv_steps(spec))
    return dict(KIND=1, BITS=1, LEVELS=1, INV_STEPS=1.0)


def quantize(v: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Payload sections of flat contiguous ``v`` (fp32/bf16/fp16) in ``spec`` (:func:`supports`), on ``v``'s device.

    Raises:
        ValueError: ``v`` holds NaN/±Inf, or a group's range cannot be encoded (decoding would overflow).
    """
    check_finite(v)
    n, g, dev = v.numel(), spec.group, v.device
    groups = -(-n // g)
    layout = spec.layout(n)
    out = {name: torch.empty(count, dtype=dt, device=dev) for name, dt, count in layout}
    if n:
        nbytes = out["codes"].numel()
        zp = out.get("zero_points", out["scales"])
        bf16 = v.dtype == torch.bfloat16
        _quantize_kernel[(triton.cdiv(groups, GROUPS_PER_PROGRAM),)](
            v.view(torch.int16) if bf16 else v,
            out["codes"],
            out["scales"],
            zp,
            n,
            nbytes,
            G=g,
            GPP=GROUPS_PER_PROGRAM,
            BF16=bf16,
            **_consts(spec),
            enable_fp_fusion=False,
        )
        bits = out["scales"].to(torch.int32)
        limit = max_scale_bits16(spec.levels) if spec.kind == "int" else BF16_INF_BITS - 1
        if bool((bits > limit).any()):
            raise ValueError("cannot quantize: a group's range is so large that decoding would overflow fp32")
    return out


def dequantize(sections: dict[str, torch.Tensor], spec: QuantSpec, n: int) -> torch.Tensor:
    """Flat fp32 decode of ``n`` values from validated ``sections`` in ``spec`` (:func:`supports`)."""
    codes = sections["codes"]
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    if n:
        zp = sections.get("zero_points", sections["scales"])
        c = _consts(spec)
        _dequantize_kernel[(triton.cdiv(n, DEQ_BLOCK),)](
            codes,
            sections["scales"],
            zp,
            out,
            n,
            codes.numel(),
            G=spec.group,
            BLOCK=DEQ_BLOCK,
            KIND=c["KIND"],
            BITS=c["BITS"],
            enable_fp_fusion=False,
        )
    return out
