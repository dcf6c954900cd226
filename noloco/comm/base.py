"""The transport interface: moving opaque byte payloads between ranks, with byte accounting.

A transport knows who its peers are and how to move bytes; it does not know what the bytes mean
(docs/design.md §2). Every collective in :mod:`noloco.collectives` is written against :class:`Transport`,
so the same reduction runs over the in-process fabric, torch.distributed or hivemind.

Messages are addressed by ``(src, dst, tag)``. A tag names one message of one collective call
(e.g. ``"outer/r12/delta/rs/3"``), so a payload from the wrong round or phase can never be taken
for the expected one. ``recv`` blocks at most ``timeout`` seconds and raises :class:`CommTimeout`
after that, so a dead peer costs at most a timeout.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch

from noloco.state import StateError, is_count


class CommError(RuntimeError):
    """A peer-to-peer transfer failed (peer gone, fabric aborted, malformed address)."""


class CommTimeout(CommError, TimeoutError):
    """A ``recv`` waited longer than its timeout: the peer is dead, partitioned or too slow."""


class CommUnreachable(CommError):
    """The peer could not be reached at all (no route to it, the connection failed): absent, not slow.

    Raised where a transport can tell the two apart (the swarm's p2p daemon answers at once when it finds no
    route); a peer that answered and refused, or took too long, raises :class:`CommError` or :class:`CommTimeout`.
    """


class CommAborted(CommError):
    """The transport was shut down on purpose because the run is failing (e.g. another in-process rank raised).

    Unlike a timeout or a lost peer this is not a fault to survive: callers that skip failed rounds
    (:class:`~noloco.optim.algorithms.OuterAlgorithm`) re-raise it, so a run whose worker crashed on a
    bug stops at once instead of training on without it.
    """


@dataclass
class ByteCounter:
    """Bytes and messages this rank has put on and taken off the wire (payload bytes, all tags)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def count_sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.messages_sent += 1

    def count_received(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.messages_received += 1

    def state_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @staticmethod
    def check_state(state, where: str = "counter") -> None:
        """:class:`~noloco.state.StateError` unless ``state`` maps names to byte or message counts."""
        if not isinstance(state, dict) or not all(isinstance(k, str) and is_count(v) for k, v in state.items()):
            raise StateError(f"{where}: not a mapping of byte counts")

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            if key in self.state_dict():
                setattr(self, key, int(value))


class DeviceMessage:
    """A message whose body stays in GPU memory, for transports whose ranks share one process (``carries_device``).

    ``head`` is the host header, ``body`` a 1-D uint8 CUDA tensor the sender gives up (nobody writes it after
    sending). An event recorded on the sender's stream at construction marks when the body is complete;
    :meth:`body_on` makes the receiver's stream wait for it and keeps the memory alive until the receiver's
    queued work is done. Counted as ``len(head) + body.numel()`` bytes, what the same message costs on a wire.
    """

    __slots__ = ("head", "body", "_ready")

    def __init__(self, head: bytes, body: torch.Tensor):
        if body.dtype != torch.uint8 or body.dim() != 1 or body.device.type != "cuda":
            raise TypeError(f"a device message body is a 1-D uint8 CUDA tensor, got {body.dtype} {body.device}")
        self.head, self.body = bytes(head), body
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(body.device))

    def __len__(self) -> int:
        return len(self.head) + self.body.numel()

    def body_on(self, device: torch.device | str) -> torch.Tensor:
        """The body, readable in order on the current stream of ``device`` (a copy when that is another device)."""
        device = torch.device(device)
        source = torch.cuda.current_stream(self.body.device)
        source.wait_event(self._ready)
        self.body.record_stream(source)
        if device == self.body.device:
            return self.body
        with torch.cuda.stream(source):
            return self.body.to(device)  # another GPU or the host: torch orders the copy after the source stream


class Transport(ABC):
    """Point-to-point byte transport seen from one rank.

    Attributes:
        rank: this rank's index in ``[0, world_size)``.
        world_size: number of ranks that can be addressed.
        counter: bytes and messages moved by this rank.
        carries_device: whether :meth:`send` also takes a :class:`DeviceMessage` (handed over without leaving
            the GPU; only transports whose ranks share one process) and :meth:`recv` may return one.
    """

    rank: int
    world_size: int
    counter: ByteCounter
    carries_device: bool = False

    @abstractmethod
    def send(self, dst: int, tag: str, payload: bytes | memoryview) -> None:
        """Send ``payload`` (any bytes-like object) to rank ``dst`` under ``tag``. Does not wait for the receiver.

        The transport may keep ``payload`` itself rather than a copy: the caller does not change it afterwards.
        """

    @abstractmethod
    def recv(self, src: int, tag: str, timeout: float) -> bytes | memoryview:
        """Return the payload rank ``src`` sent under ``tag`` (bytes-like; read it, do not write it);
        raise :class:`CommTimeout` after ``timeout`` s."""

    def expect(self, src: int, tag: str, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Say that rank ``src`` will send a payload of ``nbytes`` bytes under ``tag``: a transport whose
        receives are better posted early does so now (:class:`~noloco.comm.torchdist.TorchDistTransport`: both
        directions of a link then run at once). Only a hint: what arrives is received as without it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; further calls may fail."""

    def _check_peer(self, peer: int) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise CommError(f"rank {self.rank}: peer {peer!r} is not in [0, {self.world_size})")
        if peer == self.rank:
            raise CommError(f"rank {self.rank}: cannot send to or receive from itself")
