"""Multi-hop ring all-reduce with partial sums in a format built for them, and the naive ablation.

A ring reduce-scatter forwards each segment's partial sum hop by hop: at step ``s`` member ``i``
sends the partial sum of segment ``(i - s) mod n`` (``s + 1`` contributors) to ``i + 1``, which adds
its own contribution and forwards it; after ``n - 1`` steps member ``i`` holds the full sum of segment
``(i + 1) mod n``, encodes it once in the requested codec, and the all-gather forwards those same
bytes around the ring (never re-encoded), so every member decodes identical bytes and returns a
bit-identical result.

- ``naive_ring`` re-encodes every partial sum in the requested codec. The re-encoding error of a hop
  scales with the partial sum's range, which grows like ``sqrt(c)`` (independent inputs) or ``c``
  (correlated inputs) with ``c`` contributors, so the total error grows with the hop count.
- ``ring`` carries partial sums in a representation chosen for the number of contributors, in the
  spirit of DynamiQ (Han, Vargaftik, Mitzenmacher, Ben Basat, arXiv 2602.08923): every format here
  has per-group (or per-block) scales derived from the partial sum's own range, so scales widen with
  the contributors; on top of that the hop with ``c`` contributors uses the cheapest format of a
  widening ladder (``int4 → int8 → bf16 → fp32``; ``mxfpN → int8 → bf16 → fp32``) whose error variance relative
  to the base format is at most ``1/c`` — more bits exactly where the partial
  sums' variance is. Each hop then adds at most about one base-format quantization error of a single
  contribution, as two-phase does, so the error stays bounded independently of the group size; the
  price is bytes (reported by the benchmark). Each hop is one fused decode–accumulate–recode step
  (:func:`noloco.quant.dequantize_accumulate_requantize`; with error feedback the pre-encoding sum
  is needed for the residual, so the hop decodes, adds and encodes in three calls).

A note on rounding: stochastic rounding makes a hop's error unbiased but doubles its variance, and
round-to-nearest errors of successive hops on different partial sums are already uncorrelated, so
the ladder uses round-to-nearest (pass a ``:stochastic`` int spec to get unbiased hops instead).
An information argument explains why a ladder (not a cleverer fixed-width code) is needed: a hop at
``b`` bits per element forwarding a partial sum of ``c`` independent contributions cannot have an
error below ``~ c · 2^-2b`` times one input's variance, so at fixed width no multi-hop scheme can match
two-phase's group-size-independent error on independent data.

Norm bound (optional, docs/reliability.md): a member cannot separate the inputs of a partial sum, so a hop refuses a
whole incoming partial sum of ``c`` inputs if its norm exceeds ``c`` times the bound on this member's own
contribution (``max_norm_ratio`` × own norm + floor); the messages then carry their input count so the
owner divides by the inputs that reached it. Members whose partial sums went through a misbehaving
member lose their inputs to that segment for the round (they are not applied, and nothing huge is).
"""

from __future__ import annotations

import struct

import torch

from noloco.collectives.codec import Codec, Fp32Codec, PayloadMismatch, QuantCodec, message_of
from noloco.collectives.protocol import PHASE_GATHER, PHASE_REDUCE, Exchange
from noloco.collectives.two_phase import segment_bounds
from noloco.quant import Packed, QuantSpec, dequantize, dequantize_accumulate_requantize

#: With a norm bound, each reduce-scatter message of a ring starts with the number of members' inputs in
#: its partial sum (a hop may have dropped some), so that the owner divides by the right count.
COUNT = struct.Struct("<H")

# Error variance of one encoding relative to the first rung of the ladder (measured on Gaussian data:
# int4 g128 ~0.10 relative error, int8 ~0.006, bf16 ~0.0016; mxfp4 ~0.12, mxfp6 ~0.047, mxfp8 ~0.03).
# MX partial sums widen to int8, not mxfp6/mxfp8: the OCP scale rule (floor(log2 amax) - emax) clips
# block maxima whose mantissa exceeds the element format's largest (e.g. values in (6, 8)·2^X → 6·2^X
# for E2M1, (1.75, 2)·2^emax for E3M2/E4M3), always toward zero, so that error does not shrink with
# more MX bits and it adds up over hops; zero-aware int8 never clips.
_INT_LADDER = ((1.0, "base"), (289.0, "int8"), (289.0 * 13.0, "bf16"))
_INT8_LADDER = ((1.0, "base"), (13.0, "bf16"))
_MX_LADDER = ((1.0, "base"), (400.0, "int8"), (400.0 * 13.0, "bf16"))
_MX6_LADDER = ((1.0, "base"), (60.0, "int8"), (60.0 * 13.0, "bf16"))
_MX8_LADDER = ((1.0, "base"), (25.0, "int8"), (25.0 * 13.0, "bf16"))


def _ladder(base: QuantSpec) -> tuple[tuple[float, str], ...]:
    if base.kind == "int":
        return _INT_LADDER if base.bits == 4 else _INT8_LADDER
    if base.kind == "mx":
        return {4: _MX_LADDER, 6: _MX6_LADDER}.get(base.bits, _MX8_LADDER)
    return ((1.0, "base"),)  # bf16/fp16: next rung is fp32


