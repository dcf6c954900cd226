"""The message protocol every reduction speaks: a fixed header per payload, checked on receipt,
and error markers so that a failure on one member fails every member quickly instead of hanging.

Each payload a collective sends is ``header (32 bytes) + body``; the body is a codec's message
(:mod:`noloco.collectives.message`: the encoded sections, sized by codec and numel, which this header
checks). The header says what the sender
believes this call is::

    offset size field
    0      2    magic b"NC"
    2      1    version (2)
    3      1    status: 0 ok; 1 mismatch, 2 timeout, 3 other error (body = UTF-8 reason)
    4      1    reduction code        5  1  op code
    6      1    input dtype code      7  1  phase (0 reduce-scatter / ring reduce, 1 all-gather)
    8      2    group size n          10 2  sender's index in the group
    12     2    segment index         14 2  step (ring hop; 0 for two-phase)
    16     8    numel of the whole vector
    24     4    CRC-32 of "requested codec|codec on the wire"
    28     4    CRC-32 of the call tag (names the call and its round, e.g. "outer/r7/delta")

A receiver builds the header it expects for each message and compares field by field, so members
that disagree on numel, dtype, codec, op, reduction or group size get an error that names the field
and both values, and a payload from the wrong member, phase, segment or round is rejected even if a
transport delivered it under the right address.

Failure protocol (:class:`Exchange`): a member that fails (mismatch, undecodable payload, its own
input cannot be encoded, a timeout) sends an *error marker* in place of every message it still owes
in this call, then raises. A member that receives a marker does the same. Every reduction here makes
every member wait on a chain of messages that reaches every other member, so one failure fails all
members within about one ``timeout`` (a dead member: every survivor raises
:class:`~noloco.comm.base.CommTimeout`; a mismatch: every member raises :class:`PayloadMismatch`).

Values (docs/reliability.md): every decoded float payload is checked for NaN/Inf (:meth:`Exchange.check_finite`;
quantized payloads are already validated by the codec's ``decode``), and an optional :class:`NormBound`
drops a peer's contribution whose L2 norm exceeds ``max_ratio`` times this member's own contribution to
the same segment (plus a small floor): a peer that sends huge values is refused, counted in
:class:`NormRejections` and logged with its rank, and never applied (docs/reliability.md).
"""

from __future__ import annotations

import logging
import math
import struct
import zlib
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field

import torch

from noloco.collectives.codec import Codec, PayloadMismatch
from noloco.comm.base import CommError, CommTimeout, DeviceMessage, Transport
from noloco.state import StateError, is_count

logger = logging.getLogger(__name__)

MAGIC = b"NC"
VERSION = 2  # 2: bodies are noloco.collectives.message layouts (1: Packed.to_bytes)
_FORMAT = "<2sBBBBBBHHHHQII"
HEADER_BYTES = struct.calcsize(_FORMAT)  # 32

REDUCTION_CODES = {"two_phase": 0, "ring": 1, "naive_ring": 2, "allgather": 3}
OP_CODES = {"mean": 0, "sum": 1}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
STATUS_OK, STATUS_MISMATCH, STATUS_TIMEOUT, STATUS_ERROR = 0, 1, 2, 3
PHASE_REDUCE, PHASE_GATHER = 0, 1

_FIELD_NAMES = {
    "reduction": ("reduction", {v: k for k, v in REDUCTION_CODES.items()}),
    "op": ("op", {v: k for k, v in OP_CODES.items()}),
    "dtype": ("dtype", {v: str(k).replace("torch.", "") for k, v in DTYPE_CODES.items()}),
    "group_size": ("group size", None),
    "numel": ("numel", None),
    "codec": ("codec", None),
    "call": ("call tag (round)", None),
    "sender": ("sender index", None),
    "phase": ("phase", None),
    "segment": ("segment", None),
    "step": ("step", None),
}


def crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


@dataclass(frozen=True)
class Header:
    """One message's header (see the module docstring for the layout)."""

    status: int
    reduction: int
    op: int
    dtype: int
    phase: int
    group_size: int
    sender: int
    segment: int
    step: int
    numel: int
    codec: int
    call: int

    def pack(self) -> bytes:
        return struct.pack(
            _FORMAT,
            MAGIC,
            VERSION,
            self.status,
            self.reduction,
            self.op,
            self.dtype,
            self.phase,
            self.group_size,
            self.sender,
            self.segment,
            self.step,
            self.numel,
            self.codec,
            self.call,
        )

    @staticmethod
    def unpack(payload: bytes) -> Header:
        if len(payload) < HEADER_BYTES:
            raise PayloadMismatch(f"message of {len(payload)} bytes is shorter than the {HEADER_BYTES}-byte header")
        magic, version, *fields = struct.unpack_from(_FORMAT, payload, 0)
        if magic != MAGIC:
            raise PayloadMismatch(f"bad collective magic {magic!r} (not a noloco.collectives message)")
        if version != VERSION:
            raise PayloadMismatch(f"collective protocol version {version}, this member speaks {VERSION}")
        return Header(*fields)


