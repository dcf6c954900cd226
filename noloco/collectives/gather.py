"""All-gather reduction: every member sends its whole encoded vector to every other member and sums them all.

The reduction for sparse codecs (top-k, docs/quant.md), where re-encoding a sum is what hurts: a sum of n
top-k messages has up to n·K values per chunk, and two-phase's owner must re-sparsify it, dropping most of
them. Here each member encodes its input (plus its ``contribution`` residual) **once**, sends the same bytes
to every other member, and every member decodes all n messages, its own included (the value of its own
bytes), and sums them in fp32 in member order: every member adds the same fp32 values in the same order,
so all return bit-identical results. There is no second encoding, so nothing is lost beyond each member's
own encoding, which its error feedback pays back (``contribution <- v - decoded``; the ``result`` residual
is not used and stays as it is).

A coset code (:class:`~noloco.collectives.codec.CosetCodec`) is decoded against the receiving member's own
value: while no peer's grid index wraps, every member decodes each peer's grid value exactly and the results stay
bit-identical; :func:`~noloco.collectives.allreduce` carries such codecs by this schedule only.

Bytes sent per member: ``(n - 1)`` × the encoded vector (two-phase: ``2 (n - 1) / n`` ×), plus one 32-byte
header per message. For n = 2 both send one encoded vector, so :func:`~noloco.collectives.allreduce` runs
sparse codecs' two-phase calls of two members this way (docs/collectives.md, "Sparse codecs").

Norm bound (optional, docs/reliability.md): a member leaves out any peer's vector whose L2 norm exceeds
``max_norm_ratio`` times its own contribution's (plus the floor) and divides by the members it admitted;
with honest members every member admits the same set and the results stay bit-identical.
"""

from __future__ import annotations

import torch

from noloco.collectives.codec import Codec
from noloco.collectives.protocol import PHASE_GATHER, Exchange


def allgather_allreduce(
    flat: torch.Tensor,
    ex: Exchange,
    codec: Codec,
    op: str,
    residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reduce the 1-D fp32 ``flat`` over the exchange's group by all-gathering every member's encoding.

    Args mirror :func:`~noloco.collectives.two_phase.two_phase_allreduce`; ``residuals[0]`` (contribution) is
    updated in place to ``value - decoded`` over the whole vector, ``residuals[1]`` is left as it is.
    """
    group, me = ex.info.group, ex.info.me
    n, numel = len(group), flat.numel()
    contribution = residuals[0] if residuals is not None else None
    ex.expect_sends([(j, PHASE_GATHER, me, 0) for j in range(n) if j != me])
    ex.expect_recvs([(j, PHASE_GATHER, j, 0, codec.nbytes(numel)) for j in range(n) if j != me])
    value = flat if contribution is None else flat + contribution
    own_norm = ex.bound.own_norms(value, [(0, numel)])[0] if ex.bound is not None else 0.0
    with ex:
        message, decoded = ex.encode(codec, value, with_value=True)
        for j in range(n):
            if j != me:
                ex.send(j, PHASE_GATHER, me, 0, message)
        if contribution is not None:
            contribution.copy_(value - decoded)
        out = torch.zeros(numel, dtype=torch.float32, device=flat.device)
        admitted = 0
        for j in range(n):  # fixed member order: the sum does not depend on arrival order
            if j == me:
                term = decoded
            else:
                payload = ex.recv(j, PHASE_GATHER, j, device=flat.device)
                if codec.side_information:  # a coset code: decoded against this member's own value
                    term = codec.decode(payload, numel, flat.device, side=value)
                else:
                    term = codec.decode(payload, numel, flat.device)
                ex.check_finite(term, j, j, codec)
                if not ex.admits(j, j, term, own_norm):
                    continue
            out += term
            admitted += 1
        if op == "mean":
            out /= torch.tensor(float(admitted), device=out.device)  # a tensor divisor: same rounding on CUDA
    return out
