"""Fuzz of what a swarm peer decodes from the network: frames (``read_frame``) and late-join state.

- ``read_frame`` (noloco.swarm.endpoint): a mutated, truncated or forged frame — including forgeries by a
  holder of the run key, whose MACs (header and frame) verify, so the header parsing behind them is
  reached — is either returned as a well-typed header and a payload of at most ``max_payload`` bytes, or
  raises ``Rejected``. Never another exception, never a wait (the stream ends), and the reader never
  allocates more than ``max_payload`` plus a header, nor more than the bytes that actually arrived (a
  declared length is never allocated up front).
- ``decode_state`` (noloco.train.backends.hivemind): a mutated state is either returned with exactly the model's
  numel, finite values and a step on a round boundary, or raises ``StateError``; zlib bombs are cut
  at the expected size.
"""

from __future__ import annotations

import asyncio
import json
import struct
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from noloco.swarm.endpoint import (
    HEADER_DOMAIN,
    KINDS,
    MAC_BYTES,
    MAGIC,
    PREFIX,
    Header,
    Rejected,
    RunKey,
    encode_frame,
    read_frame,
)
from noloco.swarm.state import STATE_HEADER, StateError, decode_state, encode_state

from .fuzzing import fuzz_settings, mutate, peak_python_allocation, record

KEY = RunKey("reliability fuzz key")
OTHER_KEY = RunKey("another run's key")
MAX_PAYLOAD = 1 << 16
HEADER = Header("fuzz", "data", 3, "group-id", "peerA", "peerB", "outer/r3/delta/two_phase/p0/s1/h0",
                "0123456789abcdef", 1700000000.5)  # fmt: skip
PAYLOAD = bytes(range(256)) * 3


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _read(loop: asyncio.AbstractEventLoop, raw: bytes, max_payload: int = MAX_PAYLOAD):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()  # a peer that stops sending: truncation must be reported, not waited on
        return await read_frame(reader, KEY, max_payload, idle_timeout=2.0)

    return loop.run_until_complete(go())


def _sealed(prefix: bytes, header: bytes, payload: bytes, key: RunKey = KEY) -> bytes:
    """A frame from its parts with both MACs computed: what a holder of the key sends."""
    return prefix + header + key.mac(HEADER_DOMAIN, prefix, header) + payload + key.mac(prefix, header, payload)


def _reseal(raw: bytes) -> bytes:
    """Recompute both MACs of a mutated frame (header MAC over prefix ‖ header, frame MAC over the rest)."""
    if len(raw) < PREFIX.size:
        return raw
    end = PREFIX.size + struct.unpack_from("!I", raw, 4)[0]
    if len(raw) < end + MAC_BYTES:
        return raw
    rest = raw[end + MAC_BYTES :]
    payload = rest[:-MAC_BYTES] if len(rest) >= MAC_BYTES else rest
    return _sealed(raw[: PREFIX.size], raw[PREFIX.size : end], payload)


def check_frame(loop, raw: bytes, target: str) -> None:
    with peak_python_allocation() as peak:
        try:
            header, payload = _read(loop, raw)
        except Rejected as exc:
            assert exc.reason in ("malformed", "oversized", "unauthenticated", "stalled")
            header = None
    assert peak[0] <= MAX_PAYLOAD + (96 << 10), f"read_frame allocated {peak[0]} bytes"
    record(target, header is not None)
    if header is not None:
        assert len(payload) <= MAX_PAYLOAD and header.kind in KINDS
        for name, kind in dict(run=str, kind=str, round=int, group=str, src=str, dst=str, tag=str, nonce=str).items():
            assert isinstance(getattr(header, name), kind)
        assert isinstance(header.sent_at, (int, float))


def _frame_layout(frame: bytes) -> tuple[list[int], list[tuple[int, int, str]]]:
    header_len = struct.unpack_from("!I", frame, 4)[0]
    end = PREFIX.size + header_len
    body = end + MAC_BYTES
    boundaries = [4, 8, PREFIX.size, end, body, body + len(PAYLOAD), len(frame) - MAC_BYTES]
    fields = [(0, 4, "big"), (4, 4, "big"), (8, 8, "big"), (PREFIX.size + 1, 1, "big"), (body, 2, "big")]
    return boundaries, fields


FRAME = encode_frame(KEY, HEADER, PAYLOAD)
FRAME_BOUNDARIES, FRAME_FIELDS = _frame_layout(FRAME)


def test_mutated_frames_are_returned_well_formed_or_rejected(loop):
    @fuzz_settings(1200)
    @given(data=st.data())
    def run(data):
        _, raw = mutate(data, FRAME, FRAME_BOUNDARIES, FRAME_FIELDS, _reseal)
        check_frame(loop, raw, "swarm read_frame")

    run()


