"""Randomized block Hadamard rotation (spreads outliers before quantizing; docs/design.md §3.3).

The flat vector is zero-padded to a multiple of the block size B (a power of two), cut into blocks,
and each block row-vector x is mapped to ``y = (x * d) @ H`` with H the Sylvester Hadamard matrix scaled
by 1/sqrt(B) (orthonormal and symmetric) and d a vector of B random signs drawn from a CPU
``torch.Generator`` seeded with the spec's ``hadamard_seed``; the same d serves every block. The
inverse is ``x = (y @ H) * d``. Both ends derive d from the seed in the spec, so nothing extra travels.
This follows the randomized Hadamard transforms of QuIP#/QuaRot (arXiv 2402.04396, 2404.00456).

**No B x B table for large blocks.** Block size and seed come from the spec, i.e. from a peer's wire
header, so nothing here may allocate in proportion to B**2. Blocks up to :data:`DENSE_MAX` use the dense
matrix (at most 256 KiB; one GEMM is the fastest form there). Larger blocks use the Kronecker structure of
Sylvester's construction, ``H_B = H_a ⊗ H_b`` (B = a * b, a <= b <= 64): a block viewed as an (a, b) matrix X
becomes ``H_a X H_b``, two small GEMMs, O(a + b) work per element instead of O(B), equal to the dense product up
to fp32 rounding (tests/quant/test_hadamard_hostile.py checks both against float64).

**Bounded cache.** The tables (H or its two factors per block size, d per (block, seed)) live in one LRU
keyed by device, bounded by :data:`CACHE_MAX_ENTRIES` entries and :data:`CACHE_MAX_BYTES` bytes. A table is at
most 256 KiB (dense H, one per block size and device) or 16 KiB (a Kronecker factor, or d per seed), so a stream of
payloads with distinct seeds or blocks costs at most that bound (:func:`cache_info`).

**Finite after decoding.** The rotation of a finite vector can exceed fp32, and so can the inverse rotation of a
finite payload (a sum of B terms of up to fp32 max / sqrt(B) each). Both ends keep the project's contract that an
accepted payload decodes to finite values (docs/quant.md, "Error handling"):

- :func:`rotate` (every encoder) refuses, with ``ValueError``, a vector whose rotated values exceed
  :func:`encode_limit` = fp32 max / (4 sqrt(B)). Quantizing never doubles a group's largest magnitude (int:
  |decoded| <= L * s with s the range / L rounded up to bf16, at most 2 (1 + 2**-7) x; MX and casts less), so an
  honest payload's decoded values stay below fp32 max / (1.9 sqrt(B)), and their inverse rotation (at most
  sqrt(B) x the largest) is finite with a wide margin for fp32 rounding.
- :func:`unrotate` (every decoder) refuses, with :class:`~noloco.quant.base.PayloadError`, a payload whose inverse
  rotation is not finite: no honest encoder writes one, so it is corrupt or forged (``from_bytes`` bounds each
  value but cannot see this sum). The check is exact: a payload that decodes to finite values is never refused.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from .base import PayloadError, QuantSpec

#: largest block rotated with the dense B x B matrix (256 KiB); larger blocks use two Kronecker factors
DENSE_MAX = 256
#: bounds of the table cache shared by every device, block size and seed
CACHE_MAX_ENTRIES = 64
CACHE_MAX_BYTES = 4 << 20

_F32_MAX = float(torch.finfo(torch.float32).max)


def encode_limit(block: int) -> float:
    """Largest rotated magnitude :func:`rotate` accepts for blocks of ``block``: fp32 max / (4 sqrt(block))."""
    return _F32_MAX / (4.0 * math.sqrt(block))


def _sylvester(size: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``size`` / sqrt(size), fp32 (built in float64, then rounded)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / size**0.5).float()


def _signs(block: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (block,), generator=gen).float() * 2 - 1


def _split(block: int) -> tuple[int, int]:
    """(a, b) with a * b = block, a <= b: the Kronecker factors used for blocks above DENSE_MAX."""
    k = block.bit_length() - 1
    return 1 << (k // 2), 1 << (k - k // 2)


class _TableCache:
    """A thread-safe LRU of small tensors bounded by entry count and total bytes."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple, build) -> torch.Tensor:
        with self._lock:
            t = self._items.get(key)
            if t is not None:
                self._items.move_to_end(key)
                return t
        t = build()  # outside the lock: building may copy to a device
        size = t.numel() * t.element_size()
        with self._lock:
            if key in self._items:  # another thread built it meanwhile
                self._items.move_to_end(key)
                return self._items[key]
            if size > self.max_bytes:
                return t  # never cached (cannot happen for the tables above; kept for safety)
            self._items[key] = t
            self._bytes += size
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
            return t

    def info(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._items),
                "bytes": self._bytes,
                "max_entries": self.max_entries,
                "max_bytes": self.max_bytes,
            }

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


