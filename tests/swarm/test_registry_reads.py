"""How often a peer reads the registry of live peers: real DHT nodes and p2pd daemons in this process.

Each read is a DHT search that visits up to ~20 nodes and carries every live peer's entry; matchmaking asks three
questions of it each round (the swarm's front, whether anyone is left, who is expected), and answering each with a
read of its own made the reads of a 64-peer swarm grow as N x N (registry reads took 0.69 s of a 1.6 s round on 16
cores; docs/results/scale.md section 3).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from noloco.train.backends.hivemind import LISTING_REUSE, HivemindBackend
from noloco.train.config import load_config

RUN = "registry-reads-test"


@dataclasses.dataclass
class _Steps:
    """What the backend reads of the outer algorithm after a step: its round period, inner steps, the round landed."""

    period: int
    inner_step: int = 0
    last_round: object = None


@pytest.fixture(scope="module")
def backend(in_process_peers):
    """Peer 0's backend (its registry listed with peer 1's entry) and the number of registry reads it made."""
    with in_process_peers(RUN, "registry-reads-test-key-0123456", 2) as peers:
        cfg = load_config(["backend=hivemind", "steps=100", "outer.every=10", "peer.window=0.5", "peer.slack=0.2",
                           "peer.matchmaking_timeout=1"])  # fmt: skip
        ours = HivemindBackend(cfg, *peers[0], "p0", 0, lambda line: None)
        other = HivemindBackend(cfg, *peers[1], "p1", 1, lambda line: None)
        other.publish(0, next_round=0)
        ours.publish(0, next_round=0)
        reads = []
        live = ours.registry.live
        ours.registry.live = lambda fetched=None: (reads.append(time.monotonic()), live(fetched))[1]
        yield ours, other.endpoint.peer_id, reads


def test_a_round_reads_the_registry_once_for_all_its_questions(backend):
    ours, other, reads = backend
    time.sleep(LISTING_REUSE)  # nothing left from the fixture's publishing
    group = ours.matchmaking.form(0, timeout=1.0)  # peer 1 never announces: the round forms no group
    assert group is None
    record = ours.matchmaking.rounds[-1]
    assert len(reads) == 1, (reads, record)  # the front, anyone left and who is expected: one read
    assert record.listing_seconds > 0, record
    time.sleep(LISTING_REUSE)
    assert ours._expected(0) == {other}
    assert len(reads) == 2  # a later round reads it afresh


def test_the_registry_is_read_a_step_before_the_round_that_asks(backend):
    """After the step before a round the read is under way, and the round's matchmaking takes its answer instead of
    searching the DHT again (it waits only for what is left of that search)."""
    ours, other, reads = backend
    fetches = []
    fetch = ours.registry.fetch
    ours.registry.fetch = lambda: (fetches.append(time.monotonic()), fetch())[1]
    time.sleep(LISTING_REUSE)
    algo = _Steps(period=ours.period)
    for step in range(1, ours.period):  # inner steps 1 .. period - 1: the next one ends round 0
        algo.inner_step = step
        ours.after_step(step, algo)
    assert len(fetches) == 1, fetches
    before = len(reads)
    assert ours.matchmaking.form(0, timeout=1.0) is None  # peer 1 never announces
    assert len(reads) == before + 1 and len(fetches) == 1  # the round read the early search, and no other
    assert ours._fetched[1] is None  # taken
