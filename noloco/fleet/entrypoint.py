"""Container entry point of a noloco swarm fleet (``docker/compose.yaml``; see ``docs/docker.md``).

Turns ``NOLOCO_*`` environment variables into the command a container runs, after checking them:
``NOLOCO_ROLE=bootstrap`` runs hivemind's bootstrap-only DHT node (``hivemind-dht``) with a persistent
identity and a fixed port; ``NOLOCO_ROLE=worker`` runs one swarm peer,
``python train.py backend=hivemind ...`` (NoLoCo, arXiv 2506.10911, over an open swarm; docs/swarm.md).

Bootstrap discovery: the bootstrap keeps its libp2p private key on a volume (so its peer id survives
restarts) and writes ``<NOLOCO_DATA_DIR>/bootstrap.json`` (peer id, port) on the volume shared with
the workers. A worker waits for that file and for the bootstrap's port to accept connections, resolves
``NOLOCO_BOOTSTRAP_HOST`` (the compose service name) to an IPv4 address, and joins through
``/ip4/<address>/tcp/<port>/p2p/<peer id>``; scaled workers need no manual copying of multiaddrs.

Validation: every variable is checked before anything runs, and the config overrides it produces go
through :func:`noloco.train.config.load_config`; a missing or bad value exits with code 2 and one line
on stderr (``noloco-entrypoint: error: ...``). ``NOLOCO_DRY_RUN=1`` prints the plan instead of running.

Restarts: a restarted worker whose folder on the volume holds a complete checkpoint resumes from it
(``resume=<peer dir>/checkpoints/latest``). One restarted before its first checkpoint
rejoins from the live swarm (``peer.join=auto``: the most advanced live peer's slow
weights, momentum and step; fresh AdamW moments). Its previous ``metrics.jsonl`` is kept as
``metrics.attempt-<k>.jsonl``. A worker whose ``summary.json`` exists has finished and exits 0 at once.
If no live peer answers within ``peer.join_timeout`` it starts from the seed's initial weights.

Throttling: ``NOLOCO_RATE=50mbit`` shapes the container's egress on ``NOLOCO_NET_DEV`` (default
``eth0``) with ``tc tbf`` before training. It needs ``cap_add: [NET_ADMIN]``; without it the
entrypoint fails (it never trains unthrottled when a rate was asked for).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("bootstrap", "worker")
DEFAULT_PORT = 31337
CAP_NET_ADMIN = 12  # bit in /proc/<pid>/status Cap* masks
SWARM_ALGOS = ("noloco", "diloco")

# Plain one-to-one mappings of environment variables onto config keys (omegaconf dotlist).
ENV_TO_CONFIG = {
    "NOLOCO_STEPS": "steps",
    "NOLOCO_ALGO": "outer.algo",
    "NOLOCO_OUTER_EVERY": "outer.every",
    "NOLOCO_GROUP_SIZE": "outer.group_size",
    "NOLOCO_CODEC": "comm.codec",
    "NOLOCO_SLOW_CODEC": "comm.slow_codec",
    "NOLOCO_REDUCTION": "comm.reduction",
    "NOLOCO_COMM_ALGORITHM": "comm.reduction",  # the old name of NOLOCO_REDUCTION
    "NOLOCO_MODEL": "model.preset",
    "NOLOCO_DATA_SOURCE": "data.source",
    "NOLOCO_DATA_PATH": "data.path",
    "NOLOCO_CHECKPOINT_EVERY": "checkpoint.every",
    "NOLOCO_THREADS": "threads",
    "NOLOCO_SEED": "run.seed",
    "NOLOCO_RUN_ID": "peer.run_id",
    "NOLOCO_JOIN": "peer.join",
    "NOLOCO_WAIT_FOR_PEERS": "peer.wait_for_peers",
}


class EnvError(ValueError):
    """A missing or bad environment variable; the message is one line meant for the user."""


@dataclass
class Plan:
    """What the container will do: commands and files, computed (and checked) before any side effect."""

    role: str
    argv: list[str] | None  # the command exec'd at the end; None: nothing to run (already finished)
    env: dict[str, str]
    tc: list[list[str]] = field(default_factory=list)  # tc commands applied first
    notes: list[str] = field(default_factory=list)  # printed before exec
    bootstrap_file: Path | None = None  # bootstrap: written before exec
    bootstrap_record: dict | None = None
    rotate: list[tuple[Path, Path]] = field(default_factory=list)  # (old, new) renames of a previous attempt


def _get(env: dict[str, str], name: str, default: str | None = None) -> str | None:
    value = env.get(name)
    return default if value is None or value.strip() == "" else value.strip()


def _int(env: dict[str, str], name: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
    text = _get(env, name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise EnvError(f"{name}={text!r} is not an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise EnvError(f"{name}={value} is out of range [{minimum}, {maximum if maximum is not None else '...'}]")
    return value


def _float(env: dict[str, str], name: str, default: float) -> float:
    text = _get(env, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise EnvError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise EnvError(f"{name}={text!r} must be > 0 seconds")
    return value


def parse_maddrs(name: str, text: str | None, need_peer_id: bool = True) -> list[str]:
    """A JSON list or a comma/space separated list of multiaddrs, each checked (``/p2p/<id>`` required)."""
    if text is None:
        return []
    from hivemind.utils.multiaddr import Multiaddr

    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise EnvError(f"{name} is not a JSON list of multiaddrs: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise EnvError(f"{name} must be a JSON list of multiaddr strings")
    else:
        items = [i for i in re.split(r"[,\s]+", text) if i]
    for item in items:
        try:
            maddr = Multiaddr(item)
        except Exception as exc:  # noqa: BLE001 - the multiaddr parser raises several types
            raise EnvError(f"{name}: bad multiaddr {item!r}: {str(exc).splitlines()[0]}") from None
        if need_peer_id and "/p2p/" not in str(maddr):
            raise EnvError(f"{name}: multiaddr {item!r} has no /p2p/<peer id> part")
    return items


def rate_from_env(text: str) -> int:
    """``"50mbit"`` → 50_000_000 bits per second (tc units); :class:`EnvError` if malformed."""
    from noloco.fleet.netns import parse_rate as fleet_parse_rate

    try:
        return int(fleet_parse_rate(text))
    except ValueError as exc:
        raise EnvError(f"NOLOCO_RATE: {exc}") from None


def tc_commands(rate_bps: int, dev: str) -> list[list[str]]:
    """Egress shaping: one ``tbf`` at ``rate_bps`` as the root qdisc of ``dev`` (burst ≈ 5 ms, ≥ 16 KiB)."""
    burst = max(16 * 1024, rate_bps // 8 // 200)
    return [["tc", "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "100ms"]]  # fmt: skip


def has_capability(bit: int, mask: str = "CapBnd", status: str = "/proc/self/status") -> bool:
    """Whether capability ``bit`` is in this process's ``mask`` (CapBnd: grantable, CapEff: held now)."""
    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith(mask + ":"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False


def _paths(env: dict[str, str]) -> dict[str, Path | str | int]:
    """Folders and names that both the plan and the health check derive from the environment."""
    data = Path(_get(env, "NOLOCO_DATA_DIR", "/data")).expanduser()
    run_name = _get(env, "NOLOCO_RUN_NAME") or _get(env, "NOLOCO_RUN_ID", "noloco")
    name = _get(env, "NOLOCO_PEER_NAME") or socket.gethostname()
    return {
        "data": data,
        "runs": data / "runs",
        "cache": data / "cache",
        "bootstrap_file": data / "bootstrap.json",
        "identity": Path(_get(env, "NOLOCO_BOOTSTRAP_IDENTITY", str(data / "bootstrap.key"))),
        "name": name,
        "peer_dir": data / "runs" / run_name / f"peer-{name}",
        "run_name": run_name,
    }


def _run_key(env: dict[str, str]) -> str:
    key = _get(env, "NOLOCO_RUN_KEY")
    key_file = _get(env, "NOLOCO_RUN_KEY_FILE")
    if key is None and key_file is not None:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise EnvError(f"NOLOCO_RUN_KEY_FILE={key_file}: cannot read: {exc.strerror}") from None
    if not key:
        raise EnvError("NOLOCO_RUN_KEY (or NOLOCO_RUN_KEY_FILE, a Docker secret) is not set: every peer needs it")
    if len(key.encode()) < 8:
        raise EnvError("NOLOCO_RUN_KEY is too short: use at least 8 bytes (a long random secret)")
    return key


def _train_command(env: dict[str, str]) -> list[str]:
    script = _get(env, "NOLOCO_TRAIN_SCRIPT") or str(Path(__file__).resolve().parents[2] / "train.py")
    if Path(script).is_file():
        return [sys.executable, script]
    return [sys.executable, "-m", "noloco.train.cli"]  # the same main() as train.py


def _bootstrap_plan(env: dict[str, str], paths: dict) -> Plan:
    port = _int(env, "NOLOCO_BOOTSTRAP_PORT", DEFAULT_PORT, 1, 65535)
    listen = _get(env, "NOLOCO_LISTEN_HOST", "0.0.0.0")
    peers = parse_maddrs("NOLOCO_INITIAL_PEERS", _get(env, "NOLOCO_INITIAL_PEERS"))
    announce = parse_maddrs("NOLOCO_ANNOUNCE_MADDRS", _get(env, "NOLOCO_ANNOUNCE_MADDRS"), need_peer_id=False)
    identity = paths["identity"]
    argv = ["hivemind-dht", "--host_maddrs", f"/ip4/{listen}/tcp/{port}", "--identity_path", str(identity)]
    if peers:
        argv += ["--initial_peers", *peers]
    if announce:
        argv += ["--announce_maddrs", *announce]
    plan = Plan("bootstrap", argv, dict(env), bootstrap_file=paths["bootstrap_file"])
    plan.bootstrap_record = {"port": port, "identity": str(identity)}
    return plan


def _discover_bootstrap(env: dict[str, str], paths: dict, wait: float) -> str:
    """Wait for the bootstrap's record on the volume and its open port; return its multiaddr."""
    host = _get(env, "NOLOCO_BOOTSTRAP_HOST", "bootstrap")
    path: Path = paths["bootstrap_file"]
    deadline = time.monotonic() + wait
    record = None
    while record is None:
        try:
            record = json.loads(path.read_text())
            peer_id, port = str(record["peer_id"]), int(record["port"])
        except (OSError, ValueError, KeyError, TypeError):
            record = None
            if time.monotonic() > deadline:
                raise EnvError(f"no bootstrap record {path} after {wait:.0f}s: is the bootstrap service running "
                               "with the same NOLOCO_DATA_DIR volume?") from None  # fmt: skip
            time.sleep(0.5)
    while True:
        try:
            address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            with socket.create_connection((address, port), timeout=2):
                break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise EnvError(f"bootstrap {host}:{port} not reachable after {wait:.0f}s: {exc}") from None
            time.sleep(0.5)
    return f"/ip4/{address}/tcp/{port}/p2p/{peer_id}"


def _worker_plan(env: dict[str, str], paths: dict, discover: bool) -> Plan:
    from noloco.train.config import ConfigError, load_config

    key = _run_key(env)
    name = str(paths["name"])
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        raise EnvError(f"NOLOCO_PEER_NAME={name!r}: use letters, digits, '.', '_', '-' (at most 64)")
    peers = parse_maddrs("NOLOCO_INITIAL_PEERS", _get(env, "NOLOCO_INITIAL_PEERS"))
    announce = parse_maddrs("NOLOCO_ANNOUNCE_MADDRS", _get(env, "NOLOCO_ANNOUNCE_MADDRS"), need_peer_id=False)
    listen = _get(env, "NOLOCO_LISTEN_HOST", "0.0.0.0")
    port = _int(env, "NOLOCO_LISTEN_PORT", 0, 0, 65535)
    wait = _float(env, "NOLOCO_BOOTSTRAP_WAIT", 120.0)
    rate = _get(env, "NOLOCO_RATE")
    rate_bps = rate_from_env(rate) if rate is not None else None
    dev = _get(env, "NOLOCO_NET_DEV", "eth0")
    if not re.fullmatch(r"[A-Za-z0-9._@-]{1,15}", dev):
        raise EnvError(f"NOLOCO_NET_DEV={dev!r} is not a network interface name")
    try:
        extra = shlex.split(_get(env, "NOLOCO_OVERRIDES", "") or "")
    except ValueError as exc:
        raise EnvError(f"NOLOCO_OVERRIDES cannot be split into key=value words: {exc}") from None

    overrides = [
        "backend=hivemind",
        f"run.dir={paths['runs']}",
        f"run.name={paths['run_name']}",
        f"data.cache_dir={paths['cache']}",
        f"peer.name={name}",
        "log.progress=false",  # container logs: one line per event, not progress bars
        f"peer.host_maddrs={json.dumps([f'/ip4/{listen}/tcp/{port}'])}",
    ]
    if announce:
        overrides.append(f"peer.announce_maddrs={json.dumps(announce)}")
    overrides += [f"{key_}={_get(env, var)}" for var, key_ in ENV_TO_CONFIG.items() if _get(env, var) is not None]
    overrides += extra
    try:
        cfg = load_config([*overrides, f"peer.initial_peers={json.dumps(peers)}"])
    except ConfigError as exc:
        raise EnvError(f"bad configuration from the environment: {exc}") from None
    if cfg.outer.algo not in SWARM_ALGOS:
        raise EnvError(f"NOLOCO_ALGO={cfg.outer.algo!r}: a swarm worker runs one of {SWARM_ALGOS}")
    if cfg.backend != "hivemind" or cfg.resume:
        raise EnvError("NOLOCO_OVERRIDES may not change backend= or set resume= (a worker rejoins the live swarm)")

    notes: list[str] = []
    host = _get(env, "NOLOCO_BOOTSTRAP_HOST", "bootstrap")
    host = None if host.lower() == "none" else host  # none: no bootstrap service (NOLOCO_INITIAL_PEERS only)
    if discover and host:
        bootstrap = _discover_bootstrap(env, paths, wait)
        peers = [*peers, bootstrap]
        notes.append(f"bootstrap found: {bootstrap}")
    elif host:
        notes.append(f"bootstrap discovery skipped (dry run): would wait for {paths['bootstrap_file']} and {host}")
    if not peers and not host:
        notes.append("no initial peers and no bootstrap: this worker starts a new swarm")

    peer_dir = Path(cfg.run.dir) / (cfg.run.name or cfg.peer.run_id) / f"peer-{name}"
    child_env = dict(env)
    child_env["NOLOCO_RUN_KEY"] = key
    child_env.pop("NOLOCO_RUN_KEY_FILE", None)
    argv = [*_train_command(env), *overrides, f"peer.initial_peers={json.dumps(peers)}"]
    plan = Plan("worker", argv, child_env, notes=notes)
    if (peer_dir / "summary.json").exists():
        plan.argv = None
        plan.notes.append(f"peer {name} already finished ({peer_dir / 'summary.json'}); nothing to do")
        return plan
    latest = peer_dir / "checkpoints" / "latest"
    if (latest / "COMPLETE").exists():
        plan.argv.append(f"resume={latest}")
        plan.notes.append(f"restart of peer {name}: resuming from its own checkpoint {latest.resolve().name}")
    elif (peer_dir / "metrics.jsonl").exists():
        attempt = 1 + len(list(peer_dir.glob("metrics.attempt-*.jsonl")))
        plan.rotate.append((peer_dir / "metrics.jsonl", peer_dir / f"metrics.attempt-{attempt}.jsonl"))
        plan.notes.append(
            f"restart of peer {name} (attempt {attempt + 1}) before its first checkpoint: "
            f"rejoining from the live swarm's slow weights (peer.join={cfg.peer.join})"
        )
    if rate_bps is not None:
        plan.tc = tc_commands(rate_bps, dev)
    return plan


def build_plan(env: dict[str, str], discover: bool = True) -> Plan:
    """Check ``env`` and compute what to run; :class:`EnvError` (one line) on the first bad value."""
    role = _get(env, "NOLOCO_ROLE")
    if role not in ROLES:
        raise EnvError(f"NOLOCO_ROLE={role!r}: set it to one of {ROLES}")
    paths = _paths(env)
    if role == "bootstrap":
        return _bootstrap_plan(env, paths)
    return _worker_plan(env, paths, discover)


def _apply_tc(commands: list[list[str]]) -> None:
    import shutil

    if not commands:
        return
    if shutil.which("tc") is None:
        raise EnvError("NOLOCO_RATE is set but `tc` (iproute2) is not installed in this image")
    if not has_capability(CAP_NET_ADMIN, "CapBnd"):
        raise EnvError("NOLOCO_RATE is set but the container lacks NET_ADMIN: add `cap_add: [NET_ADMIN]`")
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).strip().splitlines()
            raise EnvError(f"{' '.join(command)} failed: {reason[0] if reason else done.returncode}")


