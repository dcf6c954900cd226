"""Fused Triton kernels for the int (DESIGN §3.3) and MX (OCP Microscaling v1.0) formats.

Three kernels, each one pass over memory, each a bit-exact twin of the torch reference in
``intq.py`` / ``mx.py`` for deterministic rounding (same fp32 operations in the same order; fp
contraction into FMAs is disabled at launch so that holds on the GPU too):

- ``quantize`` (+ optional error feedback: reads x and the residual e, quantizes v = x + e, writes
  codes/scales/zero points and the new residual v - deq(v) to a fresh buffer);
- ``dequantize`` and ``dequantize-accumulate``: [acc +] deq(p_1) + ... + deq(p_k), up to 4 inputs per
  launch;
- ``dequantize-accumulate-requantize``: Q(acc + deq(p_1) + ... + deq(p_k)), one hop of a multi-hop
  reduction, without materialising the fp32 sum.

Work layout. A program handles a tile of whole groups, ``[groups_per_program, columns]``; every
per-group quantity (range, scale, zero point, flag) is a ``[groups_per_program, 1]`` tile of the same
layout (``keep_dims`` reductions), so no per-group value goes through shared memory. When a side of the
op is 4-bit (int4, MXFP4) the tile is *paired*: column c holds elements 2c (even) and 2c + 1 (odd) as
two fp32 tiles. fp32 data is then read and written as 64-bit words and bf16/fp16 input as 32-bit words
(little-endian: the even element is the low half), and a code byte is ``even | odd << 4``; nothing is
interleaved in registers (no reshape/join/split, hence no layout conversion through shared memory).
An odd element count reads/writes its last element separately (the ``ODD`` specialisation). 8-bit
formats on both sides use plain ``[groups, group]`` tiles.

Round half to even is the add-and-subtract of 1.5 * 2**23, exact for |t| < 2**22. ``1/s`` is one IEEE
division (``div_rn``) per group. Stochastic rounding draws from Triton's Philox (``tl.rand``) at each
element's index, so it is unbiased but not bit-identical to the torch reference.

Non-finite input. The group statistics are NaN-propagating min/max (int zero-aware and naive) or an
integer max over the magnitudes' bit patterns (symmetric and MX, where NaN/Inf patterns are the largest),
so non-finite input shows in the statistics themselves at no per-element cost. A bad group gets the
scale pattern bf16 NaN 0x7FC0 (or E8M0 255) and sets a one-word flag in device memory (only programs that
see a bad group write it); the host wrapper reads that word once (one small copy and sync per call) and
raises ``ValueError`` before anything is returned. MXFP6 has no kernel (the torch reference serves it).
Rotation (``+hadamard``) is applied by the caller around these kernels.

Kernels use only Triton features available since 3.0 (keep_dims reductions, PropagateNan, rand,
bitcast casts, pointer casts) and run under ``TRITON_INTERPRET=1`` on the CPU.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .base import Packed, QuantSpec
from .intq import inv_steps, inv_sym, max_scale_bits16
from .mx import element_params

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126
_EXP_ALL_ONES = tl.constexpr(0x7F800000)  # |v| bit patterns >= this are Inf or NaN


def supports(spec: QuantSpec) -> bool:
    """Whether a Triton kernel exists for ``spec`` (rotation is handled outside the kernels)."""
    return spec.kind == "int" or (spec.kind == "mx" and spec.bits in (4, 8))


# ----------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _rne(t):
    return (t + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def _div(a, b):
    """IEEE round-to-nearest fp32 division (plain ``/`` lowers to the approximate div.full on NVIDIA)."""
    return tl.math.div_rn(a, b + tl.zeros_like(a))


@triton.jit
def _pow2(k):
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _nanmin(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tile(GPP: tl.constexpr, W: tl.constexpr, I64: tl.constexpr):
    """Group indices [GPP, 1] and column indices [GPP, W] of this program's tile."""
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    g = pid * GPP + tl.arange(0, GPP)[:, None]
    return g, g * W + tl.arange(0, W)[None, :]


