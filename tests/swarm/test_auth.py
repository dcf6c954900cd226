"""Message authentication of the swarm transport over real p2pd daemons on loopback."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time

import pytest
import torch

from noloco.comm.base import CommError, CommTimeout
from noloco.swarm.endpoint import Header, Rejected, RunKey, SwarmEndpoint, encode_frame, read_frame
from noloco.swarm.matchmaking import draw_groups, windows
from noloco.swarm.state import StateError, decode_state, encode_state

KEY = RunKey("unit-test-run-key")


@pytest.fixture(scope="module")
def endpoints():
    """Two endpoints, each on its own p2pd daemon (hivemind.P2P), the second bootstrapped from the first."""
    from hivemind.p2p import P2P

    async def first():
        return await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    a = SwarmEndpoint(first, "unit", KEY, max_message_bytes=1 << 20, send_timeout=10)
    maddrs = a.visible_maddrs()

    async def second():
        return await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    b = None
    try:
        b = SwarmEndpoint(second, "unit", KEY, max_message_bytes=1 << 20, send_timeout=10)
        yield a, b
    finally:
        for endpoint in (a, b):
            if endpoint is not None:
                endpoint.close()


def _group(a, b, name):
    members = sorted([a.peer_id, b.peer_id])
    return a.open_group(name, 3, members), b.open_group(name, 3, members)


def _frame_to(sender, receiver, group, tag, payload, key=KEY, **changes) -> bytes:
    fields = dict(run="unit", kind="data", round=3, group=group, src=sender.peer_id, dst=receiver.peer_id, tag=tag,
                  nonce=secrets.token_hex(16), sent_at=time.time())  # fmt: skip
    fields.update(changes)
    return encode_frame(key, Header(**fields), payload)


def _raw_send(sender, receiver, frame: bytes) -> int:
    """Push raw frame bytes through a real stream; return the receiver's ack status."""
    status, _ = sender._loop.call(sender._exchange(receiver.peer_id, frame, 0), 10)
    return status


def test_authenticated_message_is_delivered_once_and_counted(endpoints):
    a, b = endpoints
    ta, tb = _group(a, b, "ok")
    before = b.counter.bytes_received
    ta.send(tb.rank, "x", b"payload" * 100)
    assert tb.recv(ta.rank, "x", timeout=5) == b"payload" * 100
    assert b.counter.bytes_received - before == 700
    ta.close(), tb.close()


def test_forged_message_with_another_key_is_rejected_and_counted(endpoints):
    a, b = endpoints
    ta, tb = _group(a, b, "forged")
    before = b.rejection_counts().get("unauthenticated", 0)
    status = _raw_send(a, b, _frame_to(a, b, "forged", "x", b"evil", key=RunKey("some-other-key")))
    assert status != 0
    assert b.rejection_counts()["unauthenticated"] == before + 1
    with pytest.raises(CommTimeout):
        tb.recv(ta.rank, "x", timeout=0.3)
    ta.close(), tb.close()


def test_altered_payload_fails_the_mac(endpoints):
    a, b = endpoints
    ta, tb = _group(a, b, "altered")
    frame = bytearray(_frame_to(a, b, "altered", "x", b"0123456789"))
    frame[-40] ^= 1  # a payload byte
    before = b.rejection_counts().get("unauthenticated", 0)
    assert _raw_send(a, b, bytes(frame)) != 0
    assert b.rejection_counts()["unauthenticated"] == before + 1
    ta.close(), tb.close()


def test_replayed_frame_and_duplicate_tag_are_rejected(endpoints):
    a, b = endpoints
    ta, tb = _group(a, b, "replay")
    frame = _frame_to(a, b, "replay", "x", b"once")
    assert _raw_send(a, b, frame) == 0
    before = b.rejection_counts().get("replayed", 0)
    assert _raw_send(a, b, frame) != 0  # the very same bytes again
    assert _raw_send(a, b, _frame_to(a, b, "replay", "x", b"twice")) != 0  # same tag, fresh nonce
    assert b.rejection_counts()["replayed"] == before + 2
    assert tb.recv(ta.rank, "x", timeout=5) == b"once"
    ta.close(), tb.close()


