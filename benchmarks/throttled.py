"""DDP / DiLoCo / NoLoCo × fp32 / int8 / int4 on real rate-limited links (issue 6; docs/design.md §5).

    python -m benchmarks.throttled --hosts 4,8 --rates 50mbit,500mbit --to-target 320   # as root: the whole comparison
    python -m benchmarks.throttled --hosts 4 --rates 50mbit --methods ddp/fp32 noloco/int4 --steps 60   # as root
    python -m benchmarks.throttled --from-runs runs/throttled/<stamp>            # redraw table and plots
    python -m benchmarks.throttled --from-runs runs/throttled/<stamp> --out docs/results   # the committed report

Runs need root for the network namespaces (``sudo env PATH="$PATH" python -m benchmarks.throttled ...`` keeps
this Python; run it from the repository root); redrawing with ``--from-runs`` does not.

Every run is one ``noloco-fleet`` launch (:func:`noloco.fleet.launcher.launch`): N network
namespaces, each host's egress and ingress shaped with ``tc tbf`` at the given rate, one
``train.py backend=torch`` worker per host over gloo. All runs share the model, data, token budget
(steps × batch × workers) and seeds; only the algorithm and the exchange codec change. A method is
``algo/codec`` with optional ``/key=value`` config overrides (DiLoCo runs with its paper's outer momentum
0.9 and with NoLoCo's 0.5). Exact (fp32) exchanges use the ring all-reduce, the faster reduction on these
links; quantized ones the two-phase reduction (:func:`method_overrides`).

``--burst 50ms`` deepens every link's token bucket (default 5 ms of traffic, as ``noloco-fleet``): a deeper one
lets each message start at line speed, as many access links do; the rows record it (``burst_seconds``).

``--to-target STEPS`` adds, at the slowest rate, one longer run per DiLoCo/NoLoCo method (a budget of STEPS
inner steps, its LR schedule stretched to it): at an equal token budget the local methods rarely reach
DDP's final loss, and these runs say when they do, in wall-clock and in bytes.

Per run it reports the final held-out loss (mean over workers), the wall-clock of the training
loop, bytes sent per worker (encoded payload, as counted by the transport), the time to reach the
target loss, and the idle fraction: the share of the loop spent waiting on the network (the seconds
each worker's transport was blocked in ``recv``, ``comm_wait_seconds_per_worker``, over the loop wall).

Targets (issue 6): at the slowest rate, NoLoCo-int4 reaches the target loss (DDP-fp32's final loss
at the same hosts and rate) ≥ 5× sooner than DDP-fp32 and ≥ 1.5× sooner than DiLoCo-fp32; NoLoCo-int4's
final loss is within 1% of NoLoCo-fp32's with ≥ 6× fewer bytes per worker. When a method never
reaches the target within the budget, the table says so, and a second target that every method
reaches (the highest final loss of the group) is reported beside it.

Writes ``<out>/throttled.md`` (tables, targets, command, machine), ``throttled.json`` and one
``throttled-<hosts>h-<rate>.png`` per setting (loss vs steps, wall-clock and bytes; one line per method,
DDP's final loss dashed), plus ``…-long.png`` for the longer runs (``<out>``: ``runs/benchmarks/throttled/``
unless ``--out`` says otherwise; ``throttled``: ``--name``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/throttled.py`: rerun as `python -m benchmarks.throttled`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.throttled", *sys.argv[1:]])

from benchmarks import common
from noloco.fleet.launcher import host_cpu_sets, launch
from noloco.fleet.netns import MAX_BURST_SECONDS, FleetError, is_root, parse_duration, parse_rate
from noloco.train.config import ConfigError, load_config
from noloco.train.plots import eval_curves, plot_runs, reach

ROOT = common.ROOT

METHODS = [
    "ddp/fp32",
    "diloco/fp32",
    "diloco/fp32/outer.momentum=0.5",
    "diloco/int4",
    "diloco/int4/outer.momentum=0.5",
    "noloco/fp32",
    "noloco/int8",
    "noloco/int4",
]
# DiLoCo runs twice: with its paper's outer momentum 0.9 (the default of docs/design.md, tuned for runs of thousands of
# steps) and with NoLoCo's 0.5, which is much better over a few dozen outer rounds (in-process, 4 workers,
# H = 20: DDP's 120-step loss reached at step ~140 with 0.5, not within 480 steps with 0.9).
# A model small enough that 24 fleet runs of 8 workers fit on a 2-core machine in about an hour,
# large enough that DDP's per-step gradient exchange dominates at 50 Mbit/s.
MODEL = [
    "model.dim=128",
    "model.n_layers=2",
    "model.n_heads=4",
    "data.batch_size=8",
    "data.seq_len=128",
    "eval.every=10",
    "eval.batches=4",
    "log.progress=false",
    "log.tensorboard=false",
    "comm.recv_timeout=600",
    "comm.group_timeout=600",
    "comm.startup_timeout=600",
]


def method_overrides(method: str) -> list[str]:
    """``algo/codec`` → config overrides; the codec applies to every exchanged vector of the method.

    Exact (fp32) exchanges use the ring all-reduce: one TCP flow per direction per host, which keeps a
    tbf link busier than the two-phase reduction's all-to-all (DDP-fp32, 4 hosts at 50 Mbit/s: 1.09 s per
    step against 1.33 s), so the baselines get the faster of the two. Quantized exchanges keep the
    two-phase reduction, which quantizes each value at most twice; a ring would requantize at every hop.
    """
    algo, codec, *extra = common.split_method(method)
    overrides = [f"outer.algo={algo}", f"comm.codec={codec}", f"comm.slow_codec={codec}"]
    if codec == "fp32":
        overrides.append("comm.reduction=ring")
    return overrides + extra


def method_label(algo: str, codec: str, momentum: float | None) -> str:
    """The method key of a finished run: ``algo/codec``, plus ``/outer.momentum=m`` when the run's outer momentum
    is not its algorithm's default (the config's: 0.9 for DiLoCo, 0.5 for NoLoCo; DDP uses none)."""
    label = f"{algo}/{codec}"
    if momentum is None or algo not in ("diloco", "noloco"):
        return label
    if momentum == load_config([f"outer.algo={algo}"]).outer.momentum:
        return label
    return f"{label}/outer.momentum={momentum:g}"


LONG = "-long"  # run-name suffix of the longer-budget (time-to-target) runs


def curve(run_dir: Path) -> list[tuple]:
    """Mean over workers per eval step: ``(step, wall of the slowest worker, bytes sent, loss)``."""
    return eval_curves(run_dir)[1]


def time_to(points: list[tuple], target: float) -> float | None:
    """Wall-clock at which the mean held-out loss first reaches ``target`` (linear in between evals)."""
    hit = reach(points, target)
    return None if hit is None else hit[1]


def _momentum(run_dir: Path) -> float | None:
    """``outer.momentum`` of the run (its config.yaml holds the resolved value), or None without a config."""
    config = run_dir / "config.yaml"
    if not config.exists():
        return None
    from omegaconf import OmegaConf

    value = OmegaConf.load(config).get("outer", {}).get("momentum")
    return None if value is None else float(value)


def measure(run_dir: Path) -> dict:
    """What one finished fleet run reports (``summary.json``, ``fleet.json``, metrics)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    fleet = json.loads((run_dir / "fleet.json").read_text())
    points = curve(run_dir)
    wall = points[-1][1]  # the training loop's wall-clock at the last step, slowest worker (no start-up)
    waits = summary.get("comm_wait_seconds_per_worker")
    return {
        "run_dir": str(run_dir),
        "algo": summary["algo"],
        "codec": summary["codec"],
        "method": method_label(summary["algo"], summary["codec"], _momentum(run_dir)),
        "long": run_dir.name.endswith(LONG),
        "steps": summary.get("steps"),
        "hosts": fleet["hosts"],
        "rate_bps": fleet["rate_bps"],
        "burst_seconds": fleet.get("burst_seconds"),
        "final_eval_loss": summary["final_eval_loss"],
        "wall_seconds": wall,
        "launch_seconds": fleet["wall_seconds"],
        "bytes_sent_per_worker": summary["bytes_sent_per_worker"],
        "idle_fraction": (sum(waits) / len(waits) / wall) if waits and wall else None,
        "link_tx_bytes": [s.get("tx_bytes") for s in fleet["link_stats"]],
        "curve": points,
    }


