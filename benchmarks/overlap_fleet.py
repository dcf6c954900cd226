"""Overlapped exchange on a throttled fleet: seconds per outer round, blocking against overlapped (issue 17).

    python -m benchmarks.overlap_fleet --hosts 4 --cpus-per-host 4 --to-target 240   # as root, 16 cores
    python -m benchmarks.overlap_fleet --from-runs runs/overlap_fleet/<stamp> --out docs/results
    python -m benchmarks.overlap_fleet --every 80 --steps 640 --ddp-steps 160 --ddp-rate 10gbit -- device=cuda ...

Every run is one ``noloco-fleet`` launch, as in :mod:`benchmarks.throttled` (same model, data, seeds, links:
``tc tbf`` on each host's egress and ingress). What this benchmark adds is the time per outer round, split
the way overlap changes it, from each worker's ``summary.json`` timings (:func:`noloco.train.run.timing_summary`):

- *blocked*: seconds per round the training loop spent inside outer steps. Blocking, that is the whole
  exchange (encode, the link, decode, update); overlapped, only the wait for an exchange that has not
  arrived when the next round ends, and the merge;
- *compute*: the rest of the loop per round (inner steps and evaluations);
- *idle fraction*: blocked over the loop, mean over workers.

Each figure is given over the whole run, and over its *steady rounds* from the per-round records of
``metrics.jsonl`` (:func:`steady`): without the first two rounds (the first exchange compiles its
kernels, seconds on CUDA) and the last (overlapped, the last exchange has nothing to hide behind). The targets
are judged on the steady rounds where there are any. For the overlapped runs a table gives each exchange's own
time, from its send until its result was ready (``exchange_ms``), beside the compute it hides behind, and how
long training waited for it where it landed (``wait_ms``): a round that waits shows whether its exchange was
slower than the blocking one, or the compute beside it shorter.

Choose H (``--every``; and the work per step with overrides such as ``data.batch_size``) so that a blocking
round's exchange takes about as long as its compute: the regime overlap is for, a GPU that computes H steps
as fast as the link moves their payload. The table gives both halves of a blocking round to check it by.

Targets (issue 17): overlapped seconds per round ≤ 1.15 × max(compute, blocked) of the blocking run of the
same method; idle fraction ≤ 5%; with ``--to-target``, overlapped NoLoCo-int4 reaches DDP-fp32's final loss
≥ 1.5× sooner than each blocking method of the longer runs (blocking NoLoCo-int4, and DiLoCo with momentum 0.5).
DDP-fp32's run only sets that loss, which does not depend on the link: ``--ddp-rate`` gives it a faster one
(with a GPU-sized model its fp32 all-reduce at the fleet's rate would take seconds per inner step).

The exchange's own CPU work (encode, decode, framing) runs on the worker's cores, beside training: give each
host cores of its own (``--cpus-per-host``) and more than one, or that work stretches both.

Writes ``<out>/<name>.md``, ``.json`` and ``.png`` (held-out loss against steps, wall-clock and bytes; with
``--to-target`` also ``<name>-long.png``); ``<out>``: ``runs/benchmarks/overlap_fleet/`` unless ``--out`` says
otherwise, ``<name>``: ``overlap_fleet`` unless ``--name`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import common, throttled
from noloco.fleet.netns import is_root, parse_rate
from noloco.train.metrics import metrics_files
from noloco.train.plots import plot_runs

METHODS = ["ddp/fp32", "noloco/int4", "noloco/int4/outer.overlap=true",
           "noloco/int4/outer.overlap=true/outer.fragments=4", "diloco/fp32/outer.momentum=0.5",
           "diloco/fp32/outer.momentum=0.5/outer.overlap=true"]  # fmt: skip
#: overrides of every run on top of :data:`throttled.MODEL` (the model, evaluation and timeouts); none yet
SETTING: list[str] = []
#: the keys that make a run overlapped; the rest of its method names its blocking counterpart
OVERLAP_KEYS = ("outer.overlap", "outer.fragments")


def blocking_of(method: str) -> str:
    """The blocking counterpart of ``method``: its name without the overlap and fragment keys."""
    return "/".join(part for part in common.split_method(method) if not part.startswith(OVERLAP_KEYS))


def method_of(run_dir: Path) -> str:
    """The method a finished run was launched as (its folder name, ``<hosts>h-<rate>-<method>[-long]``, is a
    lossy spelling, so the config says): ``algo/codec`` plus its non-default momentum, overlap and fragments."""
    label = throttled.method_label(*_algo_codec(run_dir), throttled._momentum(run_dir))
    outer = _outer(run_dir)
    if outer.get("overlap"):
        label += f"/outer.overlap={str(outer.overlap).lower()}"
    if _fragments(run_dir) > 1:
        label += f"/outer.fragments={outer.fragments}"
    return label


def _outer(run_dir: Path):
    """The ``outer`` section of a finished run's ``config.yaml``."""
    from omegaconf import OmegaConf

    return OmegaConf.load(run_dir / "config.yaml").get("outer", {})