_cache = _TableCache(CACHE_MAX_ENTRIES, CACHE_MAX_BYTES)


def cache_info() -> dict[str, int]:
    """Entries and bytes the rotation tables hold now, and their bounds."""
    return _cache.info()


def cache_clear() -> None:
    """Drop every cached table (they are rebuilt, identically, on the next use)."""
    _cache.clear()


def _table(size: int, device: torch.device) -> torch.Tensor:
    return _cache.get(("h", size, str(device)), lambda: _sylvester(size).to(device))


def _sign_table(spec: QuantSpec, device: torch.device) -> torch.Tensor:
    block, seed = spec.hadamard_block, spec.hadamard_seed
    return _cache.get(("d", block, seed, str(device)), lambda: _signs(block, seed).to(device))


def signs(spec: QuantSpec, device: torch.device) -> torch.Tensor:
    """d of the spec on ``device``: (B,) fp32 of ±1 drawn from ``hadamard_seed`` (a copy of the cached table)."""
    return _sign_table(spec, device).clone()


def factors(spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense (H, d) of the spec on ``device``: H (B, B) fp32 orthonormal, d (B,) fp32 of ±1.

    A reference, built on every call and never cached; :func:`rotate` and :func:`unrotate` do not use it.
    """
    return _sylvester(spec.hadamard_block).to(device), signs(spec, device)


def _transform(rows: torch.Tensor, block: int) -> torch.Tensor:
    """``rows @ H`` for fp32 ``rows`` (m, block), H the orthonormal Sylvester matrix; a new tensor."""
    if block <= DENSE_MAX:
        return rows @ _table(block, rows.device)
    a, b = _split(block)
    z = (rows.reshape(-1, b) @ _table(b, rows.device)).view(-1, a, b)  # X H_b for each (a, b) block X
    return torch.matmul(_table(a, rows.device), z).view(-1, block)  # H_a (X H_b)


def _magnitude(t: torch.Tensor) -> float:
    """max |t| (NaN if ``t`` holds a NaN): one pass (aminmax), one host read."""
    lo, hi = torch.aminmax(t)
    return float(torch.maximum(hi, -lo))


def rotate(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Rotate flat fp32 ``v`` (n,) -> flat fp32 (spec.padded_numel(n),).

    Raises:
        ValueError: a rotated value exceeds :func:`encode_limit` (or is not finite): a payload carrying it could
            decode to ±Inf, so the format cannot represent this input.
    """
    n, block = v.numel(), spec.hadamard_block
    if n == 0:
        return v.float()
    padded = torch.zeros(spec.padded_numel(n), dtype=torch.float32, device=v.device)
    padded[:n] = v
    rows = padded.view(-1, block).mul_(_sign_table(spec, v.device))
    y = _transform(rows, block).view(-1)
    top, limit = _magnitude(y), encode_limit(block)
    if not top <= limit:
        raise ValueError(
            f"cannot quantize: {spec} rotates this input to magnitudes up to {top:.4g}, above "
            f"{limit:.4g} = fp32 max / (4 sqrt({block})); a payload carrying them could decode to ±Inf"
        )
    return y


def unrotate(y: torch.Tensor, spec: QuantSpec, n: int) -> torch.Tensor:
    """Inverse of :func:`rotate`: flat fp32 (padded,) -> flat fp32 (n,).

    Raises:
        PayloadError: the inverse rotation of the first ``n`` values is not finite (NaN or ±Inf). An honest encoder
            never writes such a payload (:func:`rotate` bounds its values), so it is corrupt or forged.
    """
    if n == 0:
        return y[:0]
    block = spec.hadamard_block
    out = _transform(y.view(-1, block), block).mul_(_sign_table(spec, y.device)).view(-1)[:n]
    if not math.isfinite(_magnitude(out)):
        raise PayloadError(
            f"{spec} payload decodes to non-finite values after the inverse rotation (its rotated "
            f"values reach {_magnitude(y):.4g}; an honest encoder keeps them below "
            f"{encode_limit(block):.4g} before quantizing): corrupt or forged"
        )
    return out
