"""Rounds formed by two honest swarm peers over 20 rounds, with each hostile key holder present (docs/reliability.md).

Every case starts two honest peers (``python train.py backend=hivemind``, tiny model, 200 steps, a round every 10,
loopback, the short matchmaking windows of tests/swarm) and, except ``honest``, one attacker process
(``tests/swarm/hostile.py``: a real hivemind peer holding the run key that misbehaves):

- ``bad-time``: ready announcements with NaN, infinite, negative or absurd times, registry entry with an
  infinite time;
- ``silent``: ready every round, never confirming; ``mute``: confirming, then sending no data;
- ``bad-data:nan`` / ``bad-data:long`` / ``bad-data:partial``: confirming, then NaN int4 scales, contributions
  encoding a few values too many, or its first messages and then nothing;
- ``sybils:K``: K identities of one key holder (no daemon each), ready and listed live every round.

The attacker starts once both honest peers train (peer ``a`` waits for one live peer, which would otherwise be the
attacker: its first rounds would then pair it with ``a`` alone, and a 2-member group whose other member fails is
skipped). It prints, per case, the rounds each honest peer joined out of its rounds and the seconds its 200
training steps took. ``--ab N`` adds N paired runs of the honest swarm, alternating this tree with ``--base``
(another checkout of the project, e.g. ``git archive <commit> | tar -x -C /tmp/base``), each pair back to back.

Usage: ``python -m benchmarks.hostile_swarm [--cases honest sybils:8 ...] [--ab 3 --base /tmp/base] [--out DIR]``;
writes ``DIR/hostile_swarm.md`` and ``.json`` (DIR: ``runs/benchmarks/hostile_swarm/``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]
KEY = "hostile-swarm-benchmark-key"
STEPS, EVERY = 200, 10
PEER = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.vocab_size=512", "data.seq_len=32",
        "data.batch_size=4", "eval.batches=2", "log.progress=false", "inner.warmup=5", "log.tensorboard=false",
        "threads=1", "comm.recv_timeout=6", "comm.group_timeout=15", "comm.startup_timeout=60",
        'peer.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', "peer.window=3.0", "peer.slack=0.5", "peer.live_timeout=15",
        "peer.confirm_timeout=4", "peer.matchmaking_timeout=8", f"steps={STEPS}", f"outer.every={EVERY}",
        "peer.wait_for_peers=1"]  # fmt: skip
CASES = ["honest", "bad-time", "silent", "mute", "bad-data:nan", "bad-data:long", "bad-data:partial", "sybils:1",
         "sybils:2", "sybils:4", "sybils:8"]  # fmt: skip


def _env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NOLOCO_RUN_KEY"}
    env.update(PYTHONPATH=str(tree), NOLOCO_RUN_KEY=KEY)
    return env


def _attack_args(case: str) -> list[str]:
    attack, _, option = case.partition(":")
    args = [attack, "--seconds", "240", "--count", "100", "--every", str(EVERY), "--pause", "0.2"]
    if attack == "mute":
        args += ["--hold", "6.5"]
    if attack == "bad-data":
        args += ["--mode", option]
    if attack == "sybils":
        args += ["--identities", option]
    return args


def run_case(case: str, cache: Path, tree: Path = ROOT) -> dict:
    """One swarm of two honest peers (and the case's attacker); their rounds joined and training seconds."""
    with tempfile.TemporaryDirectory(prefix="hostile-swarm-") as tmp:
        run_dir, procs = Path(tmp), []

        def start(name: str, command: list[str], env: dict) -> subprocess.Popen:
            log = (run_dir / f"{name}.log").open("w")
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree,
                                    start_new_session=True)  # fmt: skip
            procs.append(proc)
            return proc

        def peer(name: str, *extra: str) -> subprocess.Popen:
            return start(name, [sys.executable, str(tree / "train.py"), "backend=hivemind", *PEER,
                                f"data.cache_dir={cache}", f"run.dir={run_dir}", "run.name=swarm", f"peer.name={name}",
                                *extra], _env(tree))  # fmt: skip

        try:
            a = peer("a", "peer.worker=0")
            maddrs = run_dir / "swarm" / "peer-a" / "maddrs.json"
            deadline = time.monotonic() + 120
            while not maddrs.exists():
                if time.monotonic() > deadline or a.poll() is not None:
                    raise RuntimeError(f"peer a did not start: {(run_dir / 'a.log').read_text()[-2000:]}")
                time.sleep(0.2)
            first = json.loads(maddrs.read_text())["maddrs"][0]
            b = peer("b", "peer.worker=1", f'peer.initial_peers=["{first}"]')
            metrics = run_dir / "swarm" / "peer-b" / "metrics.jsonl"
            while case != "honest" and not metrics.exists() and b.poll() is None and time.monotonic() < deadline + 120:
                time.sleep(0.2)  # the attacker comes once both train: a waits for one peer, which must be b
            if case != "honest":
                start("attacker", [sys.executable, str(ROOT / "tests" / "swarm" / "hostile.py"), *_attack_args(case),
                                   "--target", str(maddrs), "--out", str(run_dir / "attacker.json")],
                      _env(ROOT))  # fmt: skip
            out = {"case": case, "tree": str(tree)}
            for name, proc in (("a", a), ("b", b)):
                if proc.wait(600) != 0:
                    raise RuntimeError(f"peer {name} failed: {(run_dir / f'{name}.log').read_text()[-2000:]}")
                summary = json.loads((run_dir / "swarm" / f"peer-{name}" / "summary.json").read_text())
                lines = (run_dir / "swarm" / f"peer-{name}" / "metrics.jsonl").read_text().splitlines()
                out[name] = {"joined": summary["rounds_joined"], "rounds": summary["rounds"],
                             "seconds": json.loads(lines[-1])["wall"], "retried": summary.get("rounds_retried"),
                             "redrawn": summary.get("rounds_redrawn"),
                             "rejected": summary["rejected_messages"]}  # fmt: skip
            return out
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)


