"""Stragglers cost nobody else: the other peers' tokens/s beside one slow peer, and a killed peer's rejoin time.

N real swarm peers (``python train.py backend=hivemind``, a tiny model, NoLoCo pairs) on loopback, for each
matchmaking mode of ``--deadlines`` (``adaptive``: per-round deadlines from recent rounds; ``fixed``: the
``peer.window`` / ``peer.confirm_timeout`` waits; docs/swarm.md):

1. **baseline**: N equal peers. Their compute seconds per inner step (training loop less outer steps) set the
   straggler's delay. Also N − 1 equal peers: the others without the straggler.
2. **straggler**: the same with one peer ``--factor`` times slower (``NOLOCO_FAULTS`` sleeps ``(factor − 1) ×``
   the baseline's compute step before each of its inner steps). Reported: the other peers' median tokens/s
   (training loop: start-up and the wait for peers left out) against N equal peers' and against the N − 1
   others alone, their rounds joined, and the straggler's.
3. **restart** (adaptive only, unless ``--no-restart``): N equal peers with a checkpoint every round; one is
   SIGKILLed (its process group: peer, DHT process, p2pd) after its second round (``--kill-after-steps K``: K inner
   steps after it) and restarted at once from its own checkpoint (``resume=``). Reported: seconds from the restart
   to its first outer round joined with the swarm, and to its first inner step.
4. **supervised restart** (``--supervised-restart``): the same with the killed peer run with ``run.restarts=1``: the
   kill hits its run's process group (the run, its DHT process, p2pd), its supervisor forks the run again from its
   checkpoint with the imports done, and the seconds count from the kill.

``--reps R`` repeats steps 1 and 2 R times, interleaved (N equal, straggler, N − 1 alone, then again), the
straggler's sleep fixed by the first baseline; the report gives each repetition and the medians, since on a shared
machine a baseline moves between runs by more than a straggler costs (docs/results/scale.md). A column that compute
noise moves less: the others' extra seconds in outer steps beside the straggler, over those of the N − 1 alone.

Usage: ``python -m benchmarks.straggler [--peers 8] [--factor 4] [--steps 200] [--every 10] [--reps 1] [--out DIR]
[-- KEY=VALUE ...]`` (the keys: ``train.py`` overrides for the restart's peers, such as a 125M-sized model); writes
``DIR/straggler.md`` and ``DIR/straggler.json`` (default ``runs/benchmarks/straggler/``; ``--name`` renames them);
the peers' run folders go under ``runs/benchmarks/straggler/``. Needs about
``--peers`` cores to be meaningful (each peer trains on one thread); on fewer, the peers' compute shares the
cores and the baseline itself is slow.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/straggler.py`: rerun as `python -m benchmarks.straggler`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.straggler", *sys.argv[1:]])

from benchmarks import common
from benchmarks.peers import TINY, PeerSwarm, children, joined_seconds, slow_steps, tokens_per_second

TOKENS_PER_STEP = 4 * 32  # data.batch_size × data.seq_len of benchmarks.peers.TINY


def _start(swarm: PeerSwarm, names: list[str], common_args: list[str], env: dict[str, dict],
           extra: dict[str, list[str]] | None = None) -> None:  # fmt: skip
    """Start ``names`` (the first one bootstraps the others), all waiting for each other before training;
    ``extra``: more ``train.py`` keys for some of them."""
    wait, extra = [f"peer.wait_for_peers={len(names) - 1}"], extra or {}
    swarm.peer(names[0], *common_args, *wait, "peer.worker=0", *extra.get(names[0], []), env=env.get(names[0]))
    join = f'peer.initial_peers=["{swarm.maddr(names[0])}"]'
    for rank, name in enumerate(names[1:], start=1):
        swarm.peer(name, *common_args, *wait, join, f"peer.worker={rank}", *extra.get(name, []), env=env.get(name))


def swarm_run(folder: Path, peers: int, steps: int, every: int, deadlines: str, slow_seconds: float = 0.0,
              timeout: float = 1800) -> dict:  # fmt: skip
    """One run of ``peers`` peers (the last one slowed by ``slow_seconds`` per step if > 0); per-peer numbers."""
    names = [f"p{i}" for i in range(peers - 1)] + ["slow" if slow_seconds > 0 else f"p{peers - 1}"]
    args = [*TINY, f"steps={steps}", f"outer.every={every}", f"eval.every={steps}", "checkpoint.every=0",
            f"peer.deadlines={deadlines}"]  # fmt: skip
    env = {"slow": {"NOLOCO_FAULTS": slow_steps(steps, slow_seconds)}} if slow_seconds > 0 else {}
    with PeerSwarm(folder, args) as swarm:
        _start(swarm, names, args, env)
        codes = swarm.finish(names, timeout)
        out = {}
        for name in names:
            s = swarm.summary(name)
            if codes[name] != 0 or s is None:
                raise RuntimeError(f"peer {name} exited {codes[name]}; see {folder}/{name}.log")
            rounds = swarm.rounds(name)
            loop = s["loop_seconds_by_worker"][0]
            outer = s["outer_seconds_by_worker"][0] or 0.0
            out[name] = {"tokens_per_second": tokens_per_second(s, TOKENS_PER_STEP), "rounds": s["rounds"],
                         "rounds_joined": s["rounds_joined"], "loop_seconds": loop, "outer_seconds": outer,
                         "compute_step_seconds": (loop - outer) / max(1, s["steps"] - s["eval_history"][0][0]),
                         "matchmaking_seconds": joined_seconds(rounds, "matchmaking_seconds"),
                         "outcomes": s["round_outcomes"],
                         "window_widths": [r.get("window_width") for r in rounds],
                         "round_seconds": [[r.get("round"), r.get("matchmaking_seconds") or 0.0,
                                            r.get("exchange_seconds") or 0.0, r.get("outcome", "")]
                                           for r in rounds]}  # fmt: skip
        return out


def restart_run(folder: Path, peers: int, steps: int, every: int, timeout: float = 1800,
                overrides: tuple[str, ...] = (), supervised: bool = False, kill_after: int = 0) -> dict:  # fmt: skip
    """Kill one of ``peers`` ``kill_after`` steps after its second round, restart it from its checkpoint; seconds
    to rejoin.

    ``overrides``: ``train.py`` keys for every peer after the tiny model's (a larger model, the GPU).
    ``supervised``: the killed peer runs with ``run.restarts=1``; the kill hits its run's process group (the run,
    its DHT process, p2pd), its supervisor forks the run again, and the seconds count from the kill. Otherwise
    the whole peer is killed and a new ``train.py resume=...`` started at once; the seconds count from its
    start."""
    names = [f"p{i}" for i in range(peers)]
    # log.flush_every=1: the first step after the restart is read from metrics.jsonl, which a CUDA worker writes
    # every 10 steps by default (the restart's first step then read as its tenth)
    args = [*TINY, f"steps={steps}", f"outer.every={every}", f"eval.every={steps}", f"checkpoint.every={every}",
            "peer.deadlines=adaptive", "log.flush_every=1", *overrides]  # fmt: skip
    victim = names[-1]
    with PeerSwarm(folder, args) as swarm:
        _start(swarm, names, args, {}, {victim: ["run.restarts=1"]} if supervised else {})
        rounds = lambda: [m for m in swarm.metrics(victim) if "outer_round" in m and "outer_skipped" not in m]
        swarm.wait(lambda: len(rounds()) >= 2, timeout, f"{victim} did not join two rounds")
        if kill_after:  # later in the round that follows (the peer's checkpoint of its second round then written)
            kill_at = rounds()[1]["step"] + kill_after
            swarm.wait(lambda: max(m["step"] for m in swarm.metrics(victim)) >= kill_at, timeout,
                       f"{victim} did not reach step {kill_at}")  # fmt: skip
        if supervised:  # its run: the supervisor's child that leads a process group
            (run,) = [c for c in children(swarm.procs[victim].pid) if os.getpgid(c) == c]
            os.killpg(run, signal.SIGKILL)
            started = time.monotonic()
        else:
            swarm.kill(victim)
        latest = swarm.peer_dir(victim) / "checkpoints" / "latest"
        resumed_at = int(latest.resolve().name.split("_")[-1])
        others = {n: max((m["step"] for m in swarm.metrics(n)), default=0) for n in names if n != victim}
        others_seen: dict[str, list] = {n: [] for n in others}  # the others' rounds after the kill, as its own below
        # the killed run's lines past the checkpoint stay until the resumed peer rewrites the file: only new ones count
        before = {json.dumps(m, sort_keys=True) for m in swarm.metrics(victim)}
        log = folder / f"{victim}.log"
        log_from, timeline = log.stat().st_size, []  # (seconds after the restart, a new line of its log)
        if not supervised:
            started = time.monotonic()
            swarm.peer(victim, *args, f"resume={latest}", f'peer.initial_peers=["{swarm.maddr(names[0])}"]')
        first_step = first_round = None
        rounds_seen: list[tuple[float, int, int, str]] = []  # (s after the restart, step, its own round, outcome)
        while first_round is None and time.monotonic() - started < timeout:
            log_from = _new_lines(log, log_from, time.monotonic() - started, timeline)
            after = [m for m in swarm.metrics(victim)
                     if m["step"] > resumed_at and json.dumps(m, sort_keys=True) not in before]  # fmt: skip
            if first_step is None and after:
                first_step = time.monotonic() - started
            seen = {(step, r) for _, step, r, _ in rounds_seen}
            for m in after:
                if "outer_round" in m and (m["step"], m["outer_round"]) not in seen:  # its rounds, and why none formed
                    rounds_seen.append((round(time.monotonic() - started, 2), m["step"], m["outer_round"],
                                        m.get("outer_skipped", "joined")))  # fmt: skip
            for name, killed_at in others.items():  # what the swarm did meanwhile: where a first round was lost
                _rounds_since(swarm.metrics(name), killed_at, time.monotonic() - started, others_seen[name])
            if any("outer_round" in m and "outer_skipped" not in m for m in after):
                first_round = time.monotonic() - started
            if swarm.procs[victim].poll() is not None and first_round is None:
                break
            time.sleep(0.05)
        # measured: the others' remaining steps are not waited for (the swarm is killed on leaving the block)
        return {"supervised": supervised, "kill_after": kill_after, "resumed_at_step": resumed_at,
                "seconds_to_first_step": first_step,
                "seconds_to_first_round": first_round, "rounds": rounds_seen, "log_timeline": timeline,
                "others_rounds": others_seen}  # fmt: skip


def _rounds_since(metrics: list[dict], after_step: int, seconds: float, seen: list) -> None:
    """Append ``(seconds, step, round, outcome, partners)`` for each round in ``metrics`` past ``after_step`` not in
    ``seen`` yet (a peer's rounds as they appear in its ``metrics.jsonl``)."""
    known = {(step, r) for _, step, r, _, _ in seen}
    for m in metrics:
        if m["step"] > after_step and "outer_round" in m and (m["step"], m["outer_round"]) not in known:
            seen.append((round(seconds, 2), m["step"], m["outer_round"], m.get("outer_skipped", "joined"),
                         ",".join(map(str, m.get("group") or []))))  # fmt: skip


def _new_lines(log: Path, offset: int, seconds: float, timeline: list) -> int:
    """Append ``(seconds, line)`` for each complete line written to ``log`` past ``offset``; the new offset."""
    with log.open("rb") as f:
        f.seek(offset)
        data = f.read()
    done = data.rfind(b"\n") + 1
    for line in data[:done].decode("utf-8", "replace").splitlines():
        if line.strip():
            timeline.append((round(seconds, 2), line.strip()[:200]))
    return offset + done


def _straggler_row(folder: Path, args, mode: str, sleep: float | None) -> dict:
    """One repetition for ``mode``: N equal peers, the same with one straggler, the N − 1 others alone (in that
    order); the straggler sleeps ``sleep`` s a step (None: ``factor − 1`` times this baseline's compute step)."""
    base = swarm_run(folder / "base", args.peers, args.steps, args.every, mode)
    step = statistics.median(r["compute_step_seconds"] for r in base.values())
    sleep = (args.factor - 1) * step if sleep is None else sleep
    slow = swarm_run(folder / "slow", args.peers, args.steps, args.every, mode, sleep)
    # the others without it: N - 1 equal peers (an odd swarm draws a group of three, which costs the others too)
    without = swarm_run(folder / "without", args.peers - 1, args.steps, args.every, mode)
    others = [n for n in slow if n != "slow"]
    row = {"deadlines": mode, "compute_step_seconds": step, "sleep_per_step": sleep,
           "base_tokens_per_second": _median(base, "tokens_per_second", base),
           "without_tokens_per_second": _median(without, "tokens_per_second", without),
           "others_tokens_per_second": _median(slow, "tokens_per_second", others),
           "base_rounds_joined": _median(base, "rounds_joined", base),
           "without_rounds_joined": _median(without, "rounds_joined", without),
           "others_rounds_joined": _median(slow, "rounds_joined", others),
           "straggler_rounds_joined": slow["slow"]["rounds_joined"], "rounds": slow[others[0]]["rounds"],
           "straggler_tokens_per_second": slow["slow"]["tokens_per_second"],
           # what the straggler costs the others whatever their compute does: their seconds in outer steps beside
           # it, over those of the N - 1 alone, as a share of their training loop beside it
           "others_outer_seconds": _median(slow, "outer_seconds", others),
           "without_outer_seconds": _median(without, "outer_seconds", without),
           "others_loop_seconds": _median(slow, "loop_seconds", others),
           "base": base, "slow": slow, "without": without}  # fmt: skip
    row["ratio"] = row["others_tokens_per_second"] / row["base_tokens_per_second"]
    row["ratio_without"] = row["others_tokens_per_second"] / row["without_tokens_per_second"]
    row["outer_cost"] = (row["others_outer_seconds"] - row["without_outer_seconds"]) / row["others_loop_seconds"]
    return row


def _spread(rows: list[dict], key: str) -> str:
    """Median (min–max) of ``key`` over the rows that have it (reports before it was kept lack some)."""
    values = [r[key] for r in rows if key in r] or [float("nan")]
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def _outer_cost(row: dict) -> str:
    """The others' extra seconds in outer steps beside the straggler (over the N − 1 alone) and their share of the
    loop; reports before it was kept show a dash."""
    if "outer_cost" not in row:
        return "–"
    return f"{row['others_outer_seconds'] - row['without_outer_seconds']:+.1f} s ({100 * row['outer_cost']:+.1f}%)"


def _without_joined(row: dict) -> str:
    """The N − 1 peers' rounds joined (median) of a report row; reports before it was kept show a dash."""
    joined = row.get("without_rounds_joined")
    return "–" if joined is None else f"{joined:g}/{row['rounds']}"


def _median(rows: dict, key: str, names) -> float:
    return statistics.median(rows[n][key] for n in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.straggler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--peers", type=int, default=8, help="swarm peers (8)")
    parser.add_argument("--factor", type=float, default=4.0, help="the straggler is this many times slower (4)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per peer (200)")
    parser.add_argument("--every", type=int, default=10, help="inner steps per outer round (10)")
    parser.add_argument(
        "--deadlines",
        nargs="*",
        default=["adaptive", "fixed"],
        choices=["adaptive", "fixed"],
        help="matchmaking modes to compare (adaptive fixed); none: the restart only",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=1,
        help="repetitions of the three runs (N equal, with the straggler, N - 1 alone), interleaved "
        "in that order; the report gives each and the medians (1)",
    )
    parser.add_argument("--no-restart", action="store_true", help="skip the kill-and-restart measurement")
    parser.add_argument("--kill-after-steps", type=int, default=0, metavar="K",
                        help="kill the restarted peer K inner steps after its second round (0: at once)")  # fmt: skip
    parser.add_argument("--supervised-restart", action="store_true",
                        help="also measure the restart of a peer run with run.restarts=1 (its supervisor forks the "
                             "killed run again, imports kept), after the plain one")  # fmt: skip
    common.add_out(parser, "straggler")
    parser.add_argument("--name", default="straggler", help="report file names (straggler)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="train.py keys for the restart's peers, after '--' (a 125M-sized peer on the GPU: "
                             "-- model.preset=125m data.vocab_size=32000 device=cuda)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.peers < 3 or args.factor <= 1 or args.steps < 3 * args.every or args.every < 1 or args.reps < 1:
        parser.error("need --peers >= 3, --factor > 1, --every >= 1, --steps >= 3 x --every and --reps >= 1")
    if not 0 <= args.kill_after_steps < args.steps:
        parser.error("need 0 <= --kill-after-steps < --steps")
    # the peers' run folders (checkpoints, logs) stay under runs/, whatever --out is
    work = Path(tempfile.mkdtemp(prefix="straggler-", dir=common.out_dir(common.RUNS / "straggler")))
    rows = []
    for mode in args.deadlines:
        sleep = None  # the straggler's sleep per step, set by the first repetition's baseline and kept
        for rep in range(args.reps):
            row = _straggler_row(work / (mode if args.reps == 1 else f"{mode}-{rep}"), args, mode, sleep)
            sleep = row["sleep_per_step"]
            rows.append({**row, "rep": rep})
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("base", "slow", "without")}), flush=True)
    restart = None if args.no_restart else restart_run(work / "restart", args.peers, 3 * args.steps, args.every,
                                                       overrides=tuple(args.overrides),
                                                       kill_after=args.kill_after_steps)  # fmt: skip
    print(json.dumps({"restart": restart}), flush=True)
    supervised = None
    if args.supervised_restart:
        supervised = restart_run(work / "restart-supervised", args.peers, 3 * args.steps, args.every,
                                 overrides=tuple(args.overrides), supervised=True,
                                 kill_after=args.kill_after_steps)  # fmt: skip
        print(json.dumps({"supervised_restart": supervised}), flush=True)
    command, machine = common.command("straggler", argv), common.machine()
    lines = _report(args, rows, restart, command, machine, supervised)
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "restart": restart,
            "supervised_restart": supervised, "work": str(work)}  # fmt: skip
    common.write_report(args.out, args.name, lines, data, command=command, machine=machine)
    print("\n".join(lines))
    return 0