def partial_sum_codec(base: Codec, contributors: int, naive: bool) -> Codec:
    """The codec of a partial sum of ``contributors`` inputs (``ring``), or ``base`` (``naive_ring``)."""
    if naive or contributors <= 1 or not isinstance(base, QuantCodec):
        return base
    for gain, name in _ladder(base.spec):
        if gain >= contributors:
            if name == "base":
                return base
            if name == "int8" and base.spec.kind == "int":
                spec = QuantSpec.parse(str(base.spec).replace("int4", "int8", 1))
            else:
                spec = QuantSpec.parse(name)
            return QuantCodec(spec)
    return Fp32Codec()


def _decode_partial(codec: Codec, payload: bytes, numel: int, device: torch.device) -> Packed | torch.Tensor:
    if isinstance(codec, QuantCodec):
        return codec.unpack(payload, numel, device=device)
    return codec.decode(payload, numel, device)


def _value(partial: Packed | torch.Tensor) -> torch.Tensor:
    return dequantize(partial).reshape(-1) if isinstance(partial, Packed) else partial


def ring_allreduce(
    flat: torch.Tensor,
    ex: Exchange,
    codec: Codec,
    op: str,
    residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
    naive: bool = False,
) -> torch.Tensor:
    """Ring reduce-scatter + all-gather of the 1-D fp32 ``flat``; returns a new fp32 tensor.

    Args mirror :func:`~noloco.collectives.two_phase.two_phase_allreduce`; ``naive`` re-encodes every
    hop in ``codec`` (the ablation) instead of using :func:`partial_sum_codec`.

    With a norm bound (``ex.bound``) every reduce-scatter message starts with the number of inputs in
    its partial sum (u16, :data:`COUNT`); a hop drops an incoming partial sum of ``c`` inputs whose norm
    exceeds ``c`` times the bound on this member's own contribution, the owner divides by the inputs
    that reached it, and a member refuses a forwarded reduced segment over the bound (keeping its own
    contribution there instead, but forwarding the bytes unchanged).
    """
    n, me = len(ex.info.group), ex.info.me
    succ = (me + 1) % n
    bounds = segment_bounds(flat.numel(), n)
    contribution, result = residuals if residuals is not None else (None, None)
    bound = ex.bound
    ex.expect_sends(
        [(succ, PHASE_REDUCE, (me - s) % n, s) for s in range(n - 1)]
        + [(succ, PHASE_GATHER, (me + 1 - t) % n, t) for t in range(n - 1)]
    )
    pred, count = (me - 1) % n, 0 if bound is None else COUNT.size
    sizes = [end - start for start, end in bounds]
    ex.expect_recvs(
        [
            (
                pred,
                PHASE_REDUCE,
                (me - s - 1) % n,
                s,
                count + partial_sum_codec(codec, s + 1, naive).nbytes(sizes[(me - s - 1) % n]),
            )
            for s in range(n - 1)
        ]
        + [(pred, PHASE_GATHER, (me - t) % n, t, codec.nbytes(sizes[(me - t) % n])) for t in range(n - 1)]
    )
    contributed = None  # with a bound: this member's own contribution (input + residual), before any encoding
    own_norms = None
    if bound is not None:
        contributed = flat.clone() if contribution is None else flat + contribution
        own_norms = ex.bound.own_norms(contributed, bounds)

    with ex:
        incoming, inputs = _reduce_scatter_phase(flat, ex, codec, bounds, contribution, own_norms, naive)
        # This member now owns segment me + 1: add its contribution, reduce, encode once.
        seg = (me + 1) % n
        codes = _reduce_owned_segment(flat, codec, op, bounds, seg, incoming, inputs, contribution, result)
        out = _all_gather_phase(flat, ex, codec, op, bounds, seg, codes, contribution, contributed, own_norms)
    return out


def _own(
    flat: torch.Tensor, contribution: torch.Tensor | None, bounds: list[tuple[int, int]], seg: int
) -> torch.Tensor:
    """This member's contribution to segment ``seg``: its input there, plus the contribution residual if any."""
    start, end = bounds[seg]
    if contribution is None:
        return flat[start:end]
    return flat[start:end] + contribution[start:end]


def _hop(
    flat: torch.Tensor,
    contribution: torch.Tensor | None,
    bounds: list[tuple[int, int]],
    seg: int,
    incoming: Packed | torch.Tensor | None,
    out_codec: Codec,
) -> bytes:
    """This member's contribution to ``seg`` plus ``incoming``, encoded in ``out_codec``."""
    start, end = bounds[seg]
    mine = _own(flat, contribution, bounds, seg)
    fused = contribution is None and isinstance(incoming, Packed) and isinstance(out_codec, QuantCodec)
    if fused:
        return bytes(message_of(dequantize_accumulate_requantize(mine, [incoming], out_codec.spec)).numpy())
    total = mine if incoming is None else mine + _value(incoming)
    if contribution is None:
        return out_codec.encode(total)
    payload, decoded = out_codec.encode_with_value(total)
    contribution[start:end] = total - decoded  # what this hop lost from the group total
    return payload