def _row(r: dict) -> str:
    a, b = r["a"], r["b"]
    return (f"| {r['case']} | {a['joined']}/{a['rounds']} | {b['joined']}/{b['rounds']} | "
            f"{a['seconds']:.0f} / {b['seconds']:.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=CASES, help=f"of {CASES}")
    parser.add_argument("--ab", type=int, default=0, help="paired honest runs, this tree vs --base")
    parser.add_argument("--base", type=Path, default=None, help="another checkout of the project (for --ab)")
    common.add_out(parser, "hostile_swarm")
    args = parser.parse_args()
    if args.ab and args.base is None:
        parser.error("--ab needs --base")
    sys.path.insert(0, str(ROOT))
    from noloco.data.corpus import prepare_corpus
    from noloco.train.config import load_config

    cache = Path(tempfile.mkdtemp(prefix="hostile-swarm-data-"))
    cfg = load_config([*PEER, f"data.cache_dir={cache}"])
    prepare_corpus(cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir)
    results, lines = [], ["| case | rounds joined a | rounds joined b | training s (a / b) |", "|---|---|---|---|"]
    for case in args.cases:
        results.append(run_case(case, cache))
        lines.append(_row(results[-1]))
        print(lines[-1], flush=True)
    ab = []
    for i in range(args.ab):
        for tree in (ROOT, args.base) if i % 2 == 0 else (args.base, ROOT):  # alternate which goes first
            ab.append(run_case("honest", cache, tree))
            print(f"A/B {'new' if tree == ROOT else 'base'}: {_row(ab[-1])}", flush=True)
    if ab:
        lines += ["", "| honest A/B | rounds joined (a+b) | training s (mean of a, b) |", "|---|---|---|"]
        for label, tree in (("this tree", ROOT), ("base", args.base)):
            runs = [r for r in ab if Path(r["tree"]) == tree]
            joined = [r["a"]["joined"] + r["b"]["joined"] for r in runs]
            seconds = [(r["a"]["seconds"] + r["b"]["seconds"]) / 2 for r in runs]
            lines.append(f"| {label} | {joined} | {[round(s) for s in seconds]} |")
    print("\n".join(lines))
    common.write_report(args.out, "hostile_swarm", lines, {"cases": results, "ab": ab},
                        command=common.command("hostile_swarm"), machine=common.machine())  # fmt: skip


if __name__ == "__main__":
    main()