# Header JSON a key holder might send: wrong types, missing or extra fields, odd values, not JSON at all.
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def test_forged_headers_with_a_valid_mac_are_parsed_or_rejected(loop):
    fields = dict(HEADER.__dict__)

    @fuzz_settings(400)
    @given(
        change=st.sampled_from(["value", "drop", "extra", "raw"]),
        name=st.sampled_from(sorted(fields)),
        value=_JSON_VALUES,
        raw=st.binary(max_size=200),
    )
    def run(change, name, value, raw):
        forged = dict(fields)
        if change == "value":
            forged[name] = value
        elif change == "drop":
            del forged[name]
        elif change == "extra":
            forged["x" + name] = value
        text = raw if change == "raw" else json.dumps(forged, allow_nan=True).encode()
        check_frame(loop, _sealed(PREFIX.pack(MAGIC, len(text), len(PAYLOAD)), text, PAYLOAD),
                    "swarm frame header (MAC valid)")  # fmt: skip

    run()


def test_deeply_nested_header_json_is_rejected(loop):
    text = b"[" * 4000
    with pytest.raises(Rejected):
        _read(loop, _sealed(PREFIX.pack(MAGIC, len(text), 0), text, b""))


def test_frames_from_another_key_and_lying_lengths_are_rejected_before_buffering(loop):
    with pytest.raises(Rejected, match="unauthenticated"):
        _read(loop, encode_frame(OTHER_KEY, HEADER, PAYLOAD))
    lying = bytearray(FRAME)
    struct.pack_into("!Q", lying, 8, MAX_PAYLOAD + 1)
    with peak_python_allocation() as peak, pytest.raises(Rejected, match="oversized"):
        _read(loop, bytes(lying))
    assert peak[0] < 64 << 10
    struct.pack_into("!Q", lying, 8, 1 << 62)
    with pytest.raises(Rejected, match="oversized"):
        _read(loop, bytes(lying), max_payload=1 << 40)  # still bounded by the caller's limit


def test_a_declared_length_is_never_allocated_before_the_bytes_arrive(loop):
    """Issue #14: a payload declared just under the limit, then silence, costs the reader ~nothing."""
    limit = 1 << 30
    raw = HEADER.to_bytes()
    prefix = PREFIX.pack(MAGIC, len(raw), limit - 1)
    # without the key: the header MAC fails before a payload byte is read
    forged = prefix + raw + OTHER_KEY.mac(HEADER_DOMAIN, prefix, raw) + bytes(1 << 16)
    with peak_python_allocation() as peak, pytest.raises(Rejected, match="unauthenticated"):
        _read(loop, forged, max_payload=limit)
    assert peak[0] < 256 << 10
    # a key holder's valid header, 64 KiB of payload, then the stream ends: the buffer held what arrived
    sealed = prefix + raw + KEY.mac(HEADER_DOMAIN, prefix, raw) + bytes(1 << 16)
    with peak_python_allocation() as peak, pytest.raises(Rejected, match="malformed"):
        _read(loop, sealed, max_payload=limit)
    assert peak[0] < 512 << 10, peak[0]


# ----------------------------------------------------------------------------------------- late-join state

NUMEL, EVERY = 257, 10


def _state(velocity: bool) -> bytes:
    gen = torch.Generator().manual_seed(int(velocity))
    return encode_state(40, torch.randn(NUMEL, generator=gen), torch.randn(NUMEL, generator=gen) if velocity else None)


STATES = {False: _state(False), True: _state(True)}
STATE_FIELDS = [(0, 8, "big"), (8, 8, "big"), (16, 1, "big"), (17, 8, "big"), (17 + 8, 2, "big")]
BOMB = zlib.compress(bytes(10 << 20), 9)  # 10 MiB of zeros in ~10 KiB


def check_state(payload: bytes, target: str) -> None:
    with peak_python_allocation() as peak:
        try:
            step, slow, velocity = decode_state(payload, NUMEL, EVERY)
        except StateError:
            step = None
    assert peak[0] <= 4 * len(payload) + 16 * NUMEL + (256 << 10), f"decode_state allocated {peak[0]} bytes"
    record(target, step is not None)
    if step is not None:
        assert step % EVERY == 0 and slow.shape == (NUMEL,) and bool(torch.isfinite(slow).all())
        assert velocity is None or (velocity.shape == (NUMEL,) and bool(torch.isfinite(velocity).all()))


def test_mutated_peer_states_decode_to_valid_tensors_or_raise_state_error():
    @fuzz_settings(900)
    @given(velocity=st.booleans(), data=st.data())
    def run(velocity, data):
        payload = STATES[velocity]
        slow_len = struct.unpack_from("!Q", payload, STATE_HEADER.size)[0]
        boundaries = [8, 16, STATE_HEADER.size, STATE_HEADER.size + 8, STATE_HEADER.size + 8 + slow_len]
        _, mutated = mutate(data, payload, boundaries, STATE_FIELDS)
        check_state(mutated, "swarm decode_state")

    run()


