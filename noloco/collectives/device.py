"""Two-phase quantized all-reduce whose payloads never leave the device (docs/design.md §3.4, §3.5).

:func:`allreduce_device` is the two-phase reduction of :mod:`noloco.collectives.two_phase` (the Echo
scheme: reduce-scatter to owners, one encoding of each reduced segment, all-gather of those codes),
but the encoded segments travel as tensors through torch.distributed collectives on the process
group's own device instead of as bytes through a :class:`~noloco.comm.base.Transport`. On GPUs with
NCCL nothing is staged through host memory: ``x`` is quantized where it lives, the packed sections go
over NVLink/InfiniBand by ``all_to_all_single`` and ``all_gather_into_tensor``, and the owner's
decode-accumulate-requantize is one fused :mod:`noloco.quant` kernel. Over gloo the same code runs on
CPU tensors (a CUDA tensor is staged through the CPU), which is how CI tests it.

It is meant for *trusted, intra-worker* groups (the GPUs of one worker, DDP's gradient buckets):

- a message is the payload sections of one :class:`~noloco.quant.Packed` (``codes``, ``scales``,
  ``zero_points``/``mins``) concatenated, each 16-byte aligned, in one uint8 tensor per peer. There is
  no wire header and no checksum (``Packed.to_bytes``): sizes are a pure function of the segment length
  and the spec, so every receiver preallocates exactly what it receives.
- instead of per-message headers, one small all-gather at the start of every call compares numel,
  dtype, op, codec and group size across members, together with whether each member could encode its
  input (NaN/Inf make quantization fail). Members that disagree, or a member that cannot encode, make
  *every* member raise (:class:`~noloco.collectives.codec.PayloadMismatch` /
  :class:`~noloco.collectives.protocol.RemoteFailure`) before any payload moves, so nobody hangs.
  With the all-gather of the reduced segments goes a 16-byte status per member (a second, tiny
  all-gather) for the same purpose: an owner whose reduced segment cannot be encoded (e.g. NaN in its
  own unencoded segment).
- a member that dies mid-call is handled by the process group's own timeout (NCCL watchdog), not here.

Results are the same as the bytes path (``allreduce(..., reduction="two_phase")``) on the same inputs,
codec and threshold: same segments, same fp32 sums in member order, same error feedback, so every
member returns bit-identical values, equal to the bytes path's. One shortcut keeps that equality: for
an integer codec without result error feedback, with ``op="sum"`` or a power-of-two group, the owner
encodes the *sum* with the fused kernel and then divides the bf16 scales (and naive-mode minima) by
``n``. Division by a power of two commutes with every step of the int quantizer (range, bf16 rounding
of the scale, ``1/s``, rounding of ``x/s``, zero point), so these codes decode to the values the bytes
path gets by encoding ``sum / n``. The exception is a group whose range is below about 2**-117 (1e-35),
where the scale's lower clamp 2**-126 binds: its scale differs, which changes nothing for an all-zero
group (both decode to zeros). It saves a division pass and lets the fused kernel encode the sum. In
every other case (MX and float codecs, groups of 3, 5, ..., result error feedback) the owner divides,
then encodes, as the bytes path does.

Bytes sent per member per call: ``2 (n-1)/n`` times the packed size of the vector, plus at most 15
bytes of alignment per section and a 16-byte status per all-gathered segment (:func:`wire_bytes`); counted
into ``counter`` if given. Each call also all-gathers 56 bytes per member for the check and reads
back n status bytes (two small host synchronisations). The quantize kernels do not sync per call: on
CUDA each payload carries its deferred NaN/Inf verdict (:meth:`~noloco.quant.Packed.check`), read for
every payload before it is sent -- after all of a phase's encodings are queued, so the first read waits
for the kernels and the others find them done. (With error feedback, the residual update of each
encoding still reads its verdict at once.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from noloco.collectives.codec import Fp32Codec, PayloadMismatch, QuantCodec, get_codec
from noloco.collectives.message import message_layout, message_view, pack_into, unpack
from noloco.collectives.protocol import DTYPE_CODES, OP_CODES, RemoteFailure, crc
from noloco.collectives.residuals import ReductionErrorFeedback
from noloco.collectives.two_phase import segment_bounds
from noloco.comm.base import ByteCounter
from noloco.quant import (
    ErrorFeedback,
    Packed,
    QuantSpec,
    dequantize,
    dequantize_accumulate,
    dequantize_accumulate_requantize,
    quantize,
)
from noloco.quant import ops as quant_ops

__all__ = [
    "allreduce_device",
    "wire_bytes",
    "message_layout",
    "message_view",
    "encode_segment",
    "reduce_segment",
    "decode_segment",
    "pack_into",
    "unpack",
]

#: bytes each owner all-gathers with its reduced segment: byte 0 is 0 when it encoded it, 1 otherwise
STATUS_BYTES = 16
FP32 = QuantSpec.parse("fp32")
_META_MAGIC = 0x4E4C4456  # "NLDV": this all-gather is allreduce_device's call check
_META_FIELDS = ("magic", "numel", "dtype", "op", "codec", "group size")
_DTYPE_NAMES = {code: str(dtype).replace("torch.", "") for dtype, code in DTYPE_CODES.items()}
_OP_NAMES = {code: name for name, code in OP_CODES.items()}


def wire_bytes(numel: int, world: int, codec: str | QuantSpec = "int4") -> int:
    """Bytes one member sends in one :func:`allreduce_device` call (payload, alignment and status bytes).

    Phase 1 sends each non-owned segment to its owner; phase 2 sends this member's all-gather slot
    (sized for the largest segment) and its 16-byte status to the ``world - 1`` others. The 56-byte call
    check is not counted.
    The member that owns segment 0 (the largest) sends the least; this returns member 0's count.
    """
    spec = codec if isinstance(codec, QuantSpec) else _wire_spec(get_codec(codec))
    bounds = segment_bounds(numel, world)
    if world == 1:
        return 0
    reduce_scatter = sum(message_layout(spec, end - start)[1] for start, end in bounds[1:])
    gather_slot = STATUS_BYTES + message_layout(spec, bounds[0][1] - bounds[0][0])[1]
    return reduce_scatter + (world - 1) * gather_slot


def _is_raw(spec: QuantSpec) -> bool:
    """fp32 on the wire: the segment's own bytes, exact, no finiteness check (as :class:`Fp32Codec`)."""
    return spec.kind == "float" and spec.name == "fp32" and not spec.hadamard


