"""Readiness buckets (``peer.buckets``): real DHT nodes and p2pd daemons in this process, real matchmaking.

With B > 1 a round's announcements go to B DHT keys, a peer's key a hash of (run, round, peer id); groups form
within a key only, and a peer that nobody else drew into its key skips the round at once.
"""

from __future__ import annotations

import collections

import pytest

from noloco.swarm.matchmaking import bucket_of

RUN = "bucket-test"
PEERS, BUCKETS = 4, 2


def test_bucket_of_is_shared_changes_with_the_round_and_spreads():
    peers = [f"12D3KooWpeer{i:04d}" for i in range(2000)]
    counts = collections.Counter(bucket_of(RUN, 7, p, 8) for p in peers)
    assert set(counts) == set(range(8)) and min(counts.values()) > 2000 / 8 * 0.8  # about uniform
    assert [bucket_of(RUN, 7, p, 8) for p in peers[:50]] == [bucket_of(RUN, 7, p, 8) for p in peers[:50]]
    assert [bucket_of(RUN, 7, p, 8) for p in peers[:50]] != [bucket_of(RUN, 8, p, 8) for p in peers[:50]]
    assert {bucket_of(RUN, r, p, 1) for r in range(5) for p in peers[:50]} == {0}


@pytest.fixture(scope="module")
def swarm(in_process_peers):
    """``PEERS`` peers: each a DHT node under its own identity and an endpoint on its p2pd, all on loopback."""
    with in_process_peers(RUN, "bucket-test-key-0123456789", PEERS) as peers:
        yield peers


def test_groups_form_within_each_bucket_and_a_lone_peer_skips_at_once(form_rounds, swarm):
    from noloco.swarm.matchmaking import SwarmMatchmaking

    ids = [endpoint.peer_id for _, endpoint in swarm]
    options = dict(group_size=2, window=1.5, slack=0.5, confirm_timeout=4, timeout=10, buckets=BUCKETS)
    makers = [SwarmMatchmaking(dht, endpoint, f"p{i}", expected=lambda r, me=ids[i]: set(ids) - {me}, **options)
              for i, (dht, endpoint) in enumerate(swarm)]  # fmt: skip

    def split(r: int) -> list[int]:
        return sorted(collections.Counter(bucket_of(RUN, r, peer, BUCKETS) for peer in ids).values())

    # rounds whose buckets split the four peers 1 + 3, 2 + 2 and 4 + 0 (increasing: a peer's rounds only go on)
    rounds = sorted(next(r for r in range(200) if split(r) == want) for want in ([1, 3], [2, 2], [4]))

    # window_width stays 0 when the peer never announced in the round
    results = form_rounds(makers, rounds, 10, "window_width", pause=0.2, join=120)
    assert len(results) == PEERS * len(rounds), results

    formed = 0
    for r in rounds:
        buckets = [bucket_of(RUN, r, peer, BUCKETS) for peer in ids]
        for i in range(PEERS):
            members, outcome, width = results[i, r]
            mates = [f"p{j}" for j in range(PEERS) if buckets[j] == buckets[i]]
            if len(mates) == 1:  # nobody it expects drew this key: skipped at once, without announcing or waiting
                assert members is None and outcome == "alone in its bucket" and width == 0, (r, i, results[i, r])
            else:  # every group lies within one bucket (2 or 3 members: a leftover joins the last group)
                assert members is not None and outcome == "joined", (r, i, results[i, r], buckets)
                assert set(members) <= set(mates) and f"p{i}" in members, (r, i, members, mates)
                formed += 1
    assert formed == PEERS * len(rounds) - 1  # everyone joined, except the one peer alone in its bucket


def test_buckets_refuse_bad_values_and_one_group_of_everyone():
    from noloco.swarm.matchmaking import SwarmMatchmaking

    class Endpoint:
        key = run_id = peer_id = "x"
        counter = None

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="buckets must be an integer >= 1"):
            SwarmMatchmaking(None, Endpoint(), "me", buckets=bad)
    with pytest.raises(ValueError, match="needs groups"):
        SwarmMatchmaking(None, Endpoint(), "me", group_size=None, buckets=2)