def test_forged_peer_states_with_valid_compression_are_bounded():
    """Well-formed zlib streams a forger controls: wrong sizes, NaN, bombs, trailing data."""

    @fuzz_settings(200)
    @given(
        numel=st.sampled_from([0, 1, NUMEL - 1, NUMEL, NUMEL + 1, 1 << 20]),
        step=st.sampled_from([0, 10, 40, 41, 2**63]),
        fill=st.sampled_from([0.0, 1.0, float("nan"), float("inf"), 1e38]),
        velocity=st.sampled_from(["none", "same", "bomb", "short", "garbage"]),
        bomb_slow=st.booleans(),
        trailing=st.binary(max_size=8),
    )
    def run(numel, step, fill, velocity, bomb_slow, trailing):
        values = torch.full((min(numel, 1 << 12),), fill).numpy().tobytes()
        slow_z = BOMB if bomb_slow else zlib.compress(values)
        vel_z = {"none": b"", "same": zlib.compress(values), "bomb": BOMB, "short": zlib.compress(values[:8]),
                 "garbage": b"\x78\x9c" + trailing}[velocity]  # fmt: skip
        header = STATE_HEADER.pack(step % 2**64, NUMEL, velocity != "none") + struct.pack("!Q", len(slow_z))
        check_state(header + slow_z + vel_z + (trailing if velocity == "none" else b""), "swarm decode_state (forged)")

    run()


# ------------------------------------------------------------------ DHT records signed by a key holder
class _Rejections:
    """Where :func:`signed_entries` counts what it drops (a real endpoint's ``count_rejection``, without a daemon)."""

    def __init__(self):
        self.key, self.counts, self.invalid = KEY, {}, []

    def count_rejection(self, reason: str, detail: str, src: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1


class _Item:
    def __init__(self, value):
        self.value = value


class _Found:
    def __init__(self, entries: dict):
        self.value = {peer: _Item(v) for peer, v in entries.items()}


_ANY = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**30), 10**30), st.booleans(),
                 st.none(), st.text(max_size=80), st.binary(max_size=8),
                 st.lists(st.integers(), max_size=3))  # fmt: skip


@given(times=st.lists(_ANY, min_size=1, max_size=6), names=st.lists(_ANY, min_size=6, max_size=6))
@fuzz_settings(300)
def test_key_holder_announcements_with_any_time_or_name_are_dropped_or_usable(times, names):
    """Announcements a key holder signed (MAC and Ed25519 signature valid) with any value in ``t`` and ``name``:
    :func:`signed_entries` returns only entries with a finite time near now and a printable name, counts each other
    one as ``invalid_record`` (and hands it to ``on_invalid``), never raises; the window search then finds a window
    for every time it kept (a NaN time once raised StopIteration there and skipped every round)."""
    from noloco.swarm import matchmaking as mm
    from noloco.swarm.identity import PeerIdentity

    now = mm.get_dht_time()
    endpoint, entries = _Rejections(), {}
    for i, t in enumerate([now, *times]):
        identity = _IDENTITIES[i % len(_IDENTITIES)] if i else PeerIdentity.generate()
        name = "honest" if i == 0 else names[i - 1]
        text = "|".join(map(str, ("ready", "fuzz", 3, identity.peer_id, t, name))).encode()
        entries[identity.peer_id] = {"t": t, "name": name, "mac": KEY.mac(text).hex(),
                                     "sig": identity.sign(mm.SIGNATURE_DOMAIN + text).hex()}  # fmt: skip

    def text_of(peer: str, value) -> bytes:
        float(value["t"])
        return "|".join(map(str, ("ready", "fuzz", 3, peer, value["t"], str(value["name"])))).encode()

    def check(peer: str, value) -> str | None:
        return mm.record_time_error(value["t"], mm.get_dht_time(), 60.0) or mm.name_error(value["name"])

    good = mm.signed_entries(_Found(entries), text_of, endpoint, set(), "announcement", check,
                          lambda peer, why: endpoint.invalid.append(peer))  # fmt: skip
    record("dht_record", len(good) == len(entries))
    kept = [float(v["t"]) for _, v in good]
    assert len(good) >= 1 and all(abs(t - now) <= 60 + 2 * mm.MAX_CLOCK_SKEW for t in kept)
    assert all(isinstance(v["name"], str) and v["name"].isprintable() for _, v in good)
    assert len(good) + endpoint.counts.get("unauthenticated", 0) + len(endpoint.invalid) == len(entries)
    for t in kept:
        assert next(w for w in mm.windows(kept, 3.0) if w[0] <= t <= w[1])


_IDENTITIES = []


def setup_module(module):
    from noloco.swarm.identity import PeerIdentity

    module._IDENTITIES.extend(PeerIdentity.generate() for _ in range(7))