def encode_segment(
    values: torch.Tensor, spec: QuantSpec, residual: torch.Tensor | None = None, backend: str | None = None
) -> Packed:
    """Encode the 1-D float ``values`` (not modified) for the wire.

    With ``residual`` (fp32, ``values``' length and device; updated in place) the encoded value is
    ``values + residual`` and the residual becomes ``values + residual - decoded`` (error feedback on
    the fused quantize kernel where one exists). NaN/Inf (quantized specs) raise ``ValueError``: from
    this call on the CPU, from the payload's :meth:`~noloco.quant.Packed.check` on CUDA's fused kernels
    (callers check before sending); the residual is left unchanged either way.
    """
    if _is_raw(spec):
        value = values.float() if residual is None else values.float() + residual
        if residual is not None:
            residual.zero_()  # sent exactly
        return Packed(spec, (values.numel(),), torch.float32, value.contiguous().view(torch.uint8))
    if residual is None:
        return quantize(values, spec, backend=backend)
    feedback = ErrorFeedback(spec, backend=backend)
    feedback.residuals[None] = residual
    packed = feedback.quantize(values)
    residual.copy_(feedback.residuals[None])
    return packed


def decode_segment(out: torch.Tensor, packed: Packed, backend: str | None = None) -> None:
    """Decode ``packed`` into ``out`` (contiguous 1-D fp32 view of ``packed.numel`` values) in place.

    Raises:
        ValueError: ``packed``'s pending non-finite check fails (:meth:`~noloco.quant.Packed.check`).
    """
    packed.check()
    if packed.numel == 0:
        return
    spec = packed.spec
    if _is_raw(spec):
        out.copy_(packed.codes.view(torch.float32))
        return
    be = quant_ops.pick_backend(backend, out.device, spec)
    if be == "triton" and not spec.hadamard:
        # straight into the output slice: no fp32 temporary and no copy (the kernel's accumulate=False mode)
        quant_ops._triton().dequantize_accumulate(out, [packed], accumulate=False)
    else:
        out.copy_(dequantize(packed, backend=be).view(-1))


def _divide_scales(packed: Packed, n: int) -> Packed:
    """Divide ``packed``'s bf16 scales (and naive minima) by the power of two ``n``, in place (exact)."""
    for bits in (packed.scales, packed.mins):
        if bits is not None:
            bits.view(torch.bfloat16).mul_(1.0 / n)
    return packed


