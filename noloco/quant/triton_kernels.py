"""Fused Triton kernels for the int (docs/design.md §3.3) and MX (OCP Microscaling v1.0) formats.

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

Element arithmetic. Round half to even uses 1.5 * 2**23 (exact for |t| < 2**22): int codes are the bit
pattern of ``t + 1.5 * 2**23`` minus the constant's, so rounding, clamping and packing stay in integers.
``1/s`` is one IEEE division (``div_rn``) per group. MX elements are encoded with one magic-number fp32 addition
(:func:`_mx_codes`) and decoded by direct bit construction (:func:`_mx_decode`), not by searching the exponent.
Stochastic rounding draws from Triton's Philox (``tl.rand``) at each element's index, so it is unbiased but not
bit-identical to the torch reference.

Non-finite input. The group statistics are NaN-propagating min/max (int zero-aware and naive) or an
integer max over the magnitudes' bit patterns (symmetric and MX, where NaN/Inf patterns are the largest),
so non-finite input shows in the statistics themselves at no per-element cost. A bad group gets the
scale pattern bf16 NaN 0x7FC0 (or E8M0 255), and the programs that see one store the call's id into a flag word
in device memory, persistent per (thread, device, stream) and never zeroed per call (:mod:`.deferred`). On CUDA a
checked call queues a 4-byte copy of the word into pinned host memory and an event, and the payload carries the
pending verdict, read when it is first used (``Packed.check``): no host sync per call. Under the interpreter
(CPU), and where a caller asks for an immediate answer, the word is read right after the launch and a refused
call raises ``ValueError`` before anything is returned. MXFP6 has no kernel (the torch reference serves it).
Rotation (``+hadamard``) is applied by the caller around these kernels.

Host side. Everything that depends only on (op, spec, n, dtypes, device, launch configuration) -- grid,
constexpr arguments, output layout -- is cached in a launch plan; a plan's compiled kernel is launched directly
after its first launch through Triton (see :meth:`_Plan.launch`); a payload's sections are views of one
allocation. docs/quant.md ("Host path") has the measurements.

Kernels use only Triton features available since 3.0 (keep_dims reductions, PropagateNan, rand,
bitcast casts, pointer casts) and run under ``TRITON_INTERPRET=1`` on the CPU; they are checked to compile for
sm_90 with Triton 3.6 and with the installed Triton.
"""

# fmt: off
# (hand layout: the kernels' aligned argument lists and the launcher's option table read better as written)

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch
import triton
import triton.language as tl

from .base import Packed, QuantSpec
from .deferred import NON_FINITE, RING_SLOTS, FlagRing, FlagWord, HostEvent, PendingCheck
from .intq import inv_steps, inv_sym, max_scale_bits16
from .mx import element_params

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
_RNE_MAGIC_BITS = tl.constexpr(0x4B400000)  # its fp32 bit pattern
_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126
_EXP_ALL_ONES = tl.constexpr(0x7F800000)  # |v| bit patterns >= this are Inf or NaN