def rate_label(rate_bps: float | None) -> str:
    return "unshaped" if not rate_bps else f"{rate_bps / 1e6:g}mbit"


def _speedup(mine: float | None, theirs: float | None, their_wall: float) -> tuple[float | None, str]:
    """How many times sooner ``mine`` reaches a loss than ``theirs``; when they never reach it, a lower bound
    from their whole run (``> x×``)."""
    if mine is None:
        return None, "not reached"
    if theirs is None:
        ratio = their_wall / mine if mine else float("inf")
        return ratio, f"> {ratio:.2f}× (a bound: they never reach it)"
    ratio = theirs / mine if mine else float("inf")
    return ratio, f"{ratio:.2f}×"  # two decimals: a ratio just under a target's 1.5× must not read "1.5×"


def _in_order(by_method: dict) -> list[str]:
    """The methods of ``by_method`` in :data:`METHODS` order, others after."""
    return [m for m in METHODS if m in by_method] + [m for m in by_method if m not in METHODS]


def _idle(r: dict) -> str:
    return "–" if r["idle_fraction"] is None else f"{100 * r['idle_fraction']:.0f}%"


def analyse(results: list[dict]) -> tuple[list[str], dict]:
    """Markdown tables per (hosts, rate), time-to-target and the issue's targets.

    Runs named ``…-long`` (``--to-target``) trained a longer budget of their own; they are reported in a
    second table per setting, and the time-to-target verdicts use them where the equal-budget run of the
    same method never reached the target.
    """
    lines: list[str] = []
    verdicts: dict = {}
    settings = sorted({(r["hosts"], r["rate_bps"] or 0) for r in results})
    slowest = min((rate for _, rate in settings if rate), default=None)
    for hosts, rate in settings:
        everything = [r for r in results if r["hosts"] == hosts and (r["rate_bps"] or 0) == rate]
        group = [r for r in everything if not r.get("long")]
        longer = {r["method"]: r for r in everything if r.get("long")}
        by_method = {r["method"]: r for r in group}
        ddp = by_method.get("ddp/fp32")
        target = ddp["final_eval_loss"] if ddp else None
        common_target = max(r["final_eval_loss"] for r in group) if group else None
        for r in everything:
            hit = reach(r["curve"], target) if target is not None else None
            r["time_to_target"] = None if hit is None else hit[1]
            r["step_to_target"] = None if hit is None else hit[0]
            r["bytes_to_target"] = None if hit is None else hit[2]
            r["time_to_common"] = time_to(r["curve"], common_target) if common_target is not None else None
        lines += ["", f"### {hosts} hosts, {rate_label(rate)} per host", ""]
        if group:
            lines += [
                f"Target loss (DDP-fp32's final): {target:.4f}. " if target is not None else "No DDP-fp32 run. ",
                f"Common target (the highest final loss here, reached by every method): {common_target:.4f}.",
                "",
                "| method | final held-out loss | loop wall (s) | MB sent per worker | time to target (s) "
                "| time to common target (s) | idle fraction |",
                "|---|---|---|---|---|---|---|",
            ]
        for method in _in_order(by_method):
            r = by_method[method]
            ttt = "not reached" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
            idle = _idle(r)
            lines.append(
                f"| {method} | {r['final_eval_loss']:.4f} | {r['wall_seconds']:.1f} | "
                f"{r['bytes_sent_per_worker'] / 1e6:.2f} | {ttt} | {r['time_to_common']:.1f} | {idle} |"
            )
        if longer and target is not None and ddp is not None:
            lines += [
                "",
                f"Longer budgets (`--to-target`): each method below trained its own longer run (its LR schedule "
                f"stretched to the budget) to measure when it reaches DDP-fp32's final loss {target:.4f}; DDP-fp32 "
                f"reached it at step {ddp['steps']} after {ddp['wall_seconds']:.1f} s.",
                "",
                "| method | budget (steps) | step at target | time to target (s) | sooner than DDP-fp32 "
                "| MB sent to target | final held-out loss | idle fraction |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for method in _in_order(longer):
                r = longer[method]
                _, vs = _speedup(r["time_to_target"], ddp["time_to_target"], ddp["wall_seconds"])
                idle = _idle(r)
                if r["time_to_target"] is None:
                    at = ttt = mb = "not reached"
                else:
                    at, ttt, mb = (f"{r['step_to_target']:.0f}", f"{r['time_to_target']:.1f}",
                                   f"{r['bytes_to_target'] / 1e6:.2f}")  # fmt: skip
                lines.append(f"| {method} | {r['steps']} | {at} | {ttt} | {vs} | {mb} | "
                             f"{r['final_eval_loss']:.4f} | {idle} |")  # fmt: skip

        def best(method: str, by_method: dict = by_method, longer: dict = longer) -> dict | None:
            """The run of ``method`` whose time to target counts: the equal-budget one if it got there."""
            short, long = by_method.get(method), longer.get(method)
            if short is not None and (short["time_to_target"] is not None or long is None):
                return short
            return long

        noloco4, noloco32 = by_method.get("noloco/int4"), by_method.get("noloco/fp32")
        checks = []
        if rate == slowest and noloco4 and ddp:
            mine = best("noloco/int4")
            for method, need in (("ddp/fp32", 5.0), ("diloco/fp32", 1.5), ("diloco/fp32/outer.momentum=0.5", 1.5)):
                other = best(method)
                if other is None:
                    continue
                name = f"NoLoCo-int4 reaches the target ≥ {need}× sooner than {method}"
                if mine is not noloco4 or other is not by_method.get(method):
                    name += " (longer budgets)"
                ratio, text = _speedup(mine["time_to_target"], other["time_to_target"], other["wall_seconds"])
                if ratio is None:
                    text = "NoLoCo-int4 does not reach it within its budget"
                checks.append((name, ratio is not None and ratio >= need, text))
                equal = by_method.get(method)
                if equal is None:
                    continue
                ratio, text = _speedup(noloco4["time_to_common"], equal["time_to_common"], equal["wall_seconds"])
                if ratio is not None:
                    checks.append((f"(common target) NoLoCo-int4 ≥ {need}× sooner than {method}", ratio >= need,
                                   text))  # fmt: skip
        if noloco4 and noloco32:
            gap = noloco4["final_eval_loss"] / noloco32["final_eval_loss"] - 1
            fewer = noloco32["bytes_sent_per_worker"] / max(1, noloco4["bytes_sent_per_worker"])
            # "within 1%" judged one-sided: a lower loss than fp32 is not a miss
            checks.append(("NoLoCo-int4 final loss within 1% of NoLoCo-fp32 (or lower)", gap <= 0.01,
                           f"{100 * gap:+.2f}%"))  # fmt: skip
            checks.append(("NoLoCo-int4 sends ≥ 6× fewer bytes per worker", fewer >= 6, f"{fewer:.1f}×"))
        if checks:
            lines += ["", "| target | met | measured |", "|---|---|---|"]
            lines += [f"| {name} | {'yes' if ok else '**no**'} | {value} |" for name, ok, value in checks]
        verdicts[f"{hosts}h-{rate_label(rate)}"] = [{"target": n, "met": ok, "value": v} for n, ok, v in checks]
    return lines, verdicts


def plan_of(args: argparse.Namespace) -> list[tuple]:
    """The ``(hosts, rate, method, steps)`` runs the arguments ask for: every method at every host count and rate,
    then with ``--to-target`` every local method's longer run at the slowest rate."""
    hosts_list = [int(h) for h in args.hosts.split(",")]
    rates = [r.strip() for r in args.rates.split(",")]
    slowest = min(rates, key=parse_rate)
    plan = [(hosts, rate, method, args.steps) for hosts in hosts_list for rate in rates for method in args.methods]
    if args.to_target:
        plan += [(hosts, slowest, method, args.to_target) for hosts in hosts_list for method in args.methods
                 if not method.startswith("ddp/")]  # fmt: skip
    return plan


def finished_runs(folder: Path, prog: str) -> list[Path]:
    """The fleet runs under ``folder`` that finished (a ``fleet.json`` and a ``summary.json``), sorted; none:
    an empty list, with a line on stderr."""
    runs = sorted(p.parent for p in folder.glob("*/fleet.json") if (p.parent / "summary.json").exists())
    if not runs:
        print(f"{prog}: no finished runs under {folder}", file=sys.stderr)
    return runs


MACHINE = "machine.txt"  # in a stamp folder: the machine its runs ran on (common.machine), for --from-runs


def machine_of(folder: Path) -> str:
    """The machine the runs under ``folder`` ran on, as :func:`benchmarks.common.machine` said there; this
    machine's words for a folder from before that was written down."""
    path = folder / MACHINE
    return path.read_text().strip() if path.exists() else common.machine()


def check_plan(plan: list[tuple], every_run: list[str], show: bool = False) -> int:
    """Load the config of every ``(hosts, rate, method, steps)`` run of ``plan`` (``show``: print each as a line);
    0, or 2 with the config's error for the first method it refuses."""
    for hosts, rate, method, budget in plan:
        overrides = ["backend=torch", f"workers={hosts}", *every_run, f"steps={budget}", *method_overrides(method)]
        try:
            load_config(overrides)
        except ConfigError as exc:
            print(f"{method}: {exc}", file=sys.stderr)
            return 2
        if show:
            print(f"{hosts} hosts at {rate}: train.py {' '.join(overrides)}")
    return 0


def run_plan(plan: list[tuple], folder: Path, every_run: list[str], steps: int, cpus_per_host: int | None,
             burst: str = "5ms") -> int:  # fmt: skip
    """Run each ``(hosts, rate, method, steps)`` of ``plan`` as one fleet launch under ``folder``, printing a line
    per run; a run of more than ``steps`` inner steps is named ``…-long``, of fewer ``…-s<steps>``. Returns 0, or
    2 when a method's config is refused (checked for every run first) or a fleet cannot be built (not root, tools
    missing)."""
    code = check_plan(plan, every_run)  # a method the config refuses fails here, before minutes of fleet runs
    if code:
        return code
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MACHINE).write_text(common.machine() + "\n")
    total = len(plan)
    started = time.monotonic()
    for done, (hosts, rate, method, budget) in enumerate(plan, 1):
        suffix = LONG if budget > steps else f"-s{budget}" if budget < steps else ""
        name = re.sub(r"[^a-z0-9.]+", "-", f"{hosts}h-{rate}-{method}") + suffix
        command = [sys.executable, str(ROOT / "train.py"), "backend=torch", f"workers={hosts}",
                   *every_run, f"steps={budget}", *method_overrides(method)]  # fmt: skip
        print(f"== [{done}/{total}] {name} ({time.monotonic() - started:.0f} s so far)", flush=True)
        try:
            with open(os.devnull, "w") as quiet:
                result = launch(command, hosts, rate=rate, run_dir=folder, name=name, out=quiet,
                                cpus_per_host=cpus_per_host, burst=burst)  # fmt: skip
        except FleetError as exc:
            print(exc, file=sys.stderr)
            return 2
        status = "ok" if result.returncode == 0 else f"FAILED ({result.returncode})"
        loss = result.summary["final_eval_loss"] if result.summary else float("nan")
        print(f"   {status}: {result.wall_seconds:.0f} s, held-out loss {loss:.4f}", flush=True)
    return 0


