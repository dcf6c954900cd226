"""Hostile peers inside the rounds (issue #14, attacks 8-10): a key holder announcing NaN or absurd times, sybil
identities of one key holder, and one sending bad data; attacks 1-7 are in test_hostile.py. Each attack by a real
process against real peers, DHT and p2pd on loopback; the honest side is ``Swarm.pair`` and ``Swarm.check_trained``
(conftest.py). Numbers measured with these tests are in docs/reliability.md.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_a_key_holder_announcing_nan_or_absurd_times_is_dropped_and_struck(swarm):
    """Attack 8: ready in every round with a NaN, infinite, negative or absurd time (MAC'd and signed), listed
    live with an infinite time. Before the check, a NaN time broke every peer's window search (0 of 20 rounds)."""
    steps, every = 200, 10
    swarm.pair(steps, every)
    stats_path = swarm.attacker("bad-time", "bad-time", "a", "--seconds", "120", "--count", "100", "--pause", "0.2",
                                "--every", str(every), key=swarm.key)  # fmt: skip
    stats, a, b = swarm.outcome(("a", "b"), stats_path, 200)
    print(
        f"attack 8: attacker {stats}; a {a['round_outcomes']}; a rejected {a['rejected_messages']}; "
        f"rounds joined a={a['rounds_joined']}/{a['rounds']} b={b['rounds_joined']}/{b['rounds']}"
    )
    assert stats.get("rounds_announced", 0) >= 5, stats
    for s in (a, b):
        assert s["rejected_messages"].get("invalid_record", 0) >= 2, s["rejected_messages"]
        assert not any(o.startswith("error") for o in s["round_outcomes"]), s["round_outcomes"]
        swarm.check_trained(s, min_joined=s["rounds"] - 2)


@pytest.mark.parametrize("identities", [4])
def test_sybil_identities_of_one_key_holder_are_drawn_around(swarm, identities):
    """Attack 9: one key holder lists ``identities`` identities (no daemon each), ready in every round and never
    confirming. Before the retry draw, 4 of them brought the honest peers to 1 of 20 rounds (8: 0 of 20). Each
    identity costs at most the rounds before its penalty (2 strikes), so a fifth of the rounds held on a
    loaded machine, where a redraw may find too little time (a full suite on 2 cores once formed 4 of 20; a quarter
    held before); the rounds formed on a quiet one are measured by ``python -m benchmarks.hostile_swarm``
    (docs/reliability.md: 20 of 20). With 8 identities on a machine as loaded as CI's, one run formed 5 of 20. A CI
    run formed 3 of 20 before the chain of a window left penalized identities out and the redraw waited for the
    window's last read (tests/swarm/test_catching_up.py has both cases), and a full suite on 2 cores formed 3 of 20
    again after (most lost rounds ``late``: the honest peers out of step under that load), so a tenth is asserted:
    without the retry draw, 4 identities left 1 of 20. With pushed announcements it formed 0 of 20 in CI and in
    half the runs alone, until a window of penalized announcements stopped counting as a group that formed without
    the honest peers (test_catching_up.py); 6 runs alone then formed 9 to 20. A full suite then formed 0 of 20
    once more: each honest peer struck, and so penalized, the other, which it had drawn only because its own
    penalties cut the window (tests/swarm/test_defences.py)."""
    steps, every = 200, 10
    swarm.pair(steps, every)
    stats_path = swarm.attacker("sybils", "sybils", "a", "--seconds", "150", "--count", "100", "--pause", "0.2",
                                "--every", str(every), "--identities", str(identities), key=swarm.key)  # fmt: skip
    stats, a, b = swarm.outcome(("a", "b"), stats_path, 300)
    print(
        f"attack 9 ({identities} sybils): attacker {stats}; a {a['round_outcomes']}; a rejected "
        f"{a['rejected_messages']}; rounds joined a={a['rounds_joined']}/{a['rounds']} "
        f"b={b['rounds_joined']}/{b['rounds']}"
    )
    assert stats.get("rounds_announced", 0) >= 5, stats
    for s in (a, b):
        assert s["rejected_messages"].get("no_confirm", 0) >= 1, s["rejected_messages"]
        swarm.check_trained(s, min_joined=s["rounds"] // 10)


@pytest.mark.parametrize("mode", ["nan", "partial"])
def test_a_key_holder_sending_bad_data_is_struck_and_the_others_average_without_it(swarm, mode):
    """Attack 10: confirms every round, then sends contributions with NaN int4 scales, or its first messages and
    then nothing. Before the retry, every round of its group failed and it was never struck; now the honest members
    run the round again among themselves, and it is left out. (``hostile.py bad-data --mode long``, a payload a few
    values too long, takes the NaN payload's path here: the decode refuses it, ``invalid_data``; every mutation of
    a payload's bytes and sizes is refused at the decode in tests/reliability/test_fuzz_collectives.py.)

    The retry needs a group of all three. The attacker is ready at once in every round, so an honest peer more
    than a window behind the other leaves it a pair with the one on time; on a loaded machine one peer's first
    steps ran 4x slower than the other's and both of the attacker's offences were such pairs (penalised, it
    never met both). So it joins the draws from round 2, after the honest peers' first rounds put them in step, and
    the honest peers take at least 0.05 s a step (10 s for the run), time for the attacker's few groups."""
    steps, every = 200, 10
    swarm.pair(steps, every, "comm.recv_timeout=6", attacker=True, pace=0.05)
    stats_path = swarm.attacker("bad-data", "bad-data", "a", "--seconds", "150", "--count", "100", "--mode", mode,
                                "--every", str(every), "--from-round", "2", key=swarm.key)  # fmt: skip
    stats, a, b = swarm.outcome(("a", "b"), stats_path, 300)
    print(
        f"attack 10 ({mode}): attacker {stats}; a {a['round_outcomes']}; a rejected {a['rejected_messages']}; "
        f"b rejected {b['rejected_messages']}; rounds joined a={a['rounds_joined']}/{a['rounds']} "
        f"b={b['rounds_joined']}/{b['rounds']}; retried a={a.get('rounds_retried')} b={b.get('rounds_retried')}"
    )
    assert stats.get("bad_contributions", 0) >= 1, stats
    rejected = [s["rejected_messages"] for s in (a, b)]
    reason = "no_data" if mode == "partial" else "invalid_data"
    assert sum(r.get(reason, 0) for r in rejected) >= 2, rejected
    for s, r in zip((a, b), rejected):
        # a repeat offender is penalised (left out of the next draws); one offence is struck, not yet penalised.
        # Whether it is then seen left out of a window ("penalized") depends on when it announces, so the test
        # checks the penalty each peer imposed (invalid payloads are counted for good; no_data strikes count in a
        # row only, and a partial sender's first messages are data).
        if reason == "invalid_data" and r.get(reason, 0) >= 2:
            assert s["penalties"].get(reason, 0) >= 1, (r, s["penalties"])
    assert sum(s.get("rounds_retried", 0) for s in (a, b)) >= 1, (a.get("rounds_retried"), b.get("rounds_retried"))
    for s in (a, b):
        # lost: rounds where it was the only partner (a 2-member group: skipped), and ones where the honest
        # peers' penalties of it differed and the redraw did not reconcile them
        swarm.check_trained(s, min_joined=s["rounds"] - 5)