def reduce_segment(
    own: torch.Tensor,
    received: list[Packed | None],
    me: int,
    op: str,
    spec: QuantSpec,
    result_residual: torch.Tensor | None = None,
    backend: str | None = None,
    *,
    own_is_scratch: bool = False,
    mark: Callable[[str], None] | None = None,
) -> Packed:
    """The owner's step: encode ``(own + sum of received) [/ n]`` once, summing in fp32 in member order.

    Args:
        own: this member's segment (1-D float, any float dtype), added unencoded; not modified unless
            ``own_is_scratch`` (an fp32 temporary the caller gives away: then it may become the accumulator).
        received: by member index, the Packed each member sent for this segment (None at ``me``).
        me: this member's index; ``len(received)`` is the group size ``n``.
        op: ``"mean"`` or ``"sum"``.
        spec: the wire format of the reduced segment.
        result_residual: error feedback in units of the result (fp32, segment length), added before
            encoding and replaced by the new encoding error, in place; None for none.
        mark: called after each step with its name (``dequantize-accumulate``, ``requantize``) when profiling.

    Returns:
        The reduced segment's Packed, which every member (this one included) decodes.
    """
    n = len(received)
    # Member order, as the bytes path: ((0 + t_0) + t_1) + ... Swapping t_0 and t_1 when this member is
    # index 1 changes nothing (fp32 addition commutes; 0 + t only turns -0 into +0) and lets both members
    # of a pair start from their own segment, so the fused kernel serves the last additions of both.
    terms: list[torch.Tensor | Packed] = [own if j == me else received[j] for j in range(n)]
    if me == 1:
        terms[0], terms[1] = terms[1], terms[0]
    mark = mark or (lambda phase: None)
    divide_later = op == "sum" or n & (n - 1) == 0
    fused = (
        n > 1
        and spec.kind == "int"
        and not spec.hadamard
        and result_residual is None
        and divide_later
        and isinstance(terms[-1], Packed)
    )
    tail: list[Packed] = []
    if fused:
        while terms and isinstance(terms[-1], Packed) and len(tail) < 4:
            tail.insert(0, terms.pop())
    first, middle = terms[0], terms[1:]
    if isinstance(first, Packed):
        acc = dequantize(first, backend=backend).reshape(-1)
    else:  # no copy when own is fp32 and nothing below writes into acc, or when the caller gave it away
        writes = bool(middle) or not fused
        acc = first.to(torch.float32, copy=writes and not (own_is_scratch and first.dtype == torch.float32))
    pending: list[Packed] = []
    for term in middle:
        if isinstance(term, Packed):
            pending.append(term)
            continue
        if pending:
            dequantize_accumulate(acc, pending, backend=backend)
            pending = []
        acc.add_(term)
    if pending:
        dequantize_accumulate(acc, pending, backend=backend)
    if middle or isinstance(first, Packed):
        mark("dequantize-accumulate")
    if fused:  # the last additions and the encoding in one pass (the kernel's decode-accumulate-requantize)
        packed = dequantize_accumulate_requantize(acc, tail, spec, backend=backend)
        packed = packed if op == "sum" else _divide_scales(packed, n)
    else:
        if op == "mean":
            acc.div_(torch.tensor(float(n), device=acc.device))  # exact division on CUDA too (see two_phase)
        if result_residual is not None:
            acc = acc + result_residual
            result_residual.zero_()
        packed = encode_segment(acc, spec, result_residual, backend)
    mark("requantize")
    return packed


def _wire_spec(codec: Any) -> QuantSpec:
    if isinstance(codec, Fp32Codec):
        return FP32
    if isinstance(codec, QuantCodec):
        return codec.spec
    raise TypeError(f"allreduce_device supports fp32 and noloco.quant codecs, not {type(codec).__name__}")


