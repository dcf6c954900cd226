"""The defences of issue #14 one by one, fast: caps on unauthenticated streams (real p2pd on loopback), the
DHT record validator (run key and per-peer signatures, also between real DHT nodes), plausible registry
claims, state-serving rate limits, no-confirm and no-data penalties, and the ``peer.*`` keys of these limits.

The end-to-end attacks on training peers are in test_hostile.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

import pytest
import torch

from noloco.comm.base import CommError, CommTimeout, CommUnreachable
from noloco.gossip.base import Group
from noloco.swarm.dht import RunRecordValidator, start_peer_dht
from noloco.swarm.endpoint import (
    HEADER_DOMAIN,
    MAGIC,
    PREFIX,
    REASONS,
    Header,
    Rejected,
    RunKey,
    SwarmEndpoint,
    encode_frame,
)
from noloco.swarm.identity import PeerIdentity, verify
from noloco.swarm.matchmaking import (
    MAX_PENALTY_ROUNDS,
    PENALTY_ROUNDS,
    STRIKES_BEFORE_PENALTY,
    Announcement,
    PeerRegistry,
    SwarmMatchmaking,
    implausible_rounds,
    implausible_steps,
    sign_record,
    signed_entries,
    step_bound,
)
from noloco.swarm.state import StateServer, decode_state

KEY = RunKey("defence-test-run-key")


@pytest.fixture(scope="module")
def endpoints():
    """A target endpoint (small caps, short header deadline) and an attacker's endpoint, each on its own p2pd."""
    from hivemind.p2p import P2P

    async def first():
        return await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    target = SwarmEndpoint(first, "unit", KEY, max_message_bytes=1 << 28, send_timeout=10, header_timeout=2,
                           max_unauth_per_peer=2, max_unauth_streams=3)  # fmt: skip
    maddrs = target.visible_maddrs()

    async def second():
        return await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    other = None
    try:
        other = SwarmEndpoint(second, "unit", KEY, send_timeout=10)  # raw frames below carry made-up MACs
        yield target, other
    finally:
        for endpoint in (target, other):
            if endpoint is not None:
                endpoint.close()


def _stalling_frame(src: SwarmEndpoint, dst: SwarmEndpoint, declared: int, whole_header: bool) -> bytes:
    header = Header("unit", "data", 0, "g", src.peer_id, dst.peer_id, "t", secrets.token_hex(16), time.time())
    raw = header.to_bytes()
    prefix = PREFIX.pack(MAGIC, len(raw), declared)
    return prefix + raw + secrets.token_bytes(32) if whole_header else prefix + raw[:10]


