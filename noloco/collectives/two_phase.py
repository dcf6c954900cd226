"""Two-phase all-reduce over any transport: reduce-scatter to owners, then all-gather.

Implements the reduction of DESIGN §3.4 (the scheme of the Echo paper): the vector is cut into
``n`` contiguous segments and member ``k`` owns segment ``k``. Each member encodes the segments it
does not own and sends each to its owner; the owner decodes them, adds its own segment
*unencoded*, and sums in fp32 in member order. The owner then encodes the reduced segment once and
sends those same bytes to every member; every member, the owner included, decodes those bytes, so
all members return bit-identical results. Each value is encoded at most twice, whatever ``n`` is.

Bytes sent per member: ``2 (n-1)/n`` times the encoded size of the vector.
"""

from __future__ import annotations

import torch

from noloco.collectives.codec import Codec
from noloco.comm.base import Transport


def segment_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` contiguous [start, end) ranges of near-equal size."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def two_phase_allreduce(
    flat: torch.Tensor,
    transport: Transport,
    group: list[int],
    codec: Codec,
    op: str,
    tag: str,
    timeout: float,
) -> torch.Tensor:
    """Reduce the 1-D fp32 ``flat`` over ``group``; returns a new fp32 tensor (``flat`` untouched)."""
    n = len(group)
    me = group.index(transport.rank)
    bounds = segment_bounds(flat.numel(), n)

    # Phase 1: reduce-scatter. Send every segment we do not own to its owner.
    for k, (start, end) in enumerate(bounds):
        if k != me:
            transport.send(group[k], f"{tag}/rs{k}", codec.encode(flat[start:end]))
    start, end = bounds[me]
    numel = end - start
    contributions = []
    for j in range(n):
        if j == me:
            contributions.append(flat[start:end].to(torch.float32))
        else:
            contributions.append(codec.decode(transport.recv(group[j], f"{tag}/rs{me}", timeout), numel))
    reduced = torch.zeros(numel, dtype=torch.float32)
    for part in contributions:  # fixed member order: the sum does not depend on arrival order
        reduced += part
    if op == "mean":
        reduced /= n

    # Phase 2: all-gather. Encode the reduced segment once; everyone decodes the same bytes.
    codes = codec.encode(reduced)
    for j in range(n):
        if j != me:
            transport.send(group[j], f"{tag}/ag{me}", codes)
    out = torch.empty(flat.numel(), dtype=torch.float32)
    for k, (start, end) in enumerate(bounds):
        payload = codes if k == me else transport.recv(group[k], f"{tag}/ag{k}", timeout)
        out[start:end] = codec.decode(payload, end - start)
    return out
