"""Ctrl-C on a swarm peer: real peer processes (``python train.py backend=hivemind``), real DHT and p2pd on loopback.

Like the local and torch backends, an interrupted peer saves a checkpoint at the step it stops at, exits 130
with one line saying how to resume, writes no ``summary.json`` and (a swarm's own rule) never lists itself
as finished in the DHT registry, so no other peer takes it for a completed one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

pytestmark = pytest.mark.slow

RESUME_LINE = re.compile(r"interrupted at step (\d+): resume with python train\.py resume=(\S+/checkpoints/latest)")


def _steps(swarm, name: str) -> list[int]:
    path = swarm.peer_dir(name) / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


class Observer:
    """A DHT node of the run's swarm in the test process, holding the run key: reads the peer registry."""

    def __init__(self, run_key: str, run_id: str = "noloco"):
        from noloco.swarm import PeerRegistry, RunRecordValidator, SwarmEndpoint, run_key_from, start_peer_dht

        key = run_key_from(run_key)
        validator = RunRecordValidator.create(key, run_id, max_ttl=600)
        self.dht = start_peer_dht([], ["/ip4/127.0.0.1/tcp/0"], record_validators=[validator])
        self.endpoint = None
        try:
            self.endpoint = SwarmEndpoint.from_dht(self.dht, run_id, key)
            self.registry = PeerRegistry(self.dht, self.endpoint, "observer")
        except BaseException:
            self.close()
            raise
        self.maddr = str(self.dht.get_visible_maddrs()[0])

    def entry(self, name: str) -> dict | None:
        return next((e for e in self.registry.live() if e["name"] == name), None)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        self.dht.shutdown()


@pytest.fixture
def observer(swarm):
    node = Observer(swarm.key)
    try:
        yield node
    finally:
        node.close()


def test_an_interrupted_peer_saves_exits_130_is_not_listed_as_finished_and_resumes(swarm, observer):
    common = ("steps=400", "outer.every=5", "checkpoint.every=1000", "peer.join=never", "peer.matchmaking_timeout=1",
              f'peer.initial_peers=["{observer.maddr}"]')  # fmt: skip
    peer = swarm.peer("p", *common)
    # listed after its first outer round (step 5): its registry records reach the observer's node
    swarm.wait(lambda: (observer.entry("p") or {}).get("step", 0) >= 5, 240, "the peer was never listed past step 5")
    os.kill(peer.pid, signal.SIGINT)  # the peer only (`kill -INT`): its p2pd lives on and could publish
    assert swarm.finish("p", timeout=120) == 130, swarm.logs()

    log = (swarm.run_dir / "p.log").read_text()
    match = RESUME_LINE.search(log)
    assert match, log
    stopped, latest = int(match.group(1)), match.group(2)
    assert 5 <= stopped < 400 and "the run key" in log.splitlines()[-1], log
    assert "done ·" not in log, log  # no end-of-run line
    folder = swarm.peer_dir("p")
    assert latest == str(folder / "checkpoints" / "latest")
    assert os.readlink(latest) == f"step_{stopped:06d}"
    assert (folder / "checkpoints" / f"step_{stopped:06d}" / "COMPLETE").exists()
    assert not (folder / "summary.json").exists() and not (folder / "rounds.jsonl").exists()
    assert _steps(swarm, "p") == list(range(stopped + 1))
    # Not listed as finished (round -1, which others read as "completed"): its last entry is a training one.
    time.sleep(2.0)  # anything the peer stored on its way out has reached the observer's node
    entry = observer.entry("p")
    assert entry is not None and entry["round"] >= 0 and entry["step"] <= stopped, entry

    # Resumed with the printed command (and the run key): the same folder, even without peer.name.
    swarm.peer("p", f"resume={latest}", "peer.name=null", f"steps={stopped + 4}")
    assert swarm.finish("p", timeout=240) == 0, swarm.logs()
    resumed = (swarm.run_dir / "p.log").read_text()
    assert f"resuming from its own checkpoint at step {stopped}" in resumed, resumed
    summary = swarm.summary("p")
    assert summary["steps"] == stopped + 4 and summary["slow_weights_finite"]
    assert _steps(swarm, "p") == list(range(stopped + 5))  # no step lost or repeated across the interrupt
    assert [p.name for p in swarm.run_dir.joinpath("swarm").iterdir()] == ["peer-p"]


def test_ctrl_c_from_a_terminal_stops_the_peer_and_its_daemons_with_the_resume_line(swarm):
    """A terminal sends SIGINT to the whole process group: the peer, its DHT process and its p2pd."""
    peer = swarm.peer("t", "steps=400", "outer.every=5", "checkpoint.every=1000", "peer.matchmaking_timeout=1")
    swarm.wait(lambda: len(_steps(swarm, "t")) > 3, 240, "the peer did not start training")
    os.killpg(peer.pid, signal.SIGINT)
    assert swarm.finish("t", timeout=120) == 130, swarm.logs()
    assert len(_steps(swarm, "t")) < 400  # stopped, not trained to its end (a step count: load stretches seconds)
    log = (swarm.run_dir / "t.log").read_text()
    match = RESUME_LINE.search(log)
    assert match, log
    stopped = int(match.group(1))
    assert (swarm.peer_dir("t") / "checkpoints" / f"step_{stopped:06d}" / "COMPLETE").exists()
    assert not (swarm.peer_dir("t") / "summary.json").exists()
    swarm.wait(lambda: not swarm.group_members(peer.pid), 20, "the peer's DHT process or p2pd lives on")
