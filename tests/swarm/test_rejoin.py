"""A peer resumed behind its swarm joins the swarm's next round as it gathers (``peer.catch_up``): real peer
processes, a real DHT and real p2pd daemons on loopback."""

from __future__ import annotations

import json
import os
import signal

import pytest

pytestmark = pytest.mark.slow


def _records(swarm, name: str) -> list[dict]:
    path = swarm.peer_dir(name) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_resumed_peer_joins_the_round_the_swarm_gathers_with_the_steps_it_trained(swarm):
    """Peer c dies at step 25 (its checkpoint: step 20); a and b hold themselves (SIGSTOP) at step 35, mid-way
    through round 3, until c has resumed and trains again (one step a second, so its own next round, at step 30,
    is ten seconds away). Released, a and b announce round 3; c, listed in round 3 since it resumed, joins it
    after a step or two of its own: it skips to step 40, the step that ends round 3, instead of training to step 30
    and meeting the swarm a round later."""
    steps = 60
    # windows wide enough for a peer that comes two seconds after the others (its step, then the round's step), on
    # a loaded machine; listings fresh through the hold, so that c is expected in round 3 when the others form it
    common = (f"steps={steps}", "outer.every=10", "checkpoint.every=10", "peer.window=8", "peer.min_window=4",
              "peer.matchmaking_timeout=20", "peer.live_timeout=120", "peer.wait_for_peers=2")  # fmt: skip
    hold = {"NOLOCO_FAULTS": "inner.step@35=stop"}
    a = swarm.peer("a", *common, "peer.worker=0", env=hold)
    join = f'peer.initial_peers=["{swarm.maddrs("a")[0]}"]'
    b = swarm.peer("b", *common, join, "peer.worker=1", env=hold)
    swarm.peer("c", *common, join, "peer.worker=2", env={"NOLOCO_FAULTS": "inner.step@26=kill"})
    assert swarm.finish("c", timeout=200) == -signal.SIGKILL, swarm.logs()
    latest = swarm.peer_dir("c") / "checkpoints" / "latest"
    assert latest.resolve().name == "step_000020"
    swarm.wait(lambda: swarm.stopped(a.pid) and swarm.stopped(b.pid), 150, "a and b did not reach the hold")

    swarm.peer("c", *common, join, "peer.worker=2", f"resume={latest}", env=swarm.paced(steps, 1.0))
    # the resumed run drops the killed one's records past step 20 before it says so
    swarm.wait(lambda: "resuming from its own checkpoint" in (swarm.run_dir / "c.log").read_text(), 150,
               "c did not resume")  # fmt: skip
    swarm.wait(lambda: any(r["step"] > 20 for r in _records(swarm, "c")), 60, "c did not train after resuming")
    for proc in (a, b):
        os.kill(proc.pid, signal.SIGCONT)
    for name in ("a", "b", "c"):
        assert swarm.finish(name, timeout=200) == 0, swarm.logs()

    log = (swarm.run_dir / "c.log").read_text()
    assert "the swarm's round 3 is gathering: joining it" in log, swarm.logs()
    after = [r for r in _records(swarm, "c") if r["step"] > 20]
    trained = [r["step"] for r in after if r["step"] < 40]
    assert trained and trained == list(range(21, trained[-1] + 1)) and trained[-1] < 30, trained  # no own round
    first = next(r for r in after if "outer_round" in r)
    assert (first["step"], first["outer_round"]) == (40, 3), first
    assert first["group"] and "outer_skipped" not in first, (first, swarm.logs())
    assert [r["step"] for r in after if r["step"] >= 40] == list(range(40, steps + 1))
    s = swarm.summary("c")
    assert s["slow_weights_finite"] and s["rounds_joined"] >= 1, s["round_outcomes"]
    assert s["steps_skipped_by_worker"] == [39 - trained[-1]], s["steps_skipped_by_worker"]  # not trained, counted


def test_a_peer_held_rounds_behind_goes_on_from_the_swarms_step_and_finishes_with_it(swarm):
    """Peer c is held (SIGSTOP) at step 8, mid-way through round 1, while a and b form rounds 1 to 3 without it.
    Released, it ends its round 1 at step 10 and matches in the swarm's front: joined there (a round ahead of its
    own), its partners have just ended that round's step, so it goes on from it; late instead, it joins the next
    round that gathers for it with the steps it trained (``peer.catch_up``). Either way it skips the steps it is
    behind and its last rounds come with the others', where without that it would train them alone after the swarm
    had finished (``peer.catch_up=false``: its last rounds find no live peers)."""
    steps, every = 50, 5
    # each step takes at least 0.2 s (a round at least 1 s), so the hold costs c several of the others' rounds
    common = (f"steps={steps}", f"outer.every={every}", "checkpoint.every=0", "checkpoint.final=false",
              f"eval.every={steps}", "eval.batches=1", "log.plot=false", "peer.wait_for_peers=2")  # fmt: skip
    paced = swarm.paced(steps, 0.2)
    swarm.peer("a", *common, "peer.worker=0", env=paced)
    join = f'peer.initial_peers=["{swarm.maddrs("a")[0]}"]'
    swarm.peer("b", *common, join, "peer.worker=1", env=paced)
    held = {"NOLOCO_FAULTS": paced["NOLOCO_FAULTS"].replace("inner.step@8=sleep:0.2", "inner.step@8=stop")}
    c = swarm.peer("c", *common, join, "peer.worker=2", env=held)
    swarm.wait(lambda: swarm.stopped(c.pid), 150, "c did not reach the hold")
    swarm.wait(lambda: any(r.get("outer_round", -1) >= 3 for r in _records(swarm, "a")), 150, "a did not go on")
    os.kill(c.pid, signal.SIGCONT)
    for name in ("a", "b", "c"):
        assert swarm.finish(name, timeout=300) == 0, swarm.logs()

    s = swarm.summary("c")
    skipped = s["steps_skipped_by_worker"][0]
    assert skipped >= every, (s["steps_skipped_by_worker"], s["round_outcomes"], swarm.logs())
    log = (swarm.run_dir / "c.log").read_text()
    assert "going on from the swarm's step" in log or "is gathering: joining it" in log, swarm.logs()
    # it finished with the swarm: its last rounds had the others to meet (without the skip, 15 or more steps after
    # theirs: rounds that find nobody live)
    assert not any(o.startswith(("no live peers", "timeout")) for o in s["round_outcomes"][-2:]), s["round_outcomes"]
    assert s["rounds_joined"] >= 2 and s["slow_weights_finite"], s["round_outcomes"]
    for name in ("a", "b"):  # the hold cost the others nothing: no window waited out for c
        outcomes = swarm.summary(name)["round_outcomes"]
        assert outcomes.count("timeout") == 0 and outcomes.count("joined") >= 7, (name, outcomes)
