"""The key end-to-end check of issue 7, without a Docker engine: the entrypoint itself, run on the host
with the ``environment:`` of docker/compose.yaml's ``bootstrap`` and ``worker`` services (paths moved to
a temporary volume, addresses to loopback), starts a bootstrap and two workers that find it through
the volume, train a tiny model and exchange — the same command the containers run."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from noloco.data.corpus import prepare_corpus
from noloco.train.config import load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "docker-fleet-key-0123"
TINY = ("model.dim=64 model.n_layers=2 model.n_heads=2 data.vocab_size=512 data.seq_len=32 data.batch_size=4 "
        "eval.batches=2 log.tensorboard=false inner.warmup=5 comm.timeout=15 peer.window=3.0 peer.slack=0.5 "
        "peer.live_timeout=15 peer.confirm_timeout=4 peer.matchmaking_timeout=8 peer.wait_for_peers=1")  # fmt: skip


def compose_environment(service: str, shell: dict[str, str]) -> dict[str, str]:
    """A service's ``environment:`` from docker/compose.yaml, ``${VAR:-default}`` resolved against ``shell``."""
    spec = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"][service]["environment"]

    def resolve(value: str) -> str:
        return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: shell.get(m.group(1)) or (m.group(2) or ""), value)

    return {name: resolve(str(value)) for name, value in spec.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_entrypoint_starts_a_bootstrap_and_two_workers_that_train_and_exchange(tmp_path):
    volume = tmp_path / "data"
    # The corpus, prepared once on the volume so that the two workers do not race to build it.
    cfg = load_config([*TINY.split(), f"data.cache_dir={volume / 'cache'}"])
    prepare_corpus(cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir)
    port = free_port()
    shell = {"NOLOCO_RUN_KEY": KEY, "NOLOCO_BOOTSTRAP_PORT": str(port), "NOLOCO_STEPS": "30",
             "NOLOCO_OUTER_EVERY": "10", "NOLOCO_THREADS": "1", "NOLOCO_OVERRIDES": TINY}  # fmt: skip
    host = {k: v for k, v in os.environ.items() if not k.startswith("NOLOCO_")}
    on_host = {"NOLOCO_DATA_DIR": str(volume), "NOLOCO_LISTEN_HOST": "127.0.0.1"}
    bootstrap_env = {**host, **compose_environment("bootstrap", shell), **on_host,
                     "NOLOCO_BOOTSTRAP_IDENTITY": str(tmp_path / "identity" / "bootstrap.key")}  # fmt: skip
    worker_env = {**host, **compose_environment("worker", shell), **on_host, "NOLOCO_BOOTSTRAP_HOST": "127.0.0.1"}
    assert worker_env["NOLOCO_ROLE"] == "worker" and worker_env["NOLOCO_CODEC"] == "int4"  # the compose defaults

    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, env: dict[str, str]) -> None:
        log = (tmp_path / f"{name}.log").open("w")
        command = [sys.executable, "-m", "noloco.fleet.entrypoint"]
        procs[name] = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # fmt: skip

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    try:
        start("bootstrap", bootstrap_env)
        for name in ("w1", "w2"):
            start(name, {**worker_env, "NOLOCO_PEER_NAME": name})
        for name in ("w1", "w2"):
            try:
                assert procs[name].wait(240) == 0, logs()
            except subprocess.TimeoutExpired:
                raise AssertionError(f"worker {name} did not finish; logs: {logs()}") from None
        assert procs["bootstrap"].poll() is None, logs()  # the bootstrap outlives the workers
        record = json.loads((volume / "bootstrap.json").read_text())
        assert record["port"] == port
        for name in ("w1", "w2"):
            peer_dir = volume / "runs" / "noloco" / f"peer-{name}"
            summary = json.loads((peer_dir / "summary.json").read_text())
            assert summary["rounds_joined"] >= 1, (name, summary, logs())
            assert math.isfinite(summary["final_eval_loss"]), summary
            assert f"/p2p/{record['peer_id']}" in (tmp_path / f"{name}.log").read_text()  # found the bootstrap
            assert KEY not in (peer_dir / "config.yaml").read_text()
        # A restarted container (same name, same volume) whose peer has finished exits at once.
        again = subprocess.run([sys.executable, "-m", "noloco.fleet.entrypoint"], capture_output=True, text=True,
                               env={**worker_env, "NOLOCO_PEER_NAME": "w1"}, cwd=ROOT, timeout=120)  # fmt: skip
        assert again.returncode == 0 and "already finished" in again.stdout, again.stdout + again.stderr
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the peer, its forked DHT process and its p2pd
            except ProcessLookupError:
                pass
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
