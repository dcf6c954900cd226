"""The coset code: a uniform grid whose high bits the receiver supplies from its own values (docs/design.md §3.2).

A sender that knows its receiver holds values close to its own need not send what they share. For each block of
:data:`BLOCK` values the sender picks a power-of-two grid ``s = 2**e`` (``e`` one int8 per block) and sends only the
low ``b`` bits of each grid index, ``q = rne(x / s) mod M`` (``M = 2**b``). The receiver, holding ``y`` near ``x``,
takes the index of its own value on the same grid, ``q_y = rne(y / s)``, and the centred residue
``d = ((q - q_y) mod M)`` in ``[-M/2, M/2)``; it decodes ``s · (q_y + d)``. That is exactly the sender's grid value
``s · rne(x / s)`` whenever ``|rne(x / s) - rne(y / s)| < M/2`` (in particular whenever ``|x - y| < (M/2 - 1)·s``);
otherwise the index *wraps* and the value decodes a multiple of ``M·s`` away (a bounded error). Every receiver of a
message decodes the same values while no index wraps, so a group's sums stay bit-identical; the sender's own
value is its grid value, which error feedback's residual is measured against.

The grid: a receiver's index wraps once ``|x - y|`` passes ``(M/2 - 1) · s``, and when both sides send with error
feedback each value carries up to half a step of the residual it owes, so ``s`` is the smallest power of two with
``(M/2 - 2) · s ≥ margin · D``: ``D`` is what the sender expects the largest distance between its values and a
receiver's to be in the block (the caller's *spread*, e.g. measured at the last exchange less the coding noise;
unknown: ``2 · max|x|``, which covers any receiver whose values have the same range), but at least ``max|x| / 8``
(a receiver whose values wrapped looks close, and a spread that followed it down would end with every value
wrapping and the term decoded as the receiver's own). The grid is never finer than ``2**-24`` of the block's
largest value (fp32 cannot hold a finer grid) nor outside ``[2**-126, 2**127]``.

Arithmetic is float64 elementwise (round-half-to-even; the same bits on every device). The wire body: the int8
exponents, then the packed codes (:func:`~noloco.quant.intq.pack_bits`), each section starting at a multiple of 16
bytes, the padding zero. ``b`` is 3..8; the code costs ``b + 8/128`` bits per value.
"""

from __future__ import annotations

import math

import torch

from .base import PayloadError
from .intq import pack_bits, padding_bits_bad, unpack_bits