def _comm_device(group: Any, x: torch.Tensor) -> tuple[torch.device, bool]:
    """Where the payloads live and whether the collectives go through NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if x.device.type == "cuda" and "nccl" in backend:
        return x.device, True
    if "gloo" in backend:
        return torch.device("cpu"), False
    if "nccl" in backend:
        raise ValueError(f"an NCCL process group reduces CUDA tensors; x is on {x.device}")
    raise ValueError(f"allreduce_device supports nccl and gloo process groups, not {backend!r}")


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, nccl: bool, async_op: bool = False) -> Any:
    """All-gather ``inp`` into the equal slots of ``out`` (one flat tensor on NCCL; slot views on gloo)."""
    if nccl:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(out, inp, group=group, async_op=async_op)
    return dist.all_gather(list(out.view(-1, inp.numel()).unbind(0)), inp, group=group, async_op=async_op)


class _PhaseClock:
    """Wall time per phase (``timings``): CUDA events on the current stream, or the host clock on CPU."""

    def __init__(self, timings: dict[str, float] | None, device: torch.device):
        self.timings, self.cuda = timings, device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []
        self.mark("start")

    @property
    def enabled(self) -> bool:
        return self.timings is not None

    def mark(self, phase: str) -> None:
        if self.timings is None:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def finish(self) -> None:
        if self.timings is None:
            return
        if self.cuda:
            self.marks[-1][1].synchronize()
        for (_, a), (phase, b) in zip(self.marks, self.marks[1:]):
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            self.timings[phase] = self.timings.get(phase, 0.0) + ms


def _check_call(
    meta: list[int], group: Any, device: torch.device, nccl: bool, me: int, n: int, failure: BaseException | None
) -> None:
    """All-gather every member's view of the call; raise the same way on every member if they differ."""
    mine = torch.tensor(meta + [0 if failure is None else 1], dtype=torch.int64)
    table = torch.empty(n * mine.numel(), dtype=torch.int64, device=device)
    _all_gather(table, mine.to(device), group, nccl)
    rows = table.view(n, -1).cpu().tolist()
    for index, field in enumerate(_META_FIELDS):
        values = [row[index] for row in rows]
        if len(set(values)) > 1:
            if field == "dtype":
                values = [_DTYPE_NAMES.get(v, v) for v in values]
            elif field == "op":
                values = [_OP_NAMES.get(v, v) for v in values]
            elif field == "codec":
                values = [f"crc {v:#010x}" for v in values]
            raise PayloadMismatch(
                f"allreduce_device: members disagree on {field}: {values} (by member; this is member {me})"
            )
    if failure is not None:
        raise failure
    bad = [j for j, row in enumerate(rows) if row[-1]]
    if bad:
        raise RemoteFailure(f"allreduce_device: member(s) {bad} could not encode their input (NaN/Inf?)")


