"""The hivemind swarm transport: noloco's own bytes over libp2p streams, authenticated with a run key.

Implements the transport of the hivemind backend (docs/design.md §2, §5). One
:class:`SwarmEndpoint` per peer process owns a ``hivemind.P2P`` client (usually the replica of the
DHT's own p2pd daemon, :meth:`SwarmEndpoint.from_dht`) and an asyncio loop in a background thread. It
serves one raw libp2p stream protocol, ``/noloco/<run id>/2``; every message is one stream:

    prefix  16 B   magic b"NLC2", header length (u32), payload length (u64), big-endian
    header  ≤ 4 KiB canonical JSON: run, kind, round, group, src, dst, tag, nonce, send time
    hmac    32 B   HMAC-SHA256(run key, "noloco-header/2" ‖ prefix ‖ header)
    payload n B    sent in 64 KiB chunks; read chunk by chunk into a buffer that grows as bytes arrive
    mac     32 B   HMAC-SHA256(run key, prefix ‖ header ‖ payload)
    ← ack   1 B    0 = delivered, otherwise the rejection reason (below)

The header is authenticated, and checked against this peer's state (run, receiver, sender, replay,
open group, size budget), *before* a single payload byte is read: a process without the key costs a
receiver at most a 4 KiB header per stream, and only while it holds one of the few unauthenticated
stream slots (:data:`MAX_UNAUTH_PER_PEER` per remote peer, :data:`MAX_UNAUTH_STREAMS` in all), each
for at most ``header_timeout`` seconds. Nothing is ever allocated from a declared length: the payload
buffer grows with the bytes that actually arrive, a whole frame must arrive within the sender's own
deadline (``send_timeout``), and declared payloads in flight plus the inbox stay within
``max_buffered_bytes``.

Raw binary streams (``add_binary_stream_handler``) were chosen over hivemind's protobuf handlers
because the receiver must see the declared size *before* it buffers anything (protobuf handlers
read and parse a whole message first, up to the daemon's message limit), and because the MAC is
computed incrementally over the exact bytes on the wire, with no re-serialisation.

A message is delivered only if: the frame is well formed; it is for this run and this peer; the
claimed sender is the libp2p-authenticated remote peer; its payload is at most ``max_message_bytes``
and fits the bounded inbox; the MAC verifies; it was never seen before (nonce and MAC); and, for
data, its group is open here, the sender is a member, and that (group, sender, tag) has not been
delivered already. Anything else is *rejected and counted* in :attr:`SwarmEndpoint.rejected` by
reason (``malformed``, ``oversized``, ``unauthenticated``, ``replayed``, ``unexpected``,
``overflow``, ``throttled``: over a stream cap, ``stalled``: past a read deadline, and whatever a
service refuses, e.g. ``state_throttled``) and never reaches a caller. Log lines about rejections
are rate-limited (one per reason per :data:`LOG_EVERY_SECONDS`), so a flood cannot fill the log.
The run key lives in a :class:`RunKey`, whose ``repr`` is redacted; it is never logged.

:class:`SwarmTransport` is the group-local :class:`~noloco.comm.base.Transport` (ranks = index in
the group) that :mod:`noloco.swarm.matchmaking` hands to the outer optimizer. Failure modes: a
dead or unreachable peer makes ``send`` raise :class:`~noloco.comm.base.CommError` (stream open or
ack fails) and ``recv`` raise :class:`~noloco.comm.base.CommTimeout` after its timeout; a receiver
that rejects a message makes the sender's ``send`` raise ``CommError`` naming the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from noloco.comm.base import ByteCounter, CommError, CommTimeout, CommUnreachable, Transport

logger = logging.getLogger(__name__)

MAGIC = b"NLC2"
#: The stream protocol is ``/noloco/<run id>/<PROTOCOL_VERSION>`` (2: the header is authenticated on its own).
PROTOCOL_VERSION = 2
PREFIX = struct.Struct("!4sIQ")
MAC_BYTES = 32
HEADER_DOMAIN = b"noloco-header/2"
MAX_HEADER_BYTES = 4096
CHUNK_BYTES = 1 << 16
KINDS = ("data", "ctl", "rpc", "reply")
#: ack byte → reason; 0 means delivered.
REASONS = ("ok", "malformed", "oversized", "unauthenticated", "replayed", "unexpected", "overflow", "error",
           "throttled", "stalled")  # fmt: skip
MAX_CTL_BYTES = 4096
MAX_RPC_REQUEST_BYTES = 1 << 16
ACK_LINGER_SECONDS = 10.0
#: A stream refused before its header authenticated waits at most this long for the sender to close.
UNAUTH_LINGER_SECONDS = 2.0
#: Streams whose header has not authenticated yet: at most this many per remote peer, and in all from
#: remote peers not known to be of the run (known: listed in the authenticated registry or a ready list).
MAX_UNAUTH_PER_PEER = 4
MAX_UNAUTH_STREAMS = 32
MAX_KNOWN_PEERS = 4096
#: Authenticated streams being read at once from one remote peer (a key holder's streams).
MAX_AUTH_PER_PEER = 32
#: Seconds from a stream's start until its prefix, header and header MAC must have arrived.
HEADER_TIMEOUT = 10.0
LOG_EVERY_SECONDS = 5.0


class RunKey:
    """The run's shared secret. Its ``repr``/``str`` never show the key; use :meth:`mac`."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str | bytes):
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw) < 8:
            raise ValueError("the run key must be at least 8 bytes")
        self._secret = hashlib.sha256(b"noloco-run-key/1" + raw).digest()

    def new_mac(self) -> hmac.HMAC:
        return hmac.new(self._secret, digestmod=hashlib.sha256)

    def mac(self, *parts: bytes) -> bytes:
        h = self.new_mac()
        for part in parts:
            h.update(part)
        return h.digest()

    def __repr__(self) -> str:
        return "RunKey(<redacted>)"

    __str__ = __repr__

    def __reduce__(self):  # never pickled into a checkpoint or a child process by accident
        raise TypeError("RunKey cannot be pickled")