def supports(spec: QuantSpec) -> bool:
    """Whether a Triton kernel exists for ``spec`` (rotation is handled outside the kernels)."""
    return (spec.kind == "int" and spec.bits in (4, 8)) or (spec.kind == "mx" and spec.bits in (4, 8))


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
    """fp32 value of MX element codes (sign | exponent field | mantissa) times the block scale 2**X.

    Bit construction: a normal element's fp32 pattern is its magnitude bits shifted into place plus the exponent
    rebias; a subnormal one (exponent field 0) is mantissa * 2**(emin - MBITS), exact in fp32; the sign bit moves to
    bit 31. Then two exact power-of-two multiplies (X in [-127, 127] does not fit one fp32 power of two).
    """
    mag = code & ((1 << (EBITS + MBITS)) - 1)
    norm = ((mag << (23 - MBITS)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    val = tl.where(mag < (1 << MBITS), mag.to(tl.float32) * SUBSCALE, norm)
    val = (val.to(tl.int32, bitcast=True) | ((code >> (EBITS + MBITS)) << 31)).to(tl.float32, bitcast=True)
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
                 INV_STEPS: tl.constexpr, INV_SYM: tl.constexpr, EMAX: tl.constexpr, MXCEIL: tl.constexpr,
                 MAXMANT: tl.constexpr):
    """Per-group [GPP, 1] statistics of the tile (elements beyond n are 0, except for naive).

    Returns (p, lo, lb, bad): int -- p = unrounded scale, lo = zero-aware range low / naive bf16 min,
    lb = naive min bits; MX -- p = X (shared exponent; ``MXCEIL``: one more when amax / 2**X would exceed the
    element max, i.e. when amax's mantissa bits exceed ``MAXMANT``, those of the max, and X was not clamped at
    -127 -- ``mx.shared_exponent(ceil=True)``). ``bad``: the group holds NaN or ±Inf.
    """
    if KIND == 1 or MODE == 1:
        m = tl.abs(va).to(tl.int32, bitcast=True)
        if PAIRED:
            m = tl.maximum(m, tl.abs(vb).to(tl.int32, bitcast=True))
        m = tl.max(m, axis=1, keep_dims=True)
        bad = m >= _EXP_ALL_ONES
        if KIND == 1:
            x = ((m >> 23) & 0xFF) - 127 - EMAX
            p = tl.minimum(tl.maximum(x, -127), 127)
            if MXCEIL:
                p = tl.minimum(p + ((x >= -127) & ((m & 0x7FFFFF) > MAXMANT)).to(tl.int32), 127 - EMAX)
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
def _int_codes(v, inv, z, lo, eidx, seed, MODE: tl.constexpr, STOCH: tl.constexpr, LEVELS: tl.constexpr,
               HALF: tl.constexpr):
    """int32 codes q of an int tile (per-group 1/s, int32 zero point z, naive min lo).

    Round half to even as an integer: t + 1.5 * 2**23 lands in [2**23, 2**24), whose step is 1, so the sum's fp32
    pattern minus the constant's is rne(t) (|t| <= L here), which saves the subtraction, the float-to-int
    conversion and does the clamp in integers.
    """
    if MODE == 2:
        t = (v - lo) * inv
    else:
        t = v * inv
    if STOCH:
        r = tl.floor(t + tl.rand(seed, eidx.to(tl.int32))).to(tl.int32)
    else:
        r = (t + _RNE_MAGIC).to(tl.int32, bitcast=True) - _RNE_MAGIC_BITS
    if MODE == 0:
        q = tl.minimum(tl.maximum(r + z, 0), LEVELS)
    elif MODE == 1:
        q = tl.minimum(tl.maximum(r + HALF, 1), LEVELS)
    else:
        q = tl.minimum(tl.maximum(r, 0), LEVELS)
    return q


@triton.jit
def _int_deq(q, s, z, lo, MODE: tl.constexpr, HALF: tl.constexpr):
    """fp32 values of int32 codes q, the reference's ``(q - z) * s`` / ``(q - half) * s`` / ``lo + q * s``."""
    if MODE == 0:
        y = (q - z).to(tl.float32) * s
    elif MODE == 1:
        y = (q - HALF).to(tl.float32) * s
    else:
        y = lo + q.to(tl.float32) * s
    return y


@triton.jit
def _mx_codes(v, X, EBITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXVAL: tl.constexpr):
    """MX element codes (int32, sign bit included) of ``v / 2**X``, bit-exact with ``mx.encode_elements``.

    The reference's single formula ``code = (e - emin) * 2**M + rne(a * 2**(M - e))`` with e = max(floor(log2 a),
    emin), for a = min(|w|, max), in one fp32 addition: the magic M_e = 2**(e + 23 - MBITS) has an ulp of exactly the
    element step 2**(e - MBITS) at a's binade (or the subnormal step when a is below 2**emin), so the bits of
    a + M_e are M_e's plus n = rne(a / step), carry into the next binade included. M_e's bits come from a's exponent
    field with one max against emin's; (e - emin) * 2**M is M_e's bits shifted down by 23 - MBITS, less a constant.
    About a dozen operations per element (half the earlier bit-by-bit construction, which made MX quantize
    ALU-bound on an H200). The sign is set for w below minus half the smallest subnormal, i.e. exactly for the
    negative values that do not round to 0 (-0 and those get code 0, as in the reference).
    """
    w = v * _pow2(-X)
    a = tl.minimum(tl.abs(w), MAXVAL)
    b = a.to(tl.int32, bitcast=True)
    mb = tl.maximum(b & 0x7F800000, (EMIN + 127) << 23) + ((23 - MBITS) << 23)
    s = (a + mb.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    code = s - mb + (mb >> (23 - MBITS)) - ((150 - MBITS + EMIN) << MBITS)
    neg = w < -(2.0 ** (EMIN - MBITS - 1))
    return tl.where(neg, code | (1 << (EBITS + MBITS)), code)


@triton.jit
def _quant(va, vb, g, gmask, c, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr, call_id,
           PAIRED: tl.constexpr, ODD: tl.constexpr, NEED_DEQ: tl.constexpr,
           KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr,
           LEVELS: tl.constexpr, HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr,
           MBITS: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
           MAXMANT: tl.constexpr, MXCEIL: tl.constexpr, MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr,
           INV_STEPS: tl.constexpr, INV_SYM: tl.constexpr):
    """Quantize the tile (va[, vb]); store codes, group parameters and, if a group is bad, ``call_id`` into the
    non-finite flag word (every bad program of a call stores the same id, so plain stores suffice).

    Paired: va/vb are elements 2c / 2c + 1. Flat: va holds elements c, vb is ignored.
    Returns deq(va), deq(vb) when NEED_DEQ (else va, vb).
    """
    if PAIRED:
        ea = c < nb
        eb = c < nw
    else:
        ea = c < n
        eb = ea
    p, lo, lb, bad = _group_stats(va, vb, ea, eb, PAIRED, KIND, MODE, INV_STEPS, INV_SYM, EMAX, MXCEIL, MAXMANT)
    if KIND == 0:
        s_raw = tl.maximum(p, _TINY)
        sb = (s_raw.to(tl.int32, bitcast=True) + 0xFFFF) & -65536
        s = sb.to(tl.float32, bitcast=True)
        sb16 = sb >> 16
        bad = bad | (sb16 > MAXB) | (s_raw != s_raw)
        inv = _div(tl.full(s.shape, 1.0, tl.float32), s)
        z = sb
        if MODE == 0:
            if STOCH:
                zf = tl.minimum(tl.maximum(tl.ceil(-lo * inv), 0.0), LEVELS * 1.0)
            else:
                zf = tl.minimum(tl.maximum(_rne(-lo * inv), 0.0), LEVELS * 1.0)
            z = zf.to(tl.int32)
            tl.store(zp_ptr + g, z.to(tl.uint8), mask=gmask)
        elif MODE == 2:
            tl.store(mins_ptr + g, (lb >> 16).to(tl.int16), mask=gmask)
        tl.store(scales_ptr + g, tl.where(bad, 0x7FC0, sb16).to(tl.int16), mask=gmask)
        if PAIRED:
            ca = _int_codes(va, inv, z, lo, 2 * c, seed, MODE, STOCH, LEVELS, HALF)
            cb = _int_codes(vb, inv, z, lo, 2 * c + 1, seed, MODE, STOCH, LEVELS, HALF)
            if NEED_DEQ:
                va = _int_deq(ca, s, z, lo, MODE, HALF)
                vb = _int_deq(cb, s, z, lo, MODE, HALF)
        else:
            ca = _int_codes(va, inv, z, lo, c, seed, MODE, STOCH, LEVELS, HALF)
            if NEED_DEQ:
                va = _int_deq(ca, s, z, lo, MODE, HALF)
            cb = ca
    else:
        X = p
        tl.store(scales_ptr + g, tl.where(bad, 255, X + 127).to(tl.uint8), mask=gmask)
        ca = _mx_codes(va, X, EBITS, MBITS, EMIN, MAXVAL)
        if NEED_DEQ:
            va = _mx_decode(ca, X, EBITS, MBITS, BIAS, SUBSCALE)
        if PAIRED:
            cb = _mx_codes(vb, X, EBITS, MBITS, EMIN, MAXVAL)
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
    tl.store(flag_ptr, call_id, mask=nbad > 0)
    return va, vb


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["call_id"])
def _quantize_kernel(x_ptr, xw_ptr, res_ptr, resw_ptr, res_out_ptr, res_outw_ptr, codes_ptr, scales_ptr, zp_ptr,
                     mins_ptr, flag_ptr, call_id, n, nw, nb, seed,
                     HAS_RES: tl.constexpr, PAIRED: tl.constexpr, XW: tl.constexpr, ODD: tl.constexpr,
                     I64: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr, KIND: tl.constexpr,
                     BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr, LEVELS: tl.constexpr,
                     HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
                     BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MAXMANT: tl.constexpr,
                     MXCEIL: tl.constexpr, MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr, INV_STEPS: tl.constexpr,
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
    da, db = _quant(va, vb, g, gmask, c, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr, call_id,
                    PAIRED, ODD, HAS_RES, KIND, BITS, MODE, STOCH, LEVELS, HALF, MAXB, EBITS, MBITS, BIAS,
                    EMIN, EMAX, MAXMANT, MXCEIL, MAXVAL, SUBSCALE, INV_STEPS, INV_SYM)
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


@triton.jit(do_not_specialize=["call_id"])
def _requantize_kernel(acc_ptr, accw_ptr, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr, call_id,
                       c0, s0, z0, m0, c1, s1, z1, m1, c2, s2, z2, m2, c3, s3, z3, m3,
                       K: tl.constexpr, HAS_ACC: tl.constexpr, PAIRED: tl.constexpr, ODD: tl.constexpr,
                       EVEN: tl.constexpr, I64: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr,
                       IKIND: tl.constexpr, IBITS: tl.constexpr, IMODE: tl.constexpr, IHALF: tl.constexpr,
                       IEBITS: tl.constexpr, IMBITS: tl.constexpr, IBIAS: tl.constexpr,
                       ISUBSCALE: tl.constexpr,
                       KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr,
                       LEVELS: tl.constexpr, HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr,
                       MBITS: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                       MAXMANT: tl.constexpr, MXCEIL: tl.constexpr, MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr,
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
    _quant(va, vb, g, gmask, c, n, nw, nb, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr, flag_ptr, call_id,
           PAIRED, ODD, False, KIND, BITS, MODE, STOCH, LEVELS, HALF, MAXB, EBITS, MBITS, BIAS,
           EMIN, EMAX, MAXMANT, MXCEIL, MAXVAL, SUBSCALE, INV_STEPS, INV_SYM)


# ----------------------------------------------------------------------------------------------------
# host wrappers

#: Launch configuration per kernel: (elements per program, warps per program). A program handles
#: max(1, elements // group) whole groups. ``benchmarks/kernels.py --sweep`` times alternatives on the GPU.
#: Keys: kernel name / tile kind ("paired": a 4-bit side, "flat": 8-bit codes only); MX quantize (groups of 32,
#: other element arithmetic) has its own keys, ``quantize_mx/...`` (MXFP4 is paired, MXFP8 flat). A ``:fp32``
#: key, where present, serves fp32 input (:func:`quantize_config_key`): the paired quantize kernels' best tile
#: differs by input width (H200, 2^28: int4 from bf16 0.178 ms at (4096, 4) against 0.217 ms at (4096, 8); from
#: fp32 0.275 ms at (2048, 4) against 0.328 ms at (4096, 4)).
#: Values: the fastest of the sweep's candidates (``SWEEP_CANDIDATES`` in benchmarks/kernels.py) on an H200 at
#: 2^28 elements, each key timed on its own rows (``--sweep --triton-only``, results in docs/results/kernels.json).
CONFIG: dict[str, tuple[int, int]] = {
    "quantize/paired": (4096, 4),
    "quantize/paired:fp32": (2048, 4),
    "quantize/flat": (4096, 4),
    "quantize_mx/paired": (4096, 4),
    "quantize_mx/paired:fp32": (2048, 4),
    "quantize_mx/flat": (8192, 8),
    "quantize_ef/paired": (1024, 4),
    "quantize_ef/flat": (1024, 8),
    "dequantize/paired": (1024, 4),
    "dequantize/flat": (1024, 4),
    "requantize/paired": (2048, 4),
    "requantize/flat": (4096, 4),
}

_XW = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

# Direct launches of compiled kernels (see _Plan.launch). Triton >= 3.3 exposes the pieces (knobs, CompiledKernel's
# launcher); anything else, the interpreter, or NOLOCO_TRITON_DIRECT_LAUNCH=0 keeps Triton's own launcher.
try:  # pragma: no cover - depends on the installed Triton
    from triton import knobs as _knobs
    from triton.compiler import CompiledKernel as _CompiledKernel

    _DIRECT = os.environ.get("NOLOCO_TRITON_DIRECT_LAUNCH", "1") != "0"
except Exception:  # pragma: no cover
    _knobs, _CompiledKernel, _DIRECT = None, None, False
try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # what Triton itself passes as the launch stream
except AttributeError:  # pragma: no cover - CPU-only torch builds
    _raw_stream = None


def _hooks_idle() -> bool:
    """No Triton launch hook (profilers such as proton) is installed; those need Triton's own launcher."""
    rt = _knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class _Plan:
    """Everything about one launch that depends only on (op, spec(s), n, dtypes, flags, device, CONFIG entry).

    Built once per key and cached (:func:`_plan`), so a call does no spec parsing, layout or grid arithmetic.

    Attributes:
        kernel: the ``@triton.jit`` kernel.
        grid: the launch grid, ``(programs,)``.
        consts: the kernel's constexpr arguments, in signature order (they follow the runtime arguments).
        n_runtime: number of runtime (non-constexpr) arguments.
        num_warps: warps per program.
        paired: the tile pairs elements (a 4-bit side).
        sizes: byte sizes for ``torch.split_with_sizes`` of the one output allocation: each section padded to a
            multiple of 16 bytes, so every section starts 16-byte aligned (what Triton's vectorised accesses need).
        sections: ``(name, dtype, index into the split)`` of each payload section, in wire order.
        total: bytes of the output allocation.
        compiled: specialization signature -> the CompiledKernel Triton returned for a launch of this plan with
            that signature (see :meth:`launch`).
    """

    __slots__ = ("kernel", "grid", "consts", "n_runtime", "num_warps", "paired", "sizes", "sections", "total",
                 "compiled")

    def __init__(self, kernel, n: int, group: int, cfg: tuple[int, int], paired: bool, consts: dict,
                 out_spec: QuantSpec | None) -> None:
        gpp = max(1, cfg[0] // group)
        self.kernel = kernel
        groups = (n + group - 1) // group
        self.grid = ((groups + gpp - 1) // gpp,)
        consts = dict(consts, PAIRED=paired, ODD=paired and n % 2 == 1, I64=n + gpp * group >= 2**31, GROUP=group,
                      GPP=gpp)
        names = kernel.arg_names[len(kernel.arg_names) - len(consts):]
        if set(names) != set(consts):  # a signature/host mismatch must fail loudly, not launch garbage
            raise RuntimeError(f"{kernel.__name__}: constexprs {sorted(consts)} do not match {names}")
        self.consts = tuple(consts[k] for k in names)
        self.n_runtime = len(kernel.arg_names) - len(names)
        self.num_warps = cfg[1]
        self.paired = paired
        self.sizes: list[int] = []
        self.sections: list[tuple[str, torch.dtype, int]] = []
        if out_spec is not None:
            for name, dt, count in out_spec.layout(n):
                nbytes = count * (2 if dt == torch.int16 else 1)
                self.sections.append((name, dt, len(self.sizes)))
                self.sizes.append(nbytes)
                if nbytes % 16:
                    self.sizes.append(16 - nbytes % 16)
        self.total = sum(self.sizes)
        self.compiled: dict[tuple, object] = {}

    def alloc(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The payload sections: views of one fresh ``torch.empty`` allocation (one allocator call per call)."""
        parts = torch.empty(self.total, dtype=torch.uint8, device=device).split_with_sizes(self.sizes)
        return {name: parts[i] if dt == torch.uint8 else parts[i].view(dt) for name, dt, i in self.sections}

    def launch(self, args: tuple, sig: tuple, device: torch.device) -> None:
        """Launch with the runtime arguments ``args`` (the constexprs are appended).

        Triton specializes a compiled kernel on each tensor argument's dtype and 16-byte alignment and on each
        int argument's range, ``== 1`` and ``% 16 == 0``; the plan's key fixes the dtypes and every int except the
        stochastic seed, and ``sig = (all pointers 16-byte aligned, seed == 1, seed % 16 == 0)`` covers the rest.
        The first launch goes through Triton's launcher (``kernel[grid](...)``: binding, specialization, cache
        lookup, compilation on a miss), which returns the CompiledKernel; later launches with the same ``sig``
        call that kernel's launcher directly, exactly as ``JITFunction.run`` does after its cache lookup, which
        skips ~20 us of Python per call. Launch hooks or a misaligned view take Triton's path. Should a Triton
        version's launcher not accept the call (TypeError), direct launches are switched off for the process.
        """
        global _DIRECT
        ck = self.compiled.get(sig)
        if ck is not None and _hooks_idle():
            try:
                ck.run(self.grid[0], 1, 1, _raw_stream(device.index), ck.function, ck.packed_metadata, None, None,
                       None, *args, *self.consts)
                return
            except TypeError as err:  # pragma: no cover - a Triton whose launcher takes other arguments
                _DIRECT = False
                clear_plans()
                warnings.warn(f"noloco.quant: direct Triton launches switched off ({err})", RuntimeWarning,
                              stacklevel=2)
        if len(args) != self.n_runtime:
            raise RuntimeError(f"{self.kernel.__name__} takes {self.n_runtime} runtime arguments, got {len(args)}")
        ret = self.kernel[self.grid](*args, *self.consts, num_warps=self.num_warps, enable_fp_fusion=False)
        if _DIRECT and sig[0] and isinstance(ret, _CompiledKernel):  # None under the interpreter
            self.compiled[sig] = ret


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096  # distinct (op, spec, n, ...) keys; a training run uses a handful of tensor sizes


def _plan(key: tuple, build) -> _Plan:
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = build()
    return plan


def clear_plans() -> None:
    """Forget every cached launch plan (and the compiled kernels they hold); the next calls rebuild them."""
    _PLANS.clear()


def _run(plan: _Plan, args: tuple, sig: tuple, device: torch.device) -> None:
    """Launch ``plan`` on ``device`` (made the current CUDA device for the launch if it is not already)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            plan.launch(args, sig, device)
    else:
        plan.launch(args, sig, device)


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
        maxmant = int(torch.tensor(p["max_value"], dtype=torch.float32).view(torch.int32)) & 0x7FFFFF
        c.update(STOCH=False, LEVELS=0, MAXB=0, EMIN=p["emin"], EMAX=p["emax"], MAXMANT=maxmant,
                 MXCEIL=spec.mx_scale == "ceil", MAXVAL=p["max_value"], INV_STEPS=1.0, INV_SYM=1.0)
    else:
        c.update(STOCH=spec.stochastic, LEVELS=spec.levels, MAXB=max_scale_bits16(spec.levels), EMIN=0,
                 EMAX=0, MAXMANT=0, MXCEIL=False, MAXVAL=0.0, INV_STEPS=inv_steps(spec), INV_SYM=inv_sym(spec))
    return c


@functools.lru_cache(maxsize=256)
def _input_consts(spec: QuantSpec) -> dict:
    return {"I" + k: v for k, v in _decode_consts(spec).items()}


# ---------------------------------------------------------------------------------- non-finite flag words
# One int32 word per (thread, device, stream), kept for the life of the thread (deferred.FlagWord): each checked call
# gets the next call id and its kernel stores that id into the word where a group is non-finite, so no call zeroes
# it. On CUDA the call then queues a 4-byte copy of the word into a pinned ring slot and records an event; the
# verdict is read when the payload is first used (Packed.check). The interpreter (CPU) reads the word at once: its
# launches are synchronous. Unchecked calls write into a per-device scratch word that is never read (their bad
# groups are still marked in the payload itself).

_TLS = threading.local()
_SCRATCH: dict[torch.device, torch.Tensor] = {}
#: device types whose checked calls defer their verdict (the tests add "cpu" to run the deferred path on the CPU)
_DEFER_DEVICES = frozenset({"cuda"})


def _new_ring(device: torch.device) -> FlagRing:
    """The ring of deferred verdicts of the current stream of ``device``."""
    if device.type == "cuda":
        return FlagRing(RING_SLOTS, torch.cuda.Event, torch.cuda.current_stream(device), pin_memory=True)
    return FlagRing(RING_SLOTS, HostEvent)


def _flag_word(device: torch.device) -> FlagWord:
    """The flag word of this thread on ``device``'s current stream."""
    words = getattr(_TLS, "words", None)
    if words is None:
        words = _TLS.words = {}
    key = (device, _raw_stream(device.index) if device.type == "cuda" else 0)
    word = words.get(key)
    if word is None:
        word = words[key] = FlagWord(device, functools.partial(_new_ring, device))
    return word


def _flag_args(device: torch.device, check: bool) -> tuple[FlagWord | None, torch.Tensor, int]:
    """(flag word, its tensor, the call's id) of a checked launch; an unchecked one writes a never-read scratch
    word with id 1."""
    if not check:
        return None, _scratch(device), 1
    word = _flag_word(device)
    return word, word.word, word.next_id()


def _scratch(device: torch.device) -> torch.Tensor:
    word = _SCRATCH.get(device)
    if word is None:
        word = _SCRATCH[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return word


def _verdict(flag: FlagWord, call_id: int, defer: bool, device: torch.device) -> PendingCheck | None:
    """After the launch of checked call ``call_id``: its deferred verdict (``defer`` on a device that supports it),
    or None after reading the word now and raising ``ValueError`` if the call met a non-finite group."""
    if defer and device.type in _DEFER_DEVICES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a checked quantizing call cannot be captured in a CUDA graph (its verdict is read "
                               "after the launch); pass check_finite=False")
        return flag.defer(call_id)
    if flag.is_set(call_id):
        raise ValueError(NON_FINITE)
    return None


# ---------------------------------------------------------------------------------------------------- helpers


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
    wt = torch.int64 if t.element_size() == 4 else torch.int32
    n = t.numel()
    return t.view(wt) if n % 2 == 0 else t[: n - 1].view(wt)


def _sig(ptr_bits: int, seed: int) -> tuple[bool, bool, bool]:
    """Specialization signature of a launch (see :meth:`_Plan.launch`); ``ptr_bits``: OR of the caller-supplied
    tensors' addresses (the outputs and flag words are 16-byte aligned by construction)."""
    return (ptr_bits & 15 == 0, seed == 1, seed % 16 == 0)


# ------------------------------------------------------------------------------------------------------ ops


def quantize(v: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None,
             residual: torch.Tensor | None = None, check: bool = True, defer: bool = False
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, PendingCheck | None]:
    """Quantize flat ``v`` (fp32/bf16/fp16, contiguous) with the fused kernel.

    Args:
        v: (n,) values.
        spec: an int or MXFP4/MXFP8 spec (rotation already applied by the caller).
        generator: seeds stochastic rounding.
        residual: optional (n,) fp32 error-feedback residual e; then v + e is quantized.
        check: refuse non-finite input. False: no check at all; bad groups are still marked in the payload (bf16
            NaN scale / E8M0 255), which every decoder rejects.
        defer: with ``check``, on CUDA: do not read the verdict now (no host sync) but return a
            :class:`~noloco.quant.deferred.PendingCheck` for the payload to carry. Otherwise (or on the CPU) the
            flag word is read after the launch (a sync on CUDA) and a refused call raises here.

    Returns:
        (sections, new_residual, pending): payload sections as in ``QuantSpec.layout`` (views of one allocation);
        the new residual ``v + e - deq(Q(v + e))`` as a fresh fp32 tensor (the input residual is not modified), or
        None; the deferred verdict, or None.

    Raises:
        ValueError: non-finite input (``check`` and not deferred).
    """
    n = v.numel()
    dev = v.device
    has_res = residual is not None
    paired = spec.bits == 4
    cfg = CONFIG[quantize_config_key(spec, has_res, v.dtype)]
    plan = _plan(("q", spec, n, v.dtype, has_res, dev, cfg), lambda: _Plan(
        _quantize_kernel, n, spec.group, cfg, paired, dict(_encode_consts(spec), HAS_RES=has_res, XW=_XW[v.dtype]),
        spec))
    sections = plan.alloc(dev)
    res_out = torch.empty(n, dtype=torch.float32, device=dev) if has_res else None
    pending = None
    if n:
        word, flag, call_id = _flag_args(dev, check)
        codes = sections["codes"]
        scales = sections["scales"]
        seed = _seed(spec, generator)
        if paired:
            v = _word_aligned(v)
            vw = _words(v)
            if has_res:
                residual = _word_aligned(residual)
                res, resw, rout, routw = residual, _words(residual), res_out, _words(res_out)
                bits = v.data_ptr() | residual.data_ptr()
            else:
                res, resw, rout, routw = v, vw, v, vw
                bits = v.data_ptr()
        else:
            vw = v
            if has_res:
                res = resw = residual
                rout = routw = res_out
                bits = v.data_ptr() | residual.data_ptr()
            else:
                res = resw = rout = routw = v
                bits = v.data_ptr()
        _run(plan, (v, vw, res, resw, rout, routw, codes, scales, sections.get("zero_points", codes),
                    sections.get("mins", codes), flag, call_id, n, n // 2, (n + 1) // 2, seed), _sig(bits, seed), dev)
        if check:
            pending = _verdict(word, call_id, defer, dev)
    return sections, res_out, pending


def quantize_config_key(spec: QuantSpec, error_feedback: bool = False, dtype: torch.dtype | None = None) -> str:
    """The :data:`CONFIG` key of the quantize kernel for ``spec`` (with or without an error-feedback residual) and
    input ``dtype``: ``<key>:fp32`` where CONFIG has one for fp32 input (the best tile differs from 16-bit input's)."""
    op = "quantize_ef/" if error_feedback else ("quantize_mx/" if spec.kind == "mx" else "quantize/")
    key = op + ("paired" if spec.bits == 4 else "flat")
    if dtype == torch.float32 and key + ":fp32" in CONFIG:
        key += ":fp32"
    return key


def _input_args(inputs: list[Packed]) -> tuple[list[torch.Tensor], int]:
    """(codes, scales, zero points, mins) of each input -- an absent section is replaced by the codes tensor
    (never read) -- padded to 4 inputs by repeating the first; and the OR of their addresses."""
    args: list[torch.Tensor] = []
    bits = 0
    for p in inputs:
        c, s, z, m = p.codes, p.scales, p.zero_points, p.mins
        s = c if s is None else s
        z = c if z is None else z
        m = c if m is None else m
        args += (c, s, z, m)
        bits |= c.data_ptr() | s.data_ptr() | z.data_ptr() | m.data_ptr()
    if len(inputs) < 4:
        args += args[:4] * (4 - len(inputs))
    return args, bits


def dequantize_accumulate(out: torch.Tensor, inputs: list[Packed], accumulate: bool) -> torch.Tensor:
    """out (flat fp32, contiguous) = [out +] deq(inputs[0]) + ... ; inputs share one spec, 1..4 of them."""
    spec, n = inputs[0].spec, out.numel()
    if n:
        dev = out.device
        paired = spec.bits == 4
        cfg = CONFIG["dequantize/paired" if paired else "dequantize/flat"]
        k = len(inputs)
        plan = _plan(("d", spec, n, k, accumulate, dev, cfg), lambda: _Plan(
            _dequantize_kernel, n, spec.group, cfg, paired, dict(_decode_consts(spec), K=k, ACCUM=accumulate),
            None))
        dst = _word_aligned(out) if paired else out
        args, bits = _input_args(inputs)
        _run(plan, (dst, _words(dst) if paired else dst, n, n // 2, (n + 1) // 2, *args),
             _sig(bits | dst.data_ptr(), 0), dev)
        if dst is not out:
            out.copy_(dst)
    return out


def dequantize_accumulate_requantize(acc: torch.Tensor | None, inputs: list[Packed], n: int, spec: QuantSpec,
                                     generator: torch.Generator | None = None, check: bool = True,
                                     defer: bool = False) -> tuple[dict[str, torch.Tensor], PendingCheck | None]:
    """(sections, pending) of Q(acc + deq(inputs[0]) + ...); inputs share one spec whose group equals ``spec``'s.

    ``check``, ``defer`` and ``pending`` as in :func:`quantize`.
    """
    dev = inputs[0].codes.device
    in_spec = inputs[0].spec
    paired = spec.bits == 4 or in_spec.bits == 4
    cfg = CONFIG["requantize/paired" if paired else "requantize/flat"]
    k = len(inputs)
    has_acc = acc is not None

    def build() -> _Plan:
        gpp = max(1, cfg[0] // spec.group)
        return _Plan(_requantize_kernel, n, spec.group, cfg, paired,
                     dict(_input_consts(in_spec), **_encode_consts(spec), K=k, HAS_ACC=has_acc,
                          EVEN=n % (gpp * spec.group) == 0), spec)

    plan = _plan(("r", in_spec, spec, n, k, has_acc, dev, cfg), build)
    sections = plan.alloc(dev)
    pending = None
    if n:
        word, flag, call_id = _flag_args(dev, check)
        codes = sections["codes"]
        args, bits = _input_args(inputs)
        if has_acc:
            if paired:
                acc = _word_aligned(acc)
            a, aw = acc, (_words(acc) if paired else acc)
            bits |= acc.data_ptr()
        else:
            a = aw = codes
        seed = _seed(spec, generator)
        _run(plan, (a, aw, n, n // 2, (n + 1) // 2, seed, codes, sections["scales"],
                    sections.get("zero_points", codes), sections.get("mins", codes), flag, call_id, *args),
             _sig(bits, seed), dev)
        if check:
            pending = _verdict(word, call_id, defer, dev)
    return sections, pending
