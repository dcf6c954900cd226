"""Two-phase all-reduce over any transport: reduce-scatter to owners, then all-gather.

Implements the reduction of docs/design.md §3.4 (the two-phase scheme of the Echo paper): the vector is cut
into ``n`` contiguous segments and member ``k`` owns segment ``k``. Each member encodes the segments
it does not own and sends each to its owner; the owner decodes them, adds its own segment
*unencoded*, and sums in fp32 in member order. The owner then encodes the reduced segment once and
sends those same bytes to every member; every member, the owner included, decodes those bytes, so
all members return bit-identical results. Each value is encoded at most twice, whatever ``n`` is, so
the error of the result does not grow with the group size.

Error feedback (:class:`~noloco.collectives.residuals.ReductionErrorFeedback`) applies to exactly
what this member encodes: its non-owned segments in phase 1 (residual ``contribution``) and, as
owner, the reduced segment in phase 2 (residual ``result``).

Norm bound (optional, docs/reliability.md): the owner leaves out any member's segment whose L2 norm exceeds
``max_norm_ratio`` times its own contribution to that segment (plus a floor) and divides by the members
it admitted, and every member refuses a reduced segment from another owner that exceeds the same
bound relative to its own contribution there (keeping its own value instead), so a member that sends
or owns huge values cannot move its partners by more than the bound. With honest owners every
member still decodes the same bytes and returns a bit-identical result.

Bytes sent per member: ``2 (n-1)/n`` times the encoded size of the vector, plus one 32-byte header
per message (:mod:`noloco.collectives.protocol`).
"""

from __future__ import annotations

import torch

from noloco.collectives.codec import Codec
from noloco.collectives.protocol import PHASE_GATHER, PHASE_REDUCE, Exchange


def segment_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` contiguous [start, end) ranges of near-equal size."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _encode(
    ex: Exchange,
    codec: Codec,
    value: torch.Tensor,
    residual: torch.Tensor | None,
    start: int,
    end: int,
    keep_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A message of ``value``; with error feedback, store ``value - decoded`` into ``residual[start:end]``.

    Returns ``(message, decoded)``: ``decoded`` (what every receiver decodes) when error feedback or
    ``keep_value`` asked for it, else None.
    """
    message, decoded = ex.encode(codec, value, with_value=residual is not None or keep_value)
    if residual is not None:
        residual[start:end] = value - decoded
    return message, decoded


def two_phase_allreduce(
    flat: torch.Tensor,
    ex: Exchange,
    codec: Codec,
    op: str,
    residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reduce the 1-D fp32 ``flat`` over the exchange's group; returns a new fp32 tensor.

    Args:
        flat: this member's input, 1-D fp32 on any device (codecs run there); not modified.
        ex: the call's :class:`Exchange` (group, my index, headers, timeout, optional norm bound).
        codec: wire format of both phases.
        op: ``"mean"`` or ``"sum"``.
        residuals: ``(contribution, result)`` error-feedback residuals (flat, ``flat.numel()``), updated
            in place, or None for no error feedback.

    With a norm bound (``ex.bound``) the owner leaves out every member's segment the bound refuses and
    divides by the members it admitted; a member that refuses another owner's reduced segment keeps
    its own contribution there instead (it is the only value it can vouch for).
    """
    group, me = ex.info.group, ex.info.me
    n = len(group)
    bounds = segment_bounds(flat.numel(), n)
    contribution, result = residuals if residuals is not None else (None, None)
    _announce(ex, codec, bounds)
    contributed = None  # with a bound: this member's own contribution (input + residual), before any encoding
    if ex.bound is not None:
        contributed = flat.clone() if contribution is None else flat + contribution
        own_norms = ex.bound.own_norms(contributed, bounds)

    with ex:
        # Phase 1: reduce-scatter. Send every segment we do not own to its owner.
        for k, (start, end) in enumerate(bounds):
            if k == me:
                continue
            value = flat[start:end] if contribution is None else flat[start:end] + contribution[start:end]
            ex.send(k, PHASE_REDUCE, k, 0, _encode(ex, codec, value, contribution, start, end)[0])
        start, end = bounds[me]
        own = flat[start:end]
        if contribution is not None:
            own = own + contribution[start:end]  # sent exactly: the residual is paid back in full
            contribution[start:end] = 0.0
        reduced, admitted = _sum_segment(ex, codec, own, None if ex.bound is None else own_norms[me])
        if op == "mean":
            # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal,
            # which rounds differently from the CPU (members on different devices must agree bit for bit)
            reduced /= torch.tensor(float(admitted), device=reduced.device)

        # Phase 2: all-gather. Encode the reduced segment once; everyone decodes the same bytes.
        if result is not None:
            reduced = reduced + result[start:end]
        codes, decoded = _encode(ex, codec, reduced, result, start, end, keep_value=True)
        for j in range(n):
            if j != me:
                ex.send(j, PHASE_GATHER, me, 0, codes)
        out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        for k, (start, end) in enumerate(bounds):
            if k == me:
                out[start:end] = decoded  # the value of the very bytes the others decode
                continue
            value = codec.decode(ex.recv(k, PHASE_GATHER, k, device=flat.device), end - start, flat.device)
            ex.check_finite(value, k, k, codec)
            if ex.bound is not None and not ex.admits(k, k, value, own_norms[k], n if op == "sum" else 1, True):
                value = contributed[start:end]
                if contribution is not None:
                    contribution[start:end] = 0.0  # this member's own value stands there, exactly
            out[start:end] = value
    return out


def _announce(ex: Exchange, codec: Codec, bounds: list[tuple[int, int]]) -> None:
    """Tell the transport every message of both phases this member sends and receives (tag and size)."""
    n, me = len(ex.info.group), ex.info.me
    ex.expect_sends([(k, PHASE_REDUCE, k, 0) for k in range(n) if k != me]
                    + [(j, PHASE_GATHER, me, 0) for j in range(n) if j != me])  # fmt: skip
    sizes = [codec.nbytes(end - start) for start, end in bounds]
    ex.expect_recvs([(j, PHASE_REDUCE, me, 0, sizes[me]) for j in range(n) if j != me]
                    + [(k, PHASE_GATHER, k, 0, sizes[k]) for k in range(n) if k != me])  # fmt: skip


def _sum_segment(ex: Exchange, codec: Codec, own: torch.Tensor, own_norm) -> tuple[torch.Tensor, int]:
    """Phase 1 at the owner: the fp32 sum of its own segment ``own`` and every other member's decoded one, in
    member order (the sum does not depend on arrival order), leaving out what the norm bound refuses; returns
    the sum and how many members it admitted."""
    me, numel, device = ex.info.me, own.numel(), own.device
    reduced = torch.zeros(numel, dtype=torch.float32, device=device)
    admitted = 0
    for j in range(len(ex.info.group)):
        if j == me:
            reduced += own
            admitted += 1
            continue
        value = codec.decode(ex.recv(j, PHASE_REDUCE, me, device=device), numel, device)
        ex.check_finite(value, j, me, codec)
        if ex.bound is None or ex.admits(j, me, value, own_norm):
            reduced += value
            admitted += 1
    return reduced, admitted
