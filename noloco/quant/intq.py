"""Group-wise integer quantization, plain-torch reference (the ground truth the Triton kernels match).

Implements the zero-aware asymmetric quantizer of docs/design.md §3.3 (b = 2, 3, 4 or 8 bits, groups of g values)
and its two ablations, for a flat fp32 vector ``v``:

zero-aware (default)::

    lo = min(min(v), 0) ; hi = max(max(v), 0)            # over the group's valid elements only
    s  = ceil_bf16(max((hi - lo) * fp32(1/L), 2**-126))  # L = 2**b - 1; stored as bf16
    z  = clamp(rne(-lo * (1/s)), 0, L)                    # u8 zero point
    q  = clamp(rne(v * (1/s)) + z, 0, L)                  # v = 0 gives q = z, decodes to exactly 0
    v̂  = s * (q - z)

Stochastic zero-aware mode uses ``s = ceil_bf16((hi - lo) * fp32(1/(L-1)))`` and ``z = ceil(-lo/s)``: one
level fewer, but no element can fall outside [0, L] and be clipped, which would bias the rounding.

symmetric (``:sym``): ``s = ceil_bf16(amax / (2**(b-1) - 1))``, ``z = 2**(b-1)`` fixed (not sent),
``q in [1, L]``. naive (``:naive``): ``lo = min(v)``, ``hi = max(v)`` (zero not forced into the range),
``lo`` stored as bf16 rounded toward -inf, ``s = ceil_bf16((hi - lo_st)/L)``, ``q = rne((v - lo_st)/s)``,
``v̂ = lo_st + s * q``.

Choices pinned here (docs/quant.md):

- **Scale dtype bf16, rounded up** (``ceil_bf16``): bf16 has fp32's exponent range, so a scale can
  neither overflow (fp16 tops out at 65504) nor underflow (fp16's smallest normal, 6.1e-5, is larger
  than int8 scales of typical gradients). Rounding *up* keeps the group's range on the grid; it widens
  the step by at most 2**-7 (0.8 %). Quantization uses the stored scale.
- ``rne`` is round-half-to-even; dividing by L is a multiply by the fp32 constant 1/L; ``1/s`` is one
  IEEE fp32 division per group, then one multiply per element. A range whose hi - lo overflows fp32
  raises ``ValueError``. Stochastic rounding (``:stochastic``) replaces ``rne(t)`` by ``floor(t + u)``, u ~ U[0, 1)
  (unbiased: E[floor(t + u)] = t); zeros stay exact (t = 0 gives floor(u) = 0).
- Non-finite input (NaN, ±Inf) raises ``ValueError``: a payload never carries poisoned values.
- int4 codes: element 2i in the low nibble of byte i, element 2i+1 in the high nibble; an unused
  high nibble (odd count) is 0. int2 / int3 codes: one little-endian bit stream, element i in bits
  [b·i, b·i + b) (:func:`pack_bits`): exactly ceil(b·n / 8) bytes, the unused high bits of the last byte 0.
"""

from __future__ import annotations

import torch

from .base import QuantSpec

TINY = 2.0**-126  # smallest normal fp32; also exactly representable in bf16
_BF16_LOW = 0xFFFF
_HIGH_MASK = -65536  # ~0xFFFF as int32


def inv_steps(spec: QuantSpec) -> float:
    """fp32(1 / steps) for the asymmetric modes: steps = L (nearest) or L - 1 (stochastic, zero-aware)."""
    steps = spec.levels - 1 if (spec.stochastic and spec.mode == "zero") else spec.levels
    return float(torch.tensor(1.0 / steps, dtype=torch.float32))


def inv_sym(spec: QuantSpec) -> float:
    """fp32(1 / (2**(b-1) - 1)) for the symmetric mode."""
    return float(torch.tensor(1.0 / ((1 << (spec.bits - 1)) - 1), dtype=torch.float32))


def max_scale_bits16(levels: int) -> int:
    """Largest bf16 scale pattern whose ``scale * levels`` is finite in fp32 (decode cannot overflow)."""
    return int(torch.tensor(torch.finfo(torch.float32).max / levels).view(torch.int32)) >> 16