@dataclass(frozen=True)
class CallInfo:
    """What this member believes the call is; the basis of every header it sends and expects."""

    reduction: str
    op: str
    dtype: torch.dtype
    group: tuple[int, ...]
    me: int  # my index in group
    numel: int
    codec_id: str  # "requested|on the wire"
    tag: str

    def header(self, phase: int, sender: int, segment: int, step: int = 0, status: int = STATUS_OK) -> Header:
        return Header(
            status,
            REDUCTION_CODES[self.reduction],
            OP_CODES[self.op],
            DTYPE_CODES.get(self.dtype, 255),
            phase,
            len(self.group),
            sender,
            segment,
            step,
            self.numel,
            crc(self.codec_id),
            crc(self.tag),
        )


class RemoteFailure(PayloadMismatch):
    """A peer reported (by an error marker) that this call failed on its side."""


#: Absolute floor of the norm bound, as an RMS per element: a contribution of ``numel`` elements is
#: always admitted up to ``max_ratio * floor_rms * sqrt(numel)``, so members whose own contribution is
#: exactly zero (NoLoCo's slow-weight term in round 0) do not refuse each other's zeros. Honest
#: pseudo-gradients of the default run have an RMS of 6e-4 .. 9e-3 (docs/reliability.md), far above it.
NORM_FLOOR_RMS = 1e-6


def l2_norm(value: torch.Tensor) -> float:
    """L2 norm accumulated in float64 (an fp32 sum of squares of 1e27-sized values would overflow)."""
    return float(torch.linalg.vector_norm(value, dtype=torch.float64)) if value.numel() else 0.0


@dataclass
class NormRejections:
    """What a member's norm bound refused, for the caller to read (keep one per worker or call site).

    ``contributions``: peers' contributions dropped from a sum this member computed (two-phase: a
    member's segment at its owner; ring: an incoming partial sum at a hop). ``results``: reduced
    segments from another owner that this member refused and replaced by its own contribution.
    ``by_rank``: both together, by the sender's rank in the transport. Checkpointable.
    """

    contributions: int = 0
    results: int = 0
    by_rank: dict[int, int] = dataclass_field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.contributions + self.results

    def count(self, rank: int, result: bool) -> None:
        if result:
            self.results += 1
        else:
            self.contributions += 1
        self.by_rank[rank] = self.by_rank.get(rank, 0) + 1

    def state_dict(self) -> dict:
        return {"contributions": self.contributions, "results": self.results,
                "by_rank": {str(k): v for k, v in self.by_rank.items()}}  # fmt: skip

    @staticmethod
    def check_state(state, where: str = "norm_rejections") -> None:
        """:class:`~noloco.state.StateError` unless ``state`` holds counts (and counts by rank, at most 2^16)."""
        by_rank = state.get("by_rank", {}) if isinstance(state, dict) else None
        if not (isinstance(state, dict) and set(state) <= {"contributions", "results", "by_rank"}
                and all(is_count(v) for k, v in state.items() if k != "by_rank")
                and isinstance(by_rank, dict) and len(by_rank) <= 2**16
                and all(isinstance(k, str) and k.isdigit() and is_count(v) for k, v in by_rank.items())):  # fmt: skip
            raise StateError(f"{where}: not a mapping of counts (and of counts by rank)")

    def load_state_dict(self, state: dict) -> None:
        self.contributions, self.results = int(state.get("contributions", 0)), int(state.get("results", 0))
        self.by_rank = {int(k): int(v) for k, v in state.get("by_rank", {}).items()}


