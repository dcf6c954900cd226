"""A real swarm of dozens: NoLoCo round time and rounds formed against N, beside a gloo ring all-reduce at the same N.

For each N of ``--peers`` (8, 16, 32, 64):

- **swarm**: N real peers (``python train.py backend=hivemind``: a tiny LLaMA, NoLoCo pairs, int4, adaptive
  deadlines) on loopback, all bootstrapped from the first one, all waiting for each other before training.
  Per peer, from its ``rounds.jsonl`` and ``summary.json``: the median seconds of its joined rounds' matchmaking
  and exchange (together: the round's sync time), its training loop's seconds per round, and the share of its
  rounds that formed. Reported: medians over the peers (and the worst peer's share of rounds formed).
- **gloo**: N ``torch.distributed`` processes (backend gloo, TCP on loopback, one thread each) all-reduce a
  vector of the model's parameter count in fp32 (the global mean DiLoCo needs each round) ``--reps`` times after
  one warm-up; reported: the median seconds over repetitions of the slowest process.

NoLoCo's claim (arXiv 2506.10911) is that its sync does not grow with N while the all-reduce's does. Everything
shares one machine's cores here, so both also measure the machine's load: N beyond the cores slows every peer.

``--sleep-step S`` takes the machine's load out: each peer computes a single 8-token sequence per step and
sleeps ``S`` seconds (its compute time, emulated), so N peers beyond the cores do not slow each other's training;
the model, and so the exchange, stay the same.

``--peers-per-bucket K`` spreads each N's announcements over ``peer.buckets = max(1, N // K)`` keys (about K peers
a key, whatever N), the setting docs/swarm.md recommends as N grows; without it every N uses one key.

``--peers-per-core D`` gives each N the same share of the machine: its peers (with their DHT processes and p2pd)
and then its gloo processes run pinned to the first ceil(N / D) of the cores this process may use, so N = 8 with
D = 4 has 2 cores and N = 64 has 16. Without it every N shares all the cores, and N beyond them slows every peer's
Python (encoding, matchmaking) whatever the swarm does; with it, what grows with N is the swarm's.

Usage: ``python -m benchmarks.swarm_scale --peers 8 16 [--steps 60] [--every 10] [--reps 5] [--sleep-step S]
[--peers-per-bucket K] [--peers-per-core D] [--out DIR] [-- KEY=VALUE ...]`` (the keys: ``train.py`` overrides
for every peer, such as ``peer.buckets=4``); writes ``DIR/swarm_scale.md``, ``.json`` and ``.png`` (default
``runs/benchmarks/swarm_scale/``; ``--name`` renames them); the peers' run folders go under
``runs/benchmarks/swarm_scale/``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/swarm_scale.py`: rerun as `python -m benchmarks.swarm_scale`
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.swarm_scale", *sys.argv[1:]])

from benchmarks import common
from benchmarks.peers import TINY, PeerSwarm, joined_seconds, slow_steps

#: ``--sleep-step``: one sequence of 8 tokens per step (about 30× less compute than TINY's 4 × 32), same model
SLEEP_DATA = ["data.batch_size=1", "data.seq_len=8"]


def _raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (inherited by the peers: each holds sockets to
    the others, and a peer's p2pd one per connection); returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def swarm_point(folder: Path, peers: int, steps: int, every: int, timeout: float, sleep_step: float = 0.0,
                overrides: list[str] | None = None) -> dict:  # fmt: skip
    """N peers training ``steps`` steps with a round every ``every``: medians over peers of their rounds.

    ``sleep_step`` > 0: the peers' compute is a sleep of that many seconds per step (one sequence of 8 tokens
    computed, so the cores stay free; the same model, so the same exchange)."""
    names = [f"p{i}" for i in range(peers)]
    args = [*TINY, f"steps={steps}", f"outer.every={every}", f"eval.every={steps}", "checkpoint.every=0",
            f"peer.wait_for_peers={peers - 1}", "peer.live_timeout=60",
            *(SLEEP_DATA if sleep_step > 0 else []), *(overrides or [])]  # fmt: skip
    env = {"NOLOCO_FAULTS": slow_steps(steps, sleep_step)} if sleep_step > 0 else None
    started, busy = time.monotonic(), _cpu_times()
    with PeerSwarm(folder, args) as swarm:
        swarm.peer(names[0], "peer.worker=0", env=env)
        join = f'peer.initial_peers=["{swarm.maddr(names[0], timeout)}"]'
        for rank, name in enumerate(names[1:], start=1):
            swarm.peer(name, join, f"peer.worker={rank}", env=env)
        codes = swarm.finish(names, timeout)
        per_peer = []
        for name in names:
            s = swarm.summary(name)
            if codes[name] != 0 or s is None:
                raise RuntimeError(f"peer {name} exited {codes[name]}; see {folder}/{name}.log")
            rounds = swarm.rounds(name)
            sync = [r["matchmaking_seconds"] + r["exchange_seconds"] for r in rounds if r["outcome"] == "joined"]
            per_peer.append({"peer": name, "rounds": s["rounds"], "joined": s["rounds_joined"],
                             "sync_seconds": statistics.median(sync) if sync else None,
                             "matchmaking_seconds": joined_seconds(rounds, "matchmaking_seconds"),
                             "exchange_seconds": joined_seconds(rounds, "exchange_seconds"),
                             **{k: joined_seconds(rounds, k) for k in (*PHASES, "dht_reads")},
                             "loop_seconds_per_round": s["loop_seconds_by_worker"][0] / max(1, s["rounds"]),
                             "outcomes": s["round_outcomes"], "params": s["params"]})  # fmt: skip
    synced = [p["sync_seconds"] for p in per_peer if p["sync_seconds"] is not None]
    med = lambda key: statistics.median(p[key] for p in per_peer if p[key] is not None)
    return {"peers": peers, "params": per_peer[0]["params"], "wall_seconds": time.monotonic() - started,
            "sync_seconds": statistics.median(synced) if synced else None,
            "matchmaking_seconds": med("matchmaking_seconds") if synced else None,
            "exchange_seconds": med("exchange_seconds") if synced else None,
            **{k: med(k) if synced else None for k in (*PHASES, "dht_reads")}, "cpu_busy": _busy_since(busy),
            "loop_seconds_per_round": med("loop_seconds_per_round"),
            "formed": statistics.median(p["joined"] / p["rounds"] for p in per_peer),
            "formed_worst": min(p["joined"] / p["rounds"] for p in per_peer), "per_peer": per_peer}  # fmt: skip


PHASES = ("listing_seconds", "dht_seconds", "confirm_seconds")  # where matchmaking went (RoundRecord)


def cores_for(peers: int, per_core: int, available: list[int]) -> list[int]:
    """The first ceil(``peers`` / ``per_core``) of the ``available`` cores (``--peers-per-core``)."""
    want = -(-peers // per_core)
    if want > len(available):
        raise ValueError(f"{peers} peers at {per_core} a core need {want} cores; this process may use "
                         f"{len(available)}")  # fmt: skip
    return sorted(available)[:want]


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores from /proc/stat; None where there is none."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busy_since(before: tuple[float, float] | None) -> float | None:
    """Share of the machine's cores busy since ``before`` (:func:`_cpu_times`)."""
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, numel: int, reps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=600))  # fmt: skip
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    dist.all_reduce(x.clone())  # warm-up: connections
    times = []
    for _ in range(reps):
        y = x.clone()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(y)
        times.append(time.perf_counter() - start)
    queue.put((rank, times))
    dist.destroy_process_group()


