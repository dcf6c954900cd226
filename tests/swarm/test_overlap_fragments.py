"""Overlapped exchanges and streamed fragments on the swarm (``outer.overlap``, ``outer.fragments``; issue 17).

A swarm round is one outer exchange, every ``outer.every / outer.fragments`` inner steps, numbered as the
outer algorithm numbers them; with k fragments round r exchanges fragment (r + 1) mod k, so a peer catching up
with the swarm skips whole cycles of k rounds and every member of a group exchanges the same fragment. The unit
tests check the round arithmetic on a matchmaking without a DHT; the slow ones run real peer processes (real
DHT and p2pd on loopback, the helpers of ``conftest.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from noloco.comm.base import ByteCounter
from noloco.swarm import SwarmMatchmaking, implausible_rounds
from noloco.swarm.endpoint import RunKey
from noloco.swarm.matchmaking import RoundRecord
from noloco.swarm.state import StateError, decode_state, encode_state


class _Endpoint:
    """What a SwarmMatchmaking reads of its endpoint when no round reaches the DHT."""

    def __init__(self):
        self.key, self.run_id, self.peer_id, self.counter = RunKey(b"k" * 32), "unit", "me", ByteCounter()


def _matchmaking(cycle: int, front: list[int]) -> tuple[SwarmMatchmaking, list[int]]:
    """A matchmaking whose rounds stop before the DHT: returns it and the swarm rounds it tried to form."""
    mm = SwarmMatchmaking(None, _Endpoint(), "me", cycle=cycle, front=lambda: front[0])
    tried: list[int] = []

    def form_nothing(target, record, deadline):
        # listed in the registry as in this round while it matches (with overlap the training thread publishes
        # meanwhile: listing the next round would make a peer that follows it skip the round this one waits in)
        assert mm.listed_round == target and mm.next_round == target + 1
        tried.append(target)
        record.outcome = "no partner"
        return None

    mm._form = form_nothing
    return mm, tried


def test_a_peer_catching_up_with_fragments_skips_whole_cycles_so_its_group_exchanges_its_own_fragment():
    front = [6]  # the most advanced live peers do swarm round 6 next
    mm, tried = _matchmaking(cycle=2, front=front)
    assert mm.form(3, 1.0) is None  # own round 3 (fragment 0): round 6 is fragment 1's, so round 7
    assert mm.form(4, 1.0) is None  # then 8 (own round 4: fragment 1, as round 8's)
    front[0] = 12
    assert mm.form(5, 1.0) is None  # 13, not 12
    assert tried == [7, 8, 13] and all((t - r) % 2 == 0 for t, r in zip(tried, (3, 4, 5)))
    assert mm.record_of(3).round == 7 and mm.record_of(5).round == 13 and mm.record_of(6) is None
    assert mm.next_round == mm.listed_round == 14
    # in step with the swarm, or ahead of it: its own round
    front[0] = 0
    assert mm.form(14, 1.0) is None and tried[-1] == 14
    # one fragment: the round the front does next, as before
    mm, tried = _matchmaking(cycle=1, front=[6])
    mm.form(3, 1.0)
    assert tried == [6]
    assert [mm.target(r, 9) for r in range(4)] == [9, 9, 9, 9]
    assert [SwarmMatchmaking(None, _Endpoint(), "x", cycle=4).target(r, 9) for r in range(4)] == [12, 9, 10, 11]
    with pytest.raises(ValueError):
        SwarmMatchmaking(None, _Endpoint(), "me", cycle=0)


def test_a_peer_is_never_matched_while_an_earlier_rounds_group_is_still_exchanging():
    mm, tried = _matchmaking(cycle=2, front=[0])
    mm._open["group-of-round-5"] = (RoundRecord(5), 0.0, mm.counter.state_dict())
    assert mm.form(7, 1.0) is None  # round 7 is fragment 0's again: round 5 (its last exchange) has not landed
    assert tried == [] and mm.rounds[-1].outcome == "busy: round 5 still exchanging"
    mm._open.clear()
    assert mm.form(8, 1.0) is None and tried == [8]


def test_registry_rounds_and_joined_states_count_exchanges_not_outer_every():
    steps, every, fragments = 40, 10, 2
    period = every // fragments
    entry = lambda r: {"peer": f"p{r}", "name": "p", "step": r * period, "round": r, "t": 0.0}  # noqa: E731
    listed = [entry(r) for r in range(steps // period + 1)]
    assert implausible_rounds(listed, steps, period) == listed  # rounds 0..8 are all in the schedule
    assert len(implausible_rounds(listed, steps, every)) == 5  # counted in rounds of outer.every, 5..8 would not be
    state = encode_state(15, torch.randn(8), torch.randn(8))  # after exchange 2 (round 2 ends step 15)
    assert decode_state(state, 8, period)[0] == 15
    with pytest.raises(StateError, match="not on an outer-round boundary"):
        decode_state(state, 8, every)


def test_fragments_and_overlap_are_accepted_on_the_hivemind_backend():
    from noloco.train.backends.hivemind import exchange_period
    from noloco.train.config import load_config

    cfg = load_config(["backend=hivemind", "outer.every=20", "outer.fragments=4", "outer.overlap=true"])
    assert exchange_period(cfg) == 5
    assert exchange_period(load_config(["backend=hivemind", "outer.every=20"])) == 20


# --- real swarms --------------------------------------------------------------------------------------------


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize(
    "overlap,fragments,tau",
    [("true", 1, 3), ("false", 2, None), ("true", 2, None)],  # overlap lands 3 steps after a send; with fragments at
    ids=["overlap-steps", "fragments", "overlap-fragments"],  # the next boundary
)
def test_two_peers_train_together_with_overlap_or_fragments(swarm, overlap, fragments, tau):
    steps, every = 40, 10
    period = every // fragments
    common = (f"steps={steps}", f"outer.every={every}", f"outer.overlap={overlap}", f"outer.fragments={fragments}",
              "peer.wait_for_peers=1", "peer.join_timeout=120",
              *([f"outer.overlap_steps={tau}"] if tau else []))  # fmt: skip
    swarm.peer("a", *common, "peer.worker=0")
    join = f'peer.initial_peers=["{swarm.maddrs("a", timeout=120)[0]}"]'
    swarm.peer("b", *common, join, "peer.worker=1")
    for name in ("a", "b"):
        assert swarm.finish(name, timeout=300) == 0, swarm.logs()

    summaries = {name: swarm.summary(name) for name in ("a", "b")}
    rounds = {name: _records(swarm.peer_dir(name) / "rounds.jsonl") for name in ("a", "b")}
    seed_loss = max(s["eval_history"][0][1] for s in summaries.values())
    for name, s in summaries.items():
        # one round per exchange from the peer's first step; on a busy machine a peer may miss one
        swarm.check_rounds(s, steps, period)
        assert s["rounds"] == len(rounds[name]), (name, s["round_outcomes"])
        assert s["rounds_joined"] >= s["rounds"] // 2, (name, s["round_outcomes"])
        assert s["slow_weights_finite"] and s["final_eval_loss"] < seed_loss - 0.3, (name, s["eval_history"])
        assert all(b > 0 for b in s["bytes_sent_per_round"])
        metrics = _records(swarm.peer_dir(name) / "metrics.jsonl")
        exchanged = [m for m in metrics if "outer_round" in m]
        # an exchange lands at a round boundary, or τ steps after it (outer.overlap_steps); the last at the end
        lands = 0 if tau is None else tau
        assert exchanged and all(m["step"] % period == lands or m["step"] == steps for m in exchanged), exchanged
        if fragments > 1:
            # the algorithm's fragment of each exchange is the one the swarm round names: peers agree on it
            for record in rounds[name]:
                if "fragment" in record:
                    assert record["fragment"] == (record["round"] + 1) % fragments, (name, rounds[name])
            assert all(m["fragment"] == (m["outer_round"] + 1) % fragments for m in exchanged)
            joined = sorted(r["round"] for r in rounds[name] if r["outcome"] == "joined")
            assert {(r + 1) % fragments for r in joined} == set(range(fragments)), (name, joined)
        else:
            assert all("fragment" not in r for r in rounds[name]) and all("fragment" not in m for m in exchanged)
    # a round both peers joined is one round of one group: each other's partner
    joined = {name: {r["round"] for r in rounds[name] if r["outcome"] == "joined"} for name in rounds}
    both = joined["a"] & joined["b"]
    # in step: at most one round lost (peers that drifted a round apart each wait alone in their own rounds)
    assert len(both) >= min(s["rounds"] for s in summaries.values()) - 1, rounds
    for name, other in (("a", "b"), ("b", "a")):
        for record in rounds[name]:
            if record["round"] in both:
                assert record["partners"] == [other], record
    if fragments > 1:  # both halves of the parameters were averaged in rounds both peers joined
        assert {(r + 1) % fragments for r in both} == set(range(fragments)), both