def check_finite(v: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``v`` holds NaN or ±Inf."""
    if v.numel() and not bool(torch.isfinite(v).all()):
        bad = int((~torch.isfinite(v)).sum())
        raise ValueError(
            f"cannot quantize: input holds {bad} non-finite value(s) (NaN or ±Inf); "
            "refusing to produce a poisoned payload"
        )


def ceil_bf16_bits(s: torch.Tensor) -> torch.Tensor:
    """Round positive finite fp32 values up to the next bf16; returns the fp32 bit patterns (int32)."""
    return (s.view(torch.int32) + _BF16_LOW) & _HIGH_MASK


def floor_bf16_bits(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values toward -inf to bf16; returns the fp32 bit patterns (int32)."""
    bits = v.view(torch.int32)
    return torch.where(v < 0, (bits + _BF16_LOW) & _HIGH_MASK, bits & _HIGH_MASK)


def bf16_bits_to_float(bits16: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns stored as int16 -> fp32 values (exact)."""
    return (bits16.to(torch.int32) << 16).view(torch.float32)


def _grouped(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """View flat ``v`` as (groups, group), padding the tail with its own last value (keeps min/max)."""
    n = v.numel()
    groups = -(-n // group)
    pad = groups * group - n
    if pad:
        v = torch.cat([v, v[-1:].expand(pad)])
    valid = torch.arange(groups * group, device=v.device).view(groups, group) < n
    return v.view(groups, group), valid


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (flat, values 0..15): element 2i -> low nibble, 2i+1 -> high nibble of byte i."""
    q = q.to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    pairs = q.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: the first ``n`` 4-bit codes as uint8."""
    return torch.stack([codes & 15, codes >> 4], dim=1).view(-1)[:n]


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack flat non-negative codes (< 2**bits, bits in 1..16) as one little-endian bit stream.

    Element i occupies bits [bits·i, bits·i + bits) of the stream, bit j of the stream is bit j % 8 of byte
    j // 8; the result has ceil(bits·n / 8) bytes, the unused high bits of the last byte zero.
    """
    q = q.reshape(-1).to(torch.int32)
    shifts = torch.arange(bits, device=q.device, dtype=torch.int32)
    stream = ((q[:, None] >> shifts) & 1).reshape(-1).to(torch.uint8)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=q.device)
    return (stream.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as int32 (reads ceil(bits·n / 8) bytes)."""
    shifts = torch.arange(8, device=codes.device, dtype=torch.int32)
    stream = ((codes.reshape(-1).to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[: n * bits]
    weights = 1 << torch.arange(bits, device=codes.device, dtype=torch.int32)
    return (stream.view(n, bits) * weights).sum(dim=1, dtype=torch.int32)


def padding_bits_bad(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor | None:
    """A 0-d bool tensor: the unused high bits of a :func:`pack_bits` stream's last byte are not zero (None if
    the stream fills its last byte)."""
    used = n * bits % 8
    if not used or not codes.numel():
        return None
    return (codes[-1].to(torch.int32) >> used) != 0


def quantize_int(v: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Quantize flat fp32 ``v`` (shape (n,)) with an int spec.

    Returns the payload sections: ``codes`` (uint8, ceil(b·n/8) bytes for b = 2, 3, 4; n for int8), ``scales``
    (int16 bf16 bit patterns, one per group) and ``zero_points`` (uint8) or ``mins`` (int16 bf16 bits).

    Raises:
        ValueError: ``v`` holds NaN or ±Inf, or (naive) a minimum beyond bf16's range.
    """
    check_finite(v)
    n, L = v.numel(), spec.levels
    dev = v.device
    if n == 0:
        out = {
            "codes": torch.empty(0, dtype=torch.uint8, device=dev),
            "scales": torch.empty(0, dtype=torch.int16, device=dev),
        }
        if spec.mode == "zero":
            out["zero_points"] = torch.empty(0, dtype=torch.uint8, device=dev)
        elif spec.mode == "naive":
            out["mins"] = torch.empty(0, dtype=torch.int16, device=dev)
        return out
    x, _ = _grouped(v.float(), spec.group)
    out: dict[str, torch.Tensor] = {}
    if spec.mode == "sym":
        s_raw = x.abs().amax(dim=1) * inv_sym(spec)
    elif spec.mode == "zero":
        lo = x.amin(dim=1).clamp_max(0.0)
        hi = x.amax(dim=1).clamp_min(0.0)
        s_raw = (hi - lo) * inv_steps(spec)
    else:  # naive
        lo_bits = floor_bf16_bits(x.amin(dim=1))
        lo = lo_bits.view(torch.float32)
        hi = x.amax(dim=1)
        s_raw = (hi - lo) * inv_steps(spec)
        out["mins"] = (lo_bits >> 16).to(torch.int16)
    if not bool(torch.isfinite(s_raw).all()):
        raise ValueError("cannot quantize: a group's range is beyond the representable bf16 range")
    s_bits = ceil_bf16_bits(s_raw.clamp_min(TINY))
    if bool(((s_bits >> 16) > max_scale_bits16(L)).any()):
        raise ValueError("cannot quantize: a group's range is so large that decoding would overflow fp32")
    s = s_bits.view(torch.float32)
    inv = (1.0 / s)[:, None]
    out["scales"] = (s_bits >> 16).to(torch.int16)

    if spec.mode == "naive":
        t = (x - lo[:, None]) * inv
    else:
        t = x * inv
    if spec.stochastic:
        u = torch.rand(t.shape, generator=generator, device=dev if generator is None else generator.device)
        r = torch.floor(t + u.to(dev))
    else:
        r = torch.round(t)
    if spec.mode == "zero":
        z = (torch.ceil if spec.stochastic else torch.round)(-lo * inv[:, 0]).clamp(0, L)
        q = (r + z[:, None]).clamp(0, L)
        out["zero_points"] = z.to(torch.uint8)
    elif spec.mode == "sym":
        q = (r + float(1 << (spec.bits - 1))).clamp(1, L)
    else:
        q = r.clamp(0, L)
    q = q.view(-1)[:n].to(torch.uint8)
    out["codes"] = q if spec.bits == 8 else pack_nibbles(q) if spec.bits == 4 else pack_bits(q, spec.bits)
    return {"codes": out["codes"], **{k: val for k, val in out.items() if k != "codes"}}


def dequantize_int(sections: dict[str, torch.Tensor], spec: QuantSpec, n: int) -> torch.Tensor:
    """Decode int payload sections into a flat fp32 tensor of ``n`` elements."""
    codes = sections["codes"]
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=codes.device)
    if spec.bits == 8:
        q = codes[:n]
    else:
        q = unpack_nibbles(codes, n) if spec.bits == 4 else unpack_bits(codes, n, spec.bits)
    groups = -(-n // spec.group)
    qf = torch.zeros(groups * spec.group, dtype=torch.float32, device=codes.device)
    qf[:n] = q.float()
    qf = qf.view(groups, spec.group)
    s = bf16_bits_to_float(sections["scales"])[:, None]
    if spec.mode == "zero":
        y = (qf - sections["zero_points"].float()[:, None]) * s
    elif spec.mode == "sym":
        y = (qf - float(1 << (spec.bits - 1))) * s
    else:
        y = bf16_bits_to_float(sections["mins"])[:, None] + qf * s
    return y.view(-1)[:n]