def allreduce_device(
    x: torch.Tensor,
    group: Any = None,
    codec: str | QuantCodec | Fp32Codec = "int4",
    op: str = "mean",
    error_feedback: ReductionErrorFeedback | None = None,
    *,
    min_compress_numel: int | None = None,
    counter: ByteCounter | None = None,
    backend: str | None = None,
    timings: dict[str, float] | None = None,
) -> torch.Tensor:
    """Two-phase all-reduce of ``x`` over a torch.distributed process group, payloads kept on device.

    A collective call: every member of ``group`` must call it, in the same order as its other
    collectives on that group.

    Args:
        x: any-shape float tensor (fp32/bf16/fp16/fp64); not modified. CUDA with an NCCL group (no host
            copies), CPU (or CUDA, staged) with a gloo group. Every member must pass the same numel/dtype.
        group: the ``torch.distributed`` process group (default: the world). Member ``k`` is group rank
            ``k`` and owns segment ``k`` (:func:`~noloco.collectives.two_phase.segment_bounds`).
        codec: ``"fp32"`` (exact) or any :mod:`noloco.quant` spec (``"int4"``, ``"int8"``, ``"mxfp4"``, ...).
        op: ``"mean"`` or ``"sum"``.
        error_feedback: this call site's residuals (kept across calls; committed only on success).
        min_compress_numel: segments shorter than this go in fp32 (default
            :data:`~noloco.collectives.base.SMALL_MESSAGE_NUMEL`, as the bytes path).
        counter: if given, every message's bytes are counted into it (sent and received).
        backend: kernel backend for :mod:`noloco.quant` (None: Triton on CUDA, torch on CPU).
        timings: if given, the call runs its phases one after the other (no overlap of communication and
            compute) and adds the milliseconds of each phase into this dict, for profiling: ``encode``,
            ``check``, ``reduce-scatter``, ``own to fp32``, ``dequantize-accumulate`` (when not fused),
            ``requantize``, ``pack``, ``all-gather``, ``decode``.

    Returns:
        float32 tensor of ``x``'s shape on ``x``'s device, bit-identical on every member and equal to
        ``allreduce(x, transport, codec=codec, reduction="two_phase", op=op)`` on the same inputs.

    Raises:
        ValueError / TypeError: bad arguments, a sparse (top-k) codec (before any collective).
        PayloadMismatch: members disagree on numel, dtype, op, codec or group size (on every member).
        ValueError: this member's input holds NaN/Inf (quantized codecs); the others raise RemoteFailure.
    """
    requested = get_codec(codec)
    _check_arguments(x, op, error_feedback, requested)
    requested_spec = _wire_spec(requested)
    me, n = _membership(group)
    device, nccl = _comm_device(group, x)
    flat = _flat_input(x, device)
    numel = flat.numel()
    residuals = None
    if error_feedback is not None:
        residuals = tuple(r.to(device) for r in error_feedback.residuals_for(numel))
    if n == 1:
        return _reduce_alone(x, flat, error_feedback, residuals)

    spec = _segment_spec(requested, requested_spec, numel, n, min_compress_numel)
    bounds = segment_bounds(numel, n)
    contribution, result = residuals if residuals is not None else (None, None)
    clock = _PhaseClock(timings, device)
    call = _Call(group, device, nccl, me, n, spec, bounds, counter, backend, clock)

    send, send_sizes, failure = _encode_phase(call, flat, contribution)
    clock.mark("encode")
    codec_id = crc(f"{requested.name}|{'fp32' if _is_raw(spec) else spec}")
    meta = [_META_MAGIC, numel, DTYPE_CODES[x.dtype], OP_CODES[op], codec_id, n]  # what every member must agree on
    _check_call(meta, group, device, nccl, me, n, failure)
    clock.mark("check")

    own, own_is_scratch, received = _reduce_scatter_phase(call, flat, send, send_sizes, contribution)
    gather_size = message_layout(spec, bounds[0][1] - bounds[0][0])[1]  # every slot fits the largest segment
    reduced, gather_send, status, failure = _reduce_owned_segment(
        call, own, received, op, result, own_is_scratch, gather_size
    )
    out = _all_gather_phase(call, numel, reduced, gather_send, status, failure, gather_size)
    clock.mark("decode")
    clock.finish()
    if error_feedback is not None:
        error_feedback.commit(contribution, result)
    return out.reshape(x.shape).to(x.device)


@dataclass(frozen=True)
class _Call:
    """What every phase of one :func:`allreduce_device` call shares: the group, where the payloads live, this
    member's index, the group size, the wire format, the segments, and the counter, backend and clock."""

    group: Any
    device: torch.device
    nccl: bool
    me: int
    n: int
    spec: QuantSpec
    bounds: list[tuple[int, int]]
    counter: ByteCounter | None
    backend: str | None
    clock: _PhaseClock


def _check_arguments(x: torch.Tensor, op: str, error_feedback: ReductionErrorFeedback | None, codec) -> None:
    """Refuse bad arguments of :func:`allreduce_device` before any collective (``codec``: the parsed codec)."""
    from noloco.collectives.base import OPS

    if isinstance(codec, QuantCodec) and codec.spec.sparse:
        raise ValueError(f"allreduce_device does not carry the sparse codec {codec.name!r} (its two-phase owner "
                         "would re-sparsify every sum); use allreduce over a transport")  # fmt: skip
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPE_CODES:
        raise TypeError(f"allreduce_device supports fp32/bf16/fp16/fp64 tensors, got {getattr(x, 'dtype', x)}")
    if error_feedback is not None and not isinstance(error_feedback, ReductionErrorFeedback):
        raise TypeError(f"error_feedback must be a ReductionErrorFeedback, got {type(error_feedback).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized (call dist.init_process_group first)")


