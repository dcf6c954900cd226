"""``allreduce``: one entry point for every reduction inside a group, over any transport.

Reductions: ``two_phase`` (reduce-scatter to owners, one encoding of the reduced segment; the Echo
two-phase scheme, docs/design.md §3.4), ``ring`` (multi-hop partial sums in a widening format, after DynamiQ,
arXiv 2602.08923), ``naive_ring`` (re-encode every hop; the ablation) and ``allgather`` (every member's one
encoding to every member, summed everywhere; for sparse codecs). Codecs: ``fp32`` (exact) and every
:mod:`noloco.quant` spec (``int4``, ``int8``, ``mxfp4``, ``bf16``, ``int4:g64``, ``int2``, ``sign``,
``topk:64/4096+int2``, ...).

Sparse (top-k) codecs: ``two_phase`` with a group of two runs as ``allgather`` (same bytes, no re-sparsified
sum); larger groups keep two-phase (fewer bytes: ``2 (n-1)/n`` against ``n - 1`` encoded vectors) unless
``allgather`` is asked for. The rings refuse sparse codecs (``ValueError``): every hop would re-sparsify a
partial sum.

A reduction is identified on the wire by a tag; members that call collectives with the same group
in the same order get matching tags automatically, and callers that know their round (the outer
optimizers) pass an explicit ``tag`` so that a payload from another round can never be mistaken for
this one. Arguments are checked before any byte is sent. Every message carries a 32-byte header
(:mod:`noloco.collectives.protocol`) that the receiver checks, so members that disagree on numel,
dtype, codec or op fail on every member with :class:`~noloco.collectives.codec.PayloadMismatch`; a
silent or dead peer makes every member raise :class:`~noloco.comm.base.CommTimeout` within about
``timeout`` seconds.

Peers' values are checked too: NaN/Inf in a decoded payload fails the call (:class:`PayloadMismatch`),
and with ``max_norm_ratio`` a peer's contribution far larger than this member's own is dropped, counted
and logged, never applied (:class:`~noloco.collectives.protocol.NormBound`, docs/reliability.md).

Small messages go uncompressed: when a segment (``numel / n`` elements) is shorter than
``min_compress_numel`` (default :data:`SMALL_MESSAGE_NUMEL`, measured in docs/results/collectives.md)
the call runs in fp32 whatever the codec; every member makes the same choice from the same numbers.
"""

from __future__ import annotations

import functools
import warnings

import torch

from noloco.collectives.codec import Codec, Fp32Codec, QuantCodec, get_codec
from noloco.collectives.gather import allgather_allreduce
from noloco.collectives.protocol import DTYPE_CODES, NORM_FLOOR_RMS, CallInfo, Exchange, NormBound, NormRejections
from noloco.collectives.residuals import ReductionErrorFeedback
from noloco.collectives.ring import ring_allreduce
from noloco.collectives.two_phase import two_phase_allreduce
from noloco.comm.base import Transport

REDUCTIONS = ("two_phase", "ring", "naive_ring", "allgather")
OPS = ("mean", "sum")

#: Segments shorter than this many elements are sent in fp32 whatever the codec. Measured on a 2-core
#: CPU (benchmarks/collectives.py --threshold): encoding + decoding one quantized message costs a fixed
#: 0.35 ms (quiet machine) to ~1.3 ms (loaded), so at 4096 elements compression only pays on links slower
#: than ~10-35 MB/s (80-280 Mbit/s, the slow links noloco targets); at 64k elements below ~100-200 MB/s.
#: See docs/results/collectives.md; pass ``min_compress_numel`` to override (e.g. on GPU).
SMALL_MESSAGE_NUMEL = 4096