#: values per grid exponent
BLOCK = 128
#: the widths of the code (two bits leave no room for a distance once error feedback's half steps are counted)
MIN_BITS, MAX_BITS = 3, 8
#: the exponents an encoder writes
MIN_EXPONENT, MAX_EXPONENT = -126, 127
#: finest grid relative to a block's largest value (fp32 has 24 significant bits)
PRECISION_BITS = 24
#: the distance a grid covers is at least the block's largest value over this (a spread measured too small, e.g.
#: by values that wrapped and so looked close, must not shrink the grid until every value wraps)
FLOOR_RATIO = 8.0
_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def blocks(numel: int) -> int:
    """Grid exponents of ``numel`` values."""
    return -(-numel // BLOCK)


def layout(numel: int, bits: int) -> tuple[int, int, int]:
    """``(exponent bytes, code bytes, message bytes)`` of ``numel`` values at ``bits`` bits (sections 16-aligned)."""
    exps, codes = blocks(numel), -(-numel * bits // 8)
    return exps, codes, _aligned(exps) + _aligned(codes)


def codes_offset(numel: int) -> int:
    """Where the codes start in the message of ``numel`` values (after the 16-aligned exponents)."""
    return _aligned(blocks(numel))


def block_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| over each block (the last one may be short), float64."""
    n = x.numel()
    pad = -n % BLOCK
    a = x.detach().reshape(-1).double().abs()
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    return a.view(-1, BLOCK).amax(dim=1)


def grid_exponents(x: torch.Tensor, spread: torch.Tensor | None, bits: int, margin: float) -> torch.Tensor:
    """The int8 grid exponent of each block of ``x`` (see the module docstring).

    ``spread``: one expected distance per block (float; NaN: unknown), or None (all unknown).
    """
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"coset codes have {MIN_BITS}..{MAX_BITS} bits, got {bits}")
    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"coset margin must be a positive number, got {margin!r}")
    top = block_max(x)
    distance = 2.0 * top
    if spread is not None:
        spread = spread.detach().reshape(-1).to(device=top.device, dtype=torch.float64)
        if spread.numel() != top.numel():
            raise ValueError(f"spread has {spread.numel()} blocks, {x.numel()} values have {top.numel()}")
        distance = torch.where(torch.isnan(spread), distance, torch.maximum(spread, top / FLOOR_RATIO))
    levels = (1 << (bits - 1)) - 2
    with torch.no_grad():
        wanted = torch.ceil(torch.log2(margin * distance / levels))
        floor = torch.floor(torch.log2(top)) - PRECISION_BITS  # -inf for an all-zero block
        e = torch.maximum(wanted, floor)
        e = torch.nan_to_num(e, nan=MIN_EXPONENT, neginf=MIN_EXPONENT, posinf=MAX_EXPONENT)
    return e.clamp(MIN_EXPONENT, MAX_EXPONENT).to(torch.int8)


def steps(exponents: torch.Tensor, numel: int) -> torch.Tensor:
    """Each of ``numel`` values' grid step ``2**e`` (float64) from its block's exponent."""
    s = torch.ldexp(torch.ones_like(exponents, dtype=torch.float64), exponents.to(torch.int32))
    return s.repeat_interleave(BLOCK)[:numel]


def encode(x: torch.Tensor, exponents: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, value)``: the packed ``bits``-bit residues of the 1-D ``x`` on the grids ``exponents``, and the
    fp32 grid value every receiver decodes while no index wraps. NaN/Inf in ``x`` raise ``ValueError``."""
    flat = x.detach().reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("coset code: the input holds NaN or Inf")
    if exponents.numel() != blocks(flat.numel()):
        raise ValueError(f"{exponents.numel()} grid exponents for {flat.numel()} values")
    s = steps(exponents.to(flat.device), flat.numel())
    index = torch.round(flat.double() / s)
    value = (index * s).float()
    if not bool(torch.isfinite(value).all()):
        raise ValueError("coset code: a grid value overflows fp32 (a grid too coarse for the values)")
    residue = torch.remainder(index, 1 << bits).to(torch.int32)
    return pack_bits(residue, bits), value


def decode(exponents: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, bits: int) -> torch.Tensor:
    """The fp32 values a sender encoded, decoded against this receiver's own values ``side`` (1-D, finite).

    Raises :class:`~noloco.quant.PayloadError` for exponents no encoder writes, non-zero padding bits, or a
    decoded value that overflows fp32.
    """
    y = side.detach().reshape(-1)
    n = y.numel()
    if exponents.numel() != blocks(n) or codes.numel() != -(-n * bits // 8):
        raise PayloadError(f"coset{bits} payload of {exponents.numel()} exponents and {codes.numel()} code bytes "
                           f"does not hold {n} values")  # fmt: skip
    e = exponents.to(torch.int32)
    if bool(((e < MIN_EXPONENT) | (e > MAX_EXPONENT)).any()):
        raise PayloadError(f"coset{bits} payload holds a grid exponent outside [{MIN_EXPONENT}, {MAX_EXPONENT}]")
    bad = padding_bits_bad(codes, n, bits)
    if bad is not None and bool(bad):
        raise PayloadError(f"coset{bits} payload has non-zero padding bits")
    modulus = 1 << bits
    s = steps(exponents.to(y.device), n)
    own = torch.round(y.double() / s)
    q = unpack_bits(codes.to(y.device), n, bits).double()
    d = torch.remainder(q - own + modulus // 2, modulus) - modulus // 2
    out = ((own + d) * s).float()
    if not bool(torch.isfinite(out).all()):
        raise PayloadError(f"coset{bits} payload decodes to values beyond fp32")
    return out
