"""In-process fabric: N simulated workers in one process, exchanging real byte payloads.

Every rank gets a :class:`LocalTransport`; payloads are handed over through per-(src, dst, tag)
mailboxes without a copy, as a network transport hands over what it sent: a sender gives up a buffer
when it sends it (bytes cannot change; the collectives never write into a message buffer after sending
it, :mod:`noloco.collectives.message`), so simulated workers share no state that either can change, and
every byte is counted exactly as a network transport would count it. Simulated workers on GPUs hand over
:class:`~noloco.comm.base.DeviceMessage` bodies that never leave the GPU (``device_messages``, default on),
counted like the same bytes on a wire. :meth:`LocalFabric.run` runs one
function per rank in its own thread and returns the results by rank; if any rank raises, the fabric is
aborted so the others fail fast with :class:`~noloco.comm.base.CommAborted` (a
:class:`~noloco.comm.base.CommError`) instead of waiting out their timeouts, and do not mistake the
abort for a dead peer whose round can be skipped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from noloco.comm.base import ByteCounter, CommAborted, CommError, CommTimeout, DeviceMessage, Transport

T = TypeVar("T")


class LocalFabric:
    """A set of ``world_size`` in-process transports joined by mailboxes."""

    def __init__(self, world_size: int, device_messages: bool = True):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.device_messages = bool(device_messages)
        self._mail: dict[tuple[int, int, str], bytes] = {}
        self._cond = threading.Condition()
        self._aborted: str | None = None
        self.transports = [LocalTransport(self, rank) for rank in range(world_size)]

    def abort(self, reason: str) -> None:
        """Make every pending and future ``send``/``recv`` raise :class:`~noloco.comm.base.CommAborted` (``reason``)."""
        with self._cond:
            if self._aborted is None:
                self._aborted = reason
            self._cond.notify_all()

    def pending(self) -> int:
        """Number of delivered messages nobody has received yet (0 after a clean collective)."""
        with self._cond:
            return len(self._mail)

    def _deliver(self, src: int, dst: int, tag: str, payload: bytes | memoryview | DeviceMessage) -> None:
        with self._cond:
            if self._aborted is not None:
                raise CommAborted(f"fabric aborted: {self._aborted}")
            key = (src, dst, tag)
            if key in self._mail:
                raise CommError(f"rank {src} sent tag {tag!r} to rank {dst} twice before it was received")
            self._mail[key] = payload
            self._cond.notify_all()

    def _take(self, src: int, dst: int, tag: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        key = (src, dst, tag)
        with self._cond:
            while key not in self._mail:
                if self._aborted is not None:
                    raise CommAborted(f"fabric aborted: {self._aborted}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank {dst}: no message {tag!r} from rank {src} within {timeout:.1f}s")
                self._cond.wait(left)
            return self._mail.pop(key)

    def run(self, fn: Callable[[Transport], T], timeout: float | None = None) -> list[T]:
        """Run ``fn(transport)`` once per rank, each in its own thread; return results by rank.

        The first exception raised by any rank aborts the fabric and is re-raised here (with the
        rank in the message) after all threads have stopped.
        """
        results: list[T | None] = [None] * self.world_size
        errors: list[tuple[int, BaseException]] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(self.transports[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append((rank, exc))
                self.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")

        threads = [
            threading.Thread(target=target, args=(rank,), name=f"noloco-rank{rank}", daemon=True)
            for rank in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            self.abort("LocalFabric.run timed out")
            raise CommTimeout(f"LocalFabric.run did not finish within {timeout}s")
        if errors:
            # Report the root cause: the first failure that is not a consequence of the abort.
            errors.sort(key=lambda item: isinstance(item[1], CommError))
            rank, exc = errors[0]
            raise exc
        return results  # type: ignore[return-value]


class LocalTransport(Transport):
    """One rank's view of a :class:`LocalFabric`."""

    def __init__(self, fabric: LocalFabric, rank: int):
        self.fabric = fabric
        self.rank = rank
        self.world_size = fabric.world_size
        self.counter = ByteCounter()
        self.carries_device = fabric.device_messages

    def send(self, dst: int, tag: str, payload: bytes | memoryview | DeviceMessage) -> None:
        self._check_peer(dst)
        if isinstance(payload, DeviceMessage):
            if not self.carries_device:
                raise CommError(f"rank {self.rank}: this fabric does not carry device messages")
        elif not isinstance(payload, bytes):
            payload = memoryview(payload).cast("B")  # handed over as it is (see the module docstring)
        self.fabric._deliver(self.rank, dst, tag, payload)
        self.counter.count_sent(len(payload))

    def recv(self, src: int, tag: str, timeout: float) -> bytes | memoryview | DeviceMessage:
        self._check_peer(src)
        payload = self.fabric._take(src, self.rank, tag, timeout)
        self.counter.count_received(len(payload))
        return payload
