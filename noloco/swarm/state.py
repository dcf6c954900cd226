"""Late-join state: what a live peer serves so that a new peer starts where the swarm is.

A peer's live state is its inner step, its slow weights and its outer momentum (flat fp32 tensors;
fresh AdamW moments are fine for a joiner). :func:`encode_state` packs them losslessly (zlib) and
:func:`decode_state` checks everything a hostile server could get wrong before anything is adopted:
sizes against this model, exact decompressed lengths (a bounded inflate: no zip bombs), finite
values, a step on an outer-round boundary. :class:`StateServer` answers the ``state/1`` requests of
:class:`~noloco.swarm.endpoint.SwarmEndpoint` from the latest snapshot, encoded once per snapshot,
and rate-limited: at most ``burst`` (2) full states per requester every ``interval`` seconds (a
joiner whose first download timed out may retry once), and, through
:meth:`StateServer.register`, :data:`STATE_CONCURRENCY` being encoded or sent at once); other
requests are refused (``throttled``) and counted as ``state_throttled``, so a key holder flooding
requests gets two states every ``interval`` seconds and costs the server nothing more than the
refusals. This module knows tensors, not algorithms: the training side hands it (step, slow,
velocity).
"""

from __future__ import annotations

import struct
import threading
import time
import zlib

import torch

from noloco.comm.base import CommError
from noloco.swarm.endpoint import Rejected

STATE_SERVICE = "state/1"
STATE_HEADER = struct.Struct("!QQB")  # inner step, numel, has velocity
#: At most STATE_BURST full states per requester within STATE_INTERVAL_SECONDS; states being served at once.
STATE_INTERVAL_SECONDS = 30.0
STATE_BURST = 2
STATE_CONCURRENCY = 2


class StateError(ValueError):
    """A downloaded peer state is malformed, of the wrong size or not finite."""


def encode_state(step: int, slow: torch.Tensor, velocity: torch.Tensor | None) -> bytes:
    """``step``, flat fp32 ``slow`` and optional ``velocity`` → header ‖ zlib(slow) ‖ zlib(velocity)."""
    slow_z = zlib.compress(slow.float().contiguous().numpy().tobytes(), 1)
    vel_z = b"" if velocity is None else zlib.compress(velocity.float().contiguous().numpy().tobytes(), 1)
    return STATE_HEADER.pack(step, slow.numel(), velocity is not None) + struct.pack("!Q", len(slow_z)) + slow_z + vel_z


def _inflate(blob: bytes, numel: int) -> torch.Tensor:
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(blob, 4 * numel)
    except zlib.error as exc:
        raise StateError(f"bad compressed tensor: {exc}") from None
    if len(raw) != 4 * numel or inflater.unconsumed_tail or not inflater.eof:
        raise StateError(f"compressed tensor does not hold exactly {numel} fp32 values")
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    if not torch.isfinite(tensor).all():
        raise StateError("peer state holds non-finite values")
    return tensor


def decode_state(payload: bytes, numel: int, every: int) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`encode_state`, validated against the model size ``numel`` and the round length ``every``.

    ``every``: inner steps per outer round, i.e. between two exchanges (``outer.every / outer.fragments``); the
    state's step must be a multiple of it (a peer serves its state after each exchange).
    """
    if len(payload) < STATE_HEADER.size + 8:
        raise StateError("peer state is truncated")
    step, count, has_velocity = STATE_HEADER.unpack_from(payload)
    (slow_len,) = struct.unpack_from("!Q", payload, STATE_HEADER.size)
    if count != numel:
        raise StateError(f"peer state has {count} weights, this model has {numel}")
    if step % every:
        raise StateError(f"peer state is at step {step}, not on an outer-round boundary (every={every})")
    body = payload[STATE_HEADER.size + 8 :]
    if slow_len > len(body):
        raise StateError("peer state is truncated")
    slow = _inflate(body[:slow_len], numel)
    velocity = _inflate(body[slow_len:], numel) if has_velocity else None
    if not has_velocity and len(body) != slow_len:
        raise StateError("peer state has trailing bytes")
    return int(step), slow, velocity


class StateServer:
    """This peer's latest post-round state, served to late joiners (updated by the training thread).

    :meth:`update` takes copies, so the training thread can go on mutating its tensors; :meth:`serve`
    (the endpoint's handler, another thread) answers from one consistent snapshot, encoded once.
    Requests beyond the rate limits raise :class:`~noloco.swarm.endpoint.Rejected` (``throttled``,
    counted as ``state_throttled``); :attr:`served` and :attr:`throttled` count what happened.

    Args:
        interval, burst: at most ``burst`` full states to one requester (peer id) within ``interval`` seconds.
        concurrency: most states being encoded or sent at once (enforced by the endpoint, see :meth:`register`).
    """

    def __init__(self, interval: float = STATE_INTERVAL_SECONDS, concurrency: int = STATE_CONCURRENCY,
                 burst: int = STATE_BURST) -> None:  # fmt: skip
        self._lock = threading.Lock()
        self.interval, self.concurrency, self.burst = float(interval), int(concurrency), int(burst)
        self.step, self.slow, self.velocity = 0, None, None
        self._encoded: bytes | None = None
        self._last: dict[str, list[float]] = {}  # requester -> when it was served within the interval
        self.served = 0
        self.throttled = 0

    def update(self, step: int, slow: torch.Tensor, velocity: torch.Tensor | None) -> None:
        snapshot = (int(step), slow.detach().float().cpu().clone(),
                    None if velocity is None else velocity.detach().float().cpu().clone())  # fmt: skip
        with self._lock:
            self.step, self.slow, self.velocity = snapshot
            self._encoded = None

    def _admit(self, src: str) -> None:
        now = time.monotonic()
        with self._lock:
            if self.slow is None:
                raise CommError("no state yet")
            recent = [t for t in self._last.get(src, ()) if now - t < self.interval]
            if len(recent) >= self.burst:
                self.throttled += 1
                raise Rejected("throttled", f"{len(recent)} states served to this peer in {self.interval:.0f}s",
                               counter="state_throttled")  # fmt: skip
            self._last[src] = [*recent, now]
            if len(self._last) > 4096:  # forget the oldest requesters (their interval has long passed)
                for peer in sorted(self._last, key=lambda p: self._last[p][-1])[:1024]:
                    del self._last[peer]

    def register(self, endpoint, name: str = STATE_SERVICE) -> None:
        """Serve this state on ``endpoint`` as ``name``, at most :attr:`concurrency` replies at once."""
        endpoint.serve(name, self.serve, max_concurrent=self.concurrency, throttled_counter="state_throttled")

    def serve(self, request: bytes, src: str) -> bytes:
        self._admit(src)
        with self._lock:
            step, slow, velocity, encoded = self.step, self.slow, self.velocity, self._encoded
        if encoded is None:
            encoded = encode_state(step, slow, velocity)
            with self._lock:
                if self.slow is slow:  # still the latest snapshot: keep its encoding
                    self._encoded = encoded
        with self._lock:
            self.served += 1
        return encoded