def _report(
    args, rows: list[dict], restart: dict | None, command: str, machine: str, supervised: dict | None = None
) -> list[str]:
    lines = [
        "# Stragglers: the other peers' throughput beside one slow peer, and a killed peer's rejoin",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}",
        "",
        f"{args.peers} swarm peers on loopback (tiny LLaMA, NoLoCo pairs, int4), {args.steps} inner steps, a round "
        f"every {args.every}; one peer {args.factor:g}× slower (a sleep before each of its steps of "
        f"{args.factor - 1:g}× the baseline's compute step). Tokens/s: per peer over its training loop (start-up "
        "and the wait for peers left out), median over the peers.",
        "",
        "| deadlines | rep | compute s/step | tokens/s, N equal peers | tokens/s, the N − 1 others alone | tokens/s "
        "of the others, with it | ratio to N equal | ratio to the others alone | others' outer steps beside it, over "
        "the N − 1 alone (share of their loop) | rounds joined (others, median) | rounds joined, N equal | rounds "
        "joined, the N − 1 alone | straggler's rounds joined |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if not rows:  # the restarts only (--deadlines with no mode)
        lines = lines[:5] + ["The straggler runs were not asked for (`--deadlines` with no mode): the restarts only."]
    for r in rows:
        lines.append(f"| {r['deadlines']} | {r.get('rep', 0)} | {r['compute_step_seconds']:.4f} | "
                     f"{r['base_tokens_per_second']:,.0f} | {r['without_tokens_per_second']:,.0f} | "
                     f"{r['others_tokens_per_second']:,.0f} | {r['ratio']:.3f} | {r['ratio_without']:.3f} | "
                     f"{_outer_cost(r)} | {r['others_rounds_joined']:g}/{r['rounds']} | "
                     f"{r['base_rounds_joined']:g}/{r['rounds']} | {_without_joined(r)} | "
                     f"{r['straggler_rounds_joined']}/{r['rounds']} |")  # fmt: skip
    for mode in dict.fromkeys(r["deadlines"] for r in rows):
        mine = [r for r in rows if r["deadlines"] == mode]
        if len(mine) > 1:
            lines += ["", f"{mode}, median (range) over {len(mine)} repetitions: ratio to N equal "
                          f"{_spread(mine, 'ratio')}, to the N − 1 others alone {_spread(mine, 'ratio_without')}, the "
                          f"others' extra outer-step time {_spread(mine, 'outer_cost')} of their loop."]  # fmt: skip
    if rows:
        lines += _breakdown_lines(rows)
    for one in (restart, supervised):
        if one is not None:
            lines += _restart_lines(args, one)
    return lines


