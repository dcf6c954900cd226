"""Chunked top-k sparsification, plain-torch reference (SparseLoCo, arXiv 2508.15706; DeMo, arXiv 2411.19870).

A spec ``topk:K/C[+dct]+VALUE`` cuts the flat vector into chunks of C values (the last one may be shorter, t
values) and keeps, per chunk, the K largest magnitudes (min(K, t) in the tail chunk). With ``+dct`` the
selection runs over the chunk's orthonormal DCT-II coefficients (DeMo's transform; the tail chunk uses a DCT
of its own length t), and decoding applies the inverse transform (DCT-III) to the scattered coefficients.

- **Selection and ties**: a stable descending sort of the magnitudes, so among equal magnitudes the lower
  in-chunk index wins; a chunk with fewer than K non-zeros still sends K entries (the lowest-index zeros),
  so a payload's size depends only on (spec, numel).
- **Indices**: in-chunk positions, ascending within each chunk, chunks in order, ceil(log2 C) bits each,
  packed as one little-endian bit stream (:func:`noloco.quant.intq.pack_bits`). A decoder checks that every
  chunk's indices strictly increase and lie below the chunk's length (no duplicates, nothing out of range).
- **Values**: the kept values, chunk by chunk in index order, encoded by the VALUE spec as one flat tensor of
  :meth:`QuantSpec.selected` values (their groups span chunks).
- Decoding costs O(payload) plus the zero fill of the dense output (and the inverse DCT with ``+dct``).

NaN/Inf input raises ``ValueError``; with ``+dct`` so does input whose transform overflows fp32.
"""

from __future__ import annotations

import math

import torch

from .base import QuantSpec
from .intq import check_finite, pack_bits, unpack_bits


def dct2(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of each row of ``x`` (rows, N), fp32, through one length-N FFT (Makhoul 1980)."""
    n = x.shape[-1]
    v = torch.cat([x[..., ::2], x[..., 1::2].flip(-1)], dim=-1).double()
    k = torch.arange(n, dtype=torch.float64, device=x.device)
    tw = torch.exp(-1j * math.pi * k / (2 * n))
    out = (torch.fft.fft(v, dim=-1) * tw).real * math.sqrt(2.0 / n)
    out[..., 0] /= math.sqrt(2.0)
    return out.float()


def idct2(c: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct2` (orthonormal DCT-III) for each row of ``c`` (rows, N), fp32."""
    n = c.shape[-1]
    c = c.double() * math.sqrt(n / 2.0)
    c[..., 0] *= math.sqrt(2.0)
    k = torch.arange(n, dtype=torch.float64, device=c.device)
    rev = torch.cat([torch.zeros_like(c[..., :1]), c[..., 1:].flip(-1)], dim=-1)  # c[N - k], 0 at k = 0
    spec = (c - 1j * rev) * torch.exp(1j * math.pi * k / (2 * n)) / 2
    v = torch.fft.ifft(spec, dim=-1).real * 2
    out = torch.empty_like(v)
    half = (n + 1) // 2
    out[..., ::2] = v[..., :half]
    out[..., 1::2] = v[..., half:].flip(-1)
    return out.float()


def _chunks(v: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """``v`` as at most two 2-D views: the full chunks (rows of ``chunk``) and the tail chunk (one row)."""
    full = v.numel() // chunk
    parts = [v[: full * chunk].view(full, chunk)] if full else []
    if v.numel() % chunk:
        parts.append(v[full * chunk :].view(1, -1))
    return parts


def select(v: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed ``indices`` section and the kept fp32 values (:meth:`QuantSpec.selected` of them) of flat ``v``.

    Raises:
        ValueError: ``v`` holds NaN/±Inf, or (``+dct``) its transform is not finite.
    """
    check_finite(v)
    idx_parts, val_parts = [], []
    for rows in _chunks(v.float(), spec.group):
        if spec.dct:
            rows = dct2(rows)
            check_finite(rows)
        k = min(spec.topk, rows.shape[1])
        order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :k]
        idx = order.sort(dim=1).values
        idx_parts.append(idx.reshape(-1))
        val_parts.append(rows.gather(1, idx).reshape(-1))
    if not idx_parts:
        return torch.empty(0, dtype=torch.uint8, device=v.device), torch.empty(0, dtype=torch.float32, device=v.device)
    return pack_bits(torch.cat(idx_parts), spec.bits), torch.cat(val_parts)


def chunk_indices(indices: torch.Tensor, spec: QuantSpec, numel: int) -> list[torch.Tensor]:
    """Unpack the ``indices`` section of a payload of ``numel`` values: one (rows, k) int64 tensor per part of
    :func:`_chunks` (full chunks, then the tail chunk)."""
    full, tail = divmod(numel, spec.group)
    flat = unpack_bits(indices, spec.selected(numel), spec.bits).to(torch.int64)
    parts = []
    if full:
        parts.append(flat[: full * spec.topk].view(full, spec.topk))
    if tail:
        parts.append(flat[full * spec.topk :].view(1, -1))
    return parts


def indices_bad(indices: torch.Tensor, spec: QuantSpec, numel: int) -> torch.Tensor | None:
    """A 0-d bool tensor: some chunk's indices are not strictly increasing or not below its length (None if the
    payload carries no index)."""
    full, tail = divmod(numel, spec.group)
    flags = []
    for rows, length in zip(chunk_indices(indices, spec, numel), [spec.group] * bool(full) + [tail] * bool(tail)):
        flags.append((rows[:, -1] >= length).any())
        if rows.shape[1] > 1:
            flags.append((rows[:, 1:] <= rows[:, :-1]).any())
    return torch.stack(flags).any() if flags else None


def scatter(values: torch.Tensor, indices: torch.Tensor, spec: QuantSpec, numel: int) -> torch.Tensor:
    """The dense flat fp32 vector of ``numel`` values a payload decodes to (``values``: the decoded kept values).

    Raises:
        ValueError: (``+dct``) the inverse transform is not finite (a forged payload).
    """
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    start = 0
    for rows, idx in zip(_chunks(out, spec.group), chunk_indices(indices, spec, numel)):
        count = idx.numel()
        dense = rows if not spec.dct else torch.zeros_like(rows)
        dense.scatter_(1, idx, values[start : start + count].view(idx.shape))
        if spec.dct:
            rows.copy_(_idct_checked(dense))
        start += count
    return out


def _idct_checked(coefficients: torch.Tensor) -> torch.Tensor:
    """:func:`idct2` of ``coefficients``, refusing a non-finite result (``ValueError``)."""
    out = idct2(coefficients)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("top-k payload decodes to non-finite values through its inverse DCT")
    return out
