"""A :class:`~noloco.comm.base.Transport` over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

torch.distributed moves fixed-size tensors between ranks; this transport moves variable-size, tagged
byte payloads with the semantics of the in-process fabric (docs/design.md §5): ``send`` does not wait for
the receiver, ``recv(src, tag, timeout)`` returns the payload ``src`` sent under ``tag`` or raises
:class:`~noloco.comm.base.CommTimeout`, and every payload byte is counted.

Framing: every payload travels as two P2P messages: a frame header (4 int64: magic, tag length, payload
length, body slot) on one channel (a torch.distributed tag), then one uint8 tensor holding the UTF-8 tag
followed by the payload, on the body's own slot (:func:`body_slot`: a torch.distributed tag computed from
the message's tag and size). One receiver thread per peer keeps a frame receive posted at all times and
files complete messages into mailboxes keyed by ``(src, tag)``; ``recv`` waits on the mailbox, so a
timeout never leaves a half-read frame behind and messages may be received in any tag order.

Receives posted ahead (:meth:`TorchDistTransport.expect`): gloo sends a body only once the receiver has
posted its receive, and tells the sender so over the same TCP connection. A body receive posted when its
frame arrives sends that notice behind whatever this rank is itself sending to the peer, so when two ranks
send each other a large payload at once, one waits for the other's bytes to drain: the directions take
turns. A caller that knows what it will receive (a reduction: every message's tag and size) says so
first; the body's receive is then posted at once, on the slot the sender will use, and both directions
run at the same time. A message that was not announced, or differs in size from the announcement, takes
the ordinary path; an announcement whose message already arrived posts nothing. A peer
whose connection breaks (its process died) is marked lost: pending and later ``recv`` from it raise
:class:`CommTimeout` at once. :meth:`close` sends a close frame to every peer and waits for theirs, so
that ``destroy_process_group`` afterwards finds no receive pending.

Use a dedicated process group (``dist.new_group(backend="gloo")``) when the default group is also
used for collectives (e.g. by DDP), so the always-posted receives never interleave with them.
NCCL: frames are staged through CUDA tensors of ``device``; this path is written but has not been run
(no GPU was available when it was written).

Latency: with ``latency=D`` (or the ``NOLOCO_LINK_LATENCY`` environment variable, in seconds, which
``noloco-fleet --latency`` sets) every message leaves ``D`` seconds after ``send`` was called, from a
per-destination thread that keeps the order of messages; ``send`` still returns at once. This is
one-way latency per *message*, added in user space because the kernel here has no netem: TCP's own
round trips (handshake, ACK clocking) are not delayed, so a window-limited transfer over a long
link is not modelled. A delayed send that fails marks the link to that peer lost.

:func:`launch_local` starts N local processes joined over gloo on loopback (tests, benchmarks).
"""

from __future__ import annotations

import collections
import io
import os
import socket
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from noloco.comm.base import ByteCounter, CommError, CommTimeout, Transport

_MAGIC = 0x4E4C4F43  # "NLOC"
_CLOSE = -1
_CHANNEL = 7  # the torch.distributed tag all frames travel on
_MAX_TAG = 4096
_FRAME = 4  # int64 values of a frame: magic, tag length, payload length, body slot
_FIRST_SLOT = 16  # body slots are torch.distributed tags in [_FIRST_SLOT, 2**31 - 1]: never the frame channel
_MAX_AHEAD = 64  # receives posted ahead per peer and not yet used (each holds its message's buffer)
_ARRIVALS = 4096  # per peer, how many frames that found no receive posted ahead are remembered


def body_slot(tag: str, nbytes: int) -> int:
    """The torch.distributed tag a message body of ``nbytes`` bytes (tag and payload) sent under ``tag`` travels
    on: both ends compute it from the frame's contents, so a receiver can post the receive before the frame.
    Two messages of one sender share a slot only when their CRC-32s of ``"<nbytes>:<tag>"`` collide modulo
    2^31 − 16; gloo then fills the receive posted first, and the bodies' own tags keep them apart."""
    return _FIRST_SLOT + zlib.crc32(f"{nbytes}:{tag}".encode()) % (2**31 - _FIRST_SLOT)