def _fragments(run_dir: Path) -> int:
    return int(_outer(run_dir).get("fragments") or 1)


def _algo_codec(run_dir: Path) -> tuple[str, str]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["algo"], summary["codec"]


def measure(run_dir: Path) -> dict:
    """:func:`benchmarks.throttled.measure` plus the per-round split (module docstring)."""
    result = throttled.measure(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    result["method"] = method_of(run_dir)
    loops, outers = summary.get("loop_seconds_by_worker"), summary.get("outer_seconds_by_worker")
    rounds = summary["steps"] / summary["outer_every"] if summary["algo"] != "ddp" else None
    result["rounds"] = rounds
    if rounds and loops and outers and None not in loops and None not in outers:
        result["seconds_per_round"] = max(loops) / rounds
        result["compute_per_round"] = sum(lp - o for lp, o in zip(loops, outers)) / len(loops) / rounds
        result["blocked_per_round"] = sum(outers) / len(outers) / rounds
        result["idle_fraction"] = sum(o / lp for lp, o in zip(loops, outers)) / len(loops)
    if rounds:
        result["steady"] = steady(run_dir, _fragments(run_dir))
        result["step_seconds_by_worker"] = step_times(run_dir, summary["outer_every"], _fragments(run_dir))
        result["fragments"] = _fragments(run_dir)
        result["exchanges"] = exchange_times(run_dir, result["fragments"])
    return result


def _worker_records(run_dir: Path) -> list[list[dict]]:
    """Each worker's records, in worker order, each worker's in the order written: from ``metrics.jsonl`` and the
    parts ``metrics.jsonl`` of a run that stopped before merging them (a record without ``worker`` is
    the part's rank's)."""
    by_worker: dict[int, list[dict]] = {}
    for path in metrics_files(run_dir):
        rank = path.name.removeprefix("metrics.rank").removesuffix(".jsonl")
        for line in path.read_text().splitlines():
            if line:
                record = json.loads(line)
                by_worker.setdefault(int(record.get("worker", rank if rank.isdigit() else 0)), []).append(record)
    return [by_worker[w] for w in sorted(by_worker)]


def round_times(run_dir: Path) -> list[list[tuple[float, float]]]:
    """Per worker, each outer round's ``(wall seconds, seconds inside the outer step that ends it)``, from the
    round-boundary records of ``metrics.jsonl`` (the first record of each step with ``outer_ms``)."""
    workers = []
    for records in _worker_records(run_dir):
        bounds, seen = [(0.0, 0.0)], set()
        for record in records:
            if "outer_ms" in record and record["step"] not in seen:
                seen.add(record["step"])
                bounds.append((float(record["wall"]), record["outer_ms"] / 1e3))
        workers.append([(b[0] - a[0], b[1]) for a, b in zip(bounds, bounds[1:])])
    return workers


def steady(run_dir: Path, fragments: int = 1) -> dict:
    """The per-round split over the steady rounds, per H inner steps: all rounds but the first two (the first
    exchange compiles its kernels, on CUDA seconds; overlapped, it is waited for at the end of the second) and
    the last (overlapped, it also waits for the last exchange, which nothing hides). With ``fragments`` k an
    exchange ends every H/k steps: the first 2k are left out, and the means over the rest are scaled by k.
    Empty with too few rounds."""
    workers = [rounds[2 * fragments : -1] for rounds in round_times(run_dir)]
    if not workers or not all(workers):
        return {}
    walls = [fragments * sum(w for w, _ in rounds) / len(rounds) for rounds in workers]
    blocked = [fragments * sum(b for _, b in rounds) / len(rounds) for rounds in workers]
    return {"steady_rounds": len(workers[0]) / fragments, "seconds_per_round": max(walls),
            "compute_per_round": sum(w - b for w, b in zip(walls, blocked)) / len(walls),
            "blocked_per_round": sum(blocked) / len(blocked),
            "idle_fraction": sum(b / w for w, b in zip(walls, blocked)) / len(walls)}  # fmt: skip


def step_times(run_dir: Path, every: int, fragments: int = 1) -> list[float]:
    """Per worker, the mean seconds of an inner step over the steady rounds (:func:`steady`): the wall between two
    consecutive training-step records of ``metrics.jsonl``, leaving out steps that end an exchange
    (``outer_ms``) or follow an evaluation. A worker slowed by something beside its exchange shows up here
    against its peers and against the blocking run. Empty for a worker with no such step."""
    period = every // fragments  # the config refuses fragments that do not divide H
    means = []
    for records in _worker_records(run_dir):
        last = max((r["step"] for r in records), default=0)
        skip = {r["step"] for r in records if "outer_ms" in r or "eval_loss" in r}
        walls = {r["step"]: float(r["wall"]) for r in records if "loss" in r}
        gaps = [
            walls[k] - walls[k - 1]
            for k in walls
            if k - 1 in walls and 2 * period < k <= last - period and k not in skip and k - 1 not in skip
        ]
        if gaps:
            means.append(sum(gaps) / len(gaps))
    return means


def exchange_times(run_dir: Path, fragments: int = 1) -> dict:
    """An overlapped run's exchanges over its steady rounds (as :func:`steady` leaves rounds out), from the
    ``exchange_ms`` and ``wait_ms`` of ``metrics.jsonl``: the mean seconds an exchange ran on its thread
    (from its send) and the mean seconds training waited for it where it landed, each a mean over workers; the
    largest worker's mean wait too. Empty for a blocking run or too few rounds."""
    exchanges, waits = [], []
    for records in _worker_records(run_dir):
        # exchange q lands at boundary q + 2; the last boundary lands two (its own, and the last one's at the end)
        landed = [r for r in records if "exchange_ms" in r][2 * fragments - 1 : -2]
        if not landed:
            return {}
        exchanges.append(sum(r["exchange_ms"] for r in landed) / len(landed) / 1e3)
        waits.append(sum(r.get("wait_ms", 0.0) for r in landed) / len(landed) / 1e3)
    if not exchanges:
        return {}
    return {
        "exchange_seconds": sum(exchanges) / len(exchanges),
        "wait_seconds": sum(waits) / len(waits),
        "max_wait_seconds": max(waits),
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _at(run: dict) -> str:
    return f" at {run['rate_bps'] / 1e6:g} Mbit/s" if run.get("rate_bps") else ""


def _idle(r: dict) -> str:
    return "–" if r.get("idle_fraction") is None else f"{100 * r['idle_fraction']:.1f}%"


def _round_table(short: dict[str, dict]) -> list[str]:
    """The per-round split of every run, over the whole run and over its steady rounds (:func:`steady`)."""
    lines = ["| method | final held-out loss | loop wall (s) | s per round | compute s per round | blocked s per round "
             "| idle fraction | steady rounds: s per round | compute | blocked | idle | MB sent per worker |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for method, r in short.items():
        st = r.get("steady") or {}
        lines.append(f"| {method} | {r['final_eval_loss']:.4f} | {r['wall_seconds']:.1f} | "
                     f"{_fmt(r.get('seconds_per_round'))} | {_fmt(r.get('compute_per_round'))} | "
                     f"{_fmt(r.get('blocked_per_round'))} | {_idle(r)} | {_fmt(st.get('seconds_per_round'))} | "
                     f"{_fmt(st.get('compute_per_round'))} | {_fmt(st.get('blocked_per_round'))} | {_idle(st)} | "
                     f"{r['bytes_sent_per_worker'] / 1e6:.2f} |")  # fmt: skip
    steps = {method: r["step_seconds_by_worker"] for method, r in short.items() if r.get("step_seconds_by_worker")}
    if steps:
        lines += ["", "Inner step time over the steady rounds, per worker (ms; steps that end an exchange or follow an "
                  "evaluation left out):", "", "| method | worker 0, 1, … |", "|---|---|"]  # fmt: skip
        lines += [f"| {method} | {' / '.join(f'{1e3 * t:.1f}' for t in times)} |" for method, times in steps.items()]
    exchanges = {method: r["exchanges"] for method, r in short.items() if r.get("exchanges")}
    if exchanges:
        lines += ["", "Overlapped exchanges over the steady rounds (ms; mean over workers): how long one ran on its "
                  "thread from its send, beside the compute it hides behind (one exchange's share of a round), and "
                  "how long training waited for it where it landed (the largest worker's mean in brackets):", "",
                  "| method | exchange | compute it hides behind | wait |", "|---|---|---|---|"]  # fmt: skip
        for method, e in exchanges.items():
            k = short[method].get("fragments", 1)
            hides = (short[method].get("steady") or {}).get("compute_per_round")
            lines.append(f"| {method} | {1e3 * e['exchange_seconds']:.0f} | "
                         f"{'–' if hides is None else f'{1e3 * hides / k:.0f}'} | "
                         f"{1e3 * e['wait_seconds']:.0f} ({1e3 * e['max_wait_seconds']:.0f}) |")  # fmt: skip
    return lines


def _round_checks(short: dict[str, dict]) -> list[tuple[str, bool, str]]:
    """Each overlapped run against its blocking run: over the steady rounds where both have them, else the whole
    run (which counts the first exchange's kernel compilation and, overlapped, the unhidden last exchange)."""
    checks = []
    for method, r in short.items():
        base = short.get(blocking_of(method))
        if base is None or base is r or r.get("seconds_per_round") is None or base.get("compute_per_round") is None:
            continue
        over = "steady rounds" if r.get("steady") and base.get("steady") else "whole run"
        mine, theirs = (r["steady"], base["steady"]) if over == "steady rounds" else (r, base)
        bound = max(theirs["compute_per_round"], theirs["blocked_per_round"])
        ratio = mine["seconds_per_round"] / bound
        against = f"max({theirs['compute_per_round']:.2f}, {theirs['blocked_per_round']:.2f}) s"
        checks.append(
            (
                f"{method}: s per round ≤ 1.15 × max(compute, blocked) of {base['method']}",
                ratio <= 1.15,
                f"{ratio:.2f}× ({mine['seconds_per_round']:.2f} s against {against}; "
                f"blocking {theirs['seconds_per_round']:.2f} s; {over})",
            )
        )
        checks.append(
            (
                f"{method}: idle fraction ≤ 5%",
                mine["idle_fraction"] <= 0.05,
                f"{100 * mine['idle_fraction']:.1f}% (blocking {100 * theirs['idle_fraction']:.1f}%; {over})",
            )
        )
    return checks


def _target_section(pool: dict[str, dict], ddp: dict, heading: str) -> tuple[list[str], list[tuple]]:
    """When each run of ``pool`` reaches DDP-fp32's final loss, and each overlapped NoLoCo-int4 run (with or without
    fragments) against every blocking method of ``pool``."""
    target = ddp["final_eval_loss"]
    lines = ["", f"{heading}: when each method reaches DDP-fp32's final loss {target:.4f} "
             f"(DDP-fp32: step {ddp['steps']}, {ddp['wall_seconds']:.1f} s{_at(ddp)}).", "",
             "| method | budget (steps) | step at target | time to target (s) | final held-out loss | idle fraction |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for method, r in pool.items():
        lines.append(
            f"| {method} | {r['steps']} | {_fmt(r['step_to_target'], '.0f')} | "
            f"{_fmt(r['time_to_target'], '.1f')} | {r['final_eval_loss']:.4f} | {_idle(r)} |"
        )
    checks = []
    for name, mine in pool.items():  # every overlapped NoLoCo-int4 (with or without fragments) ...
        if blocking_of(name) != "noloco/int4" or name == "noloco/int4":
            continue
        label = "overlapped NoLoCo-int4" + ("" if name == "noloco/int4/outer.overlap=true" else f" ({name})")
        for other, theirs in pool.items():  # ... against every blocking method
            if blocking_of(other) != other:
                continue
            ratio, text = throttled._speedup(mine["time_to_target"], theirs["time_to_target"],
                                             theirs["wall_seconds"])  # fmt: skip
            checks.append((f"{label} reaches DDP-fp32's loss ≥ 1.5× sooner than blocking {other}",
                           ratio is not None and ratio >= 1.5, text))  # fmt: skip
    return lines, checks


def analyse(results: list[dict]) -> tuple[list[str], list[dict]]:
    """The per-round table, the time-to-target table, and the targets (module docstring). Time to target is over
    the longer runs (``--to-target``), or, when DDP-fp32 ran fewer steps than the others (``--ddp-steps``), over
    the runs of ``--steps``."""
    short = {r["method"]: r for r in results if not r.get("long")}
    longer = {r["method"]: r for r in results if r.get("long")}
    ddp = short.get("ddp/fp32")
    target = ddp["final_eval_loss"] if ddp else None
    for r in results:
        hit = throttled.reach(r["curve"], target) if target is not None else None
        r["time_to_target"], r["step_to_target"] = (None, None) if hit is None else (hit[1], hit[0])
    lines, checks = _round_table(short), _round_checks(short)
    local = {m: r for m, r in short.items() if r is not ddp}
    if ddp is not None and longer:
        more, more_checks = _target_section(longer, ddp, "Longer budgets (`--to-target`)")
    elif ddp is not None and local and ddp["steps"] < min(r["steps"] for r in local.values()):
        more, more_checks = _target_section(local, ddp, "Time to target (DDP-fp32 ran `--ddp-steps`)")
    else:
        more, more_checks = [], []
    lines, checks = lines + more, checks + more_checks
    if checks:
        lines += ["", "| target | met | measured |", "|---|---|---|"]
        lines += [f"| {name} | {'yes' if ok else '**no**'} | {value} |" for name, ok, value in checks]
    return lines, [{"target": n, "met": ok, "value": v} for n, ok, v in checks]


def rerun_args(args: argparse.Namespace) -> list[str]:
    """The arguments that rerun what a ``--from-runs`` redraw reports (its other arguments describe the runs)."""
    return ["--hosts", str(args.hosts), "--rate", args.rate, *(["--ddp-rate", args.ddp_rate] if args.ddp_rate else []),
            *(["--ddp-steps", str(args.ddp_steps)] if args.ddp_steps else []),
            "--every", str(args.every), "--steps", str(args.steps),
            *(["--to-target", str(args.to_target)] if args.to_target else []),
            *(["--cpus-per-host", str(args.cpus_per_host)] if args.cpus_per_host else []),
            "--methods", *args.methods,
            *(["--out", str(args.out)] if Path(args.out) != common.RUNS / "overlap_fleet" else []),
            *(["--name", args.name] if args.name != "overlap_fleet" else []),
            *(["--", *args.overrides] if args.overrides else [])]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.overlap_fleet``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overlap_fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="50mbit", help="per-host rate, tc units")
    parser.add_argument(
        "--ddp-rate",
        default=None,
        metavar="RATE",
        help="the DDP-fp32 run's rate (default --rate): it only sets the target loss, which the "
        "link does not change, and a GPU-sized model's fp32 all-reduce per step is slow",
    )
    parser.add_argument(
        "--ddp-steps",
        type=int,
        default=None,
        metavar="STEPS",
        help="the DDP-fp32 run's budget (default --steps); fewer than --steps: the other runs "
        "reach its loss themselves, and need no --to-target runs",
    )
    parser.add_argument("--every", type=int, default=20, help="H, inner steps per outer round")
    parser.add_argument("--steps", type=int, default=120, help="inner steps per worker")
    parser.add_argument(
        "--to-target",
        type=int,
        default=0,
        metavar="STEPS",
        help="then a run of STEPS inner steps per local method: when it reaches DDP-fp32's loss",
    )
    parser.add_argument(
        "--cpus-per-host", type=int, default=None, metavar="N", help="pin each host's worker to N cores of its own"
    )
    parser.add_argument("--methods", nargs="+", default=METHODS, help="algo/codec[/key=value...] entries")
    parser.add_argument("--runs", type=Path, default=Path("runs/overlap_fleet"))
    parser.add_argument("--from-runs", type=Path, default=None, help="only redraw from a finished stamp folder")
    parser.add_argument("--dry-run", action="store_true", help="check every run's config, print the runs, run none")
    common.add_out(parser, "overlap_fleet")
    parser.add_argument("--name", default="overlap_fleet", help="output name: <out>/<name>.md/.json/.png")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    parse_rate(args.rate)  # fail on a typo before any run
    ddp_rate = args.ddp_rate or args.rate
    parse_rate(ddp_rate)
    every_run = [*throttled.MODEL, *SETTING, f"outer.every={args.every}", *args.overrides]
    ddp_steps = args.ddp_steps or args.steps
    plan = [(args.hosts, ddp_rate, m, ddp_steps) if m.startswith("ddp/") else (args.hosts, args.rate, m, args.steps)
            for m in args.methods]  # fmt: skip
    if args.to_target:
        plan += [(args.hosts, args.rate, m, args.to_target) for m in args.methods if not m.startswith("ddp/")]
    if args.dry_run:
        return throttled.check_plan(plan, every_run, show=True)

    if args.from_runs is not None:
        folder = args.from_runs
    else:
        if not is_root():
            print("benchmarks.overlap_fleet: needs root for the network namespaces (see docs/fleet.md)",
                  file=sys.stderr)  # fmt: skip
            return 2
        folder = args.runs / time.strftime("%Y%m%d-%H%M%S")
        code = throttled.run_plan(plan, folder, every_run, args.steps, args.cpus_per_host)
        if code:
            return code
    runs = throttled.finished_runs(folder, "benchmarks.overlap_fleet")
    if not runs:
        return 1
    results = [measure(run) for run in runs]
    order = {m: i for i, m in enumerate(args.methods)}
    results.sort(key=lambda r: (r.get("long", False), order.get(r["method"], len(order)), r["method"]))
    tables, verdicts = analyse(results)
    out = common.out_dir(args.out)
    short = [r for r in results if not r.get("long")]
    ddp = next((r for r in short if r["method"] == "ddp/fp32"), None)
    png = out / f"{args.name}.png"
    plot_runs([Path(r["run_dir"]) for r in short], png, labels=[r["method"] for r in short],
              title=f"{args.hosts} hosts, {args.rate} per host, H = {args.every}",
              target=ddp["final_eval_loss"] if ddp else None)  # fmt: skip
    pictures = [f"![held-out loss vs steps, wall-clock and bytes]({png.name})"]
    longer = [r for r in results if r.get("long")]
    if longer:
        png_long = out / f"{args.name}-long.png"
        plot_runs([Path(r["run_dir"]) for r in ([ddp] if ddp else []) + longer], png_long,
                  labels=[r["method"] + ("" if r is ddp else f" ({r['steps']} steps)") for r in
                          ([ddp] if ddp else []) + longer],
                  title="longer budgets: time to DDP-fp32's final loss",
                  target=ddp["final_eval_loss"] if ddp else None)  # fmt: skip
        pictures.append(f"![longer budgets]({png_long.name})")
    first = json.loads((Path(short[0]["run_dir"]) / "summary.json").read_text()) if short else {}
    command = common.command("overlap_fleet", rerun_args(args) if args.from_runs is not None else argv)
    machine = throttled.machine_of(folder)
    pinned = (f"its worker pinned to {args.cpus_per_host} cores of its own" if args.cpus_per_host else
              "the workers sharing its cores (each runs cores ÷ hosts torch threads)")  # fmt: skip
    lines = [
        "# Overlapped exchange on a throttled fleet", "",
        f"Command: `{command}`  ",
        f"Machine: {machine}; every host is a network namespace on this machine, {pinned}.  ",
        f"Date: {time.strftime('%Y-%m-%d')}  ",
        f"Setting: {args.hosts} hosts at {args.rate} each way"
        f"{f' (the DDP-fp32 run, which only sets the target loss, at {args.ddp_rate})' if args.ddp_rate else ''}, "
        f"{first.get('params', 0) / 1e6:.2f}M-parameter model, "
        f"{args.steps} inner steps per worker, H = {args.every}, overrides "
        f"`{' '.join([*SETTING, *args.overrides])}`.", "",
        "Per round: loop wall ÷ rounds (slowest worker); compute and blocked split each worker's loop into the "
        "time outside and inside outer steps (mean over workers). Idle fraction = blocked ÷ loop.", "",
        *tables, "", *pictures, "",
    ]  # fmt: skip
    throttled.write_report(out, args.name, lines, results, verdicts, command, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