class Rejected(Exception):
    """A message was refused; ``reason`` is one of :data:`REASONS` (the ack byte).

    ``counter`` names the rejection count it adds to (default: ``reason``), e.g. a state request over its
    rate limit is acked ``throttled`` and counted as ``state_throttled``.
    """

    def __init__(self, reason: str, detail: str = "", counter: str | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.counter = counter or reason


@dataclass(frozen=True)
class Header:
    """What a message is bound to. ``group`` is the matchmaking group id ("" outside groups)."""

    run: str
    kind: str
    round: int
    group: str
    src: str
    dst: str
    tag: str
    nonce: str
    sent_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Header:
        try:
            fields = json.loads(raw.decode())
            header = cls(**fields)
        except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:  # nested JSON: RecursionError
            raise Rejected("malformed", f"bad header: {exc}") from None
        types = dict(run=str, kind=str, round=int, group=str, src=str, dst=str, tag=str, nonce=str)
        if not all(isinstance(getattr(header, k), t) for k, t in types.items()) or not isinstance(
            header.sent_at, (int, float)
        ):
            raise Rejected("malformed", "header field of the wrong type")
        if header.kind not in KINDS:
            raise Rejected("malformed", f"unknown kind {header.kind!r}")
        return header


def encode_frame(key: RunKey, header: Header, payload: bytes) -> bytes:
    """The wire bytes of one message (prefix, header, header MAC, payload, MAC). Pure; used by tests too."""
    raw = header.to_bytes()
    prefix = PREFIX.pack(MAGIC, len(raw), len(payload))
    return prefix + raw + key.mac(HEADER_DOMAIN, prefix, raw) + bytes(payload) + key.mac(prefix, raw, payload)


class _Reader:
    """``readexactly`` with an idle timeout per read and an overall deadline; failures become :class:`Rejected`."""

    def __init__(self, reader: asyncio.StreamReader, idle_timeout: float, deadline: float):
        self.reader, self.idle_timeout, self.deadline = reader, idle_timeout, deadline

    async def exactly(self, n: int) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Rejected("stalled", "frame not received within its deadline")
        try:
            return await asyncio.wait_for(self.reader.readexactly(n), min(self.idle_timeout, left))
        except asyncio.IncompleteReadError:
            raise Rejected("malformed", "truncated frame") from None
        except asyncio.TimeoutError:
            raise Rejected("stalled", "stalled frame") from None


async def read_header(reader: _Reader, key: RunKey, max_payload: int) -> tuple[bytes, bytes, Header, int]:
    """Read prefix, header and header MAC; ``(prefix, raw header, header, payload length)`` once authenticated.

    Nothing is buffered beyond the ≤ 4 KiB header, and the declared payload length is only checked, never
    allocated: a frame without the run key is refused here.
    """
    prefix = await reader.exactly(PREFIX.size)
    magic, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise Rejected("malformed", "bad magic")
    if header_len > MAX_HEADER_BYTES:
        raise Rejected("oversized", f"header of {header_len} bytes")
    if payload_len > max_payload:
        raise Rejected("oversized", f"payload of {payload_len} bytes > limit {max_payload}")
    raw = await reader.exactly(header_len)
    tag = await reader.exactly(MAC_BYTES)
    if not hmac.compare_digest(key.mac(HEADER_DOMAIN, prefix, raw), tag):
        raise Rejected("unauthenticated", "bad header MAC (wrong run key or altered bytes)")
    return prefix, raw, Header.from_bytes(raw), payload_len


async def read_payload(reader: _Reader, key: RunKey, prefix: bytes, raw: bytes, payload_len: int) -> bytes:
    """The payload of an authenticated header, read in chunks into a buffer that grows as they arrive."""
    mac = key.new_mac()
    mac.update(prefix)
    mac.update(raw)
    payload = bytearray()
    while len(payload) < payload_len:
        chunk = await reader.exactly(min(CHUNK_BYTES, payload_len - len(payload)))
        payload += chunk
        mac.update(chunk)
    tag = await reader.exactly(MAC_BYTES)
    if not hmac.compare_digest(mac.digest(), tag):
        raise Rejected("unauthenticated", "bad MAC (wrong run key or altered bytes)")
    return bytes(payload)


async def read_frame(
    reader: asyncio.StreamReader, key: RunKey, max_payload: int, idle_timeout: float = 30.0,
    timeout: float | None = None,
) -> tuple[Header, bytes]:  # fmt: skip
    """Read and authenticate one frame (header first, then the payload); raise :class:`Rejected`.

    ``idle_timeout`` bounds each read, ``timeout`` (default: none beyond the idle one) the whole frame.
    """
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    bounded = _Reader(reader, idle_timeout, deadline)
    prefix, raw, header, payload_len = await read_header(bounded, key, max_payload)
    return header, await read_payload(bounded, key, prefix, raw, payload_len)


class _LoopThread:
    """An asyncio event loop in a daemon thread; ``call`` runs a coroutine there and waits."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Awaitable, timeout: float | None):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class _OpenGroup:
    round: int
    members: tuple[str, ...]
    consumed: set


class SwarmEndpoint:
    """One peer's end of the swarm: serves the noloco stream protocol, sends frames, keeps inboxes.

    Args:
        p2p_factory: coroutine function returning a started ``hivemind.P2P`` (run in the endpoint's loop).
        run_id: the run's public name; bound into every message and into the protocol name.
        key: the run's shared secret.
        max_message_bytes: largest payload accepted (the sender refuses larger ones too).
        max_buffered_bytes: payload bytes waiting in the inbox plus those declared by frames being read;
            beyond it messages are refused (``overflow``) before their payload is read.
        send_timeout: seconds for opening a stream, writing a message and reading its ack; also the most
            a received frame may take to arrive in full.
        header_timeout: seconds a new stream has to deliver its authenticated header.
        max_unauth_per_peer, max_unauth_streams: streams not yet authenticated, per remote peer and in
            all (peers noted with :meth:`note_peers` are only held to ``max_auth_per_peer`` per peer);
            more are refused at once (``throttled``) without reading a byte.
        max_auth_per_peer: authenticated frames being read at once from one remote peer.
        identity: this peer's :class:`~noloco.swarm.identity.PeerIdentity` (the key of its libp2p id), which
            signs its DHT records (:attr:`identity`; ``None``: this endpoint cannot publish records).
    """

    def __init__(
        self,
        p2p_factory: Callable[[], Awaitable],
        run_id: str,
        key: RunKey,
        max_message_bytes: int = 1 << 28,
        max_buffered_bytes: int = 1 << 30,
        send_timeout: float = 120.0,
        header_timeout: float = HEADER_TIMEOUT,
        max_unauth_per_peer: int = MAX_UNAUTH_PER_PEER,
        max_unauth_streams: int = MAX_UNAUTH_STREAMS,
        max_auth_per_peer: int = MAX_AUTH_PER_PEER,
        identity=None,
    ):
        if not run_id or "/" in run_id:
            raise ValueError(f"run id must be a non-empty string without '/', got {run_id!r}")
        self.run_id, self.key = run_id, key
        self.protocol = f"/noloco/{run_id}/{PROTOCOL_VERSION}"
        self.max_message_bytes, self.max_buffered_bytes = int(max_message_bytes), int(max_buffered_bytes)
        self.send_timeout, self.header_timeout = float(send_timeout), float(header_timeout)
        self.max_unauth_per_peer, self.max_unauth_streams = int(max_unauth_per_peer), int(max_unauth_streams)
        self.max_auth_per_peer = int(max_auth_per_peer)
        self.identity = identity
        self.counter = ByteCounter()
        self.rejected: dict[str, int] = defaultdict(int)
        self.wire_bytes_sent = 0
        self._cond = threading.Condition()
        self._inbox: dict[tuple[str, str, str], bytes] = {}
        self._buffered = 0
        self._in_flight = 0  # declared payload bytes of authenticated frames being read
        self._unauth: dict[str, int] = defaultdict(int)  # loop thread only
        self._unknown_unauth = 0  # of those, from peers not noted as known
        self._known: OrderedDict[str, None] = OrderedDict()  # peer ids seen in authenticated records
        self._auth: dict[str, int] = defaultdict(int)  # loop thread only
        self.peak_unauth_streams = 0
        self._logged: dict[str, list] = {}  # reason -> [last log time, suppressed since]
        self._groups: dict[str, _OpenGroup] = {}
        self._ctl: OrderedDict[tuple[str, str, str], tuple[float, bytes]] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._services: dict[str, Callable[[bytes, str], bytes]] = {}
        self._service_limits: dict[str, tuple[int | None, str]] = {}  # name -> (most at once, counter)
        self._service_active: dict[str, int] = defaultdict(int)
        self._closed = False
        self._loop = _LoopThread(f"noloco-swarm-{run_id}")
        try:
            self.p2p = self._loop.call(p2p_factory(), 60)
            self.peer_id = self.p2p.peer_id.to_base58()
            if identity is not None and identity.peer_id != self.peer_id:
                raise ValueError(f"identity {identity.peer_id} is not this daemon's peer id {self.peer_id}")
            self._loop.call(self.p2p.add_binary_stream_handler(self.protocol, self._handle), 30)
        except BaseException:
            self._loop.stop()
            raise

    @classmethod
    def from_dht(cls, dht, run_id: str, key: RunKey, **kwargs) -> SwarmEndpoint:
        """An endpoint on the p2pd daemon of a running ``hivemind.DHT`` (one daemon per peer)."""
        return cls(dht.replicate_p2p, run_id, key, **kwargs)

    # ----------------------------------------------------------------------------- receiving
    def count_rejection(self, reason: str, detail: str, src: str) -> None:
        """Count (and log, without any secret, at most once per reason every few seconds) one refusal."""
        now = time.monotonic()
        with self._cond:
            self.rejected[reason] += 1
            last = self._logged.setdefault(reason, [float("-inf"), 0])
            if now - last[0] < LOG_EVERY_SECONDS:
                last[1] += 1
                return
            suppressed, last[0], last[1] = last[1], now, 0
        more = f"; {suppressed} more since the last line" if suppressed else ""
        logger.warning("swarm: rejected a message from %s: %s (%s%s)", src[:12], reason, detail, more)

    def _remember(self, nonce_key: bytes) -> bool:
        """True if never seen; bounded memory of the last 2**16 messages."""
        if nonce_key in self._seen:
            return False
        self._seen[nonce_key] = None
        if len(self._seen) > 1 << 16:
            self._seen.popitem(last=False)
        return True

    def note_peers(self, peer_ids) -> None:
        """Peer ids listed in authenticated records (registry, ready lists): their streams skip the global cap.

        For them the global unauthenticated-stream cap is lifted and the per-peer one is ``max_auth_per_peer``
        instead of ``max_unauth_per_peer``, so that a keyless outsider with many libp2p identities filling
        the global cap cannot delay the run's own peers (a key holder can list any id: it gains nothing it
        could not do with the key).
        """
        with self._cond:
            for peer in peer_ids:
                self._known[peer] = None
                self._known.move_to_end(peer)
            while len(self._known) > MAX_KNOWN_PEERS:
                self._known.popitem(last=False)

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = stream_info.peer_id.to_base58()
        known = remote in self._known
        per_peer = self.max_auth_per_peer if known else self.max_unauth_per_peer
        if self._unauth[remote] >= per_peer or (not known and self._unknown_unauth >= self.max_unauth_streams):
            # over a cap: refused without reading a byte, and the stream is dropped at once
            self.count_rejection("throttled", "too many unauthenticated streams", remote)
            with contextlib.suppress(Exception):
                writer.write(bytes([REASONS.index("throttled")]))
                await asyncio.wait_for(writer.drain(), 1.0)
            writer.close()
            return
        self._unauth[remote] += 1
        self._unknown_unauth += not known
        self.peak_unauth_streams = max(self.peak_unauth_streams, sum(self._unauth.values()))
        authenticated, reserved, service = False, 0, None
        status, reply = 0, None
        try:
            stream = _Reader(reader, self.header_timeout, time.monotonic() + self.header_timeout)
            prefix, raw, header, payload_len = await read_header(stream, self.key, self.max_message_bytes)
            # From here on the sender holds the run key: it leaves the unauthenticated slots.
            self._unauth[remote] -= 1
            self._unknown_unauth -= not known
            authenticated = True
            if self._auth[remote] >= self.max_auth_per_peer:
                raise Rejected("throttled", "too many concurrent frames from this peer")
            self._auth[remote] += 1
            try:
                reserved = self._admit(header, remote, payload_len)
                if header.kind == "rpc":
                    service = self._enter_service(header.tag)
                stream.idle_timeout = 30.0
                stream.deadline = time.monotonic() + self.send_timeout
                payload = await read_payload(stream, self.key, prefix, raw, payload_len)
                reply = await self._accept(header, payload)
            finally:
                self._auth[remote] -= 1
        except Rejected as exc:
            status = REASONS.index(exc.reason) if exc.reason in REASONS else REASONS.index("error")
            self.count_rejection(exc.counter, str(exc), remote)
        except Exception as exc:  # noqa: BLE001 - a bad stream must never take the endpoint down
            status = REASONS.index("error")
            self.count_rejection("malformed", f"{type(exc).__name__}: {exc}", remote)
        finally:
            if reserved:
                with self._cond:
                    self._in_flight -= reserved
        try:
            writer.write(bytes([status]))
            if reply is not None:
                writer.write(reply)
            await writer.drain()
            # Close only after the sender has read the ack and closed its end: closing first can make
            # the daemon reset the stream before the ack left, and the sender would see no ack.
            await asyncio.wait_for(reader.read(1), ACK_LINGER_SECONDS if authenticated else UNAUTH_LINGER_SECONDS)
        except Exception:  # noqa: BLE001 - the sender went away; nothing to tell it
            pass
        finally:
            if service is not None:
                with self._cond:
                    self._service_active[service] -= 1
            if not authenticated:
                self._unauth[remote] -= 1
                self._unknown_unauth -= not known
            for table in (self._unauth, self._auth):
                if table.get(remote) == 0:
                    del table[remote]
            writer.close()

    def _admit(self, header: Header, remote: str, payload_len: int) -> int:
        """Check an authenticated header before its payload is read; returns the payload bytes reserved."""
        if header.run != self.run_id or header.dst != self.peer_id:
            raise Rejected("unexpected", f"for run {header.run!r} / peer {header.dst[:12]}")
        if header.src != remote:
            raise Rejected("unauthenticated", "claimed sender is not the connected peer")
        with self._cond:
            if not self._remember(f"{header.src}/{header.nonce}".encode()):
                raise Rejected("replayed", f"nonce {header.nonce[:8]} seen before")
            if header.kind == "ctl" and payload_len > MAX_CTL_BYTES:
                raise Rejected("oversized", "control message too large")
            if header.kind == "rpc":
                if header.tag not in self._services:
                    raise Rejected("unexpected", f"rpc {header.tag!r}")
                if payload_len > MAX_RPC_REQUEST_BYTES:
                    raise Rejected("oversized", "request too large")
            if header.kind == "reply":
                raise Rejected("unexpected", "a reply outside a request")
            if header.kind == "data":
                self._check_data(header)
            if self._buffered + self._in_flight + payload_len > self.max_buffered_bytes:
                raise Rejected("overflow", f"inbox holds {self._buffered} bytes, {self._in_flight} in flight")
            self._in_flight += payload_len
        return payload_len

    def _enter_service(self, name: str) -> str:
        """Take one of service ``name``'s reply slots (held until its reply has been sent) or refuse."""
        limit, counter = self._service_limits.get(name, (None, "throttled"))
        with self._cond:
            if limit is not None and self._service_active[name] >= limit:
                raise Rejected("throttled", f"{self._service_active[name]} {name} replies in progress", counter)
            self._service_active[name] += 1
        return name

    async def _accept(self, header: Header, payload: bytes) -> bytes | None:
        """Deliver an authenticated frame whose header :meth:`_admit` accepted."""
        with self._cond:
            if header.kind == "data":
                self._accept_data(header, payload)
                return None
            if header.kind == "ctl":
                self._ctl[(header.group, header.src, header.tag)] = (time.monotonic(), payload)
                while len(self._ctl) > 1024:
                    self._ctl.popitem(last=False)
                self._cond.notify_all()
                return None
            service = self._services[header.tag]  # rpc: checked in _admit
        loop = asyncio.get_running_loop()
        try:
            response = await loop.run_in_executor(None, service, payload, header.src)
        except Rejected:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. no state to serve yet
            raise Rejected("error", f"service {header.tag!r} failed: {exc}", counter="service_error") from None
        self.counter.count_received(len(payload))
        reply = Header(self.run_id, "reply", header.round, "", self.peer_id, header.src, header.nonce,
                       secrets.token_hex(16), time.time())  # fmt: skip
        self.counter.count_sent(len(response))
        return encode_frame(self.key, reply, response)

    def _check_data(self, header: Header) -> None:  # holds self._cond
        group = self._groups.get(header.group)
        if group is None or header.src not in group.members or header.round != group.round:
            raise Rejected("unexpected", f"no open group {header.group[:12]} with that sender/round")
        slot = (header.group, header.src, header.tag)
        if slot in self._inbox or (header.src, header.tag) in group.consumed:
            raise Rejected("replayed", f"tag {header.tag!r} already delivered")

    def _accept_data(self, header: Header, payload: bytes) -> None:  # holds self._cond
        self._check_data(header)  # again: the group may have closed while the payload arrived
        self._inbox[(header.group, header.src, header.tag)] = payload
        self._buffered += len(payload)
        self._cond.notify_all()

    # ----------------------------------------------------------------------------- groups
    def open_group(self, group_id: str, round_index: int, members: list[str]) -> SwarmTransport:
        """Start accepting data for ``group_id`` from ``members``; returns this member's transport."""
        if self.peer_id not in members:
            raise ValueError("this peer is not a member of the group it opens")
        with self._cond:
            self._groups[group_id] = _OpenGroup(round_index, tuple(members), set())
        return SwarmTransport(self, group_id, round_index, list(members))

    def close_group(self, group_id: str) -> None:
        """Stop accepting data for ``group_id`` and drop whatever of it was not received."""
        with self._cond:
            self._groups.pop(group_id, None)
            for slot in [s for s in self._inbox if s[0] == group_id]:
                self._buffered -= len(self._inbox.pop(slot))
            for slot in [s for s in self._ctl if s[0] == group_id]:
                del self._ctl[slot]

    def take(self, group_id: str, src: str, tag: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        slot = (group_id, src, tag)
        with self._cond:
            while slot not in self._inbox:
                if self._closed:
                    raise CommError("swarm endpoint closed")
                if group_id not in self._groups:
                    raise CommError(f"group {group_id[:12]} is not open")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"no message {tag!r} from {src[:12]} within {timeout:.1f}s")
                self._cond.wait(left)
            payload = self._inbox.pop(slot)
            self._buffered -= len(payload)
            self._groups[group_id].consumed.add((src, tag))
        self.counter.count_received(len(payload))
        return payload

    def delivered_from(self, group_id: str) -> set[str]:
        """Members of open group ``group_id`` whose data this peer received (taken or waiting in the inbox)."""
        with self._cond:
            group = self._groups.get(group_id)
            taken = {src for src, _ in group.consumed} if group is not None else set()
            return taken | {src for (gid, src, _) in self._inbox if gid == group_id}

    def control_tags(self, group_id: str, src: str) -> list[str]:
        """Tags of the control messages from ``src`` under ``group_id`` waiting to be taken."""
        with self._cond:
            return [tag for (group, sender, tag) in self._ctl if group == group_id and sender == src]

    def control_payloads(self, group_id: str, src: str) -> list[bytes]:
        """Payloads of the control messages from ``src`` under ``group_id`` waiting to be taken (not taken)."""
        with self._cond:
            return [payload for (group, sender, _), (_, payload) in self._ctl.items() if group == group_id
                    and sender == src]  # fmt: skip

    def control_from(self, group_id: str, tag: str) -> list[tuple[str, bytes]]:
        """``(sender, payload)`` of every control message ``tag`` under ``group_id`` waiting to be taken (not taken)."""
        with self._cond:
            return [(sender, payload) for (group, sender, t), (_, payload) in self._ctl.items()
                    if group == group_id and t == tag]  # fmt: skip

    def wait_control(self, group_id: str, tag: str, known: int, timeout: float) -> None:
        """Return once more than ``known`` control messages ``tag`` under ``group_id`` wait to be taken, or after
        ``timeout`` seconds (or at once if the endpoint is closed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for (group, _, t) in self._ctl if group == group_id and t == tag) <= known:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return
                self._cond.wait(left)

    def take_control(self, group_id: str, src: str, tag: str, timeout: float) -> bytes | None:
        """A control message (e.g. a membership confirmation) or ``None`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        slot = (group_id, src, tag)
        with self._cond:
            while slot not in self._ctl:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(left)
            return self._ctl.pop(slot)[1]

    # ----------------------------------------------------------------------------- sending
    def _header(self, kind: str, round_index: int, group: str, dst: str, tag: str) -> Header:
        return Header(self.run_id, kind, int(round_index), group, self.peer_id, dst, tag, secrets.token_hex(16),
                      time.time())  # fmt: skip

    async def _exchange(self, dst: str, frame: bytes, max_reply: int) -> tuple[int, bytes | None]:
        from hivemind.p2p import PeerID

        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(dst), self.protocol)
        try:
            view = memoryview(frame)
            for offset in range(0, len(frame), CHUNK_BYTES * 16):
                writer.write(view[offset : offset + CHUNK_BYTES * 16])
                await writer.drain()
            status = (await reader.readexactly(1))[0]
            if status != 0 or max_reply <= 0:
                return status, None
            header, payload = await read_frame(reader, self.key, max_reply)
            return status, (header, payload)
        finally:
            writer.close()

    def send_frame(self, kind: str, round_index: int, group: str, dst: str, tag: str, payload: bytes,
                   timeout: float | None = None, max_reply: int = 0):  # fmt: skip
        """Send one message and wait for the receiver's ack; raise CommError if it was refused or failed."""
        if self._closed:
            raise CommError("swarm endpoint closed")
        if len(payload) > self.max_message_bytes:
            raise CommError(f"message of {len(payload)} bytes exceeds max_message_bytes={self.max_message_bytes}")
        header = self._header(kind, round_index, group, dst, tag)
        frame = encode_frame(self.key, header, payload)
        timeout = self.send_timeout if timeout is None else timeout
        status, reply = self._call(dst, frame, max_reply, timeout, f"sending {tag!r} to {dst[:12]}")
        if status != 0:
            reason = REASONS[status] if status < len(REASONS) else f"status {status}"
            raise CommError(f"{dst[:12]} refused {kind} {tag!r}: {reason}")
        self.wire_bytes_sent += len(frame)
        if kind == "data":
            self.counter.count_sent(len(payload))
        return reply

    def _call(self, dst: str, frame: bytes, max_reply: int, timeout: float, what: str):
        """One frame to ``dst`` and its reply ``(status, reply)``; failures become CommTimeout/CommError
        (CommUnreachable where the daemon could not reach ``dst`` at all)."""
        try:
            return self._loop.call(self._exchange(dst, frame, max_reply), timeout)
        except TimeoutError:
            raise CommTimeout(f"{what} took longer than {timeout:.1f}s") from None
        except Rejected as exc:
            self.count_rejection(exc.reason, f"reply: {exc}", dst)
            raise CommError(f"reply from {dst[:12]} refused: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - p2pd errors of every kind mean "peer unreachable"
            raise CommUnreachable(f"{what} failed: {type(exc).__name__}: {exc}") from None

    def send_control(self, group: str, round_index: int, dst: str, tag: str, payload: bytes, timeout: float):
        self.send_frame("ctl", round_index, group, dst, tag, payload, timeout)

    def post_control(self, group: str, round_index: int, dst: str, tag: str, payload: bytes, timeout: float) -> None:
        """:meth:`send_control` without waiting: the message goes out in the background, failures are ignored."""
        if self._closed or len(payload) > MAX_CTL_BYTES:
            return
        frame = encode_frame(self.key, self._header("ctl", round_index, group, dst, tag), payload)

        async def post() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._exchange(dst, frame, 0), timeout)

        asyncio.run_coroutine_threadsafe(post(), self._loop.loop)

    # ----------------------------------------------------------------------------- request/response
    def serve(self, name: str, handler: Callable[[bytes, str], bytes], max_concurrent: int | None = None,
              throttled_counter: str = "throttled") -> None:  # fmt: skip
        """Answer authenticated requests ``name`` with ``handler(request, sender_peer_id) -> response``.

        At most ``max_concurrent`` requests are handled and answered at once (until each reply has been
        sent); more are refused (``throttled``) and counted as ``throttled_counter``. A handler refuses a
        request by raising :class:`Rejected`.
        """
        with self._cond:
            self._services[name] = handler
            self._service_limits[name] = (max_concurrent, throttled_counter)

    def request(self, dst: str, name: str, payload: bytes, timeout: float, max_reply_bytes: int) -> bytes:
        """Call ``dst``'s service ``name``; the reply is authenticated and bound to this request's nonce."""
        header = self._header("rpc", 0, "", dst, name)
        frame = encode_frame(self.key, header, payload)
        status, reply = self._call(dst, frame, max_reply_bytes, timeout, f"request {name!r} to {dst[:12]}")
        if status != 0:
            raise CommError(f"{dst[:12]} refused request {name!r}: {REASONS[min(status, len(REASONS) - 1)]}")
        reply_header, body = reply
        if (reply_header.kind, reply_header.src, reply_header.dst, reply_header.tag, reply_header.run) != (
            "reply", dst, self.peer_id, header.nonce, self.run_id,
        ):  # fmt: skip
            self.count_rejection("unexpected", "reply not bound to this request", dst)
            raise CommError(f"reply from {dst[:12]} is not bound to this request")
        self.counter.count_sent(len(payload))
        self.counter.count_received(len(body))
        return body

    # ----------------------------------------------------------------------------- misc
    def visible_maddrs(self) -> list[str]:
        return [str(a) for a in self._loop.call(self.p2p.get_visible_maddrs(), 30)]

    def connected_peers(self) -> list[str]:
        """Peer ids this peer's daemon holds a connection to (diagnostics)."""
        return [info.peer_id.to_base58() for info in self._loop.call(self.p2p.list_peers(), 10)]

    def rejection_counts(self) -> dict[str, int]:
        with self._cond:
            return dict(self.rejected)

    def close(self) -> None:
        """Stop serving; pending ``take`` calls raise CommError. Does not stop the DHT's daemon."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._loop.call(self._shutdown(), 10)
        except Exception:  # noqa: BLE001 - the daemon may already be gone
            pass
        self._loop.stop()

    async def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.p2p.remove_binary_stream_handler(self.protocol), 3)
        with contextlib.suppress(Exception):
            await self.p2p.shutdown()  # a DHT replica only closes its client; an owned daemon stops
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SwarmTransport(Transport):
    """A group-local transport over a :class:`SwarmEndpoint`: rank = index in ``members``.

    Every payload is bound to (run, round, group id, sender, receiver, tag) and authenticated.
    ``counter`` is the endpoint's (all bytes this peer moved for exchanges). :attr:`waited_on` holds the
    members a ``recv`` timed out waiting for, :attr:`refused_by` those a ``send`` to failed (refused,
    unreachable); matchmaking strikes those of them that delivered no data at all. :attr:`last_from` is the
    member whose payload ``recv`` returned last: a payload that then fails to decode or validate is its.
    """

    def __init__(self, endpoint: SwarmEndpoint, group_id: str, round_index: int, members: list[str]):
        self.endpoint, self.group_id, self.round = endpoint, group_id, round_index
        self.members = list(members)
        self.rank = self.members.index(endpoint.peer_id)
        self.world_size = len(self.members)
        self.counter = endpoint.counter
        self.waited_on: set[str] = set()
        self.refused_by: set[str] = set()
        self.last_from: str | None = None  # the member whose payload recv returned last (what is being decoded)

    def send(self, dst: int, tag: str, payload: bytes) -> None:
        self._check_peer(dst)
        try:
            self.endpoint.send_frame("data", self.round, self.group_id, self.members[dst], tag, bytes(payload))
        except CommError:
            self.refused_by.add(self.members[dst])
            raise

    def recv(self, src: int, tag: str, timeout: float) -> bytes:
        self._check_peer(src)
        self.last_from = None
        try:
            payload = self.endpoint.take(self.group_id, self.members[src], tag, timeout)
            self.last_from = self.members[src]
            return payload
        except CommTimeout:
            self.waited_on.add(self.members[src])
            raise

    def close(self) -> None:
        self.endpoint.close_group(self.group_id)


def run_key_from(value: str | None, env: str = "NOLOCO_RUN_KEY") -> RunKey:
    """The run key from a config value or, if empty, the environment; a clear error if neither is set."""
    secret = value or os.environ.get(env)
    if not secret:
        raise ValueError(f"the hivemind backend needs a shared run key: set peer.run_key or the {env} variable")
    return RunKey(secret)