class NormBound:
    """Admit a peer's contribution only if ``‖value‖ <= contributors · (max_ratio · ‖own‖ + floor_rms · √numel)``.

    ``own`` is this member's own contribution to the same segment (or the segment of ``reference``, when
    the caller knows a better scale, e.g. for a term that is legitimately zero on this member), so the
    bound scales with whatever is being reduced (pseudo-gradients, slow weights) without tuning. Honest
    NoLoCo contributions are within a factor 1.4 of each other (measured, docs/reliability.md); one sent
    1e30 times too large is refused. ``contributors`` is the number of inputs summed into ``value``
    (ring partial sums; the all-gather of a sum).

    Raises:
        ValueError: ``max_ratio`` is not a finite number > 1 or ``floor_rms`` is negative.
    """

    def __init__(self, max_ratio: float, floor_rms: float = NORM_FLOOR_RMS, rejections: NormRejections | None = None,
                 reference: torch.Tensor | None = None):  # fmt: skip
        if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) or not 1 < max_ratio < math.inf:
            raise ValueError(f"max_norm_ratio must be a finite number > 1 (None disables the bound), got {max_ratio!r}")
        if not floor_rms >= 0:
            raise ValueError(f"norm floor must be >= 0, got {floor_rms!r}")
        self.max_ratio, self.floor_rms = float(max_ratio), float(floor_rms)
        self.rejections = rejections if rejections is not None else NormRejections()
        self.reference = reference  # flat fp32; None: this member's own contribution

    def own_norms(self, contributed: torch.Tensor, bounds: list[tuple[int, int]]) -> list[float]:
        """Per segment, the norm ``own`` the bound scales with: of ``reference`` if set, else ``contributed``."""
        basis = contributed if self.reference is None else self.reference
        norms = [torch.linalg.vector_norm(basis[s:e], dtype=torch.float64) for s, e in bounds if e > s]
        values = iter(torch.stack(norms).tolist() if norms else [])  # one host read for all segments
        return [next(values) if end > start else 0.0 for start, end in bounds]

    def limit(self, own_norm: float, numel: int, contributors: int = 1) -> float:
        return contributors * (self.max_ratio * own_norm + self.floor_rms * math.sqrt(numel))