@triton.jit
def _load_pair(ptr, wptr, c, nw, XW: tl.constexpr, ODD: tl.constexpr):
    """Elements 2c and 2c + 1 of ``ptr`` as fp32 (0 beyond n), read through ``wptr``, the same memory
    seen as 64-bit (fp32 data) or 32-bit (bf16/fp16) words. XW: 0 bf16, 1 fp16, 2 fp32."""
    full = c < nw  # whole pairs (a mask the compiler can see is constant over vectors, unlike 2c + 1 < n)
    if XW == 2:
        word = tl.load(wptr + c, mask=full, other=0)
        a = word.to(tl.int32).to(tl.float32, bitcast=True)
        b = (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        word = tl.load(wptr + c, mask=full, other=0)
        if XW == 0:
            a = (word << 16).to(tl.float32, bitcast=True)
            b = (word & -65536).to(tl.float32, bitcast=True)
        else:
            a = word.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            b = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if ODD:
        last = c == nw
        a = tl.where(last, tl.load(ptr + 2 * c, mask=last, other=0.0).to(tl.float32), a)
    return a, b


@triton.jit
def _store_pair(ptr, wptr, c, nw, a, b, ODD: tl.constexpr):
    """fp32 elements 2c (a) and 2c + 1 (b) of ``ptr``, written as one word of its int64 view ``wptr``."""
    lo = a.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True).to(tl.int64)
    hi = b.to(tl.int32, bitcast=True).to(tl.int64)
    tl.store(wptr + c, (hi << 32) | lo, mask=c < nw)
    if ODD:
        tl.store(ptr + 2 * c, a, mask=c == nw)