def test_oversized_message_is_refused_before_it_is_buffered(endpoints):
    a, b = endpoints
    ta, tb = _group(a, b, "big")
    before = b.rejection_counts().get("oversized", 0)
    with pytest.raises(CommError):
        ta.send(tb.rank, "x", bytes((1 << 20) + 1))  # the sender refuses it too
    header = Header("unit", "data", 3, "big", a.peer_id, b.peer_id, "x", "ab" * 16, time.time()).to_bytes()
    from noloco.swarm.endpoint import MAGIC, PREFIX

    lying_prefix = PREFIX.pack(MAGIC, len(header), 1 << 40)  # claims 1 TiB, sends nothing
    assert _raw_send(a, b, lying_prefix + header) != 0
    assert b.rejection_counts()["oversized"] == before + 1
    ta.close(), tb.close()


def test_messages_for_other_groups_rounds_or_senders_are_unexpected(endpoints):
    a, b = endpoints
    ta, tb = _group(a, b, "bound")
    before = b.rejection_counts().get("unexpected", 0)
    assert _raw_send(a, b, _frame_to(a, b, "not-open", "x", b"?")) != 0  # unknown group
    assert _raw_send(a, b, _frame_to(a, b, "bound", "y", b"?", round=4)) != 0  # wrong round
    assert _raw_send(a, b, _frame_to(a, b, "bound", "z", b"?", run="other")) != 0  # wrong run
    assert b.rejection_counts()["unexpected"] == before + 3
    before = b.rejection_counts().get("unauthenticated", 0)
    assert _raw_send(a, b, _frame_to(a, b, "bound", "w", b"?", src=b.peer_id)) != 0  # spoofed sender
    assert b.rejection_counts()["unauthenticated"] == before + 1
    ta.close(), tb.close()


def test_key_is_never_shown():
    key = RunKey("super-secret-value")
    assert "super-secret" not in repr(key) and "super-secret" not in str(key)
    with pytest.raises(TypeError):
        __import__("pickle").dumps(key)


def test_read_frame_rejects_truncated_and_bad_magic():
    async def read(raw: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await read_frame(reader, KEY, 1 << 20)

    header = Header("unit", "data", 0, "g", "a", "b", "t", "00", 0.0)
    frame = encode_frame(KEY, header, b"abc")
    assert asyncio.run(read(frame)) == (header, b"abc")
    with pytest.raises(Rejected, match="malformed"):
        asyncio.run(read(frame[:-5]))
    with pytest.raises(Rejected, match="malformed"):
        asyncio.run(read(b"XXXX" + frame[4:]))


def test_windows_chain_and_group_draw_is_deterministic():
    assert windows([5.0, 0.0, 0.5, 2.1, 2.2], 2.0) == [(0.0, 2.0), (2.1, 4.1), (5.0, 7.0)]
    peers = [f"peer{i}" for i in range(5)]
    groups = draw_groups(peers, 2, seed=0, round_index=3, salt="w")
    assert groups == draw_groups(list(reversed(peers)), 2, seed=0, round_index=3, salt="w")
    assert sorted(len(g) for g in groups) == [2, 3] and sorted(sum(groups, [])) == peers
    # a seeded round robin: in one epoch (3 rounds for 4 peers) every peer meets every other once
    for epoch in range(3):
        met = [frozenset(g) for r in range(3 * epoch, 3 * epoch + 3) for g in draw_groups(peers[:4], 2, 7, r)]
        assert sorted(map(sorted, met)) == sorted(sorted(pair) for pair in itertools.combinations(peers[:4], 2))
    # odd counts: the peer with the bye joins a pair; everyone is placed exactly once
    for r in range(8):
        groups = draw_groups(peers, 2, 1, r)
        assert sorted(len(g) for g in groups) == [2, 3] and sorted(sum(groups, [])) == peers
    assert draw_groups(peers, None, 0, 0, "w") == [peers]


def test_peer_state_round_trip_and_validation():
    slow, velocity = torch.randn(1000), torch.randn(1000)
    payload = encode_state(40, slow, velocity)
    step, got_slow, got_velocity = decode_state(payload, 1000, every=10)
    assert step == 40 and torch.equal(got_slow, slow) and torch.equal(got_velocity, velocity)
    with pytest.raises(StateError):
        decode_state(payload, 999, every=10)  # wrong model size
    with pytest.raises(StateError):
        decode_state(payload, 1000, every=7)  # not on a round boundary
    with pytest.raises(StateError):
        decode_state(payload[:-10], 1000, every=10)  # truncated
    with pytest.raises(StateError):
        decode_state(encode_state(10, torch.full((1000,), float("nan")), None), 1000, every=10)