def write_report(out: Path, name: str, lines: list[str], results: list[dict], verdicts, command: str,
                 machine: str) -> None:  # fmt: skip
    """``<out>/<name>.md`` and ``.json`` of a fleet benchmark (the results without their curves, and the target
    verdicts), then the report on stdout."""
    for r in results:
        r.pop("curve", None)
    common.write_report(out, name, lines, {"results": results, "targets": verdicts}, command=command,
                        machine=machine)  # fmt: skip
    print("\n".join(lines))


def rerun_args(args: argparse.Namespace) -> list[str]:
    """The arguments that rerun the runs of a ``--from-runs`` redraw (as its other arguments describe them) and
    write the same report: every option spelled out, methods and defaults included."""
    return [
        "--hosts", args.hosts, "--rates", args.rates, "--methods", *args.methods, "--steps", str(args.steps),
        "--every", str(args.every), *(["--to-target", str(args.to_target)] if args.to_target else []),
        *(["--cpus-per-host", str(args.cpus_per_host)] if args.cpus_per_host else []),
        *(["--burst", args.burst] if args.burst != "5ms" else []),
        *(["--runs", str(args.runs)] if args.runs != Path("runs/throttled") else []),
        *(["--name", args.name] if args.name != "throttled" else []),
        *(["--out", str(args.out)] if Path(args.out) != common.RUNS / "throttled" else []),
        *(["--", *args.overrides] if args.overrides else []),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.throttled", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", default="4,8", help="host counts, comma-separated")
    parser.add_argument("--rates", default="50mbit,500mbit", help="per-host rates (tc units), comma-separated")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="algo/codec entries")
    parser.add_argument("--steps", type=int, default=120, help="inner steps per worker (the token budget)")
    parser.add_argument("--every", type=int, default=20, help="H, inner steps between outer rounds")
    parser.add_argument("--to-target", type=int, default=0, metavar="STEPS",
                        help="then, at the slowest rate, run every method but DDP again with a budget of STEPS "
                             "inner steps, to measure when it reaches DDP-fp32's final loss (0: off)")  # fmt: skip
    parser.add_argument(
        "--cpus-per-host",
        type=int,
        default=None,
        metavar="N",
        help="pin each host's worker to N cores of its own (noloco-fleet --cpus-per-host)",
    )
    parser.add_argument("--burst", default="5ms", help="tbf bucket per link as traffic time at the rate "
                        "(noloco-fleet --burst; default 5ms)")  # fmt: skip
    parser.add_argument("--runs", type=Path, default=Path("runs/throttled"))
    common.add_out(parser, "throttled")
    parser.add_argument("--name", default="throttled")
    parser.add_argument("--from-runs", type=Path, default=None, help="only redraw from a finished stamp folder")
    parser.add_argument("--dry-run", action="store_true", help="check every run's config, print the runs, run none")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = parser.parse_args()

    every_run = [*MODEL, f"outer.every={args.every}", *args.overrides]
    if args.dry_run:
        return check_plan(plan_of(args), every_run, show=True)
    if args.from_runs is not None:
        folder = args.from_runs
    else:
        if not is_root():
            print("benchmarks.throttled: needs root for the network namespaces (see docs/fleet.md); without root "
                  "use python -m noloco.fleet.linkmodel on an unshaped run", file=sys.stderr)  # fmt: skip
            return 2
        folder = args.runs / time.strftime("%Y%m%d-%H%M%S")
        hosts_list = [int(h) for h in args.hosts.split(",")]
        rates = [r.strip() for r in args.rates.split(",")]
        try:  # fail before any run on a typo
            for rate in rates:
                parse_rate(rate)
            burst = parse_duration(args.burst)
        except ValueError as exc:
            parser.error(str(exc))
        if not 0 < burst <= MAX_BURST_SECONDS:
            parser.error(f"--burst {args.burst}: not in (0, {MAX_BURST_SECONDS:g} s]")
        if args.cpus_per_host is not None:
            try:
                host_cpu_sets(max(hosts_list), args.cpus_per_host)  # enough cores for the largest fleet?
            except FleetError as exc:
                print(exc, file=sys.stderr)
                return 2
        code = run_plan(plan_of(args), folder, every_run, args.steps, args.cpus_per_host, args.burst)
        if code:
            return code
    runs = finished_runs(folder, "benchmarks.throttled")
    if not runs:
        return 1
    results = [measure(run) for run in runs]
    tables, verdicts = analyse(results)

    out = common.out_dir(args.out)
    pictures = []
    order = {m: i for i, m in enumerate(METHODS)}
    for hosts, rate in sorted({(r["hosts"], r["rate_bps"] or 0) for r in results}):
        everything = sorted((r for r in results if r["hosts"] == hosts and (r["rate_bps"] or 0) == rate),
                            key=lambda r: order.get(r["method"], len(order)))  # fmt: skip
        group = [r for r in everything if not r.get("long")]
        ddp = [r for r in group if r["method"] == "ddp/fp32"]
        target = ddp[0]["final_eval_loss"] if ddp else None
        label = f"{hosts} hosts, {rate_label(rate)} per host"
        if group:
            png = out / f"{args.name}-{hosts}h-{rate_label(rate)}.png"
            plot_runs([Path(r["run_dir"]) for r in group], png, title=label, target=target,
                      labels=[r["method"] for r in group])  # fmt: skip
            pictures.append(f"![{label}]({png.name})")
        longer = [r for r in everything if r.get("long")]
        if longer:
            png = out / f"{args.name}-{hosts}h-{rate_label(rate)}-long.png"
            plot_runs([Path(r["run_dir"]) for r in ddp + longer], png, target=target,
                      labels=[r["method"] + ("" if r in ddp else f" ({r['steps']} steps)") for r in ddp + longer],
                      title=f"{label}: longer budgets, time to DDP-fp32's final loss")  # fmt: skip
            pictures.append(f"![{label}, longer budgets]({png.name})")
    first = json.loads((Path(next(r for r in results if not r.get("long"))["run_dir"]) / "summary.json").read_text())
    gossip = [r for r in results if r["algo"] == "noloco"]
    group_size = None
    if gossip:
        group_size = json.loads((Path(gossip[0]["run_dir"]) / "summary.json").read_text()).get("group_size")
    command = common.command("throttled", rerun_args(args) if args.from_runs is not None else None)
    machine = machine_of(folder)
    lines = [
        "# Throttled fleet: DDP, DiLoCo and NoLoCo on rate-limited links",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}; every host is a network namespace on this one machine, "
        + (
            f"its worker pinned to {args.cpus_per_host} cores of its own.  "
            if args.cpus_per_host
            else "so the workers share its cores (each runs cores ÷ hosts torch threads).  "
        ),
        f"Date: {time.strftime('%Y-%m-%d')}  ",
        f"Setting: {first['params'] / 1e6:.2f}M-parameter model, {first['steps']} inner steps per worker, "
        f"H = {first['outer_every']} for DiLoCo and NoLoCo (NoLoCo groups of {group_size}), same data, "
        "token budget and seeds for every method. Links: `tc tbf` on each host's egress and ingress.",
        "",
        "Loop wall = the training loop's wall-clock at its last step (the slowest worker; start-up excluded). "
        "Idle fraction = seconds a worker's transport was blocked waiting for peers' messages over loop wall, "
        "mean over workers.",
        *tables,
        "",
        *pictures,
        "",
    ]
    write_report(out, args.name, lines, results, verdicts, command, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