def _segment_spec(requested, requested_spec, numel: int, n: int, min_compress_numel: int | None):
    """The wire spec of the call's segments: the codec's, or fp32 when a segment is shorter than
    ``min_compress_numel`` (default :data:`~noloco.collectives.base.SMALL_MESSAGE_NUMEL`) and the codec is lossy."""
    from noloco.collectives.base import SMALL_MESSAGE_NUMEL

    threshold = SMALL_MESSAGE_NUMEL if min_compress_numel is None else int(min_compress_numel)
    return requested_spec if requested.exact or -(-numel // n) >= threshold else FP32


def _membership(group) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ValueError if it is not a member."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if me < 0:
        raise ValueError("this process is not a member of the process group")
    return me, n


def _flat_input(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` as a 1-D tensor on the payloads' ``device`` (fp64 as fp32; other dtypes as they are)."""
    flat = x.detach().reshape(-1)
    if flat.dtype == torch.float64:
        flat = flat.float()  # fp64 is reduced in fp32, as the bytes path does
    flat = flat.to(device)
    return flat


def _reduce_alone(
    x: torch.Tensor,
    flat: torch.Tensor,
    error_feedback: ReductionErrorFeedback | None,
    residuals: tuple[torch.Tensor, ...] | None,
) -> torch.Tensor:
    """The result of a group of one: ``flat`` in fp32, plus whatever error feedback owes it."""
    out = flat.float().clone()
    if residuals is not None:  # nothing was encoded: pay back both residuals exactly
        out += residuals[0] + residuals[1]
        error_feedback.commit(torch.zeros_like(residuals[0]), torch.zeros_like(residuals[1]))
    return out.reshape(x.shape).to(x.device)


def _encode_phase(
    call: _Call, flat: torch.Tensor, contribution: torch.Tensor | None
) -> tuple[torch.Tensor | None, list[int], BaseException | None]:
    """Phase 1a: encode the segments other members own, into one send buffer (ordered by owner).

    Returns ``(send, send_sizes, failure)``: ``failure`` is the ``ValueError`` of an input that could not be
    encoded (NaN/Inf), which the caller still takes into the call check, so that every member fails.
    """
    bounds, me, n, spec, device, backend = call.bounds, call.me, call.n, call.spec, call.device, call.backend
    send_sizes = [0 if k == me else message_layout(spec, end - start)[1] for k, (start, end) in enumerate(bounds)]
    failure: BaseException | None = None
    send = None
    try:
        encoded = {}
        for k, (start, end) in enumerate(bounds):
            if k != me:
                res = None if contribution is None else contribution[start:end]
                encoded[k] = encode_segment(flat[start:end], spec, res, backend)
        for packed in encoded.values():  # every verdict before anything is sent (deferred on CUDA)
            packed.check()
        if n == 2:  # one message: sent as the kernel wrote it when possible
            send = message_view(encoded[1 - me])
        if send is None:
            send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
            offset = 0
            for k, packed in encoded.items():
                pack_into(send[offset : offset + send_sizes[k]], packed)
                offset += send_sizes[k]
        del encoded
    except ValueError as exc:  # NaN/Inf: still take part in the check, so every member fails
        failure = exc
    return send, send_sizes, failure


def _own_in_fp32(
    flat: torch.Tensor, start: int, end: int, contribution: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """The owner's own segment in fp32 (its accumulator when it sums first) and whether it is a scratch copy."""
    own, own_is_scratch = flat[start:end], True
    if contribution is not None:
        own = own + contribution[start:end]  # sent exactly: the residual is paid back in full
        contribution[start:end] = 0.0
    elif own.dtype != torch.float32:
        own = own.float()
    else:
        own_is_scratch = False  # a view of the caller's x
    return own, own_is_scratch


def _reduce_scatter_phase(
    call: _Call, flat: torch.Tensor, send: torch.Tensor, send_sizes: list[int], contribution: torch.Tensor | None
) -> tuple[torch.Tensor, bool, list[Packed | None]]:
    """Phase 1b: reduce-scatter. Every member's message for segment `me` has the same size.

    Returns the owner's own segment in fp32 (:func:`_own_in_fp32`), whether it is scratch, and the
    messages received for segment ``me``, by member (None at ``me``).
    """
    bounds, me, n, spec, group, device = call.bounds, call.me, call.n, call.spec, call.group, call.device
    counter, clock = call.counter, call.clock
    start, end = bounds[me]
    seg_numel = end - start
    recv_size = message_layout(spec, seg_numel)[1]
    recv_sizes = [0 if j == me else recv_size for j in range(n)]
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    work = None
    if any(message_layout(spec, e - s)[1] for s, e in bounds):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=True)
    if counter is not None:
        for k in range(n):
            if send_sizes[k]:
                counter.count_sent(send_sizes[k])
            if recv_sizes[k]:
                counter.count_received(recv_sizes[k])
    if clock.enabled and work is not None:
        work.wait()
        clock.mark("reduce-scatter")
    # The owner's own segment in fp32 (its accumulator when it sums first): queued before waiting on the
    # reduce-scatter, so the conversion runs on the GPU while the payloads are in flight.
    own, own_is_scratch = _own_in_fp32(flat, start, end, contribution)
    clock.mark("own to fp32")
    if work is not None and not clock.enabled:
        work.wait()
    received: list[Packed | None] = []
    offset = 0
    for j in range(n):
        received.append(None if j == me else unpack(recv[offset : offset + recv_size], spec, seg_numel))
        offset += recv_sizes[j]
    return own, own_is_scratch, received


def _reduce_owned_segment(
    call: _Call,
    own: torch.Tensor,
    received: list[Packed | None],
    op: str,
    result: torch.Tensor | None,
    own_is_scratch: bool,
    gather_size: int,
) -> tuple[Packed | None, torch.Tensor, torch.Tensor, BaseException | None]:
    """Owner: fp32 sum in member order, encoded once, packed into this member's all-gather slot.

    Returns ``(reduced, gather_send, status, failure)``: when the reduced segment cannot be encoded,
    ``reduced`` is None, ``gather_send`` zeros, ``status[0]`` is 1 (to tell the others through the
    status) and ``failure`` the ``ValueError``, raised after the gather.
    """
    me, spec, device, backend, clock = call.me, call.spec, call.device, call.backend, call.clock
    bounds = call.bounds
    start, end = bounds[me]
    status = torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=device)
    gather_send = failure = reduced = None
    try:
        res = None if result is None else result[start:end]
        reduced = reduce_segment(
            own, received, me, op, spec, res, backend, own_is_scratch=own_is_scratch, mark=clock.mark
        )
        reduced.check()  # its verdict before it is sent (deferred on CUDA)
        gather_send = message_view(reduced)
        if gather_send is None or gather_send.numel() != gather_size:
            gather_send = torch.empty(gather_size, dtype=torch.uint8, device=device)
            pack_into(gather_send, reduced)
        clock.mark("pack")
    except ValueError as exc:  # tell the others through the status, then raise after the gather
        failure = exc
        status[0] = 1
    if gather_send is None:
        gather_send = torch.zeros(gather_size, dtype=torch.uint8, device=device)
    return reduced, gather_send, status, failure


def _all_gather_phase(
    call: _Call,
    numel: int,
    reduced: Packed | None,
    gather_send: torch.Tensor,
    status: torch.Tensor,
    failure: BaseException | None,
    gather_size: int,
) -> torch.Tensor:
    """Phase 2: all-gather of the encoded reduced segments (and of each owner's status); everyone decodes the
    same codes.

    Returns the decoded fp32 result (flat, on ``device``). Raises this member's own ``failure`` after the
    gather, or :class:`RemoteFailure` when another owner's status says it could not encode its segment.
    """
    bounds, me, n, spec, group, device = call.bounds, call.me, call.n, call.spec, call.group, call.device
    nccl, counter, backend, clock = call.nccl, call.counter, call.backend, call.clock
    start, end = bounds[me]
    statuses = torch.empty(n * STATUS_BYTES, dtype=torch.uint8, device=device)
    status_work = _all_gather(statuses, status, group, nccl, async_op=True)
    gathered = torch.empty(n * gather_size, dtype=torch.uint8, device=device)
    work = _all_gather(gathered, gather_send, group, nccl, async_op=True) if gather_size else None
    if counter is not None:
        for _ in range(n - 1):
            counter.count_sent(STATUS_BYTES)
            counter.count_received(STATUS_BYTES)
            if gather_size:
                counter.count_sent(gather_size)
                counter.count_received(gather_size)
    if clock.enabled:
        status_work.wait()
        if work is not None:
            work.wait()
        clock.mark("all-gather")
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if reduced is not None:
        decode_segment(out[start:end], reduced, backend)  # overlaps the all-gather
    status_work.wait()
    if work is not None:
        work.wait()
    failed = [j for j, flag in enumerate(statuses.view(n, STATUS_BYTES)[:, 0].cpu().tolist()) if flag]
    if failure is not None:
        raise failure
    if failed:
        raise RemoteFailure(
            f"allreduce_device: member(s) {failed} could not encode their reduced segment (NaN/Inf in their own input?)"
        )
    slots = gathered.view(n, gather_size)
    for k, (s, e) in enumerate(bounds):
        if k != me and e > s:
            decode_segment(out[s:e], unpack(slots[k], spec, e - s), backend)
    return out
