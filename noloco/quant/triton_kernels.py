"""Fused Triton kernels for the int (DESIGN §3.3) and MX (OCP Microscaling v1.0) formats.

Four kernels, each one pass over memory, each a bit-exact twin of the torch reference in
``intq.py`` / ``mx.py`` for deterministic rounding (same fp32 operations in the same order; fp
contraction into FMAs is disabled at launch so that holds on the GPU too):

- ``quantize`` (+ optional error feedback: reads x and the residual e, quantizes v = x + e, writes
  codes/scales/zero points and the new residual v - deq(v) to a fresh buffer);
- ``dequantize``;
- ``dequantize-accumulate``: acc += deq(p_1) + ... + deq(p_k), up to 4 inputs per launch;
- ``dequantize-accumulate-requantize``: Q(acc + deq(p_1) + ... + deq(p_k)), one hop of a multi-hop
  reduction, without materialising the fp32 sum.

A program handles a tile of whole groups, ``[groups_per_program, group]``; int4/MXFP4 nibbles are
packed and unpacked with ``tl.split``/``tl.join`` of the pair axis (element 2i low nibble). Round half
to even is the add-and-subtract of 1.5 * 2**23, exact for |t| < 2**22. Stochastic rounding draws from
Triton's Philox (``tl.rand``), so it is unbiased but not bit-identical to the torch reference.
Non-finite input marks the group's scale (bf16 NaN 0x7FC0, or E8M0 255); the host wrapper checks the
scales and raises ``ValueError`` before anything is returned. MXFP6 has no kernel (the torch reference
serves it). Rotation (``+hadamard``) is applied by the caller around these kernels.

Kernels use only Triton features available since 3.0 (split/join/reshape, rand, bitcast casts) and run
under ``TRITON_INTERPRET=1`` on the CPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .base import Packed, QuantSpec
from .intq import inv_steps, inv_sym, max_scale_bits16
from .mx import element_params

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126


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
def _mx_decode(code, X, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    ef = (code >> MBITS) & ((1 << EBITS) - 1)
    m = code & ((1 << MBITS) - 1)
    sub = m.to(tl.float32) * SUBSCALE
    norm = (m + (1 << MBITS)).to(tl.float32) * _pow2(ef - BIAS - MBITS)
    mag = tl.where(ef == 0, sub, norm)
    val = tl.where(((code >> (EBITS + MBITS)) & 1) == 1, -mag, mag)
    a = X >> 1
    return (val * _pow2(a)[:, None]) * _pow2(X - a)[:, None]


@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, zp_ptr, mins_ptr, gidx, gmask, n,
                  GROUP: tl.constexpr, GPP: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                  MODE: tl.constexpr, HALF: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
                  BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    """fp32 values [GPP, GROUP] of the groups ``gidx``."""
    if BITS == 4:
        boffs = gidx[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        b = tl.load(codes_ptr + boffs, mask=boffs * 2 < n, other=0).to(tl.int32)
        q = tl.reshape(tl.join(b & 15, b >> 4), [GPP, GROUP])
    else:
        offs = gidx[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        q = tl.load(codes_ptr + offs, mask=offs < n, other=0).to(tl.int32)
    if KIND == 0:
        s = (tl.load(scales_ptr + gidx, mask=gmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        if MODE == 0:
            z = tl.load(zp_ptr + gidx, mask=gmask, other=0).to(tl.int32)
            y = (q - z[:, None]).to(tl.float32) * s[:, None]
        elif MODE == 1:
            y = (q - HALF).to(tl.float32) * s[:, None]
        else:
            lo = tl.load(mins_ptr + gidx, mask=gmask, other=0).to(tl.int32)
            lo = (lo << 16).to(tl.float32, bitcast=True)
            y = lo[:, None] + q.to(tl.float32) * s[:, None]
    else:
        X = tl.load(scales_ptr + gidx, mask=gmask, other=127).to(tl.int32) - 127
        y = _mx_decode(q, X, EBITS, MBITS, BIAS, SUBSCALE)
    return y


@triton.jit
def _store_codes(codes_ptr, qi, offs, emask, gidx, n, GROUP: tl.constexpr, GPP: tl.constexpr,
                 BITS: tl.constexpr):
    qi = tl.where(emask, qi, 0)
    if BITS == 4:
        qe, qo = tl.split(tl.reshape(qi, [GPP, GROUP // 2, 2]))
        boffs = gidx[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        tl.store(codes_ptr + boffs, (qe | (qo << 4)).to(tl.uint8), mask=boffs * 2 < n)
    else:
        tl.store(codes_ptr + offs, qi.to(tl.uint8), mask=emask)


@triton.jit
def _quant_tile(v, offs, emask, gidx, gmask, n, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr,
                GROUP: tl.constexpr, GPP: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                MODE: tl.constexpr, STOCH: tl.constexpr, LEVELS: tl.constexpr, HALF: tl.constexpr,
                MAXB: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                EMIN: tl.constexpr, EMAX: tl.constexpr, MAXCODE: tl.constexpr, MAXVAL: tl.constexpr,
                SUBSCALE: tl.constexpr, INV_STEPS: tl.constexpr, INV_SYM: tl.constexpr):
    """Quantize the fp32 tile v [GPP, GROUP]; store codes and per-group parameters; return deq(v)."""
    bad_el = (v != v) | (tl.abs(v) == float("inf"))
    bad = tl.max(bad_el.to(tl.int32), axis=1) > 0
    vs = tl.where(bad_el, 0.0, v)
    if KIND == 0:
        if MODE == 1:
            amax = tl.max(tl.where(emask, tl.abs(vs), 0.0), axis=1)
            s_raw = amax * INV_SYM
        elif MODE == 0:
            lo = tl.minimum(tl.min(tl.where(emask, vs, 0.0), axis=1), 0.0)
            hi = tl.maximum(tl.max(tl.where(emask, vs, 0.0), axis=1), 0.0)
            s_raw = (hi - lo) * INV_STEPS
        else:
            lo_raw = tl.min(tl.where(emask, vs, float("inf")), axis=1)
            hi = tl.max(tl.where(emask, vs, -float("inf")), axis=1)
            lb = lo_raw.to(tl.int32, bitcast=True)
            lb = tl.where(lo_raw < 0, (lb + 0xFFFF) & -65536, lb & -65536)
            lo = lb.to(tl.float32, bitcast=True)
            s_raw = (hi - lo) * INV_STEPS
        s_raw = tl.maximum(s_raw, _TINY)
        sb = (s_raw.to(tl.int32, bitcast=True) + 0xFFFF) & -65536
        s = sb.to(tl.float32, bitcast=True)
        sb16 = sb >> 16
        bad = bad | (sb16 > MAXB) | (s_raw != s_raw)
        inv = _div(tl.full(s.shape, 1.0, tl.float32), s)
        if MODE == 2:
            t = (v - lo[:, None]) * inv[:, None]
        else:
            t = v * inv[:, None]
        if STOCH:
            r = tl.floor(t + tl.rand(seed, offs.to(tl.int32)))
        else:
            r = _rne(t)
        if MODE == 0:
            if STOCH:
                z = tl.minimum(tl.maximum(tl.ceil(-lo * inv), 0.0), LEVELS * 1.0)
            else:
                z = tl.minimum(tl.maximum(_rne(-lo * inv), 0.0), LEVELS * 1.0)
            q = tl.minimum(tl.maximum(r + z[:, None], 0.0), LEVELS * 1.0)
            deq = (q - z[:, None]) * s[:, None]
            tl.store(zp_ptr + gidx, z.to(tl.int32).to(tl.uint8), mask=gmask)
        elif MODE == 1:
            q = tl.minimum(tl.maximum(r + HALF * 1.0, 1.0), LEVELS * 1.0)
            deq = (q - HALF * 1.0) * s[:, None]
        else:
            q = tl.minimum(tl.maximum(r, 0.0), LEVELS * 1.0)
            deq = lo[:, None] + q * s[:, None]
            tl.store(mins_ptr + gidx, (lb >> 16).to(tl.int16), mask=gmask)
        tl.store(scales_ptr + gidx, tl.where(bad, 0x7FC0, sb16).to(tl.int16), mask=gmask)
        _store_codes(codes_ptr, q.to(tl.int32), offs, emask, gidx, n, GROUP, GPP, BITS)
    else:
        vs = tl.where(emask, vs, 0.0)
        amax = tl.max(tl.abs(vs), axis=1)
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        X = tl.minimum(tl.maximum(e - EMAX, -127), 127)
        w = vs * _pow2(-X)[:, None]
        a = tl.minimum(tl.abs(w), MAXVAL)
        ee = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
        nn = _rne(a * _pow2(MBITS - ee))
        code = ((ee - EMIN) << MBITS) + nn.to(tl.int32)
        code = tl.minimum(code, MAXCODE)
        sign = (w < 0).to(tl.int32) << (EBITS + MBITS)
        code = tl.where(code == 0, code, code | sign)
        deq = _mx_decode(code, X, EBITS, MBITS, BIAS, SUBSCALE)
        tl.store(scales_ptr + gidx, tl.where(bad, 255, X + 127).to(tl.uint8), mask=gmask)
        _store_codes(codes_ptr, code, offs, emask, gidx, n, GROUP, GPP, BITS)
    return deq


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _quantize_kernel(x_ptr, res_ptr, res_out_ptr, codes_ptr, scales_ptr, zp_ptr, mins_ptr, n, seed,
                     HAS_RES: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr, KIND: tl.constexpr,
                     BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr, LEVELS: tl.constexpr,
                     HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
                     BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MAXCODE: tl.constexpr,
                     MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr, INV_STEPS: tl.constexpr,
                     INV_SYM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    gidx = pid * GPP + tl.arange(0, GPP)
    offs = gidx[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    emask = offs < n
    gmask = gidx * GROUP < n
    v = tl.load(x_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    if HAS_RES:
        v = v + tl.load(res_ptr + offs, mask=emask, other=0.0)
    deq = _quant_tile(v, offs, emask, gidx, gmask, n, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr,
                      GROUP, GPP, KIND, BITS, MODE, STOCH, LEVELS, HALF, MAXB, EBITS, MBITS, BIAS, EMIN,
                      EMAX, MAXCODE, MAXVAL, SUBSCALE, INV_STEPS, INV_SYM)
    if HAS_RES:
        tl.store(res_out_ptr + offs, v - deq, mask=emask)


@triton.jit
def _dequantize_kernel(out_ptr, n,
                       c0, s0, z0, m0, c1, s1, z1, m1, c2, s2, z2, m2, c3, s3, z3, m3,
                       K: tl.constexpr, ACCUM: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr,
                       KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr,
                       EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    gidx = pid * GPP + tl.arange(0, GPP)
    offs = gidx[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    emask = offs < n
    gmask = gidx * GROUP < n
    y = _dequant_tile(c0, s0, z0, m0, gidx, gmask, n, GROUP, GPP, KIND, BITS, MODE, HALF, EBITS, MBITS,
                      BIAS, SUBSCALE)
    if ACCUM:
        y = tl.load(out_ptr + offs, mask=emask, other=0.0) + y
    if K > 1:
        y = y + _dequant_tile(c1, s1, z1, m1, gidx, gmask, n, GROUP, GPP, KIND, BITS, MODE, HALF, EBITS,
                              MBITS, BIAS, SUBSCALE)
    if K > 2:
        y = y + _dequant_tile(c2, s2, z2, m2, gidx, gmask, n, GROUP, GPP, KIND, BITS, MODE, HALF, EBITS,
                              MBITS, BIAS, SUBSCALE)
    if K > 3:
        y = y + _dequant_tile(c3, s3, z3, m3, gidx, gmask, n, GROUP, GPP, KIND, BITS, MODE, HALF, EBITS,
                              MBITS, BIAS, SUBSCALE)
    tl.store(out_ptr + offs, y, mask=emask)


@triton.jit
def _requantize_kernel(acc_ptr, n, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr,
                       c0, s0, z0, m0, c1, s1, z1, m1, c2, s2, z2, m2, c3, s3, z3, m3,
                       K: tl.constexpr, HAS_ACC: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr,
                       IKIND: tl.constexpr, IBITS: tl.constexpr, IMODE: tl.constexpr, IHALF: tl.constexpr,
                       IEBITS: tl.constexpr, IMBITS: tl.constexpr, IBIAS: tl.constexpr,
                       ISUBSCALE: tl.constexpr,
                       KIND: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, STOCH: tl.constexpr,
                       LEVELS: tl.constexpr, HALF: tl.constexpr, MAXB: tl.constexpr, EBITS: tl.constexpr,
                       MBITS: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                       MAXCODE: tl.constexpr, MAXVAL: tl.constexpr, SUBSCALE: tl.constexpr,
                       INV_STEPS: tl.constexpr, INV_SYM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    gidx = pid * GPP + tl.arange(0, GPP)
    offs = gidx[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    emask = offs < n
    gmask = gidx * GROUP < n
    if HAS_ACC:
        v = tl.load(acc_ptr + offs, mask=emask, other=0.0)
        v = v + _dequant_tile(c0, s0, z0, m0, gidx, gmask, n, GROUP, GPP, IKIND, IBITS, IMODE, IHALF, IEBITS,
                              IMBITS, IBIAS, ISUBSCALE)
    else:
        v = _dequant_tile(c0, s0, z0, m0, gidx, gmask, n, GROUP, GPP, IKIND, IBITS, IMODE, IHALF, IEBITS,
                          IMBITS, IBIAS, ISUBSCALE)
    if K > 1:
        v = v + _dequant_tile(c1, s1, z1, m1, gidx, gmask, n, GROUP, GPP, IKIND, IBITS, IMODE, IHALF, IEBITS,
                              IMBITS, IBIAS, ISUBSCALE)
    if K > 2:
        v = v + _dequant_tile(c2, s2, z2, m2, gidx, gmask, n, GROUP, GPP, IKIND, IBITS, IMODE, IHALF, IEBITS,
                              IMBITS, IBIAS, ISUBSCALE)
    if K > 3:
        v = v + _dequant_tile(c3, s3, z3, m3, gidx, gmask, n, GROUP, GPP, IKIND, IBITS, IMODE, IHALF, IEBITS,
                              IMBITS, IBIAS, ISUBSCALE)
    _quant_tile(v, offs, emask, gidx, gmask, n, seed, codes_ptr, scales_ptr, zp_ptr, mins_ptr,
                GROUP, GPP, KIND, BITS, MODE, STOCH, LEVELS, HALF, MAXB, EBITS, MBITS, BIAS, EMIN,
                EMAX, MAXCODE, MAXVAL, SUBSCALE, INV_STEPS, INV_SYM)


# ----------------------------------------------------------------------------------------------------
# host wrappers

_ELEMS_PER_PROGRAM = 2048
_NUM_WARPS = 4


def _group(spec: QuantSpec) -> int:
    return spec.group


def _gpp(spec: QuantSpec) -> int:
    return max(1, _ELEMS_PER_PROGRAM // _group(spec))


def _decode_consts(spec: QuantSpec) -> dict:
    if spec.kind == "mx":
        p = element_params(spec.name)
        return dict(KIND=1, BITS=spec.bits, MODE=0, HALF=0, EBITS=p["e_bits"], MBITS=p["m_bits"],
                    BIAS=p["bias"], SUBSCALE=2.0 ** (p["emin"] - p["m_bits"]))
    return dict(KIND=0, BITS=spec.bits, MODE=("zero", "sym", "naive").index(spec.mode),
                HALF=1 << (spec.bits - 1), EBITS=1, MBITS=1, BIAS=0, SUBSCALE=1.0)


def _encode_consts(spec: QuantSpec) -> dict:
    c = _decode_consts(spec)
    if spec.kind == "mx":
        p = element_params(spec.name)
        c.update(STOCH=False, LEVELS=0, MAXB=0, EMIN=p["emin"], EMAX=p["emax"], MAXCODE=p["max_code"],
                 MAXVAL=p["max_value"], INV_STEPS=1.0, INV_SYM=1.0)
    else:
        c.update(STOCH=spec.stochastic, LEVELS=spec.levels, MAXB=max_scale_bits16(spec.levels), EMIN=0,
                 EMAX=0, MAXCODE=0, MAXVAL=0.0, INV_STEPS=inv_steps(spec), INV_SYM=inv_sym(spec))
    return c


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


def _check_flags(spec: QuantSpec, sections: dict[str, torch.Tensor]) -> None:
    scales = sections["scales"]
    if not scales.numel():
        return
    if spec.kind == "mx":
        bad = bool((scales == 255).any())
    else:
        bad = bool((scales.to(torch.int32) > max_scale_bits16(spec.levels)).any())
    if bad:
        raise ValueError(
            "cannot quantize: input holds non-finite values (NaN or ±Inf) or a group range that would "
            "overflow; refusing to produce a poisoned payload"
        )


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
        ValueError: non-finite input (checked on the scales the kernel flags; costs one device sync).
    """
    n = v.numel()
    sections = _alloc_sections(spec, n, v.device)
    res_out = torch.empty(n, dtype=torch.float32, device=v.device) if residual is not None else None
    if n:
        gpp = _gpp(spec)
        grid = (math.ceil(math.ceil(n / spec.group) / gpp),)
        codes, scales, zps, mins = _ptrs(sections)
        _quantize_kernel[grid](
            v, residual if residual is not None else v, res_out if res_out is not None else v,
            codes, scales, zps, mins, n, _seed(spec, generator),
            HAS_RES=residual is not None, GROUP=spec.group, GPP=gpp, **_encode_consts(spec),
            num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )
        _check_flags(spec, sections)
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
        gpp = _gpp(spec)
        grid = (math.ceil(math.ceil(n / spec.group) / gpp),)
        _dequantize_kernel[grid](out, n, *_input_ptrs(inputs), K=len(inputs), ACCUM=accumulate,
                                 GROUP=spec.group, GPP=gpp, **_decode_consts(spec),
                                 num_warps=_NUM_WARPS, enable_fp_fusion=False)
    return out


def dequantize_accumulate_requantize(acc: torch.Tensor | None, inputs: list[Packed], n: int, spec: QuantSpec,
                                     generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Sections of Q(acc + deq(inputs[0]) + ...); inputs share one spec whose group equals ``spec``'s."""
    device = inputs[0].codes.device
    sections = _alloc_sections(spec, n, device)
    if n:
        gpp = _gpp(spec)
        grid = (math.ceil(math.ceil(n / spec.group) / gpp),)
        icon = {"I" + k: v for k, v in _decode_consts(inputs[0].spec).items()}
        codes, scales, zps, mins = _ptrs(sections)
        _requantize_kernel[grid](
            acc if acc is not None else codes, n, _seed(spec, generator), codes, scales, zps, mins,
            *_input_ptrs(inputs), K=len(inputs), HAS_ACC=acc is not None, GROUP=spec.group, GPP=gpp,
            **icon, **_encode_consts(spec), num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )
        _check_flags(spec, sections)
    return sections
