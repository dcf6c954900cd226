"""Hostile swarm peers for the tests of issue #14 (``tests/swarm/test_hostile.py``, ``test_hostile_rounds.py``),
run as their own process.

``python tests/swarm/hostile.py <attack> --target <maddrs.json> --run-id <id> --out <stats.json> ...``

Every attack runs on loopback only, for at most ``--seconds`` and ``--count`` actions, and writes what it
did to ``--out`` (JSON, rewritten as it goes; ``"ready": true`` once the attack is under way). Attacks:

- ``streams`` (no key, knows the run id): opens streams to the target's noloco protocol, declares a
  payload just under ``--declare-mb`` and stalls: half of the streams stop inside the header, the others
  send a whole header with a made-up header MAC (where the old format began the payload) and wait.
- ``dht-junk`` (no key): a plain hivemind DHT node in the swarm that stores junk, with a far expiry,
  under the honest peers' subkeys of the registry and of the next rounds' ready lists, and fake subkeys.
- ``ahead`` (key holder): downloads the target's state, lists itself at step 10**9 (round 10**8) and a
  second identity one round past ``--steps``, and serves that state at those steps.
- ``silent`` (key holder): announces itself ready in every round the honest peers announce in, and
  lists itself live, but never confirms a group.
- ``mute`` (key holder): lists itself live, announces and confirms like an honest peer (in the draws from swarm
  round ``--from-round``), then sends no data in the exchange and holds its group open for ``--hold`` seconds
  (its partners wait for it).
- ``bad-time`` (key holder): like ``silent``, but every announcement carries a NaN, infinite, negative or
  absurd time (MAC'd and signed), and its registry entry an infinite one.
- ``bad-data`` (key holder): confirms like an honest peer (in the draws from swarm round ``--from-round``), then
  sends (``--mode``) contributions with NaN int4 scales (fp32: NaN values), ones encoding a few values too many,
  or its first messages and then nothing.
- ``sybils`` (key holder): ``--identities`` identities on its one DHT node (no daemon each), every one listed
  live and ready in every round the honest peers are in, none ever confirming.
- ``flood`` (key holder): requests the target's full state as fast as it is answered.
- ``forge`` (key holder, its own libp2p identity): stores records under the *honest peers'* subkeys,
  with a valid run-key MAC (it has the key) but signed with its own identity: registry entries saying
  they finished (round -1) and readiness announcements far from their real ones, with an expiry later
  than theirs, so that if accepted they would displace the honest records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


class Stats(dict):
    def __init__(self, path: str, **fields):
        super().__init__(ready=False, **fields)
        self.path, self._written = path, 0.0

    def bump(self, key: str, by: int = 1) -> None:
        self[key] = self.get(key, 0) + by

    def save(self, force: bool = False) -> None:
        if force or time.monotonic() - self._written > 0.5:
            self._written = time.monotonic()
            tmp = f"{self.path}.tmp"
            Path(tmp).write_text(json.dumps(self))
            os.replace(tmp, self.path)


def _target(path: str) -> tuple[str, list[str]]:
    info = json.loads(Path(path).read_text())
    return info["peer_id"], info["maddrs"]


# ------------------------------------------------------------------------------------------ no key
async def _streams(args, stats: Stats) -> None:
    from hivemind.p2p import P2P, PeerID

    from noloco.swarm import endpoint as swarm_endpoint
    from noloco.swarm.endpoint import MAGIC, PREFIX, REASONS, Header

    peer_id, maddrs = _target(args.target)
    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK)
    protocol = f"/noloco/{args.run_id}/{getattr(swarm_endpoint, 'PROTOCOL_VERSION', 1)}"
    declared = int(args.declare_mb * 2**20) - 1
    deadline = time.monotonic() + args.seconds
    stats["ready"] = True

    async def one(stall_in_header: bool) -> None:
        header = Header(args.run_id, "data", 0, "g" * 32, p2p.peer_id.to_base58(), peer_id, "outer/r0/x",
                        secrets.token_hex(16), time.time()).to_bytes()  # fmt: skip
        prefix = PREFIX.pack(MAGIC, len(header), declared)
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        stats.bump("streams")
        try:
            if stall_in_header:
                writer.write(prefix + header[: len(header) // 2])  # then nothing: the receiver waits
            else:
                writer.write(prefix + header + secrets.token_bytes(32) + bytes(1024))
            await writer.drain()
            started = time.monotonic()
            try:
                ack = await asyncio.wait_for(reader.readexactly(1), max(0.1, deadline - time.monotonic()))
                stats.bump(f"ack_{REASONS[ack[0]] if ack[0] < len(REASONS) else ack[0]}")
                stats["longest_held"] = max(stats.get("longest_held", 0.0), round(time.monotonic() - started, 2))
            except asyncio.IncompleteReadError:
                stats.bump("closed_without_ack")
            except asyncio.TimeoutError:
                stats.bump("still_open_at_the_end")
        finally:
            writer.close()

    async def worker(index: int) -> None:
        while time.monotonic() < deadline and stats.get("streams", 0) < args.count:
            try:
                await one(stall_in_header=index % 2 == 0)
            except Exception as exc:  # noqa: BLE001 - the target may refuse the stream
                stats.bump(f"error_{type(exc).__name__}")
            stats.save()
            await asyncio.sleep(args.pause)

    await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    await p2p.shutdown()


def streams(args, stats: Stats) -> None:
    asyncio.run(_streams(args, stats))


def _forger(trailer: bool = True):
    """A record validator for a node without the key: accepts anything, strips noloco's 36-byte MAC trailer
    when reading (so it can read the honest records), and appends a made-up trailer to what it stores."""
    from hivemind.dht.validation import RecordValidatorBase

    class Forger(RecordValidatorBase):
        def validate(self, record) -> bool:
            return True

        def sign_value(self, record) -> bytes:  # noloco's trailer: b"NLV2", signature (64 B), HMAC (32 B)
            return record.value + b"NLV2" + secrets.token_bytes(96) if trailer else record.value

        def strip_value(self, record) -> bytes:
            value = record.value
            return value[:-100] if len(value) >= 100 and value[-100:-96] == b"NLV2" else value

    return Forger()


def dht_junk(args, stats: Stats) -> None:
    from hivemind import DHT
    from hivemind.utils.timed_storage import get_dht_time

    _, maddrs = _target(args.target)
    dht = DHT(initial_peers=maddrs, host_maddrs=LOOPBACK, start=True, record_validators=[_forger(not args.no_trailer)])
    try:
        stats["ready"] = True
        deadline = time.monotonic() + args.seconds
        honest: set[str] = set()
        while time.monotonic() < deadline and stats.get("stores", 0) < args.count:
            try:
                found = dht.get(f"{args.run_id}/peers", latest=True, return_future=True).result(5)
            except Exception:  # noqa: BLE001 - a read that does not come back
                found = None
            if found is not None and isinstance(found.value, dict):
                honest.update(str(k) for k in found.value if not str(k).startswith("fake-"))
            stats["honest_subkeys_seen"] = len(honest)
            far = get_dht_time() + 10**6
            junk = {"t": far, "name": "junk", "step": 0, "round": 0, "mac": "00" * 32}
            keys = [f"{args.run_id}/peers"] + [f"{args.run_id}/ready/{r}" for r in range(args.rounds)]
            for subkey in [*sorted(honest), f"fake-{secrets.token_hex(4)}"]:
                for key in keys:
                    stats.bump("stores")
                    dht.store(key, junk, far, subkey=subkey, return_future=True)
            stats.save()
            time.sleep(args.pause)
    finally:
        dht.shutdown()


# ------------------------------------------------------------------------------------------ key holders
def _key_holder(args, host=LOOPBACK, validator=None):
    """A DHT under its own libp2p identity (signing its records like an honest peer) and an endpoint on its daemon.

    ``validator(key, identity)``: the record validator to run instead of the honest one.
    """
    from noloco.swarm import RunRecordValidator, SwarmEndpoint, run_key_from, start_peer_dht

    key = run_key_from(None)
    _, maddrs = _target(args.target)
    try:
        from noloco.swarm import PeerIdentity
    except ImportError:  # a tree before per-peer signatures (to measure an attack without the defence)
        dht = start_peer_dht(maddrs, host, record_validators=[RunRecordValidator.create(key, args.run_id, 600)])
        return key, dht, SwarmEndpoint.from_dht(dht, args.run_id, key, send_timeout=20)
    identity = PeerIdentity.generate()
    validator = (validator or (lambda k, i: RunRecordValidator.create(k, args.run_id, 600, i)))(key, identity)
    dht = start_peer_dht(maddrs, host, record_validators=[validator], identity=identity)
    endpoint = SwarmEndpoint.from_dht(dht, args.run_id, key, send_timeout=20, identity=identity)
    return key, dht, endpoint


def ahead(args, stats: Stats) -> None:
    from noloco.swarm import STATE_SERVICE, PeerRegistry, decode_state, encode_state

    key, dht, endpoint = _key_holder(args)
    second = second_dht = None
    try:
        _, second_dht, second = _key_holder(args)  # a second identity, with a DHT node of its own to sign with
        target, _ = _target(args.target)
        deadline = time.monotonic() + args.seconds
        payload = None
        while payload is None and time.monotonic() < deadline:
            try:
                payload = endpoint.request(target, STATE_SERVICE, b"", 20, 1 << 30)
            except Exception as exc:  # noqa: BLE001 - no state yet
                stats["last_error"] = str(exc)
                time.sleep(0.5)
        if payload is None:
            return
        # the numel is what the state says: decode with it, then re-serve at the claimed steps
        numel = int.from_bytes(payload[8:16], "big")
        step, slow, velocity = decode_state(payload, numel, 1)
        stats["honest_step"] = step
        claims = {endpoint: (10**9, 10**8), second: (args.steps + args.every, args.steps // args.every + 1)}
        for ep, (claimed, _) in claims.items():
            state = encode_state(claimed, slow, velocity)
            ep.serve(STATE_SERVICE, lambda request, src, state=state: stats.bump("states_served") or state)
        registries = {endpoint: PeerRegistry(dht, endpoint, "far-ahead"),
                      second: PeerRegistry(second_dht, second, "past-end")}  # fmt: skip
        stats["ready"] = True
        while time.monotonic() < deadline and stats.get("publishes", 0) < args.count:
            for ep, (claimed, claimed_round) in claims.items():
                registries[ep].publish(claimed, claimed_round)
                stats.bump("publishes")
            stats.save()
            time.sleep(args.pause)
    finally:
        for ep in (second, endpoint):
            if ep is not None:
                ep.close()
        for node in (second_dht, dht):
            if node is not None:
                node.shutdown()


def silent(args, stats: Stats) -> None:
    from noloco.swarm import PeerRegistry, SwarmMatchmaking
    from noloco.swarm.matchmaking import Announcement  # noqa: F401 - documents what is read

    _, dht, endpoint = _key_holder(args)
    try:
        mm = SwarmMatchmaking(dht, endpoint, "silent", window=args.window)
        registry = PeerRegistry(dht, endpoint, "silent")
        announced: set[int] = set()
        stats["ready"] = True
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and len(announced) < args.count:
            live = registry.live()
            front = max((e["round"] for e in live if e["round"] >= 0), default=0)
            registry.publish(front * args.every, front)  # listed live, so the honest peers wait for it
            for r in (front, front + 1):
                if r not in announced and mm._ready(r):  # an honest peer is ready for r: be ready too
                    mm._announce(r)
                    announced.add(r)
                    stats["rounds_announced"] = len(announced)
            stats["joins_received"] = sum(1 for (_, _, tag) in endpoint._ctl if tag.startswith("join/"))
            stats.save()
            time.sleep(args.pause)
    finally:
        endpoint.close()
        dht.shutdown()


BAD_TIMES = (float("nan"), float("inf"), -1.0, 1e300, float("-inf"))


def bad_time(args, stats: Stats) -> None:
    """Ready in every round the honest peers announce in, with a NaN, infinite, negative or absurd time (signed
    and MAC'd like an honest record), and listed live with an infinite time (it would never expire)."""
    from hivemind.utils.timed_storage import get_dht_time

    from noloco.swarm import PeerRegistry, SwarmMatchmaking
    from noloco.swarm.matchmaking import sign_record

    _, dht, endpoint = _key_holder(args)
    try:
        mm = SwarmMatchmaking(dht, endpoint, "bad-time", window=args.window)
        registry = PeerRegistry(dht, endpoint, "bad-time")
        announced: set[int] = set()
        stats["ready"] = True
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and len(announced) < args.count:
            live = registry.live()
            front = max((e["round"] for e in live if e["round"] >= 0), default=0)
            t = float("inf")
            text = registry._text(endpoint.peer_id, front * args.every, front, t, "bad-time")
            value = {"step": front * args.every, "round": front, "t": t, "name": "bad-time",
                     **sign_record(endpoint, text)}  # fmt: skip
            dht.store(f"{args.run_id}/peers", value, get_dht_time() + 60, subkey=endpoint.peer_id)
            for r in (front, front + 1):
                if r not in announced and mm._ready(r):  # an honest peer is ready for r: announce a bad time
                    t = BAD_TIMES[len(announced) % len(BAD_TIMES)]
                    value = {"t": t, "name": "bad-time", **sign_record(endpoint, mm._text(r, endpoint.peer_id, t,
                                                                                           "bad-time"))}  # fmt: skip
                    dht.store(f"{args.run_id}/ready/{r}", value, get_dht_time() + mm.ready_ttl, subkey=endpoint.peer_id)
                    announced.add(r)
                    stats["rounds_announced"] = len(announced)
            stats.save()
            time.sleep(args.pause)
    finally:
        endpoint.close()
        dht.shutdown()


def _sybil_validator(args, identities: dict):
    """A validator that signs each record with the identity its subkey names (the key holder holds them all)."""
    from noloco.swarm.dht import _TRAILER, RunRecordValidator, record_owner

    def make(key, identity):
        class Sybils(RunRecordValidator.create(key, args.run_id, 600, identity).__class__):
            def sign_value(self, record) -> bytes:
                signed = self._signed_bytes(record)
                owner = identities.get(record_owner(record.subkey), identity)
                signature = owner.sign(b"noloco-dht-sig/2" + signed)
                return bytes(record.value) + _TRAILER + signature + key.mac(b"noloco-dht/2", signed)

        return Sybils(key, args.run_id, 600, identity)

    return make


def sybils(args, stats: Stats) -> None:
    """``--identities`` Ed25519 identities of one key holder, all on its one DHT node (no daemon each): each lists
    itself live and announces itself ready in every round the honest peers announce in; none ever confirms."""
    from hivemind.utils.timed_storage import get_dht_time

    from noloco.swarm import PeerIdentity, PeerRegistry, SwarmMatchmaking
    from noloco.swarm.matchmaking import SIGNATURE_DOMAIN

    fakes = [PeerIdentity.generate() for _ in range(args.identities)]
    by_id = {i.peer_id: i for i in fakes}
    key, dht, endpoint = _key_holder(args, validator=_sybil_validator(args, by_id))
    try:
        mm = SwarmMatchmaking(dht, endpoint, "sybil", window=args.window)
        registry = PeerRegistry(dht, endpoint, "sybil")

        def signed(identity, text: bytes) -> dict:
            return {"mac": key.mac(text).hex(), "sig": identity.sign(SIGNATURE_DOMAIN + text).hex()}

        announced: set[int] = set()
        stats["ready"], stats["identities"] = True, len(fakes)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and len(announced) < args.count:
            live = [e for e in registry.live() if e["peer"] not in by_id]
            front = max((e["round"] for e in live if e["round"] >= 0), default=0)
            now = get_dht_time()
            for n, fake in enumerate(fakes):  # listed live: the honest peers expect them
                name, step = f"sybil-{n}", front * args.every
                text = f"alive|{args.run_id}|{fake.peer_id}|{step}|{front}|{now}|{name}".encode()
                value = {"step": step, "round": front, "t": now, "name": name, **signed(fake, text)}
                dht.store(f"{args.run_id}/peers", value, now + 60, subkey=fake.peer_id, return_future=True)
            for r in (front, front + 1):
                if r not in announced and any(e.peer not in by_id for e in mm._ready(r)):
                    now = get_dht_time()
                    for n, fake in enumerate(fakes):
                        name = f"sybil-{n}"
                        text = "|".join(map(str, ("ready", args.run_id, r, fake.peer_id, now, name))).encode()
                        dht.store(f"{args.run_id}/ready/{r}", {"t": now, "name": name, **signed(fake, text)},
                                  now + mm.ready_ttl, subkey=fake.peer_id, return_future=True)  # fmt: skip
                    announced.add(r)
                    stats["rounds_announced"] = len(announced)
            stats.save()
            time.sleep(args.pause)
    finally:
        endpoint.close()
        dht.shutdown()


def flood(args, stats: Stats) -> None:
    from noloco.swarm import STATE_SERVICE

    _, dht, endpoint = _key_holder(args)
    try:
        target, _ = _target(args.target)
        stats["ready"] = True
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and stats.get("requests", 0) < args.count:
            stats.bump("requests")
            try:
                payload = endpoint.request(target, STATE_SERVICE, b"", 20, 1 << 30)
                stats.bump("states")
                stats.bump("state_bytes", len(payload))
            except Exception as exc:  # noqa: BLE001 - refused: throttled; or the target has exited (trained out)
                error = str(exc)
                stats.bump("unreachable" if "Connect failed" in error or "failed to dial" in error else "refused")
                if "throttled" in error:
                    stats.bump("throttled")
                stats["last_error"] = error[:200]
            stats.save()
            time.sleep(args.pause)
    finally:
        endpoint.close()
        dht.shutdown()


def mute(args, stats: Stats) -> None:
    from noloco.swarm import PeerRegistry, SwarmMatchmaking

    _, dht, endpoint = _key_holder(args)
    registry = PeerRegistry(dht, endpoint, "mute")

    def front() -> int:
        return max((e["round"] for e in registry.live() if e["round"] >= 0), default=0)

    try:
        mm = SwarmMatchmaking(dht, endpoint, "mute", window=args.window, slack=0.5, confirm_timeout=4, timeout=8,
                              front=front)  # fmt: skip
        mm._settle = lambda: None  # it never strikes anyone: it wants to be in every group
        stats["ready"] = True
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and stats.get("groups", 0) < args.count:
            round_index = front()
            registry.publish(round_index * args.every, round_index)  # listed live: the honest peers expect it
            if round_index < args.from_round:  # listed, not yet in the draws: the honest peers first meet in step
                time.sleep(0.2)
                continue
            group = mm.form(round_index, 8)
            if group is None:
                stats.bump("no_group")
                stats.save()
                continue
            stats.bump("groups")
            stats.save()
            # confirmed: the partners now send their data and wait for ours, which never comes
            held = time.monotonic() + args.hold
            while time.monotonic() < min(held, deadline):
                time.sleep(0.1)
            group_id = group.transport.group_id
            stats.bump("data_received", len({src for (g, src, _) in endpoint._inbox if g == group_id}))  # who sent
            mm.release(group)
            stats.save()
    finally:
        endpoint.close()
        dht.shutdown()


def _bad_messages(args, endpoint, group, stats: Stats) -> None:
    """In a confirmed group, the round's first reduction (``delta``, two-phase): learn the call from a partner's
    message to this member, then send every partner a contribution with NaN scales (``nan``), one encoding a
    few values too many (``long``), or a valid one followed by nothing (``partial``: no reduced segment)."""
    from dataclasses import replace

    import torch

    from noloco.collectives import get_codec
    from noloco.collectives.message import message_layout
    from noloco.collectives.protocol import HEADER_BYTES, PHASE_GATHER, PHASE_REDUCE, Header
    from noloco.collectives.two_phase import segment_bounds

    members, me, gid = group.transport.members, group.transport.rank, group.transport.group_id
    suffix, found, deadline = f"/p{PHASE_REDUCE}/s{me}/h0", None, time.monotonic() + 20
    while found is None and time.monotonic() < deadline:  # the first reduction's message of any partner
        found = next(((src, tag) for (g, src, tag) in list(endpoint._inbox) if g == gid and tag.endswith(suffix)), None)
        time.sleep(0.02)
    if found is None:
        stats["last_error"] = "no partner sent anything"
        return
    raw = endpoint.take(gid, found[0], found[1], 1)
    seen, call = Header.unpack(raw), found[1][: -len(suffix)]  # e.g. outer/r3/delta/two_phase
    bounds = segment_bounds(seen.numel, seen.group_size)
    size = len(raw) - HEADER_BYTES  # the honest codec: the one whose message for that segment has this size
    codec = next(c for c in map(get_codec, (args.codec, "int4", "fp32", "int8", "bf16"))
                 if c.nbytes(bounds[me][1] - bounds[me][0]) == size)  # fmt: skip
    stats["call"], stats["codec"] = call, codec.name

    def message(phase: int, segment: int) -> bytes:
        numel = bounds[segment][1] - bounds[segment][0]
        extra = 3 if args.mode == "long" else 0
        body, _ = codec.encode_message(torch.full((numel + extra,), 1e-3), HEADER_BYTES)
        raw = bytearray(body.numpy().tobytes())
        if args.mode == "nan":
            layout = message_layout(codec.spec, numel)[0] if hasattr(codec, "spec") else ()
            sections = {name: (dtype, count, offset) for name, dtype, count, offset in layout}
            dtype, count, offset = sections.get("scales", (torch.float32, numel, 0))  # fp32: every value NaN
            size = torch.empty(0, dtype=dtype).element_size()  # scales may be stored as raw 16-bit words
            floats = {2: torch.float16, 4: torch.float32}[size]
            nan = torch.full((count,), float("nan"), dtype=floats).view(torch.uint8).numpy().tobytes()
            raw[HEADER_BYTES + offset : HEADER_BYTES + offset + len(nan)] = nan
        raw[:HEADER_BYTES] = replace(seen, phase=phase, sender=me, segment=segment).pack()
        return bytes(raw)

    for k, dst in enumerate(members):
        if dst != endpoint.peer_id:
            endpoint.send_frame("data", group.round, gid, dst, f"{call}/p{PHASE_REDUCE}/s{k}/h0",
                                message(PHASE_REDUCE, k))  # fmt: skip
    stats.bump("bad_contributions")
    if args.mode != "partial":
        for dst in members:
            if dst != endpoint.peer_id:
                endpoint.send_frame("data", group.round, gid, dst, f"{call}/p{PHASE_GATHER}/s{me}/h0",
                                    message(PHASE_GATHER, me))  # fmt: skip


def bad_data(args, stats: Stats) -> None:
    """Ready, listed live and confirming every round like an honest peer, then sends bad data (``--mode``)."""
    from noloco.swarm import PeerRegistry, SwarmMatchmaking

    _, dht, endpoint = _key_holder(args)
    registry = PeerRegistry(dht, endpoint, "bad-data")

    def front() -> int:
        return max((e["round"] for e in registry.live() if e["round"] >= 0), default=0)

    try:
        mm = SwarmMatchmaking(dht, endpoint, "bad-data", window=args.window, slack=0.5, confirm_timeout=4, timeout=8,
                              front=front)  # fmt: skip
        mm._settle = lambda: None  # it never strikes anyone: it wants to be in every group
        stats["ready"] = True
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and stats.get("groups", 0) < args.count:
            round_index = front()
            registry.publish(round_index * args.every, round_index)  # listed live: the honest peers expect it
            if round_index < args.from_round:  # listed, not yet in the draws: the honest peers first meet in step
                time.sleep(0.2)
                continue
            group = mm.form(round_index, 8)
            if group is None:
                stats.bump("no_group")
                stats.save()
                continue
            stats.bump("groups")
            try:
                _bad_messages(args, endpoint, group, stats)
            except Exception as exc:  # noqa: BLE001 - a partner refused: it left the group
                stats["last_error"] = str(exc)[:200]
            time.sleep(1.0)
            mm.release(group)
            stats.save()
    finally:
        endpoint.close()
        dht.shutdown()


def _forging_validator(args):
    """A key holder's DHT validator that stores anything locally and MACs and signs (with its own identity)
    whatever it stores, under any subkey: the honest nodes must see through it."""
    from noloco.swarm.dht import _SIGNED, _TRAILER, RunRecordValidator

    def make(key, identity):  # (a tree before per-peer signatures takes the honest validator: the MAC is enough)
        class Forger(RunRecordValidator.create(key, args.run_id, 600, identity).__class__):
            def validate(self, record) -> bool:
                return True

            def sign_value(self, record) -> bytes:
                signed = self._signed_bytes(record)
                forged = identity.sign(b"noloco-dht-sig/2" + signed)  # not the subkey's owner
                return bytes(record.value) + _TRAILER + forged + key.mac(b"noloco-dht/2", signed)

            def strip_value(self, record) -> bytes:
                return bytes(record.value)[:-_SIGNED]

        return Forger(key, args.run_id, 600, identity)

    return make


def forge(args, stats: Stats) -> None:
    from hivemind.utils.timed_storage import get_dht_time

    try:
        from noloco.swarm.matchmaking import sign_record
    except ImportError:  # a tree before per-peer signatures: records carry the run key's MAC only

        def sign_record(endpoint, text: bytes) -> dict:
            return {"mac": endpoint.key.mac(text).hex()}

    key, dht, endpoint = _key_holder(args, validator=_forging_validator(args))
    try:
        stats["ready"] = True
        deadline = time.monotonic() + args.seconds
        honest: dict[str, str] = {}  # peer id -> name
        while time.monotonic() < deadline and stats.get("stores", 0) < args.count:
            try:
                found = dht.get(f"{args.run_id}/peers", latest=True, return_future=True).result(5)
            except Exception:  # noqa: BLE001 - a read that does not come back
                found = None
            if found is not None and isinstance(found.value, dict):
                for peer, item in found.value.items():
                    value = getattr(item, "value", None)
                    if str(peer) != endpoint.peer_id and isinstance(value, dict) and value.get("round", -1) >= 0:
                        honest[str(peer)] = str(value.get("name"))
            stats["honest_subkeys_seen"] = len(honest)
            now = get_dht_time()
            # the round the honest peers are in: the latest ready list holding a real (not forged: t ~ now) entry
            for r in range(stats.get("front", 0), stats.get("front", 0) + 4):
                try:
                    ready = dht.get(f"{args.run_id}/ready/{r}", latest=True, return_future=True).result(5)
                except Exception:  # noqa: BLE001
                    ready = None
                entries = ready.value.values() if ready is not None and isinstance(ready.value, dict) else []
                if any(isinstance(e.value, dict) and abs(float(e.value.get("t", 0)) - now) < 600 for e in entries):
                    stats["front"] = r
            expiry = now + 200  # later than the honest records' (120 s, 75 s), within the bound (240 s)
            front = stats.get("front", 0)
            for peer, name in honest.items():
                # "finished" in the registry: the others would stop waiting for it and skip their rounds
                text = f"alive|{args.run_id}|{peer}|{args.steps}|-1|{now}|{name}".encode()
                value = {"step": args.steps, "round": -1, "t": now, "name": name, **sign_record(endpoint, text)}
                dht.store(f"{args.run_id}/peers", value, expiry, subkey=peer, return_future=True)
                stats.bump("stores")
                for r in range(front, front + 3):  # ready far from now: its partners would never see it
                    t = now + 3600
                    text = "|".join(map(str, ("ready", args.run_id, r, peer, t, name))).encode()
                    value = {"t": t, "name": name, **sign_record(endpoint, text)}
                    dht.store(f"{args.run_id}/ready/{r}", value, expiry, subkey=peer, return_future=True)
                    stats.bump("stores")
            stats.save()
            time.sleep(args.pause)
    finally:
        endpoint.close()
        dht.shutdown()


ATTACKS = {"streams": streams, "dht-junk": dht_junk, "ahead": ahead, "silent": silent, "bad-time": bad_time,
           "flood": flood, "mute": mute, "forge": forge, "sybils": sybils, "bad-data": bad_data}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("attack", choices=sorted(ATTACKS))
    parser.add_argument("--target", required=True, help="maddrs.json of the peer attacked (its id and addresses)")
    parser.add_argument("--run-id", default="noloco")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--pause", type=float, default=0.1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--declare-mb", type=float, default=256.0)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--identities", type=int, default=8, help="sybils: identities of the one key holder")
    parser.add_argument("--mode", choices=["nan", "long", "partial"], default="nan", help="bad-data: what it sends")
    parser.add_argument("--from-round", type=int, default=0, help="mute, bad-data: the first round it is drawn in")
    parser.add_argument("--codec", default="int4", help="bad-data: the honest peers' comm.codec")
    parser.add_argument("--hold", type=float, default=10.0, help="mute: seconds a confirmed group is held open")
    parser.add_argument("--no-trailer", action="store_true", help="dht-junk: plain junk values (for a tree before #14)")
    args = parser.parse_args()
    stats = Stats(args.out, attack=args.attack)
    started = time.monotonic()
    try:
        ATTACKS[args.attack](args, stats)
    finally:
        stats["seconds"] = round(time.monotonic() - started, 1)
        stats["done"] = True
        stats.save(force=True)


if __name__ == "__main__":
    main()