class Exchange:
    """Sends and receives the messages of one collective call, with headers and failure propagation.

    The reduction declares up front every message it will send (:meth:`expect_sends`); each
    :meth:`send` ticks one off. :meth:`fail` sends an error marker for each message still owed.
    Use as ``with Exchange(...) as ex:`` so that any exception inside triggers :meth:`fail`.
    """

    def __init__(self, transport: Transport, info: CallInfo, timeout: float, bound: NormBound | None = None):
        self.transport, self.info, self.timeout = transport, info, float(timeout)
        self.bound = bound
        self._owed: dict[tuple[int, str], tuple[int, int, int]] = {}
        self._stamped: dict[int, tuple[torch.Tensor, bytes]] = {}  # message buffers sent, with their header

    def tag_of(self, phase: int, segment: int, step: int) -> str:
        return f"{self.info.tag}/{self.info.reduction}/p{phase}/s{segment}/h{step}"

    def expect_sends(self, sends: list[tuple[int, int, int, int]]) -> None:
        """Declare messages this member owes: ``(dst index, phase, segment, step)``."""
        for dst, phase, segment, step in sends:
            self._owed[(dst, self.tag_of(phase, segment, step))] = (phase, segment, step)

    def expect_recvs(self, recvs: list[tuple[int, int, int, int, int]]) -> None:
        """Announce to the transport the messages this member will receive: ``(src index, phase, segment, step,
        body bytes)`` (:meth:`Transport.expect`: a transport that can post their receives early does)."""
        for src, phase, segment, step, nbytes in recvs:
            self.transport.expect(self.info.group[src], self.tag_of(phase, segment, step), HEADER_BYTES + nbytes)

    def encode(self, codec: Codec, value: torch.Tensor,
               with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``value`` encoded by ``codec`` into a message buffer with room for the header (:meth:`send` fills it).

        Returns ``(message, decoded value or None)``; see :meth:`Codec.encode_message`. A message may go to
        several members (an owner's reduced segment), always with the same header.
        """
        if self.transport.carries_device and value.is_cuda:  # simulated workers on GPUs: the body stays there
            return codec.encode_device(value, with_value)
        return codec.encode_message(value, HEADER_BYTES, with_value)

    def send(self, dst: int, phase: int, segment: int, step: int, body: bytes | memoryview | torch.Tensor) -> None:
        """Send to group member ``dst`` (an index into the group) a body: bytes, or a message from :meth:`encode`.

        A message buffer is sent as it is, its header written into its head room (no copy of the body); the
        transport takes it over, so nobody writes into it afterwards.
        """
        tag = self.tag_of(phase, segment, step)
        header = self.info.header(phase, self.info.me, segment, step).pack()
        if isinstance(body, torch.Tensor) and body.is_cuda:
            payload = DeviceMessage(header, body)
        elif isinstance(body, torch.Tensor):
            room = body.numpy()
            if self._stamped.setdefault(id(body), (body, header))[1] != header:  # kept alive: ids stay unique
                raise ValueError(f"{self.info.tag}: a message buffer already sent with another header")
            room[:HEADER_BYTES] = memoryview(header)
            payload = memoryview(room)
        else:
            payload = header + body
        self.transport.send(self.info.group[dst], tag, payload)
        self._owed.pop((dst, tag), None)

    def recv(self, src: int, phase: int, segment: int, step: int = 0,
             device: torch.device | str = "cpu") -> memoryview | torch.Tensor:  # fmt: skip
        """Receive the body member ``src`` sends for ``(phase, segment, step)``, after checking its header.

        The body is a view of the received buffer (no copy); decoding reads it, nothing writes it. A
        :class:`~noloco.comm.base.DeviceMessage`'s body comes as a uint8 tensor ready on ``device``'s current
        stream (the device the caller decodes on).
        """
        tag = self.tag_of(phase, segment, step)
        payload = self.transport.recv(self.info.group[src], tag, self.timeout)
        if isinstance(payload, DeviceMessage):
            got = Header.unpack(payload.head)
            body = payload.body_on(device) if got.status == STATUS_OK else memoryview(b"")
        else:
            got = Header.unpack(payload)
            body = memoryview(payload).cast("B")[HEADER_BYTES:]
        who = f"member {src} (rank {self.info.group[src]})"
        if got.status != STATUS_OK:
            reason = bytes(body[:2000]).decode("utf-8", errors="replace")
            kind = CommTimeout if got.status == STATUS_TIMEOUT else RemoteFailure
            raise kind(f"{self.info.tag}: {who} failed: {reason}")
        want = self.info.header(phase, src, segment, step)
        for field, (label, names) in _FIELD_NAMES.items():
            a, b = getattr(got, field), getattr(want, field)
            if a != b:
                if names is not None:
                    a, b = names.get(a, a), names.get(b, b)
                if field == "codec":
                    a, b = f"crc {a:#010x}", f"{self.info.codec_id!r} (crc {b:#010x})"
                raise PayloadMismatch(
                    f"{self.info.tag}: {who} disagrees on {label}: it sent {a}, this member (rank "
                    f"{self.transport.rank}) expects {b}"
                )
        return body

    def check_finite(self, value: torch.Tensor, src: int, segment: int, codec: Codec | None = None) -> None:
        """Raise :class:`PayloadMismatch` if member ``src``'s decoded ``value`` holds NaN or Inf.

        A ``codec`` that validated what it decoded (:attr:`Codec.checks_finite`) needs no second pass.
        """
        if codec is not None and codec.checks_finite:
            return
        if value.numel() and not bool(torch.isfinite(value).all()):
            raise PayloadMismatch(f"{self.info.tag}: member {src} (rank {self.info.group[src]}) sent non-finite "
                                  f"values for segment {segment}")  # fmt: skip

    def admits(self, src: int, segment: int, value: torch.Tensor, own_norm: float, contributors: int = 1,
               result: bool = False, owner: int | None = None) -> bool:  # fmt: skip
        """Whether the norm bound admits member ``src``'s decoded ``value`` (always, without a bound).

        A refusal is counted in ``bound.rejections`` and logged with the sender's rank (``owner``'s, for a
        reduced segment a ring member only forwarded); the caller then leaves ``value`` out (a
        contribution) or uses its own contribution instead (``result``: a reduced segment of another owner).
        """
        if self.bound is None:
            return True
        norm = l2_norm(value)
        limit = self.bound.limit(own_norm, value.numel(), contributors)
        if norm <= limit:
            return True
        rank = self.info.group[src if owner is None else owner]
        self.bound.rejections.count(rank, result)
        what = "reduced segment" if result else "contribution"
        via = "" if owner is None or owner == src else f" (forwarded by rank {self.info.group[src]})"
        logger.warning(
            "%s: rank %d refused the %s of rank %d%s to segment %d: norm %.3g > %.3g (max_norm_ratio %g x own "
            "norm %.3g, %d input(s))",
            self.info.tag,
            self.transport.rank,
            what,
            rank,
            via,
            segment,
            norm,
            limit,
            self.bound.max_ratio,
            own_norm,
            contributors,
        )
        return False

    def fail(self, exc: BaseException) -> None:
        """Send an error marker for every message still owed (best effort), so peers fail fast."""
        if isinstance(exc, CommTimeout):
            status = STATUS_TIMEOUT
        elif isinstance(exc, ValueError):
            status = STATUS_MISMATCH
        else:
            status = STATUS_ERROR
        reason = f"rank {self.transport.rank}: {type(exc).__name__}: {exc}".encode()[:2000]
        owed, self._owed = self._owed, {}
        for (dst, tag), (phase, segment, step) in owed.items():
            header = replace(self.info.header(phase, self.info.me, segment, step), status=status)
            try:
                self.transport.send(self.info.group[dst], tag, header.pack() + reason)
            except CommError:
                pass  # the fabric is already torn down, or that peer is gone

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.fail(exc)