def gloo_point(world: int, numel: int, reps: int, timeout: float = 900) -> dict:
    """``world`` gloo processes all-reduce ``numel`` fp32 values ``reps`` times: the slowest process's seconds."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, numel, reps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        times = dict(queue.get(timeout=timeout) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    slowest = [max(times[r][i] for r in range(world)) for i in range(reps)]
    return {"peers": world, "numel": numel, "seconds": statistics.median(slowest), "reps": reps}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    swarm = [r for r in rows if r.get("sync_seconds") is not None]
    ax.plot([r["peers"] for r in swarm], [r["sync_seconds"] for r in swarm], "o-",
            label="NoLoCo swarm round: matchmaking + exchange")  # fmt: skip
    ax.plot([r["peers"] for r in rows], [r["gloo_seconds"] for r in rows], "s-", label="gloo ring all-reduce (fp32)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("peers N")
    ax.set_ylabel("seconds per round")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.swarm_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32, 64], help="N values (8 16 32 64)")
    parser.add_argument("--steps", type=int, default=60, help="inner steps per peer (60)")
    parser.add_argument("--every", type=int, default=10, help="inner steps per round (10)")
    parser.add_argument("--reps", type=int, default=5, help="gloo all-reduce repetitions (5)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one N may take (1800)")
    parser.add_argument("--sleep-step", type=float, default=0.0, metavar="S",
                        help="emulate compute: each peer computes one 8-token sequence per step and sleeps S "
                             "seconds (same model and exchange; the cores stay free); 0: real compute")  # fmt: skip
    common.add_out(parser, "swarm_scale")
    parser.add_argument("--peers-per-bucket", type=int, default=0, metavar="K",
                        help="peer.buckets = max(1, N // K) for each N (about K peers a key); 0: one key")  # fmt: skip
    parser.add_argument("--peers-per-core", type=int, default=0, metavar="D",
                        help="pin each N's peers and gloo processes to ceil(N / D) cores; 0: all cores")  # fmt: skip
    parser.add_argument("--name", default="swarm_scale", help="report file names (swarm_scale)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="train.py keys for every peer, after '--' (-- peer.buckets=4)")  # fmt: skip
    args = parser.parse_args(argv)
    if (min(args.peers) < 2 or args.steps < 2 * args.every or args.every < 1 or args.reps < 1 or args.sleep_step < 0
            or args.peers_per_bucket < 0 or args.peers_per_core < 0):  # fmt: skip
        parser.error("need --peers >= 2, --every >= 1, --steps >= 2 x --every, --reps >= 1, --sleep-step >= 0, "
                     "--peers-per-bucket >= 0, --peers-per-core >= 0")  # fmt: skip
    available = sorted(os.sched_getaffinity(0))
    if args.peers_per_core:
        try:
            pinned = {n: cores_for(n, args.peers_per_core, available) for n in args.peers}
        except ValueError as e:
            parser.error(f"--peers-per-core: {e}")
    fds = _raise_fd_limit()
    out = common.out_dir(args.out)
    # the peers' run folders (logs, metrics) stay under runs/, whatever --out is
    work = Path(tempfile.mkdtemp(prefix="swarm_scale-", dir=common.out_dir(common.RUNS / "swarm_scale")))
    rows = []
    for n in args.peers:
        buckets = max(1, n // args.peers_per_bucket) if args.peers_per_bucket else None
        keys = [f"peer.buckets={buckets}"] if buckets else []
        cores = pinned[n] if args.peers_per_core else available
        os.sched_setaffinity(0, cores)  # the peers, their DHT processes, p2pd and the gloo ranks inherit it
        try:
            row = swarm_point(work / f"n{n}", n, args.steps, args.every, args.timeout, args.sleep_step,
                              [*args.overrides, *keys])  # fmt: skip
            row["gloo_seconds"] = gloo_point(n, row["params"], args.reps)["seconds"]
        finally:
            os.sched_setaffinity(0, available)
        row["buckets"], row["cores"] = buckets or 1, len(cores)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "per_peer"}), flush=True)
    command, machine = common.command("swarm_scale", argv), common.machine()
    lines = _report(args, rows, command, machine, fds)
    _plot(rows, out / f"{args.name}.png")
    common.write_report(out, args.name, lines, {"rows": rows, "open_files_limit": fds, "work": str(work)},
                        command=command, machine=machine)  # fmt: skip
    print("\n".join(lines))
    return 0


def _report(args, rows: list[dict], command: str, machine: str, fds: int) -> list[str]:
    fmt = lambda v, spec=".3f": "–" if v is None else format(v, spec)
    lines = [
        "# A real swarm of dozens: NoLoCo rounds against a gloo all-reduce, N peers on one machine",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine} (open files limit {fds})",
        "",
        f"Swarm: N peers on loopback, tiny LLaMA ({rows[0]['params']:,} parameters), NoLoCo pairs, int4, adaptive "
        f"deadlines, {args.steps} inner steps, a round every {args.every}. Sync = matchmaking + exchange of a joined "
        "round (median over its rounds, then over the peers); formed = rounds joined / rounds (median, worst peer). "
        + (
            f"Compute emulated: each peer computes one 8-token sequence a step and sleeps {args.sleep_step:g} s, so "
            "the cores are not shared by N peers' training (the exchange is the same model's). "
            if args.sleep_step
            else ""
        )
        + (f"Every peer also ran `{' '.join(args.overrides)}`. " if args.overrides else "")
        + (f"Keys: `peer.buckets` = max(1, N // {args.peers_per_bucket}) for each N. " if args.peers_per_bucket else "")
        + (
            f"Cores: each N's peers and gloo processes pinned to ceil(N / {args.peers_per_core}) cores. "
            if args.peers_per_core
            else ""
        )
        + f"gloo: N processes all-reduce the same number of fp32 values, median of {args.reps} (slowest process).",
        "",
        "Of matchmaking: registry = reading the live peers, DHT = announcing and reading the round's announcements, "
        "confirm = confirming the group (the rest waits for the window); DHT reads = reads of the round's "
        "announcements (median over rounds joined, then peers; 0: read from pushed announcements). CPU = share of "
        "the machine's cores busy from the N peers' start to their end (their start-up, N imports of torch and "
        "hivemind at once, included).",
        "",
        "| N | keys | cores | swarm sync (s) | matchmaking (s) | registry, DHT, confirm (s) | DHT reads | "
        "exchange (s) | loop s / round | rounds formed (median, worst) | CPU | gloo all-reduce (s) | "
        "gloo ÷ swarm sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["gloo_seconds"] / r["sync_seconds"] if r["sync_seconds"] else None
        lines.append(f"| {r['peers']} | {r.get('buckets', 1)} | {r.get('cores', '–')} | {fmt(r['sync_seconds'])} | "
                     f"{fmt(r['matchmaking_seconds'])} | {', '.join(fmt(r.get(k), '.2f') for k in PHASES)} | "
                     f"{fmt(r.get('dht_reads'), '.1f')} | {fmt(r['exchange_seconds'])} | "
                     f"{fmt(r['loop_seconds_per_round'])} | {r['formed']:.0%}, {r['formed_worst']:.0%} | "
                     f"{fmt(r.get('cpu_busy'), '.0%')} | {fmt(r['gloo_seconds'], '.4f')} | "
                     f"{fmt(ratio, '.2f')} |")  # fmt: skip
    swarm = [r for r in rows if r["sync_seconds"]]
    if len(swarm) > 1:
        lines += ["", f"Swarm sync from N = {swarm[0]['peers']} to {swarm[-1]['peers']}: "
                  f"{swarm[-1]['sync_seconds'] / swarm[0]['sync_seconds']:.2f}×; gloo all-reduce: "
                  f"{rows[-1]['gloo_seconds'] / rows[0]['gloo_seconds']:.2f}×."]  # fmt: skip
    return lines + ["", f"![{args.name}.png]({args.name}.png)"]


if __name__ == "__main__":
    raise SystemExit(main())