def test_keyless_streams_are_capped_cut_at_the_header_deadline_and_never_allocated(endpoints):
    target, attacker = endpoints
    from hivemind.p2p import PeerID

    async def hold(frame: bytes, wait: float):
        _, reader, writer = await attacker.p2p.call_binary_stream_handler(PeerID.from_base58(target.peer_id),
                                                                          target.protocol)  # fmt: skip
        started = time.monotonic()
        try:
            writer.write(frame)
            await writer.drain()
            ack = await asyncio.wait_for(reader.readexactly(1), wait)
            return REASONS[ack[0]], time.monotonic() - started
        except (asyncio.IncompleteReadError, ConnectionError):
            return "closed", time.monotonic() - started
        finally:
            writer.close()

    async def attack():
        stall = _stalling_frame(attacker, target, (1 << 28) - 1, whole_header=False)
        held = [asyncio.ensure_future(hold(stall, 8)) for _ in range(2)]
        await asyncio.sleep(0.5)  # the two stalled streams hold this peer's two unauthenticated slots
        over = await asyncio.gather(*(hold(stall, 8) for _ in range(3)))
        cut = await asyncio.gather(*held)  # the slots free up when the stalled streams are cut
        forged = await hold(_stalling_frame(attacker, target, (1 << 28) - 1, whole_header=True), 8)
        return cut, over, forged

    before = dict(target.rejection_counts())
    held, over, forged = attacker._loop.call(attack(), 30)
    counts = target.rejection_counts()
    # over the per-peer cap: refused at once, without reading
    assert all(reason in ("throttled", "closed") for reason, seconds in over), over  # not held to the deadline
    assert counts.get("throttled", 0) - before.get("throttled", 0) >= 3
    # the stalled ones were cut at the 2 s header deadline
    assert all(reason == "stalled" and seconds > 1.5 for reason, seconds in held), held  # (load only adds time)
    assert counts.get("stalled", 0) - before.get("stalled", 0) == 2
    # the forged header (declaring 256 MiB) was refused at its header MAC, after the slots freed up
    assert forged[0] in ("unauthenticated", "throttled"), forged
    assert target.peak_unauth_streams <= 3
    deadline = time.monotonic() + 5  # the target's handlers finish (their acks' linger) on their own
    while (target._unauth or target._in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not target._unauth and target._in_flight == 0  # every slot and reservation released


def test_known_peers_are_not_held_up_by_the_global_cap(endpoints):
    """Keyless identities filling the global cap of unauthenticated streams do not delay the run's own peers."""
    target, sender = endpoints
    from hivemind.p2p import PeerID

    async def stall():
        _, _, writer = await sender.p2p.call_binary_stream_handler(PeerID.from_base58(target.peer_id),
                                                                   target.protocol)  # fmt: skip
        writer.write(_stalling_frame(sender, target, 1 << 20, whole_header=False))
        await writer.drain()
        await asyncio.sleep(0.3)
        return writer

    target.max_unauth_streams = 1
    writer = sender._loop.call(stall(), 10)  # an unknown peer's stalled stream fills the global cap
    try:
        members = sorted([target.peer_id, sender.peer_id])
        target.open_group("known", 0, members)
        transport = sender.open_group("known", 0, members)
        before = target.rejection_counts().get("throttled", 0)
        with pytest.raises(CommError):  # refused at once (the ack, or a stream closed before the frame went)
            transport.send(members.index(target.peer_id), "x", b"payload")
        assert target.rejection_counts()["throttled"] == before + 1
        target.note_peers([sender.peer_id])  # listed in the run's authenticated registry: per-peer cap only
        transport.send(members.index(target.peer_id), "y", b"payload")
        assert target.take("known", sender.peer_id, "y", timeout=5) == b"payload"
    finally:
        target.max_unauth_streams = 3
        writer.close()
        target.close_group("known")
        sender.close_group("known")


def test_a_key_holder_cannot_reserve_more_than_the_inbox(endpoints):
    """Declared payloads in flight count against max_buffered_bytes before a byte of them is read."""
    target, _ = endpoints
    target.open_group("reserve", 0, [target.peer_id, "peer"])
    limit, target.max_buffered_bytes = target.max_buffered_bytes, 1000

    def header(tag: str) -> Header:
        return Header("unit", "data", 0, "reserve", "peer", target.peer_id, tag, secrets.token_hex(8), 0.0)

    try:
        assert target._admit(header("a"), "peer", 600) == 600
        with pytest.raises(Rejected, match="overflow"):
            target._admit(header("b"), "peer", 600)
        with pytest.raises(Rejected, match="unauthenticated"):  # a key holder speaking for another peer
            target._admit(header("c"), "someone-else", 1)
        with pytest.raises(Rejected, match="unexpected"):  # no such group open: refused before the payload
            target._admit(Header("unit", "data", 0, "nope", "peer", target.peer_id, "d", "0", 0.0), "peer", 1)
    finally:
        target._in_flight -= 600
        target.max_buffered_bytes = limit
        target.close_group("reserve")


def _subkey(peer_id: str) -> bytes:
    from hivemind.utils.serializer import MSGPackSerializer

    return MSGPackSerializer.dumps(peer_id)


def test_a_peer_identity_is_its_libp2p_id_and_signs_verifiably():
    me, other = PeerIdentity.generate(), PeerIdentity.generate()
    assert me.peer_id.startswith("12D3KooW") and me.peer_id != other.peer_id  # an Ed25519 libp2p id
    signature = me.sign(b"text")
    assert verify(me.peer_id, b"text", signature)
    assert not verify(other.peer_id, b"text", signature)  # another peer's id
    assert not verify(me.peer_id, b"texT", signature)  # other bytes
    assert not verify(me.peer_id, b"text", signature[:-1] + bytes([signature[-1] ^ 1]))
    for junk in ("", "not-base58!", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "12D3KooW"):
        assert not verify(junk, b"text", signature)  # names no Ed25519 key (an RSA id, junk)
    assert me.peer_id in repr(me)
    with pytest.raises(TypeError):
        __import__("pickle").dumps(me)
    with me.identity_file() as path:
        assert (__import__("os").stat(path).st_mode & 0o777) == 0o600
    assert not __import__("os").path.exists(path)  # gone once the daemon has read it


def test_dht_records_need_the_run_key_the_owners_signature_and_a_bounded_expiry():
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase
    from hivemind.utils.timed_storage import get_dht_time

    me, other = PeerIdentity.generate(), PeerIdentity.generate()
    validator = RunRecordValidator.create(KEY, "unit", max_ttl=300, identity=me)
    assert isinstance(validator, RecordValidatorBase)
    now = get_dht_time()
    record = DHTRecord(b"key-id", _subkey(me.peer_id), b"value", now + 60)
    signed = dataclasses.replace(record, value=validator.sign_value(record))
    assert validator.validate(signed) and validator.strip_value(signed) == b"value"
    unauthenticated = [
        record,  # unsigned
        dataclasses.replace(signed, value=signed.value[:-1] + bytes([signed.value[-1] ^ 1])),  # altered MAC
        dataclasses.replace(signed, subkey=_subkey(other.peer_id)),  # moved to another subkey
        dataclasses.replace(signed, expiration_time=now + 61),  # expiry changed
        dataclasses.replace(signed, value=b"x" + signed.value),  # value changed
    ]
    foreign = RunRecordValidator.create(RunKey("another-run-key"), "unit", max_ttl=300, identity=me)
    unauthenticated.append(dataclasses.replace(record, value=foreign.sign_value(record)))  # another run key
    # a key holder (the run key's MAC is right) writing under another peer's subkey, however it signs
    theirs = DHTRecord(b"key-id", _subkey(other.peer_id), b"value", now + 60)
    holder = RunRecordValidator.create(KEY, "unit", max_ttl=300, identity=me)
    forged = [dataclasses.replace(theirs, value=holder.sign_value(theirs))]  # honest code leaves it unsigned
    body = holder._signed_bytes(theirs)
    own_signature = me.sign(b"noloco-dht-sig/2" + body)  # signed with the forger's own key
    mac = KEY.mac(b"noloco-dht/2", body)
    forged.append(dataclasses.replace(theirs, value=b"value" + b"NLV2" + own_signature + mac))
    garbled = signed.value[:-96] + bytes(64) + signed.value[-32:]  # owner's signature zeroed, MAC kept
    forged.append(dataclasses.replace(signed, value=garbled))
    no_owner = DHTRecord(b"key-id", _subkey("not-a-peer"), b"value", now + 60)
    forged.append(dataclasses.replace(no_owner, value=holder.sign_value(no_owner)))
    assert not any(validator.validate(r) for r in unauthenticated + forged)
    far = DHTRecord(b"key-id", _subkey(me.peer_id), b"value", now + 10**6)
    assert not validator.validate(dataclasses.replace(far, value=validator.sign_value(far)))
    assert validator.counts() == {"dht_unauthenticated": len(unauthenticated), "dht_expiry": 1,
                                  "dht_forged": len(forged)}  # fmt: skip
    # the owner's own record verifies on any node of the run, whatever identity that node has
    assert RunRecordValidator.create(KEY, "unit", max_ttl=300, identity=other).validate(signed)
    with pytest.raises(TypeError):
        __import__("pickle").dumps(validator)


def test_a_key_holder_cannot_store_under_another_peers_subkey_on_real_dht_nodes():
    """Two honest peers' DHT nodes and a key holder's, on loopback: its forgery is refused everywhere it is read."""
    from types import SimpleNamespace

    from hivemind.utils.timed_storage import get_dht_time

    nodes, endpoints = [], []
    try:
        maddrs: list[str] = []
        for _ in range(2):
            identity = PeerIdentity.generate()
            validator = RunRecordValidator.create(KEY, "unit", 600, identity)
            dht = start_peer_dht(maddrs, ["/ip4/127.0.0.1/tcp/0"], record_validators=[validator], identity=identity)
            nodes.append((dht, validator))
            endpoints.append(SwarmEndpoint.from_dht(dht, "unit", KEY, identity=identity))
            maddrs = maddrs or [str(m) for m in dht.get_visible_maddrs()]
        (a_dht, a_validator), (b_dht, b_validator) = nodes
        a, b = endpoints
        PeerRegistry(a_dht, a, "a").publish(40, 4)
        # b, a key holder with its own identity, writes "a finished" under a's subkey: MAC right, not a's signature
        now = get_dht_time()
        text = f"alive|unit|{a.peer_id}|100|-1|{now}|a".encode()
        value = {"step": 100, "round": -1, "t": now, "name": "a", **sign_record(b, text)}
        assert not b_dht.store("unit/peers", value, now + 300, subkey=a.peer_id)  # refused, its own node included
        assert b_validator.counts()["dht_forged"] >= 1
        for dht in (a_dht, b_dht):  # a's own entry, read on either node (live() lists the others: read as b)
            entries = PeerRegistry(dht, b, "reader").live()
            listed = [(e["peer"], e["step"], e["round"]) for e in entries if e["peer"] == a.peer_id]
            assert listed == [(a.peer_id, 40, 4)]
        # what a reader drops itself (should a node hand it over): an entry its subkey's peer did not sign
        bad_mac = {"step": 1, "round": 0, "t": now, "name": "b", "mac": "00", "sig": "00"}
        items = {a.peer_id: SimpleNamespace(value=value), b.peer_id: SimpleNamespace(value=bad_mac)}
        found = SimpleNamespace(value=items)
        registry = PeerRegistry(None, a, "a")

        def text(peer, v):
            return registry._text(peer, int(v["step"]), int(v["round"]), v["t"], str(v["name"]))

        before = a.rejection_counts()
        assert signed_entries(found, text, a, set(), "entry") == []
        after = a.rejection_counts()
        assert after.get("forged", 0) == before.get("forged", 0) + 1
        assert after.get("unauthenticated", 0) == before.get("unauthenticated", 0) + 1
    finally:
        for endpoint in endpoints:
            endpoint.close()
        for dht, _ in nodes:
            dht.shutdown()


def _entry(peer: str, step: int, round_index: int, age: float = 0.0) -> dict:
    return {"peer": peer, "name": peer, "step": step, "round": round_index, "t": time.time() - age}


def test_registry_claims_beyond_the_schedule_or_the_swarm_are_dropped():
    steps, every = 1000, 10
    honest = [_entry("a", 300, 30), _entry("b", 290, 29), _entry("joiner", 0, 0)]
    liars = [_entry("far", 10**9, 10**8), _entry("past", steps + every, steps // every + 1)]
    seen: set = set()

    class Counter:
        counts: dict = {}

        def count_rejection(self, reason, detail, src):
            self.counts[reason] = self.counts.get(reason, 0) + 1

    counter = Counter()
    assert implausible_rounds(honest + liars, steps, every, counter, seen) == honest
    assert counter.counts == {"implausible_step": 2}
    implausible_rounds(honest + liars, steps, every, counter, seen)  # each claim is counted once
    assert counter.counts == {"implausible_step": 2}
    # a lone honest peer far ahead of peers that fell behind is still followed (rounds: schedule only)
    assert len(implausible_rounds([_entry("lead", 900, 90), _entry("slow", 100, 10)], steps, every)) == 2
    # a joiner's sources: near the median of the trained, live peers (a dead peer's old entry ignored)
    assert step_bound(honest, steps, every) == 290 + 100
    assert step_bound([*honest, _entry("dead", 10, 1, age=100)], steps, every, fresh_within=30) == 390
    close_to_the_end = _entry("near-end", steps - every, steps // every - 1)
    kept = implausible_steps(honest + liars + [close_to_the_end], steps, every)
    assert [e["peer"] for e in kept] == ["a", "b", "joiner"]
    assert step_bound([], steps, every) == steps


def test_state_server_serves_two_states_per_requester_per_interval():
    server = StateServer(interval=0.5)
    with pytest.raises(CommError):
        server.serve(b"", "x")  # nothing yet
    server.update(20, torch.randn(100), torch.randn(100))
    first = server.serve(b"", "alice")
    assert decode_state(first, 100, 10)[0] == 20
    assert server.serve(b"", "alice") is first  # a retry (burst of 2)
    for _ in range(5):
        with pytest.raises(Rejected) as refused:
            server.serve(b"", "alice")
        assert refused.value.reason == "throttled" and refused.value.counter == "state_throttled"
    assert server.serve(b"", "bob") is first  # encoded once per snapshot
    time.sleep(0.6)
    assert server.serve(b"", "alice") is first
    assert (server.served, server.throttled) == (4, 5)


class _FakeEndpoint:
    """The endpoint surface matchmaking's penalties use."""

    def note_peers(self, peers):
        pass

    def __init__(self):
        self.key, self.run_id, self.peer_id = KEY, "unit", "me"
        self.counter, self.ctl, self.counts = None, {}, {}

    def control_tags(self, channel, src):
        return self.ctl.get((channel, src), [])

    def count_rejection(self, reason, detail, src):
        self.counts[reason] = self.counts.get(reason, 0) + 1


def _matchmaking(peer_id: str) -> SwarmMatchmaking:
    """Only the penalty bookkeeping of a SwarmMatchmaking (no DHT)."""
    endpoint = _FakeEndpoint()
    endpoint.peer_id = peer_id
    return SwarmMatchmaking(None, endpoint, peer_id)


def _silent_in(mm: SwarmMatchmaking, peer: str, round_index: int) -> None:
    mm._silent.append((peer, round_index))
    mm._settle()


def test_a_peer_that_never_confirms_is_left_out_for_growing_aligned_penalties():
    mm = _matchmaking("me")
    _silent_in(mm, "x", 1)  # one silent round: counted, no penalty (an honest peer may not have drawn)
    assert not any(mm.penalized("x", r) for r in range(20)) and mm.endpoint.counts["no_confirm"] == 1
    _silent_in(mm, "x", 2)  # twice in a row: left out to the end of the next block of 4 rounds
    assert [r for r in range(20) if mm.penalized("x", r)] == list(range(0, 8))
    other = _matchmaking("other")  # a peer that met x a round earlier lets it back in in the same round
    _silent_in(other, "x", 0)
    _silent_in(other, "x", 1)
    assert other._banned_until["x"] == mm._banned_until["x"] == 7
    _silent_in(mm, "x", 8)
    assert mm._banned_until["x"] == 23 and mm.endpoint.counts["no_confirm"] == 3  # 8 rounds, aligned
    entries = [Announcement("me", 0.0, "me"), Announcement("x", 0.1, "x"), Announcement("y", 0.2, "y")]
    assert [e.peer for e in mm._drop_penalized(entries, 9)] == ["me", "y"] and mm._window_excluded == ["x"]
    mm._drop_penalized(entries, 9)
    assert mm.endpoint.counts["penalized"] == 1  # once per (peer, round)
    # an honest peer whose join arrived late (after the deadline), or whose join was taken, is not struck
    mm.endpoint.ctl[("r30", "slow")] = ["join/g"]
    for r in (30, 31):
        mm._heard.add(("heard", r))
        _silent_in(mm, "heard", r)
    _silent_in(mm, "slow", 30)
    assert "heard" not in mm._strikes and "slow" not in mm._strikes


def test_a_member_that_confirms_and_then_sends_no_data_is_struck_and_left_out(endpoints):
    """Real endpoints: a member this peer timed out waiting for, that delivered nothing, is struck (no_data)."""
    target, other = endpoints
    mm = SwarmMatchmaking(None, target, "target", penalty_rounds=4, strikes_before_penalty=2)
    members = sorted([target.peer_id, other.peer_id])
    me, them = members.index(target.peer_id), members.index(other.peer_id)
    before = dict(target.rejection_counts())

    def exchange(round_index: int, sends: bool, waits: bool = True, refuses: bool = False) -> None:
        group_id = f"mute-{round_index}"
        transport = target.open_group(group_id, round_index, members)
        theirs = other.open_group(group_id, round_index, members)
        try:
            if sends:
                theirs.send(me, "outer/x", b"data")
            if refuses:  # it closed the group it confirmed: our data is refused (unexpected), at once
                other.close_group(group_id)
                with pytest.raises(CommError, match="unexpected"):
                    transport.send(them, "outer/y", b"ours")
            elif waits:
                with pytest.raises(CommTimeout):
                    transport.recv(them, "outer/never-sent", timeout=0.3)
        finally:
            mm.release(Group(transport, [0, 1], round_index, members))
            other.close_group(group_id)
        mm._settle()  # the next round begins

    counts = lambda: {k: v - before.get(k, 0) for k, v in target.rejection_counts().items()}  # noqa: E731
    exchange(0, sends=False)
    assert counts().get("no_data") == 1 and not mm.penalized(other.peer_id, 1)  # one strike: no penalty yet
    exchange(1, sends=True)  # it sent something (and we still timed out on another tag): not struck, strikes reset
    assert counts().get("no_data") == 1 and other.peer_id not in mm._mute_strikes
    exchange(2, sends=False, waits=False)  # we never waited for it (our round failed elsewhere): not struck
    exchange(3, sends=False)
    exchange(4, sends=False, refuses=True)  # the second strike in a row: left out to the end of the next block of 4
    assert counts()["no_data"] == 3
    assert [r for r in range(20) if mm.penalized(other.peer_id, r)] == list(range(0, 12))
    assert mm._strikes == {}  # confirmation strikes are another count


def test_a_member_that_cannot_be_reached_is_left_out_from_its_first_strike(endpoints):
    """Real endpoints: a drawn member without a daemon (a sybil identity of a key holder, or a peer that died)
    fails the confirmation at once as unreachable and is left out from its first strike, where a member that
    answers and stays silent keeps the strikes before a penalty (a slow honest peer). Before, an identity without a
    daemon failed two of its drawn rounds before its first penalty, like a silent one."""
    target, other = endpoints
    mm = SwarmMatchmaking(None, target, "target", penalty_rounds=4, strikes_before_penalty=2)
    absent = PeerIdentity.generate().peer_id
    members = sorted([target.peer_id, absent])
    started = time.monotonic()
    with pytest.raises(CommUnreachable):
        mm._confirm(3, "g-absent", members, {m: m for m in members}, time.monotonic() + 20, fast_mismatch=False)
    assert time.monotonic() - started < 15  # told at once, not after the confirmation deadline
    mm._settle()  # the next round begins
    assert [r for r in range(16) if mm.penalized(absent, r)] == list(range(0, 8))  # to the end of the next block of 4
    assert target.rejection_counts().get("no_confirm", 0) >= 1
    members = sorted([target.peer_id, other.peer_id])  # there, but never confirms: one strike, no penalty yet
    with pytest.raises(TimeoutError):
        mm._confirm(4, "g-silent", members, {m: m for m in members}, time.monotonic() + 0.5, fast_mismatch=False)
    mm._settle()
    assert mm._strikes.get(other.peer_id) == 1 and not any(mm.penalized(other.peer_id, r) for r in range(16))


def test_a_member_drawn_only_because_of_this_peers_penalties_is_not_struck_for_its_silence(endpoints):
    """Two identities this peer penalizes (a key holder's sybils) open the window with a short chain gap; peer b
    comes 0.15 s after them, this peer 0.75 s after b. Without the sybils (this peer's read) the pair's chain holds
    both; read as a peer that penalizes nobody does (b, whose penalties differ), the sybils' chain ends 0.2 s after
    b, and this peer is in a later window: b never drew it. Its silence is then no strike, where it used to be one
    (two of them penalized an honest peer, and the two honest peers of the sybil attack then left each other out
    for every round: tests/swarm/test_hostile_rounds.py formed 0 of 20 in a full suite). A member that shares the
    window either way keeps its strikes."""
    sybils = [Announcement("s1", 100.0, "s1", 3.0, 0.2), Announcement("s2", 100.1, "s2", 3.0, 0.2)]
    b, mine = Announcement("b", 100.25, "b", 3.0, 1.0), Announcement("me", 101.0, "me", 3.0, 1.0)
    entries = [*sybils, b, mine]
    assert SwarmMatchmaking._unpenalized_mates(entries, 100.0, 103.0, mine.time) == set()
    assert SwarmMatchmaking._unpenalized_mates(entries, 100.0, 103.0, b.time) == {"s1", "s2", "b"}
    close = Announcement("me", 100.3, "me", 3.0, 1.0)  # 0.05 s after b: in the sybils' chain too
    assert SwarmMatchmaking._unpenalized_mates([*sybils, b, close], 100.0, 103.0, close.time) == {"s1", "s2", "b",
                                                                                                  "me"}  # fmt: skip
    target, other = endpoints
    mm = SwarmMatchmaking(None, target, "target", penalty_rounds=4, strikes_before_penalty=2)
    members = sorted([target.peer_id, other.peer_id])  # other answers and stays silent
    for round_index, mates in ((5, set()), (6, {other.peer_id})):
        mm._plain_mates = mates  # what this peer's read of the round's window left
        with pytest.raises(TimeoutError):
            mm._confirm(round_index, f"g{round_index}", members, {m: m for m in members}, time.monotonic() + 0.5,
                        fast_mismatch=False)  # fmt: skip
        mm._settle()
        assert mm._strikes.get(other.peer_id, 0) == (0 if round_index == 5 else 1), round_index


def test_the_limits_are_peer_config_keys_with_one_line_errors():
    from noloco.swarm import endpoint as swarm_endpoint
    from noloco.swarm import state as swarm_state
    from noloco.train.config import ConfigError, load_config

    peer = load_config([]).peer  # the defaults are the modules' constants
    endpoint_limits = (
        swarm_endpoint.MAX_UNAUTH_PER_PEER,
        swarm_endpoint.MAX_UNAUTH_STREAMS,
        swarm_endpoint.HEADER_TIMEOUT,
    )
    state_limits = (swarm_state.STATE_BURST, swarm_state.STATE_INTERVAL_SECONDS, swarm_state.STATE_CONCURRENCY)
    assert (peer.max_unauth_per_peer, peer.max_unauth_streams, peer.header_timeout) == endpoint_limits
    assert (peer.state_burst, peer.state_interval, peer.state_concurrency) == state_limits
    assert (peer.strikes_before_penalty, peer.penalty_rounds, peer.max_penalty_rounds) == (
        STRIKES_BEFORE_PENALTY, PENALTY_ROUNDS, MAX_PENALTY_ROUNDS)  # fmt: skip
    cfg = load_config(["peer.header_timeout=2.5", "peer.state_burst=1", "peer.penalty_rounds=0"])
    assert (cfg.peer.header_timeout, cfg.peer.state_burst, cfg.peer.penalty_rounds) == (2.5, 1, 0)
    for bad, message in [("peer.max_unauth_per_peer=0", "peer.max_unauth_per_peer must be an integer >= 1, got 0"),
                         ("peer.max_unauth_streams=1.5", "peer.max_unauth_streams must be an integer >= 1"),
                         ("peer.header_timeout=0", "peer.header_timeout must be a number of seconds > 0, got 0"),
                         ("peer.state_interval=-1", "peer.state_interval must be a number of seconds > 0"),
                         ("peer.state_burst=true", "peer.state_burst must be an integer >= 1, got True"),
                         ("peer.state_concurrency=0", "peer.state_concurrency must be an integer >= 1"),
                         ("peer.strikes_before_penalty=0", "peer.strikes_before_penalty must be an integer >= 1"),
                         ("peer.penalty_rounds=-1", "peer.penalty_rounds must be an integer >= 0, got -1"),
                         ("peer.max_penalty_rounds=0", "peer.max_penalty_rounds must be an integer >= 1"),
                         ("peer.header_timeout=soon", "peer.header_timeout must be a number of seconds")]:  # fmt: skip
        with pytest.raises(ConfigError) as error:
            load_config([bad])
        assert str(error.value).startswith(message) and "\n" not in str(error.value), (bad, str(error.value))
    # penalties off: strikes are still counted, nobody is left out (and no division by a zero length)
    mm = SwarmMatchmaking(None, _FakeEndpoint(), "me", penalty_rounds=0)
    for r in range(4):
        _silent_in(mm, "x", r)
    assert mm.endpoint.counts["no_confirm"] == 4 and not any(mm.penalized("x", r) for r in range(10))


def test_frames_carry_an_authenticated_header():
    header = Header("unit", "data", 0, "g", "a", "b", "t", "00", 0.0)
    frame = encode_frame(KEY, header, b"abc")
    raw = header.to_bytes()
    assert frame[: PREFIX.size] == PREFIX.pack(MAGIC, len(raw), 3)
    assert frame[PREFIX.size + len(raw) :][:32] == KEY.mac(HEADER_DOMAIN, frame[: PREFIX.size], raw)