@triton.jit
def _mx_decode(code, X, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    ef = (code >> MBITS) & ((1 << EBITS) - 1)
    m = code & ((1 << MBITS) - 1)
    sub = m.to(tl.float32) * SUBSCALE
    norm = (m + (1 << MBITS)).to(tl.float32) * _pow2(ef - BIAS - MBITS)
    mag = tl.where(ef == 0, sub, norm)
    val = tl.where(((code >> (EBITS + MBITS)) & 1) == 1, -mag, mag)
    a = X >> 1
    return (val * _pow2(a)) * _pow2(X - a)


@triton.jit
def _group_params(scales_ptr, zp_ptr, mins_ptr, g, gmask, KIND: tl.constexpr, MODE: tl.constexpr):
    """Per-group decode parameters [GPP, 1]: (scale, zero point or min) for int, (X, unused) for MX."""
    if KIND == 0:
        s = (tl.load(scales_ptr + g, mask=gmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        if MODE == 0:
            zz = tl.load(zp_ptr + g, mask=gmask, other=0).to(tl.int32)
        elif MODE == 2:
            zz = (tl.load(mins_ptr + g, mask=gmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            zz = s
    else:
        s = tl.load(scales_ptr + g, mask=gmask, other=127).to(tl.int32) - 127
        zz = s
    return s, zz


@triton.jit
def _decode(q, s, zz, KIND: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr, EBITS: tl.constexpr,
            MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    """fp32 values of int32 codes ``q`` given the group parameters from :func:`_group_params`."""
    if KIND == 0:
        if MODE == 0:
            y = (q - zz).to(tl.float32) * s
        elif MODE == 1:
            y = (q - HALF).to(tl.float32) * s
        else:
            y = zz + q.to(tl.float32) * s
    else:
        y = _mx_decode(q, s, EBITS, MBITS, BIAS, SUBSCALE)
    return y


@triton.jit
def _dequant_pair(codes_ptr, scales_ptr, zp_ptr, mins_ptr, g, gmask, c, nw, nb,
                  KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr,
                  EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    """fp32 values of elements 2c and 2c + 1 of one payload (paired tile)."""
    if BITS == 4:
        byte = tl.load(codes_ptr + c, mask=c < nb, other=0).to(tl.int32)
        qa = byte & 15
        qb = byte >> 4
    else:
        qa = tl.load(codes_ptr + 2 * c, mask=c < nb, other=0).to(tl.int32)
        qb = tl.load(codes_ptr + 2 * c + 1, mask=c < nw, other=0).to(tl.int32)
    s, zz = _group_params(scales_ptr, zp_ptr, mins_ptr, g, gmask, KIND, MODE)
    ya = _decode(qa, s, zz, KIND, MODE, HALF, EBITS, MBITS, BIAS, SUBSCALE)
    yb = _decode(qb, s, zz, KIND, MODE, HALF, EBITS, MBITS, BIAS, SUBSCALE)
    return ya, yb


@triton.jit
def _dequant_flat(codes_ptr, scales_ptr, zp_ptr, mins_ptr, g, gmask, e, n,
                  KIND: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr, EBITS: tl.constexpr,
                  MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    """fp32 values of elements e of an 8-bit payload (flat tile)."""
    q = tl.load(codes_ptr + e, mask=e < n, other=0).to(tl.int32)
    s, zz = _group_params(scales_ptr, zp_ptr, mins_ptr, g, gmask, KIND, MODE)
    return _decode(q, s, zz, KIND, MODE, HALF, EBITS, MBITS, BIAS, SUBSCALE)


@triton.jit
def _group_stats(va, vb, ea, eb, PAIRED: tl.constexpr, KIND: tl.constexpr, MODE: tl.constexpr,
                 INV_STEPS: tl.constexpr, INV_SYM: tl.constexpr, EMAX: tl.constexpr):
    """Per-group [GPP, 1] statistics of the tile (elements beyond n are 0, except for naive).

    Returns (p, lo, lb, bad): int -- p = unrounded scale, lo = zero-aware range low / naive bf16 min,
    lb = naive min bits; MX -- p = X (shared exponent). ``bad``: the group holds NaN or ±Inf.
    """
    if KIND == 1 or MODE == 1:
        m = tl.abs(va).to(tl.int32, bitcast=True)
        if PAIRED:
            m = tl.maximum(m, tl.abs(vb).to(tl.int32, bitcast=True))
        m = tl.max(m, axis=1, keep_dims=True)
        bad = m >= _EXP_ALL_ONES
        if KIND == 1:
            p = tl.minimum(tl.maximum(((m >> 23) & 0xFF) - 127 - EMAX, -127), 127)
        else:
            p = m.to(tl.float32, bitcast=True) * INV_SYM
        lo = p
        lb = m
    elif MODE == 0:
        if PAIRED:
            mn = _nanmin(va, vb)
            mx = _nanmax(va, vb)
        else:
            mn = va
            mx = va
        lo = tl.reduce(mn, 1, _nanmin, keep_dims=True)
        hi = tl.reduce(mx, 1, _nanmax, keep_dims=True)
        bad = (lo != lo) | (lo == -float("inf")) | (hi == float("inf"))
        lo = tl.minimum(lo, 0.0)
        hi = tl.maximum(hi, 0.0)
        p = (hi - lo) * INV_STEPS
        lb = p.to(tl.int32, bitcast=True)
    else:
        mn = tl.where(ea, va, float("inf"))
        mx = tl.where(ea, va, -float("inf"))
        if PAIRED:
            mn = _nanmin(mn, tl.where(eb, vb, float("inf")))
            mx = _nanmax(mx, tl.where(eb, vb, -float("inf")))
        lo_raw = tl.reduce(mn, 1, _nanmin, keep_dims=True)
        hi = tl.reduce(mx, 1, _nanmax, keep_dims=True)
        bad = (lo_raw != lo_raw) | (lo_raw == -float("inf")) | (hi == float("inf"))
        lb = lo_raw.to(tl.int32, bitcast=True)
        lb = tl.where(lo_raw < 0, (lb + 0xFFFF) & -65536, lb & -65536)
        lo = lb.to(tl.float32, bitcast=True)
        p = (hi - lo) * INV_STEPS
    return p, lo, lb, bad


@triton.jit
def _int_codes(v, s, inv, z, lo, eidx, seed, MODE: tl.constexpr, STOCH: tl.constexpr, LEVELS: tl.constexpr,
               HALF: tl.constexpr):
    """fp32 codes q of an int tile (per-group s, 1/s, zero point z, naive min lo)."""
    if MODE == 2:
        t = (v - lo) * inv
    else:
        t = v * inv
    if STOCH:
        r = tl.floor(t + tl.rand(seed, eidx.to(tl.int32)))
    else:
        r = _rne(t)
    if MODE == 0:
        q = tl.minimum(tl.maximum(r + z, 0.0), LEVELS * 1.0)
    elif MODE == 1:
        q = tl.minimum(tl.maximum(r + HALF * 1.0, 1.0), LEVELS * 1.0)
    else:
        q = tl.minimum(tl.maximum(r, 0.0), LEVELS * 1.0)
    return q


@triton.jit
def _int_deq(q, s, z, lo, MODE: tl.constexpr, HALF: tl.constexpr):
    if MODE == 0:
        y = (q - z) * s
    elif MODE == 1:
        y = (q - HALF * 1.0) * s
    else:
        y = lo + q * s
    return y


@triton.jit
def _mx_codes(v, X, EBITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXCODE: tl.constexpr,
              MAXVAL: tl.constexpr):
    w = v * _pow2(-X)
    a = tl.minimum(tl.abs(w), MAXVAL)
    ee = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    nn = _rne(a * _pow2(MBITS - ee))
    code = ((ee - EMIN) << MBITS) + nn.to(tl.int32)
    code = tl.minimum(code, MAXCODE)
    sign = (w < 0).to(tl.int32) << (EBITS + MBITS)
    return tl.where(code == 0, code, code | sign)


@triton.jit
def _quant(va, vb, g, gmask, c, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr,
           PAIRED: tl.constexpr, ODD: tl.constexpr, NEED_DEQ: tl.constexpr,
           KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr,
           LEVELS: tl.constexpr, HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr,
           MBITS: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
           MAXCODE: tl.constexpr, MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr, INV_STEPS: tl.constexpr,
           INV_SYM: tl.constexpr):
    """Quantize the tile (va[, vb]); store codes, group parameters and the non-finite flag.

    Paired: va/vb are elements 2c / 2c + 1. Flat: va holds elements c, vb is ignored.
    Returns deq(va), deq(vb) when NEED_DEQ (else va, vb).
    """
    if PAIRED:
        ea = c < nb
        eb = c < nw
    else:
        ea = c < n
        eb = ea
    p, lo, lb, bad = _group_stats(va, vb, ea, eb, PAIRED, KIND, MODE, INV_STEPS, INV_SYM, EMAX)
    if KIND == 0:
        s_raw = tl.maximum(p, _TINY)
        sb = (s_raw.to(tl.int32, bitcast=True) + 0xFFFF) & -65536
        s = sb.to(tl.float32, bitcast=True)
        sb16 = sb >> 16
        bad = bad | (sb16 > MAXB) | (s_raw != s_raw)
        inv = _div(tl.full(s.shape, 1.0, tl.float32), s)
        z = s
        if MODE == 0:
            if STOCH:
                z = tl.minimum(tl.maximum(tl.ceil(-lo * inv), 0.0), LEVELS * 1.0)
            else:
                z = tl.minimum(tl.maximum(_rne(-lo * inv), 0.0), LEVELS * 1.0)
            tl.store(zp_ptr + g, z.to(tl.int32).to(tl.uint8), mask=gmask)
        elif MODE == 2:
            tl.store(mins_ptr + g, (lb >> 16).to(tl.int16), mask=gmask)
        tl.store(scales_ptr + g, tl.where(bad, 0x7FC0, sb16).to(tl.int16), mask=gmask)
        if PAIRED:
            qa = _int_codes(va, s, inv, z, lo, 2 * c, seed, MODE, STOCH, LEVELS, HALF)
            qb = _int_codes(vb, s, inv, z, lo, 2 * c + 1, seed, MODE, STOCH, LEVELS, HALF)
            if NEED_DEQ:
                va = _int_deq(qa, s, z, lo, MODE, HALF)
                vb = _int_deq(qb, s, z, lo, MODE, HALF)
            ca = qa.to(tl.int32)
            cb = qb.to(tl.int32)
        else:
            qa = _int_codes(va, s, inv, z, lo, c, seed, MODE, STOCH, LEVELS, HALF)
            if NEED_DEQ:
                va = _int_deq(qa, s, z, lo, MODE, HALF)
            ca = qa.to(tl.int32)
            cb = ca
    else:
        X = p
        tl.store(scales_ptr + g, tl.where(bad, 255, X + 127).to(tl.uint8), mask=gmask)
        ca = _mx_codes(va, X, EBITS, MBITS, EMIN, MAXCODE, MAXVAL)
        if NEED_DEQ:
            va = _mx_decode(ca, X, EBITS, MBITS, BIAS, SUBSCALE)
        if PAIRED:
            cb = _mx_codes(vb, X, EBITS, MBITS, EMIN, MAXCODE, MAXVAL)
            if NEED_DEQ:
                vb = _mx_decode(cb, X, EBITS, MBITS, BIAS, SUBSCALE)
        else:
            cb = ca
    if PAIRED:
        if BITS == 4:
            if ODD:
                cb = tl.where(eb, cb, 0)
            tl.store(codes_ptr + c, (ca | (cb << 4)).to(tl.uint8), mask=ea)
        else:
            tl.store(codes_ptr + 2 * c, ca.to(tl.uint8), mask=ea)
            tl.store(codes_ptr + 2 * c + 1, cb.to(tl.uint8), mask=eb)
    else:
        tl.store(codes_ptr + c, ca.to(tl.uint8), mask=ea)
    nbad = tl.max(tl.where(gmask & bad, 1, 0))
    tl.store(flag_ptr, nbad, mask=nbad > 0)
    return va, vb


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _quantize_kernel(x_ptr, xw_ptr, res_ptr, resw_ptr, res_out_ptr, res_outw_ptr, codes_ptr, scales_ptr, zp_ptr,
                     mins_ptr, flag_ptr, n, nw, nb, seed,
                     HAS_RES: tl.constexpr, PAIRED: tl.constexpr, XW: tl.constexpr, ODD: tl.constexpr,
                     I64: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr, KIND: tl.constexpr,
                     BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr, LEVELS: tl.constexpr,
                     HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
                     BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MAXCODE: tl.constexpr,
                     MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr, INV_STEPS: tl.constexpr,
                     INV_SYM: tl.constexpr):
    if PAIRED:
        g, c = _tile(GPP, GROUP // 2, I64)
        va, vb = _load_pair(x_ptr, xw_ptr, c, nw, XW, ODD)
        if HAS_RES:
            ra, rb = _load_pair(res_ptr, resw_ptr, c, nw, 2, ODD)
            va = va + ra
            vb = vb + rb
    else:
        g, c = _tile(GPP, GROUP, I64)
        va = tl.load(x_ptr + c, mask=c < n, other=0.0).to(tl.float32)
        if HAS_RES:
            va = va + tl.load(res_ptr + c, mask=c < n, other=0.0)
        vb = va
    gmask = g * GROUP < n
    da, db = _quant(va, vb, g, gmask, c, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr,
                    PAIRED, ODD, HAS_RES, KIND, BITS, MODE, STOCH, LEVELS, HALF, MAXB, EBITS, MBITS, BIAS,
                    EMIN, EMAX, MAXCODE, MAXVAL, SUBSCALE, INV_STEPS, INV_SYM)
    if HAS_RES:
        if PAIRED:
            _store_pair(res_out_ptr, res_outw_ptr, c, nw, va - da, vb - db, ODD)
        else:
            tl.store(res_out_ptr + c, va - da, mask=c < n)


@triton.jit
def _dequantize_kernel(out_ptr, outw_ptr, n, nw, nb,
                       c0, s0, z0, m0, c1, s1, z1, m1, c2, s2, z2, m2, c3, s3, z3, m3,
                       K: tl.constexpr, ACCUM: tl.constexpr, PAIRED: tl.constexpr, ODD: tl.constexpr,
                       I64: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr,
                       KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr,
                       EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    if PAIRED:
        g, c = _tile(GPP, GROUP // 2, I64)
        gmask = g * GROUP < n
        ya, yb = _dequant_pair(c0, s0, z0, m0, g, gmask, c, nw, nb, KIND, BITS, MODE, HALF, EBITS, MBITS, BIAS,
                               SUBSCALE)
        if ACCUM:
            aa, ab = _load_pair(out_ptr, outw_ptr, c, nw, 2, ODD)
            ya = aa + ya
            yb = ab + yb
        if K > 1:
            ta, tb = _dequant_pair(c1, s1, z1, m1, g, gmask, c, nw, nb, KIND, BITS, MODE, HALF, EBITS, MBITS, BIAS,
                                   SUBSCALE)
            ya = ya + ta
            yb = yb + tb
        if K > 2:
            ta, tb = _dequant_pair(c2, s2, z2, m2, g, gmask, c, nw, nb, KIND, BITS, MODE, HALF, EBITS, MBITS, BIAS,
                                   SUBSCALE)
            ya = ya + ta
            yb = yb + tb
        if K > 3:
            ta, tb = _dequant_pair(c3, s3, z3, m3, g, gmask, c, nw, nb, KIND, BITS, MODE, HALF, EBITS, MBITS, BIAS,
                                   SUBSCALE)
            ya = ya + ta
            yb = yb + tb
        _store_pair(out_ptr, outw_ptr, c, nw, ya, yb, ODD)
    else:
        g, c = _tile(GPP, GROUP, I64)
        gmask = g * GROUP < n
        y = _dequant_flat(c0, s0, z0, m0, g, gmask, c, n, KIND, MODE, HALF, EBITS, MBITS, BIAS, SUBSCALE)
        if ACCUM:
            y = tl.load(out_ptr + c, mask=c < n, other=0.0) + y
        if K > 1:
            y = y + _dequant_flat(c1, s1, z1, m1, g, gmask, c, n, KIND, MODE, HALF, EBITS, MBITS, BIAS,
                                  SUBSCALE)
        if K > 2:
            y = y + _dequant_flat(c2, s2, z2, m2, g, gmask, c, n, KIND, MODE, HALF, EBITS, MBITS, BIAS,
                                  SUBSCALE)
        if K > 3:
            y = y + _dequant_flat(c3, s3, z3, m3, g, gmask, c, n, KIND, MODE, HALF, EBITS, MBITS, BIAS,
                                  SUBSCALE)
        tl.store(out_ptr + c, y, mask=c < n)


@triton.jit
def _requantize_kernel(acc_ptr, accw_ptr, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr,
                       c0, s0, z0, m0, c1, s1, z1, m1, c2, s2, z2, m2, c3, s3, z3, m3,
                       K: tl.constexpr, HAS_ACC: tl.constexpr, PAIRED: tl.constexpr, ODD: tl.constexpr,
                       EVEN: tl.constexpr, I64: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr,
                       IKIND: tl.constexpr, IBITS: tl.constexpr, IMODE: tl.constexpr, IHALF: tl.constexpr,
                       IEBITS: tl.constexpr, IMBITS: tl.constexpr, IBIAS: tl.constexpr,
                       ISUBSCALE: tl.constexpr,
                       KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr,
                       LEVELS: tl.constexpr, HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr,
                       MBITS: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                       MAXCODE: tl.constexpr, MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr,
                       INV_STEPS: tl.constexpr, INV_SYM: tl.constexpr):
    if PAIRED:
        g, c = _tile(GPP, GROUP // 2, I64)
        gmask = g * GROUP < n
        va, vb = _dequant_pair(c0, s0, z0, m0, g, gmask, c, nw, nb, IKIND, IBITS, IMODE, IHALF, IEBITS, IMBITS,
                               IBIAS, ISUBSCALE)
        if HAS_ACC:
            aa, ab = _load_pair(acc_ptr, accw_ptr, c, nw, 2, ODD)
            va = aa + va
            vb = ab + vb
        if K > 1:
            ta, tb = _dequant_pair(c1, s1, z1, m1, g, gmask, c, nw, nb, IKIND, IBITS, IMODE, IHALF, IEBITS, IMBITS,
                                   IBIAS, ISUBSCALE)
            va = va + ta
            vb = vb + tb
        if K > 2:
            ta, tb = _dequant_pair(c2, s2, z2, m2, g, gmask, c, nw, nb, IKIND, IBITS, IMODE, IHALF, IEBITS, IMBITS,
                                   IBIAS, ISUBSCALE)
            va = va + ta
            vb = vb + tb
        if K > 3:
            ta, tb = _dequant_pair(c3, s3, z3, m3, g, gmask, c, nw, nb, IKIND, IBITS, IMODE, IHALF, IEBITS, IMBITS,
                                   IBIAS, ISUBSCALE)
            va = va + ta
            vb = vb + tb
        if not EVEN:  # decoded padding is not 0: zero it so it cannot move the group statistics
            va = tl.where(c < nb, va, 0.0)
            vb = tl.where(c < nw, vb, 0.0)
    else:
        g, c = _tile(GPP, GROUP, I64)
        gmask = g * GROUP < n
        va = _dequant_flat(c0, s0, z0, m0, g, gmask, c, n, IKIND, IMODE, IHALF, IEBITS, IMBITS, IBIAS,
                           ISUBSCALE)
        if HAS_ACC:
            va = tl.load(acc_ptr + c, mask=c < n, other=0.0) + va
        if K > 1:
            va = va + _dequant_flat(c1, s1, z1, m1, g, gmask, c, n, IKIND, IMODE, IHALF, IEBITS, IMBITS, IBIAS,
                                    ISUBSCALE)
        if K > 2:
            va = va + _dequant_flat(c2, s2, z2, m2, g, gmask, c, n, IKIND, IMODE, IHALF, IEBITS, IMBITS, IBIAS,
                                    ISUBSCALE)
        if K > 3:
            va = va + _dequant_flat(c3, s3, z3, m3, g, gmask, c, n, IKIND, IMODE, IHALF, IEBITS, IMBITS, IBIAS,
                                    ISUBSCALE)
        if not EVEN:
            va = tl.where(c < n, va, 0.0)
        vb = va
    _quant(va, vb, g, gmask, c, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr,
           PAIRED, ODD, False, KIND, BITS, MODE, STOCH, LEVELS, HALF, MAXB, EBITS, MBITS, BIAS,
           EMIN, EMAX, MAXCODE, MAXVAL, SUBSCALE, INV_STEPS, INV_SYM)


# ----------------------------------------------------------------------------------------------------
# host wrappers

#: Launch configuration per kernel: (elements per program, warps per program). A program handles
#: max(1, elements // group) whole groups. ``benchmarks/kernels.py --sweep`` times alternatives on the GPU.
#: Keys: kernel name / tile kind ("paired": a 4-bit side, "flat": 8-bit codes only).
#: Values: the fastest of (1024, 8), (2048, 4), (4096, 4), (4096, 8) on an H200 at 2^28 elements
#: (docs/results/kernels.md).
CONFIG: dict[str, tuple[int, int]] = {
    "quantize/paired": (4096, 4),
    "quantize/flat": (2048, 4),
    "quantize_ef/paired": (1024, 8),
    "quantize_ef/flat": (4096, 8),
    "dequantize/paired": (1024, 8),
    "dequantize/flat": (4096, 4),
    "requantize/paired": (2048, 4),
    "requantize/flat": (4096, 8),
}

_XW = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_NON_FINITE = ("cannot quantize: input holds non-finite values (NaN or ±Inf) or a group range that would "
               "overflow; refusing to produce a poisoned payload")


def _gpp(group: int, kernel: str) -> int:
    """Groups per program; ``kernel`` is a CONFIG key."""
    return max(1, CONFIG[kernel][0] // group)


def _grid(n: int, group: int, kernel: str) -> tuple[int]:
    return (math.ceil(math.ceil(n / group) / _gpp(group, kernel)),)


def _shape_consts(n: int, group: int, paired: bool, kernel: str) -> dict:
    gpp = _gpp(group, kernel)
    return dict(PAIRED=paired, ODD=paired and n % 2 == 1, I64=n + gpp * group >= 2**31, GROUP=group, GPP=gpp)


@functools.lru_cache(maxsize=256)
def _decode_consts(spec: QuantSpec) -> dict:
    if spec.kind == "mx":
        p = element_params(spec.name)
        return dict(KIND=1, BITS=spec.bits, MODE=0, HALF=0, EBITS=p["e_bits"], MBITS=p["m_bits"],
                    BIAS=p["bias"], SUBSCALE=2.0 ** (p["emin"] - p["m_bits"]))
    return dict(KIND=0, BITS=spec.bits, MODE=("zero", "sym", "naive").index(spec.mode),
                HALF=1 << (spec.bits - 1), EBITS=1, MBITS=1, BIAS=0, SUBSCALE=1.0)


@functools.lru_cache(maxsize=256)
def _encode_consts(spec: QuantSpec) -> dict:
    c = dict(_decode_consts(spec))
    if spec.kind == "mx":
        p = element_params(spec.name)
        c.update(STOCH=False, LEVELS=0, MAXB=0, EMIN=p["emin"], EMAX=p["emax"], MAXCODE=p["max_code"],
                 MAXVAL=p["max_value"], INV_STEPS=1.0, INV_SYM=1.0)
    else:
        c.update(STOCH=spec.stochastic, LEVELS=spec.levels, MAXB=max_scale_bits16(spec.levels), EMIN=0,
                 EMAX=0, MAXCODE=0, MAXVAL=0.0, INV_STEPS=inv_steps(spec), INV_SYM=inv_sym(spec))
    return c


@functools.lru_cache(maxsize=256)
def _input_consts(spec: QuantSpec) -> dict:
    return {"I" + k: v for k, v in _decode_consts(spec).items()}


def _alloc_sections(spec: QuantSpec, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.empty(count, dtype=dt, device=device) for name, dt, count in spec.layout(n)}


def _ptrs(sections: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """codes, scales, zero_points, mins -- absent ones replaced by the codes tensor (never read)."""
    c = sections["codes"]
    return [c, sections.get("scales", c), sections.get("zero_points", c), sections.get("mins", c)]


def _seed(spec: QuantSpec, generator: torch.Generator | None) -> int:
    if not spec.stochastic:
        return 0
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator,
                             device="cpu" if generator is None else generator.device))


def _word_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if its data can be read as 64-bit (fp32) / 32-bit (16-bit) words, else a fresh copy."""
    return t if t.data_ptr() % (2 * t.element_size()) == 0 else t.clone()


def _words(t: torch.Tensor) -> torch.Tensor:
    """The whole element pairs of flat, word-aligned ``t`` viewed as int64 (fp32) or int32 (16-bit) words."""
    n = t.numel() - t.numel() % 2
    return t[:n].view(torch.int64 if t.element_size() == 4 else torch.int32)


def _raise_if_flagged(flag: torch.Tensor) -> None:
    if int(flag.item()):  # the one device sync of a quantize call
        raise ValueError(_NON_FINITE)


def quantize(v: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None,
             residual: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Quantize flat ``v`` (fp32/bf16/fp16, contiguous) with the fused kernel.

    Args:
        v: (n,) values.
        spec: an int or MXFP4/MXFP8 spec (rotation already applied by the caller).
        generator: seeds stochastic rounding.
        residual: optional (n,) fp32 error-feedback residual e; then v + e is quantized.

    Returns:
        (sections, new_residual): payload sections as in ``QuantSpec.layout``; the new residual
        ``v + e - deq(Q(v + e))`` as a fresh fp32 tensor (the input residual is not modified), or None.

    Raises:
        ValueError: non-finite input (flagged by the kernel; reading the flag costs one device sync).
    """
    n = v.numel()
    sections = _alloc_sections(spec, n, v.device)
    res_out = torch.empty(n, dtype=torch.float32, device=v.device) if residual is not None else None
    if n:
        paired = spec.bits == 4
        if paired:
            v = _word_aligned(v)
            residual = None if residual is None else _word_aligned(residual)
        flag = torch.zeros(1, dtype=torch.int32, device=v.device)
        codes, scales, zps, mins = _ptrs(sections)
        res = residual if residual is not None else v
        rout = res_out if res_out is not None else v
        wv = _words if paired else (lambda t: t)
        kernel = ("quantize/" if residual is None else "quantize_ef/") + ("paired" if paired else "flat")
        _quantize_kernel[_grid(n, spec.group, kernel)](
            v, wv(v), res, wv(res), rout, wv(rout),
            codes, scales, zps, mins, flag, n, n // 2, (n + 1) // 2, _seed(spec, generator),
            HAS_RES=residual is not None, XW=_XW[v.dtype], **_shape_consts(n, spec.group, paired, kernel),
            **_encode_consts(spec), num_warps=CONFIG[kernel][1], enable_fp_fusion=False,
        )
        _raise_if_flagged(flag)
    return sections, res_out


def _input_ptrs(inputs: list[Packed]) -> list[torch.Tensor]:
    ptrs: list[torch.Tensor] = []
    for p in inputs:
        ptrs += _ptrs({k: v for k, v in zip(("codes", "scales", "zero_points", "mins"),
                                            (p.codes, p.scales, p.zero_points, p.mins)) if v is not None})
    ptrs += ptrs[:4] * (4 - len(inputs))
    return ptrs


def dequantize_accumulate(out: torch.Tensor, inputs: list[Packed], accumulate: bool) -> torch.Tensor:
    """out (flat fp32, contiguous) = [out +] deq(inputs[0]) + ... ; inputs share one spec, 1..4 of them."""
    spec, n = inputs[0].spec, out.numel()
    if n:
        paired = spec.bits == 4
        dst = _word_aligned(out) if paired else out
        kernel = "dequantize/" + ("paired" if paired else "flat")
        _dequantize_kernel[_grid(n, spec.group, kernel)](
            dst, _words(dst) if paired else dst, n, n // 2, (n + 1) // 2, *_input_ptrs(inputs), K=len(inputs),
            ACCUM=accumulate, **_shape_consts(n, spec.group, paired, kernel), **_decode_consts(spec),
            num_warps=CONFIG[kernel][1], enable_fp_fusion=False)
        if dst is not out:
            out.copy_(dst)
    return out


def dequantize_accumulate_requantize(acc: torch.Tensor | None, inputs: list[Packed], n: int, spec: QuantSpec,
                                     generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Sections of Q(acc + deq(inputs[0]) + ...); inputs share one spec whose group equals ``spec``'s."""
    device = inputs[0].codes.device
    sections = _alloc_sections(spec, n, device)
    if n:
        paired = spec.bits == 4 or inputs[0].spec.bits == 4
        if paired and acc is not None:
            acc = _word_aligned(acc)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        icon = _input_consts(inputs[0].spec)
        codes, scales, zps, mins = _ptrs(sections)
        kernel = "requantize/" + ("paired" if paired else "flat")
        gpp = _gpp(spec.group, kernel)
        a = acc if acc is not None else codes
        _requantize_kernel[_grid(n, spec.group, kernel)](
            a, _words(a) if paired and acc is not None else a, n, n // 2, (n + 1) // 2, _seed(spec, generator),
            codes, scales, zps, mins, flag,
            *_input_ptrs(inputs), K=len(inputs), HAS_ACC=acc is not None, EVEN=n % (gpp * spec.group) == 0,
            **_shape_consts(n, spec.group, paired, kernel), **icon, **_encode_consts(spec),
            num_warps=CONFIG[kernel][1], enable_fp_fusion=False,
        )
        _raise_if_flagged(flag)
    return sections
