"""``allreduce``: one entry point for every reduction inside a group, over any transport.

A reduction is identified on the wire by a tag; members that call collectives with the same group
in the same order get matching tags automatically, and callers that know their round (the outer
optimizers) pass an explicit ``tag`` so that a payload from another round can never be mistaken for
this one. Shapes are checked before any byte is sent; a malformed or mis-sized peer payload raises
:class:`~noloco.collectives.codec.PayloadMismatch`, and a silent peer raises
:class:`~noloco.comm.base.CommTimeout` after ``timeout`` seconds.
"""

from __future__ import annotations

import torch

from noloco.collectives.codec import Codec, get_codec
from noloco.collectives.two_phase import two_phase_allreduce
from noloco.comm.base import Transport

ALGORITHMS = ("two_phase",)
OPS = ("mean", "sum")


def _next_auto_tag(transport: Transport, group: tuple[int, ...]) -> str:
    """Tag of the next untagged call of this group, counted on the transport itself (one per rank)."""
    calls: dict[tuple[int, ...], int] = transport.__dict__.setdefault("_untagged_calls", {})
    count = calls.get(group, 0)
    calls[group] = count + 1
    return f"ar/{'-'.join(map(str, group))}/{count}"


def allreduce(
    x: torch.Tensor,
    transport: Transport,
    group: list[int] | None = None,
    codec: str | Codec = "fp32",
    algorithm: str = "two_phase",
    op: str = "mean",
    timeout: float = 30.0,
    tag: str | None = None,
) -> torch.Tensor:
    """Reduce ``x`` over the ranks in ``group`` (default: all ranks) and return the result.

    Args:
        x: any-shape float tensor; not modified.
        transport: this rank's transport; ``transport.rank`` must be in ``group``.
        group: ranks taking part, in the same order on every member.
        codec: wire format of the exchanged segments (``"fp32"`` is exact).
        algorithm: ``"two_phase"``.
        op: ``"mean"`` or ``"sum"``.
        timeout: seconds to wait for any one peer message.
        tag: unique name of this call within the run (e.g. ``"outer/r7/delta"``).

    Returns:
        float32 tensor of ``x``'s shape on ``x``'s device, bit-identical on every member.
    """
    group = list(range(transport.world_size)) if group is None else [int(r) for r in group]
    if transport.rank not in group:
        raise ValueError(f"rank {transport.rank} is not a member of group {group}")
    if len(set(group)) != len(group):
        raise ValueError(f"group {group} lists a rank twice")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {ALGORITHMS}")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    if not torch.is_floating_point(x):
        raise TypeError(f"allreduce needs a floating-point tensor, got {x.dtype}")
    flat = x.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if len(group) == 1:
        out = flat.clone()
    else:
        tag = tag if tag is not None else _next_auto_tag(transport, tuple(group))
        out = two_phase_allreduce(flat, transport, group, get_codec(codec), op, tag, timeout)
    return out.reshape(x.shape).to(x.device)