def _time_split(peer: dict) -> tuple[float, float, float, float, list[str]]:
    """One peer's outer seconds by where they went: its first round's matchmaking, later joined rounds'
    matchmaking, joined rounds' exchanges, and rounds not joined (matchmaking and exchange), with those outcomes."""
    first = later = exchange = failed = 0.0
    outcomes = []
    for i, (_, matchmaking, seconds, outcome) in enumerate(peer.get("round_seconds", [])):
        if outcome != "joined":
            failed += matchmaking + seconds
            outcomes.append(outcome.split(":")[0])
            continue
        exchange += seconds
        if i == 0:
            first += matchmaking
        else:
            later += matchmaking
    return first, later, exchange, failed, outcomes


def _breakdown_lines(rows: list[dict]) -> list[str]:
    """Where each run's outer-step time went (medians over its peers; beside the straggler: the others'), from the
    peers' ``rounds.jsonl``: what tells a straggler's cost (the first rounds, windows that waited for it) from the
    swarm's own failed rounds."""
    if not any(p.get("round_seconds") for r in rows for p in r["base"].values()):
        return []
    lines = ["", "Where the outer steps' seconds went (median over the peers of each run; beside the straggler: the "
             "others'). Rounds not joined: their matchmaking and exchange, and what the peers' records say of them.",
             "", "| deadlines | rep | run | first round's matchmaking | later rounds' matchmaking | exchanges | rounds "
             "not joined (s) | not joined, all peers |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for label, key in (("N equal", "base"), ("beside it", "slow"), ("N − 1 alone", "without")):
            splits = [_time_split(p) for name, p in r[key].items() if name != "slow"]
            med = [statistics.median(s[i] for s in splits) for i in range(4)]
            kinds: dict[str, int] = {}
            for s in splits:
                for outcome in s[4]:
                    kinds[outcome] = kinds.get(outcome, 0) + 1
            told = ", ".join(f"{k} ×{n}" for k, n in sorted(kinds.items())) or "none"
            lines.append(f"| {r['deadlines']} | {r.get('rep', 0)} | {label} | {med[0]:.2f} | {med[1]:.2f} | "
                         f"{med[2]:.2f} | {med[3]:.2f} | {told} |")  # fmt: skip
    return lines


def _restart_lines(args, restart: dict) -> list[str]:
    """The report's section on one restart (plain, or by the peer's own supervisor)."""
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    model = f" ({' '.join(args.overrides)})" if args.overrides else ""
    when = (
        f"{restart['kill_after']} steps after its second round"
        if restart.get("kill_after")
        else "after its second round"
    )
    if restart.get("supervised"):
        lines = ["", "## Restart by the peer's supervisor (run.restarts=1) to first round", "",
                 f"One of {args.peers} peers{model}, run with `run.restarts=1`: its run (the forked process, its DHT "
                 f"process, p2pd) SIGKILLed {when}; the supervisor forked it again from its "
                 f"checkpoint (step {restart['resumed_at_step']}), the imports kept: "
                 f"{fmt(restart['seconds_to_first_step'])} s from the kill to its first inner step, "
                 f"{fmt(restart['seconds_to_first_round'])} s to its first outer round joined with the "
                 "swarm."]  # fmt: skip
    else:
        lines = ["", "## Restart to first round", "",
                 f"One of {args.peers} peers{model} SIGKILLed {when} and restarted from its own "
                 f"checkpoint (step {restart['resumed_at_step']}): {fmt(restart['seconds_to_first_step'])} s to its "
                 f"first inner step, {fmt(restart['seconds_to_first_round'])} s to its first outer round joined with "
                 "the swarm (process start, torch and hivemind imports, DHT and p2pd start, checkpoint load "
                 "included)."]  # fmt: skip
    if restart.get("rounds"):
        lines += ["", "Its rounds after the restart, from its metrics (s after the restart when first seen):",
                  "", "| s | step | its round | outcome |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {t:.2f} | {step} | {r} | {outcome} |" for t, step, r, outcome in restart["rounds"]]
    if restart.get("others_rounds"):
        lines += ["", "The other peers' rounds after the kill, from their metrics (s after the restart when first "
                  "seen; group: its members):", "", "| peer | s | step | its round | outcome | group |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, seen in restart["others_rounds"].items():
            lines += [f"| {name} | {t:.2f} | {step} | {r} | {why} | {group} |" for t, step, r, why, group in seen[:12]]
    if restart.get("log_timeline"):
        lines += ["", "The restarted peer's log, each line's first sight (s after the restart):", "", "```"]
        lines += [f"{t:7.2f}  {line}" for t, line in restart["log_timeline"][:40]] + ["```"]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