def _reduce_scatter_phase(
    flat: torch.Tensor,
    ex: Exchange,
    codec: Codec,
    bounds: list[tuple[int, int]],
    contribution: torch.Tensor | None,
    own_norms: list[float] | None,
    naive: bool,
) -> tuple[Packed | torch.Tensor | None, int]:
    """The ring reduce-scatter: returns the partial sum that reached this member and its number of inputs.

    Step s sends a partial sum of s + 1 contributors (fewer if a hop dropped some).
    """
    n, me = len(ex.info.group), ex.info.me
    succ, pred = (me + 1) % n, (me - 1) % n
    bound = ex.bound
    incoming: Packed | torch.Tensor | None = None
    inputs = 0  # number of members' contributions summed into ``incoming``
    for s in range(n - 1):
        seg = (me - s) % n
        body = _hop(flat, contribution, bounds, seg, incoming, partial_sum_codec(codec, s + 1, naive))
        ex.send(succ, PHASE_REDUCE, seg, s, body if bound is None else COUNT.pack(inputs + 1) + body)
        seg_in = (me - s - 1) % n
        in_codec = partial_sum_codec(codec, s + 1, naive)
        body = ex.recv(pred, PHASE_REDUCE, seg_in, s)
        inputs = s + 1
        if bound is not None:
            inputs = _read_count(body, s + 1, ex, pred)
            body = body[COUNT.size :]
        incoming = _decode_partial(in_codec, body, bounds[seg_in][1] - bounds[seg_in][0], flat.device)
        if bound is not None or isinstance(incoming, torch.Tensor):
            incoming = _value(incoming)
            ex.check_finite(incoming, pred, seg_in, in_codec)
        if bound is not None and not ex.admits(pred, seg_in, incoming, own_norms[seg_in], inputs):
            incoming, inputs = None, 0
    return incoming, inputs


def _reduce_owned_segment(
    flat: torch.Tensor,
    codec: Codec,
    op: str,
    bounds: list[tuple[int, int]],
    seg: int,
    incoming: Packed | torch.Tensor | None,
    inputs: int,
    contribution: torch.Tensor | None,
    result: torch.Tensor | None,
) -> bytes:
    """The owner's step: its contribution to ``seg`` plus ``incoming``, reduced and encoded once in ``codec``."""
    start, end = bounds[seg]
    mine = _own(flat, contribution, bounds, seg)
    total = mine.clone() if incoming is None else mine + _value(incoming)
    if contribution is not None:
        contribution[start:end] = 0.0  # added exactly
    if op == "mean":
        total /= torch.tensor(float(inputs + 1), device=total.device)  # exact division on CUDA too
    if result is not None:
        total = total + result[start:end]
        codes, decoded = codec.encode_with_value(total)
        result[start:end] = total - decoded
    else:
        codes = codec.encode(total)
    return codes


def _all_gather_phase(
    flat: torch.Tensor,
    ex: Exchange,
    codec: Codec,
    op: str,
    bounds: list[tuple[int, int]],
    seg: int,
    codes: bytes,
    contribution: torch.Tensor | None,
    contributed: torch.Tensor | None,
    own_norms: list[float] | None,
) -> torch.Tensor:
    """The ring all-gather: forward the owners' bytes unchanged around the ring; returns the decoded result."""
    n, me = len(ex.info.group), ex.info.me
    succ, pred = (me + 1) % n, (me - 1) % n
    bound = ex.bound
    start, end = bounds[seg]
    out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    out[start:end] = codec.decode(codes, end - start, flat.device)
    forward = codes
    for t in range(n - 1):
        ex.send(succ, PHASE_GATHER, (me + 1 - t) % n, t, forward)
        seg_in = (me - t) % n
        forward = ex.recv(pred, PHASE_GATHER, seg_in, t)
        start, end = bounds[seg_in]
        value = codec.decode(forward, end - start, flat.device)
        ex.check_finite(value, pred, seg_in, codec)
        if bound is not None and not ex.admits(
            pred, seg_in, value, own_norms[seg_in], n if op == "sum" else 1, result=True, owner=(seg_in - 1) % n
        ):
            value = contributed[start:end]
            if contribution is not None:
                contribution[start:end] = 0.0  # this member's own value stands there, exactly
        out[start:end] = value
    return out


def _read_count(body: bytes, most: int, ex: Exchange, src: int) -> int:
    """The input count a bounded ring message starts with; at least 1 and at most ``most`` (the hop's)."""
    if len(body) < COUNT.size:
        raise PayloadMismatch(f"{ex.info.tag}: ring message from member {src} is too short for its input count")
    (count,) = COUNT.unpack_from(body)
    if not 1 <= count <= most:
        raise PayloadMismatch(f"{ex.info.tag}: member {src} claims a partial sum of {count} inputs at a hop of "
                              f"at most {most}")  # fmt: skip
    return count
