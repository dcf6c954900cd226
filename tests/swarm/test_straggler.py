"""Eight real swarm peers on loopback, one of them several times slower: the others still form their rounds.

A peer made slow (``NOLOCO_FAULTS`` sleeps before each of its inner steps) is due in the swarm's rounds but
announces late; with the adaptive deadlines (docs/swarm.md) the others do not wait for it beyond one short
window, and it joins the rounds it is in time for. What is checked is rounds formed, never wall time.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

# 12 rounds: in 8, at the end of a suite that ran 17 min (a loaded box), the fast peers had finished before the
# straggler's third try (late, then two rounds it waited out alone), and it joined none
STEPS, EVERY = 60, 5
PEERS = 8


def test_eight_peers_form_their_rounds_beside_a_straggler(swarm):
    common = (f"steps={STEPS}", f"outer.every={EVERY}", "checkpoint.every=0", "checkpoint.final=false",
              f"eval.every={STEPS}", "eval.batches=1", "log.plot=false",
              f"peer.wait_for_peers={PEERS - 1}", "peer.join_timeout=240")  # fmt: skip
    swarm.peer("0", *common, "peer.worker=0")
    join = f'peer.initial_peers=["{swarm.maddrs("0", timeout=120)[0]}"]'
    for rank in range(1, PEERS - 1):
        swarm.peer(str(rank), *common, join, f"peer.worker={rank}")
    # every step of the straggler starts 0.4 s late: 5 steps a round take 2 s more than the others' (~0.1-0.5 s
    # here, busy cores), and every round it is due in it is late
    swarm.peer("slow", *common, join, f"peer.worker={PEERS - 1}", env=swarm.paced(STEPS, 0.4))
    names = [*map(str, range(PEERS - 1)), "slow"]
    for name in names:
        assert swarm.finish(name, timeout=600) == 0, swarm.logs()

    summaries = {name: swarm.summary(name) for name in names}
    rounds = STEPS // EVERY
    fast = {n: s for n, s in summaries.items() if n != "slow"}
    for name, s in fast.items():
        # one round per EVERY steps from the peer's first step (a peer slow to start joins from the others' state),
        # less the rounds it skipped to go on from the swarm's step after a round it had behind the others'
        swarm.check_rounds(s, STEPS, EVERY)
        # the straggler fails few of a fast peer's rounds: it is named in few of its failures (it may be drawn into a
        # group just as it gives up on a round). Not a floor on each fast peer's rounds joined: on a loaded box a fast
        # peer whose early rounds failed for other reasons (two members that did not confirm, an exchange refused:
        # none the straggler) came out of step with the others and was late in most of its remaining rounds (joined
        # 1 of 11, in a CI run): what the straggler costs is the swarm's total below and its timeouts
        blamed = [o for o in s["round_outcomes"] if "slow" in o.split(":", 1)[-1]]
        assert len(blamed) <= 3, (name, s["round_outcomes"])
        assert s["slow_weights_finite"]
    # of the rounds they had: a fast peer whose round failed (a member that did not confirm, 3-6 s on loaded cores)
    # fell several of these short rounds behind and skipped them to go on from the swarm's step (one skipped 30 steps
    # beside other test files on 2 cores); those rounds it was not there for
    joined = sum(s["rounds_joined"] for s in fast.values())
    had = sum(s["rounds"] for s in fast.values())
    assert joined >= 0.75 * had >= 0.5 * rounds * len(fast), {n: s["round_outcomes"] for n, s in fast.items()}
    # the straggler is not shut out: it was drawn into a group with the others in some round, and averaged with them
    # in it unless a member failed the group. It is in time only while the fast peers still run (60 of its steps
    # take about 30 s, theirs 10-15 s): in a loaded suite run its first round was late, its second group's redraw
    # failed (another member did not confirm), its third late, and the fast peers had finished before its fourth
    slow = summaries["slow"]["round_outcomes"]
    drawn = ("joined", "confirm failed", "redraw failed", "exchange failed")
    assert any(o.startswith(drawn) for o in slow), slow
    # its rounds took longer (it was slower), and it never held the others: none timed out waiting in a window
    outcomes = [o for s in fast.values() for o in s["round_outcomes"]]
    assert outcomes.count("timeout") <= 2, outcomes
