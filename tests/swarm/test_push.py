"""Announcements pushed to the expected peers (``peer.push``): real DHT nodes and p2pd daemons in this process.

Each peer sends its signed announcement straight to the peers it expects and stores it in the DHT without waiting;
a window whose expected peers are all in is read from what was pushed, and every other outcome from the DHT. The
DHT reads of a round's announcements were what grew with N (docs/results/scale.md section 3).
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from noloco.swarm.matchmaking import PUSH_TAG

RUN = "push-test"
PEERS = 4


@pytest.fixture(scope="module")
def swarm(in_process_peers):
    with in_process_peers(RUN, "push-test-key-0123456789abcdef", PEERS) as peers:
        yield peers


def _rounds(form_rounds, swarm, rounds: list[int], push: bool, expects_nobody: int | None = None) -> dict:
    """Every peer forms ``rounds`` in its own thread; ``{(peer, round): (members, outcome, dht reads)}``."""
    from noloco.swarm.matchmaking import SwarmMatchmaking

    ids = [endpoint.peer_id for _, endpoint in swarm]

    def expected(me: int):
        return lambda r: set() if me == expects_nobody else set(ids) - {ids[me]}

    options = dict(group_size=2, window=3.0, slack=1.0, confirm_timeout=5, timeout=15, push=push)
    makers = [SwarmMatchmaking(dht, endpoint, f"p{i}", expected=expected(i), **options)
              for i, (dht, endpoint) in enumerate(swarm)]  # fmt: skip
    results = form_rounds(makers, rounds, 15, "dht_reads", pause=0.3)
    assert len(results) == PEERS * len(rounds), results
    return results


def _joined_alike(results: dict, rounds: list[int]) -> None:
    """Every peer joined every round, and the members of each group drew the same group."""
    for r in rounds:
        groups = {i: results[i, r][0] for i in range(PEERS)}
        assert all(results[i, r][1] == "joined" for i in range(PEERS)), (r, results)
        for i, members in groups.items():
            assert f"p{i}" in members and all(groups[int(m[1:])] == members for m in members), (r, groups)


def test_peers_in_step_form_their_rounds_from_pushed_announcements_without_reading_the_dht(form_rounds, swarm):
    rounds = [0, 1, 2]
    pushed = _rounds(form_rounds, swarm, rounds, push=True)
    _joined_alike(pushed, rounds)
    reads = [pushed[key][2] for key in pushed]
    assert statistics.median(reads) == 0, pushed  # everyone it expects came by push: the DHT was not read
    polled = _rounds(form_rounds, swarm, [3, 4], push=False)
    _joined_alike(polled, [3, 4])
    assert min(polled[key][2] for key in polled) >= 1, polled  # without push every round reads the DHT


def test_a_peer_that_nobody_pushes_to_is_found_in_the_dht_and_the_groups_agree(form_rounds, swarm):
    """Peer 0 expects nobody (its registry read failed, say): it pushes to nobody, the others wait for it until
    their window closes and then find it in the DHT; it reads the DHT to decide its own window."""
    rounds = [10, 11]
    results = _rounds(form_rounds, swarm, rounds, push=True, expects_nobody=0)
    _joined_alike(results, rounds)
    assert all(results[0, r][2] >= 1 for r in rounds), results  # peer 0 decided on DHT reads


def test_a_pushed_record_that_its_sender_did_not_sign_is_refused_and_counted(swarm):
    from noloco.swarm.matchmaking import SwarmMatchmaking

    (dht, receiver), (_, honest), (_, liar) = swarm[0], swarm[1], swarm[2]
    maker = SwarmMatchmaking(dht, receiver, "p0", push=True)
    key, round_index = maker._ready_key(20), 20
    sender = SwarmMatchmaking(swarm[1][0], honest, "p1", push=True)
    sender._push_to = {receiver.peer_id}
    sender._announce(round_index)
    deadline = time.monotonic() + 10
    while not receiver.control_from(key, PUSH_TAG) and time.monotonic() < deadline:
        time.sleep(0.05)
    ((_, payload),) = receiver.control_from(key, PUSH_TAG)
    before = receiver.rejection_counts()
    liar.send_control(key, round_index, receiver.peer_id, PUSH_TAG, payload, 10)  # p1's record, sent by p2
    liar.send_control(maker._ready_key(21), 21, receiver.peer_id, PUSH_TAG, b"{not json", 10)
    found, heard = maker._pushed(round_index)
    assert [e.peer for e in found] == [honest.peer_id] and heard == 2  # p2's copy is not p2's announcement
    assert json.loads(payload)["name"] == "p1"
    assert maker._pushed(21) == ([], 1)
    after = receiver.rejection_counts()
    refused = sum(after.get(k, 0) - before.get(k, 0) for k in ("forged", "unauthenticated"))
    assert refused == 2, (before, after)