@functools.lru_cache(maxsize=1)
def _warn_algorithm_keyword() -> None:
    warnings.warn("allreduce(algorithm=...) is deprecated: pass reduction=...", DeprecationWarning, stacklevel=3)


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
    reduction: str = "two_phase",
    op: str = "mean",
    timeout: float = 120.0,
    tag: str | None = None,
    *,
    algorithm: str | None = None,
    error_feedback: ReductionErrorFeedback | None = None,
    min_compress_numel: int | None = None,
    max_norm_ratio: float | None = None,
    norm_rejections: NormRejections | None = None,
    norm_floor: float = NORM_FLOOR_RMS,
    norm_reference: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce ``x`` over the ranks in ``group`` (default: all ranks) and return the result.

    Args:
        x: any-shape float tensor (fp32/bf16/fp16/fp64); not modified. Every member must pass the
            same numel and dtype.
        transport: this rank's transport; ``transport.rank`` must be in ``group``.
        group: ranks taking part, in the same order on every member.
        codec: wire format (``"fp32"`` is exact; any :mod:`noloco.quant` spec string, or a Codec).
        reduction: ``"two_phase"``, ``"ring"``, ``"naive_ring"`` or ``"allgather"`` (the schedule of messages);
            a sparse codec turns ``"two_phase"`` of two members into ``"allgather"`` and is refused by the rings;
            a coset code always runs as ``"allgather"``.
        algorithm: deprecated name of ``reduction`` (warns once; removed in 0.3).
        op: ``"mean"`` or ``"sum"``.
        timeout: seconds to wait for any one peer message.
        tag: unique name of this call within the run (e.g. ``"outer/r7/delta"``).
        error_feedback: state kept by the caller across calls at this call site (one per buffer);
            updated only if the call succeeds. See :mod:`noloco.collectives.residuals`.
        min_compress_numel: segments shorter than this go in fp32 (default :data:`SMALL_MESSAGE_NUMEL`).
        max_norm_ratio: norm bound on peers' contributions (None: no bound). A peer's contribution to a
            segment whose L2 norm exceeds ``max_norm_ratio`` × this member's own contribution to it
            (+ ``norm_floor`` × √numel) is dropped, the mean divides by the members admitted, and a
            reduced segment over the bound is replaced by this member's own contribution; see
            :class:`~noloco.collectives.protocol.NormBound`. Members may use different ratios.
        norm_rejections: counts what the bound refused (updated in place, also when the call fails);
            every refusal is also logged with the sender's rank.
        norm_floor: absolute floor of the bound, as an RMS per element.
        norm_reference: what "own" means for the bound, when this member's own contribution is not a good
            scale (e.g. legitimately zero): a tensor of ``x``'s numel whose segment norms are used instead.

    Returns:
        float32 tensor of ``x``'s shape on ``x``'s device, bit-identical on every member.

    Raises:
        ValueError / TypeError: bad arguments (before anything is sent).
        PayloadMismatch: members disagree (numel, dtype, codec, op, group size), a payload is
            malformed, holds NaN/Inf, is from the wrong member or round, or a peer failed and said so.
        CommTimeout: a peer stayed silent for ``timeout`` seconds (on every surviving member).
    """
    if algorithm is not None:
        _warn_algorithm_keyword()
        reduction = algorithm
    group = _check_arguments(x, transport, group, reduction, op, error_feedback)
    bound = _norm_bound(x, max_norm_ratio, norm_floor, norm_rejections, norm_reference)
    requested = get_codec(codec)
    _check_sparse(requested, reduction)
    threshold = SMALL_MESSAGE_NUMEL if min_compress_numel is None else int(min_compress_numel)
    flat = x.detach().reshape(-1).to(dtype=torch.float32)  # stays on x's device: codecs run there
    residuals = None if error_feedback is None else error_feedback.residuals_for(flat.numel(), flat.device)
    if len(group) == 1:
        return _reduce_alone(x, flat, error_feedback, residuals)
    n = len(group)
    reduction = _schedule(requested, reduction, n)
    wire = requested if requested.exact or -(-flat.numel() // n) >= threshold else Fp32Codec()
    tag = tag if tag is not None else _next_auto_tag(transport, tuple(group))
    # A bounded ring puts an input count in front of its reduce-scatter messages: members must agree on it.
    codec_id = f"{requested.name}|{wire.name}" + ("|counted" if bound is not None and reduction != "two_phase" else "")
    info = CallInfo(reduction, op, x.dtype, tuple(group), group.index(transport.rank), flat.numel(), codec_id, tag)
    ex = Exchange(transport, info, timeout, bound)
    out = _run_schedule(reduction, flat, ex, wire, op, residuals)
    if error_feedback is not None:
        error_feedback.commit(*residuals)
    return out.reshape(x.shape).to(x.device)


def _schedule(codec: Codec, reduction: str, n: int) -> str:
    """The reduction that runs for ``codec`` among ``n`` members when ``reduction`` is asked for."""
    if _sparse(codec) and reduction == "two_phase" and n == 2:
        return "allgather"  # the same bytes as two-phase for two members, and no re-sparsified sum
    if codec.side_information:
        return "allgather"  # a coset code decodes against the receiver's own value: never a partial sum
    return reduction


def _sparse(codec: Codec) -> bool:
    """Whether ``codec`` sends a sparse selection of the values (chunked top-k)."""
    return isinstance(codec, QuantCodec) and codec.spec.sparse


def _check_sparse(codec: Codec, reduction: str) -> None:
    """Rings refuse a sparse codec before anything is sent: every hop would re-sparsify a partial sum."""
    if _sparse(codec) and reduction in ("ring", "naive_ring"):
        raise ValueError(
            f"reduction {reduction!r} cannot carry the sparse codec {codec.name!r} (every hop would "
            "re-sparsify a partial sum); use two_phase or allgather"
        )


def _run_schedule(reduction: str, flat: torch.Tensor, ex: Exchange, wire: Codec, op: str, residuals) -> torch.Tensor:
    """The messages of one reduction schedule over ``ex``'s group; returns the reduced fp32 vector."""
    if reduction == "two_phase":
        return two_phase_allreduce(flat, ex, wire, op, residuals)
    if reduction == "allgather":
        return allgather_allreduce(flat, ex, wire, op, residuals)
    return ring_allreduce(flat, ex, wire, op, residuals, naive=reduction == "naive_ring")