def _write_bootstrap(plan: Plan) -> None:
    """Create (once) the bootstrap's identity, then publish its peer id and port on the shared volume."""
    from hivemind.p2p import P2P, PeerID

    identity = Path(plan.bootstrap_record["identity"])
    identity.parent.mkdir(parents=True, exist_ok=True)
    if not identity.exists():
        P2P.generate_identity(str(identity))
    peer_id = PeerID.from_identity(identity.read_bytes()).to_base58()
    record = {"peer_id": peer_id, "port": plan.bootstrap_record["port"], "written": time.time()}
    plan.bootstrap_file.parent.mkdir(parents=True, exist_ok=True)
    partial = plan.bootstrap_file.with_suffix(".json.partial")
    partial.write_text(json.dumps(record))
    partial.replace(plan.bootstrap_file)  # atomic: a worker never reads half a record
    plan.notes.append(f"bootstrap peer id {peer_id}, port {record['port']} → {plan.bootstrap_file}")


def health(env: dict[str, str]) -> tuple[bool, str]:
    """Container HEALTHCHECK: the bootstrap's port, or the worker's p2p port from its maddrs.json, accepts TCP."""
    role = _get(env, "NOLOCO_ROLE")
    paths = _paths(env)
    if role == "bootstrap":
        ports = [_int(env, "NOLOCO_BOOTSTRAP_PORT", DEFAULT_PORT, 1, 65535)]
    else:
        if (paths["peer_dir"] / "summary.json").exists():
            return True, "finished"
        try:
            maddrs = json.loads((paths["peer_dir"] / "maddrs.json").read_text())["maddrs"]
        except (OSError, ValueError, KeyError):
            return False, f"no {paths['peer_dir'] / 'maddrs.json'} yet"
        ports = sorted({int(m) for m in re.findall(r"/tcp/(\d+)", " ".join(maddrs))})
    for port in ports:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=3):
                return True, f"port {port} open"
        except OSError:
            continue
    return False, f"no p2p port of {ports} accepts connections"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    if args == ["--health"]:
        ok, why = health(env)
        print(f"noloco health: {'ok' if ok else 'unhealthy'}: {why}")
        return 0 if ok else 1
    if args:
        print(f"noloco-entrypoint: error: unknown arguments {args}; configure with NOLOCO_* variables", file=sys.stderr)
        return 2
    dry = _get(env, "NOLOCO_DRY_RUN", "0") not in ("0", "false", "no")
    try:
        plan = build_plan(env, discover=not dry)
        if dry:
            print(json.dumps({"role": plan.role, "argv": plan.argv, "tc": plan.tc, "notes": plan.notes}))
            return 0
        _apply_tc(plan.tc)
        if plan.bootstrap_file is not None:
            _write_bootstrap(plan)
        for old, new in plan.rotate:
            old.rename(new)
    except EnvError as exc:
        print(f"noloco-entrypoint: error: {exc}", file=sys.stderr)
        return 2
    for command in plan.tc:
        plan.notes.append("shaped: " + " ".join(command))
    for note in plan.notes:
        print(f"noloco-entrypoint: {note}", flush=True)
    if plan.argv is None:
        return 0
    print("noloco-entrypoint: exec " + " ".join(shlex.quote(a) for a in plan.argv), flush=True)
    os.execvpe(plan.argv[0], plan.argv, plan.env)  # the run key travels in the environment, never in argv
    return 1  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