class TorchDistTransport(Transport):
    """This rank's transport over a torch.distributed process group.

    Args:
        group: the process group (default: the world). Ranks of this transport are ranks *in the group*.
        device: where frames are staged; default ``cuda`` for NCCL, ``cpu`` otherwise.
        max_payload: frames declaring a larger payload are treated as a broken peer (bounds memory).
        latency: one-way seconds added to every message (default: ``NOLOCO_LINK_LATENCY`` or 0).
    """

    def __init__(
        self,
        group: Any = None,
        device: torch.device | str | None = None,
        max_payload: int = 1 << 34,
        latency: float | None = None,
    ):
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialized (call dist.init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        if device is None:
            device = "cuda" if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.max_payload = int(max_payload)
        self.counter = ByteCounter()
        self._mail: dict[tuple[int, str], bytes] = {}
        self._lost: dict[int, str] = {}
        self._closed_peers: set[int] = set()
        self._cond = threading.Condition()
        self._send_locks = {peer: threading.Lock() for peer in range(self.world_size)}
        self._pending_lock = threading.Lock()
        self._pending_sends: list[Any] = []
        self._closed = False
        if latency is None:
            latency = float(os.environ.get("NOLOCO_LINK_LATENCY", "0") or 0)
        if not latency >= 0:
            raise CommError(f"latency must be >= 0 seconds, got {latency}")
        self.latency = float(latency)
        self.wait_seconds = 0.0  # time spent blocked in recv: waiting on the network (or on slower peers)
        self.early_receives = 0  # bodies that landed in a receive posted ahead (expect)
        self._ahead: dict[tuple[int, int], collections.deque] = {}  # (peer, slot) -> receives posted ahead
        self._ahead_count: dict[int, int] = collections.Counter()
        self._arrived: dict[int, collections.OrderedDict] = {}  # peer -> slot -> frames with no receive ahead
        self._delayed: dict[int, collections.deque] = {}
        self._delay_threads: dict[int, threading.Thread] = {}
        self._threads = [
            threading.Thread(target=self._receive_loop, args=(peer,), name=f"noloco-tdrecv{peer}", daemon=True)
            for peer in range(self.world_size)
            if peer != self.rank
        ]
        for thread in self._threads:
            thread.start()

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    # ---- receiving -------------------------------------------------------------------------------------
    def _receive_loop(self, peer: int) -> None:
        src = self._global(peer)
        try:
            while True:
                frame = torch.empty(_FRAME, dtype=torch.int64, device=self.device)
                dist.irecv(frame, src=src, group=self.group, tag=_CHANNEL).wait()
                magic, tag_len, size, slot = (int(v) for v in frame.cpu())
                if magic != _MAGIC:
                    raise CommError(f"bad frame magic {magic:#x} from rank {peer}")
                if tag_len == _CLOSE:
                    with self._cond:
                        self._closed_peers.add(peer)
                        self._cond.notify_all()
                    return
                if not (0 < tag_len <= _MAX_TAG and 0 <= size <= self.max_payload and _FIRST_SLOT <= slot < 2**31):
                    raise CommError(f"bad frame from rank {peer}: tag {tag_len} bytes, payload {size} bytes, "
                                    f"slot {slot}")  # fmt: skip
                body, work = self._body_receive(peer, src, slot, tag_len + size)
                work.wait()
                raw = memoryview(body[: tag_len + size].cpu().numpy())
                tag = bytes(raw[:tag_len]).decode("utf-8")
                with self._cond:
                    key = (peer, tag)
                    if key in self._mail:
                        raise CommError(f"rank {peer} sent tag {tag!r} twice before it was received")
                    self._mail[key] = bytearray(raw[tag_len:])  # one copy; writable, so decoding reads it in place
                    self._cond.notify_all()
        except Exception as exc:  # noqa: BLE001 - the peer's link is gone; recv reports it
            with self._cond:
                if not self._closed:
                    self._lost[peer] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                self._cond.notify_all()

    def _body_receive(self, peer: int, src: int, slot: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        """The receive of the body a frame announced: the first one posted ahead on its slot, else a new one."""
        with self._cond:
            ahead = self._ahead.get((peer, slot))
            if ahead:
                body, work = ahead.popleft()
                if not ahead:
                    del self._ahead[(peer, slot)]
                self._ahead_count[peer] -= 1
                if body.numel() < nbytes:  # gloo refuses a larger body than the buffer posted for it
                    raise CommError(f"rank {peer} sent {nbytes} bytes on slot {slot}, where a receive of "
                                    f"{body.numel()} bytes was posted ahead")  # fmt: skip
                self.early_receives += 1
                return body, work
            arrived = self._arrived.setdefault(peer, collections.OrderedDict())
            arrived[slot] = arrived.pop(slot, 0) + 1  # an announcement of this body now posts nothing
            while len(arrived) > _ARRIVALS:
                arrived.popitem(last=False)
            body = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return body, dist.irecv(body, src=src, group=self.group, tag=slot)

    def expect(self, src: int, tag: str, nbytes: int) -> None:
        """Post now the receive of the message rank ``src`` will send under ``tag`` with a payload of ``nbytes``
        bytes (module docstring: receives posted ahead). Nothing is posted if that message's frame has already
        arrived, if ``_MAX_AHEAD`` receives posted ahead for ``src`` are still unused, or if the link is closed
        or lost (a link gloo finds closed while posting is marked lost); a message of another size takes the
        ordinary path. Gloo only: NCCL matches receives by order, not by tag, so a receive posted before its
        frame's would take the frame."""
        self._check_peer(src)
        if self.backend != "gloo":
            return
        tag_bytes = tag.encode("utf-8")
        if not 0 < len(tag_bytes) <= _MAX_TAG or not 0 <= nbytes <= self.max_payload:
            return
        total = len(tag_bytes) + int(nbytes)
        slot = body_slot(tag, total)
        with self._cond:
            if self._closed or src in self._lost or src in self._closed_peers or (src, tag) in self._mail:
                return
            arrived = self._arrived.get(src)
            if arrived and slot in arrived:
                if arrived[slot] > 1:
                    arrived[slot] -= 1
                else:
                    del arrived[slot]
                return
            if self._ahead_count[src] >= _MAX_AHEAD:
                return
            body = torch.empty(total, dtype=torch.uint8, device=self.device)
            try:
                work = dist.irecv(body, src=self._global(src), group=self.group, tag=slot)
            except Exception as exc:  # noqa: BLE001 - the link closed before the receive was posted: recv reports it
                self._lost.setdefault(src, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                self._cond.notify_all()
                return
            self._ahead.setdefault((src, slot), collections.deque()).append((body, work))
            self._ahead_count[src] += 1

    def recv(self, src: int, tag: str, timeout: float) -> bytes:
        self._check_peer(src)
        started = time.monotonic()
        deadline = started + timeout
        key = (src, tag)
        try:
            with self._cond:
                while key not in self._mail:
                    if src in self._lost:
                        raise CommTimeout(
                            f"rank {self.rank}: link to rank {src} lost ({self._lost[src]}) while waiting for {tag!r}"
                        )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommTimeout(f"rank {self.rank}: no message {tag!r} from rank {src} within {timeout:.1f}s")
                    self._cond.wait(left)
                payload = self._mail.pop(key)
        finally:
            self.wait_seconds += time.monotonic() - started
        self.counter.count_received(len(payload))
        return payload

    # ---- sending ---------------------------------------------------------------------------------------
    def _post(self, dst: int, tensors: list[tuple[torch.Tensor, int]]) -> None:
        """Send each ``(tensor, torch.distributed tag)`` to ``dst``, in order."""
        with self._send_locks[dst]:
            works = [dist.isend(tensor, dst=self._global(dst), group=self.group, tag=slot) for tensor, slot in tensors]
        with self._pending_lock:  # delay threads post too: one list, changed under one lock
            self._pending_sends = [w for w in self._pending_sends if not w.is_completed()] + works

    def send(self, dst: int, tag: str, payload: bytes) -> None:
        self._check_peer(dst)
        if self._closed:
            raise CommError(f"rank {self.rank}: transport is closed")
        if dst in self._lost:
            raise CommError(f"rank {self.rank}: link to rank {dst} lost ({self._lost[dst]})")
        tag_bytes = tag.encode("utf-8")
        if not 0 < len(tag_bytes) <= _MAX_TAG:
            raise CommError(f"tag must be 1..{_MAX_TAG} UTF-8 bytes, got {len(tag_bytes)}")
        size = memoryview(payload).nbytes
        slot = body_slot(tag, len(tag_bytes) + size)
        frame = torch.tensor([_MAGIC, len(tag_bytes), size, slot], dtype=torch.int64)
        body = torch.empty(len(tag_bytes) + size, dtype=torch.uint8)
        view = memoryview(body.numpy())
        view[: len(tag_bytes)], view[len(tag_bytes) :] = tag_bytes, memoryview(payload).cast("B")  # one copy
        tensors = [(frame.to(self.device), _CHANNEL), (body.to(self.device), slot)]
        if self.latency > 0:
            self._post_later(dst, tensors)
        else:
            try:
                self._post(dst, tensors)
            except Exception as exc:  # noqa: BLE001 - gloo/NCCL errors become CommError
                raise CommError(f"rank {self.rank}: send to rank {dst} failed: {exc}") from exc
        self.counter.count_sent(size)

    def _post_later(self, dst: int, tensors: list[tuple[torch.Tensor, int]]) -> None:
        """Queue ``tensors`` for ``dst``; its delay thread posts them ``latency`` seconds from now, in order."""
        with self._cond:
            queue = self._delayed.setdefault(dst, collections.deque())
            queue.append((time.monotonic() + self.latency, tensors))
            if dst not in self._delay_threads:
                thread = threading.Thread(
                    target=self._delay_loop, args=(dst,), name=f"noloco-tddelay{dst}", daemon=True
                )
                self._delay_threads[dst] = thread
                thread.start()
            self._cond.notify_all()

    def _delay_loop(self, dst: int) -> None:
        queue = self._delayed[dst]
        while True:
            with self._cond:
                while not queue and not self._closed:
                    self._cond.wait()
                if not queue:
                    return
                due, tensors = queue[0]
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                self._post(dst, tensors)
            except Exception as exc:  # noqa: BLE001 - nobody waits on this send: the link is lost
                with self._cond:
                    self._lost.setdefault(dst, f"delayed send failed: {exc}".splitlines()[0][:300])
                    queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                queue.popleft()
                self._cond.notify_all()

    def _flush_delayed(self, deadline: float) -> None:
        """Wait (until ``deadline``) for delayed messages to be posted."""
        with self._cond:
            while any(self._delayed.values()) and time.monotonic() < deadline:
                self._cond.wait(max(0.01, deadline - time.monotonic()))

    def close(self, timeout: float = 10.0) -> None:
        """Tell every peer we are done, wait (up to ``timeout``) for theirs and for our sends."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        self._flush_delayed(deadline)
        close = torch.tensor([_MAGIC, _CLOSE, 0, 0], dtype=torch.int64)
        for peer in range(self.world_size):
            if peer != self.rank and peer not in self._lost:
                try:
                    self._post(peer, [(close.to(self.device), _CHANNEL)])
                except Exception:  # noqa: BLE001 - peer already gone
                    pass
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # delay threads exit
        # no thread of ours may still be inside gloo when the process group is destroyed (that aborts the
        # process: "terminate called without an active exception")
        for thread in list(self._delay_threads.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._pending_lock:
            pending, self._pending_sends = self._pending_sends, []
        for work in pending:
            try:
                work.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch_target(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any, threads: int) -> None:
    torch.set_num_threads(threads)
    transport = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        transport = TorchDistTransport(dist.new_group(backend="gloo"))
        # serialized here: tensors put on a torch.multiprocessing queue live in this process's shared
        # memory, which is gone once it exits, possibly before the parent reads them
        buffer = io.BytesIO()
        torch.save(fn(transport, *args), buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if transport is not None:
            transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_local(
    fn: Callable, world: int, *args: Any, timeout: float = 120.0, threads: int = 1, missing_ok: bool = False
) -> list[Any]:
    """Run ``fn(transport, *args)`` in ``world`` spawned processes joined over gloo on loopback.

    ``fn`` must be importable (a module-level function) and return something picklable. Returns the
    results by rank; raises ``RuntimeError`` with the remote traceback if any rank failed or did not
    report within ``timeout`` seconds. With ``missing_ok`` a rank whose process exited without
    reporting (a simulated crash) gets ``None``. Every process is terminated in ``finally``.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_launch_target, args=(rank, world, port, fn, args, queue, threads), daemon=True)
        for rank in range(world)
    ]
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"launch_local: only {len(results)} of {world} ranks reported within {timeout}s")
            try:
                rank, ok, value = queue.get(timeout=min(left, 1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: check for crashed processes
                if not any(p.is_alive() for p in procs) and queue.empty():
                    if missing_ok:
                        break
                    raise RuntimeError(f"launch_local: processes exited with {[p.exitcode for p in procs]}") from None
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank}: {value}")
        if failures:
            raise RuntimeError("launch_local: " + "\n".join(failures))
        return [results.get(rank) for rank in range(world)]
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        queue.close()