def _check_arguments(
    x: torch.Tensor,
    transport: Transport,
    group: list[int] | None,
    reduction: str,
    op: str,
    error_feedback: ReductionErrorFeedback | None,
) -> list[int]:
    """Refuse bad arguments of :func:`allreduce` before anything is sent; returns the group as a list of ranks."""
    group = list(range(transport.world_size)) if group is None else [int(r) for r in group]
    if transport.rank not in group:
        raise ValueError(f"rank {transport.rank} is not a member of group {group}")
    if len(set(group)) != len(group):
        raise ValueError(f"group {group} lists a rank twice")
    if len(group) > 65535:
        raise ValueError(f"group of {len(group)} ranks is larger than the protocol allows (65535)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; known: {REDUCTIONS}")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    if not torch.is_floating_point(x):
        raise TypeError(f"allreduce needs a floating-point tensor, got {x.dtype}")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(f"allreduce supports fp32/bf16/fp16/fp64 tensors, got {x.dtype}")
    if error_feedback is not None and not isinstance(error_feedback, ReductionErrorFeedback):
        raise TypeError(f"error_feedback must be a ReductionErrorFeedback, got {type(error_feedback).__name__}")
    return group


def _norm_bound(
    x: torch.Tensor,
    max_norm_ratio: float | None,
    norm_floor: float,
    norm_rejections: NormRejections | None,
    norm_reference: torch.Tensor | None,
) -> NormBound | None:
    """The :class:`NormBound` of a call with ``max_norm_ratio`` (None without one); checks ``norm_reference``."""
    bound = None
    if max_norm_ratio is not None:
        reference = None
        if norm_reference is not None:
            reference = norm_reference.detach().reshape(-1).to(device=x.device, dtype=torch.float32)
            if reference.numel() != x.numel():
                raise ValueError(f"norm_reference has {reference.numel()} elements, x has {x.numel()}")
        bound = NormBound(max_norm_ratio, norm_floor, norm_rejections, reference)
    return bound


def _reduce_alone(
    x: torch.Tensor,
    flat: torch.Tensor,
    error_feedback: ReductionErrorFeedback | None,
    residuals: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The result of a group of one: ``flat`` itself, plus whatever error feedback owes it."""
    out = flat.clone()
    if error_feedback is not None:  # nothing was encoded: pay back the contribution residual exactly
        out += residuals[0] + residuals[1]
        error_feedback.commit(torch.zeros_like(residuals[0]), torch.zeros_like(residuals[1]))
    return out.reshape(x.shape).to(x.device)


def barrier(transport: Transport, tag: str, timeout: float) -> None:
    """Wait until every rank of ``transport`` reached this call (a tiny fp32 all-reduce, not counted as traffic).

    Raises :class:`~noloco.comm.base.CommTimeout` (or another ``CommError``) when a rank does not arrive
    within about ``timeout`` seconds.
    """
    if transport.world_size == 1:
        return
    before = transport.counter.state_dict()
    try:
        allreduce(torch.zeros(1), transport, tag=tag, timeout=timeout)
    finally:
        transport.counter.load_state_dict(before)
