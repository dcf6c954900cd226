"""``noloco-fleet``: run one worker per network namespace behind rate-limited links (docs/design.md §5).

    noloco-fleet --hosts 4 --rate 50mbit -- python train.py backend=torch workers=4 outer.algo=noloco

As root, :func:`launch` builds a :class:`~noloco.fleet.netns.Fleet` (N namespaces on one bridge,
each host's egress and ingress shaped with ``tc tbf``), starts the command once per namespace with
the torch.distributed environment of that rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = host 0,
``MASTER_PORT``, ``LOCAL_WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` = ``veth0``),
streams every worker's output with an ``[h<i>]`` prefix, waits, and tears everything down.

For a ``train.py``/``noloco-train`` command it adds ``run.dir``/``run.name`` (unless given), so the
run folder is known; after the run it writes ``fleet.json`` there (hosts, rate, the link-layer bytes
each host's shapers passed, wall time) and one ``fleet.h<i>.log`` per worker.

Failure: a worker that exits non-zero fails the launch; the others get ``--grace`` seconds to exit
on their own (gloo notices the lost peer) and are then killed; the exit status is the first
failing worker's. SIGINT (Ctrl-C) is passed on to every worker, so a train command stops as ``train.py`` does:
every worker saves one agreed step and exits 130 (a second Ctrl-C: they quit at once, keeping the last complete
checkpoint); then the namespaces go and the launcher prints the resume command and exits 130. SIGTERM/SIGHUP
stop the workers (SIGTERM to their process groups, SIGKILL after a grace period) and delete the namespaces; a
cleanup by name prefix catches anything left.
Not root: one line that points to the in-process link model (:mod:`noloco.fleet.linkmodel`).
Latency (``--latency D``): the kernel has no netem, so the delay is added in user space: every
worker gets ``NOLOCO_LINK_LATENCY=D`` and its :class:`~noloco.comm.torchdist.TorchDistTransport`
sends each message D seconds after the call (one-way latency per message; TCP's own round trips are
not delayed). It applies to noloco's exchanges, not to other traffic of the command.
"""

# fmt: off
# (hand layout: the kernels' aligned argument lists and the launcher's option table read better as written)

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from noloco.fleet.netns import (
    IFNAME,
    Fleet,
    FleetError,
    cleanup_prefix,
    is_root,
    list_namespaces,
    missing_tools,
    namespace_inventory,
    parse_duration,
    parse_rate,
    plural,
    stale_prefixes,
)
from noloco.train.metrics import merge_parts

NOT_ROOT = (
    "noloco-fleet: needs root to build network namespaces and tc shapers; without root, predict the "
    "throttled run with the in-process link model: python -m noloco.fleet.linkmodel <run_dir> --rate 50mbit "
    "(see docs/fleet.md)"
)


@dataclass
class FleetResult:
    """What a launch returns: exit status, per-worker exit codes, run folder, summary, link stats, and each host's
    cores when they were pinned (``cpus_per_host``)."""

    returncode: int
    exit_codes: list[int | None]
    wall_seconds: float
    run_dir: Path | None = None
    summary: dict | None = None
    link_stats: list[dict] = field(default_factory=list)
    prefix: str = ""
    cpus: list[list[int]] | None = None
    interrupted: bool = False  # Ctrl-C was passed on to the workers


def _is_train_command(command: list[str]) -> bool:
    return any(Path(arg).name in ("train.py", "noloco-train") for arg in command[:3])


def _with_run_folder(command: list[str], run_dir: Path, name: str) -> tuple[list[str], Path | None]:
    """Add ``run.dir``/``run.name`` to a train command that sets neither; returns (command, folder or None)."""
    if not _is_train_command(command):
        return command, None
    keys = {arg.split("=", 1)[0] for arg in command if "=" in arg}
    if "run.dir" in keys or "run.name" in keys or "--config" in command or "resume" in keys:
        given = {arg.split("=", 1)[0]: arg.split("=", 1)[1] for arg in command if "=" in arg}
        if "run.dir" in given and "run.name" in given:
            return command, Path(given["run.dir"]) / given["run.name"]
        return command, None
    return [*command, f"run.dir={run_dir}", f"run.name={name}"], run_dir / name


def _stream(proc: subprocess.Popen, host: int, out: TextIO, log: TextIO | None, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, ""):
        with lock:
            out.write(f"[h{host}] {line}" if line.endswith("\n") else f"[h{host}] {line}\n")
            out.flush()
        if log is not None:
            log.write(line)
            log.flush()


def _signal_running(procs: list[subprocess.Popen], sig: int) -> list[subprocess.Popen]:
    """Send ``sig`` to the process group of each worker still running; returns those."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    return running


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM each worker's process group, SIGKILL whatever is left after ``grace`` seconds."""
    _signal_running(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in _signal_running(procs, signal.SIGKILL):
        proc.wait()


class _Terminated(Exception):
    """Raised in the main thread by the SIGTERM/SIGHUP handler so ``finally`` tears down."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_on_signal(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def launch(
    command: list[str],
    hosts: int,
    rate: str | float | None = None,
    latency: str | float | None = None,
    port: int = 29500,
    run_dir: Path | str = Path("runs/fleet"),
    name: str | None = None,
    prefix: str | None = None,
    local_world_size: int | None = None,
    cpus_per_host: int | None = None,
    grace: float = 10.0,
    queue: str | float = "100ms",
    out: TextIO | None = None,
    burst: str | float = "5ms",
) -> FleetResult:
    """Build the fleet, run ``command`` on every host, wait, tear down; returns a :class:`FleetResult`.

    ``rate``: per host, each direction, as ``"50mbit"`` or bits/s (``None``: unshaped).
    ``queue``: tbf's queue bound (packets that would wait longer are dropped), ``"100ms"`` or seconds.
    ``burst``: tbf's bucket as traffic time at ``rate`` (at least 16 KiB), ``"5ms"`` or seconds; a deeper one
    lets a message start at line speed as many access links do.
    ``local_world_size``: ``LOCAL_WORLD_SIZE`` given to every worker (torch threads = cores / it);
    default ``hosts``, since all hosts share this machine's cores.
    ``cpus_per_host``: pin host i's worker to its own ``cpus_per_host`` cores (the i-th slice of the launcher's
    CPU affinity), so that hosts do not compete for cores as separate machines would not; ``LOCAL_WORLD_SIZE``
    then defaults to 1 (torch threads = the host's cores). Refused when the machine has fewer than
    ``hosts * cpus_per_host`` usable cores.
    Raises :class:`~noloco.fleet.netns.FleetError` when not root, tools are missing or setup fails.
    """
    out = out or sys.stdout
    delay = _check_request(command, latency)
    rate_bps = _rate_bps(rate)
    cpu_sets = host_cpu_sets(hosts, cpus_per_host) if cpus_per_host is not None else None
    prefix = prefix or f"nlc{os.getpid()}"
    name = name or time.strftime(f"fleet-{hosts}h-%Y%m%d-%H%M%S")
    command, folder = _with_run_folder(list(command), Path(run_dir).absolute(), name)
    queue_s, burst_s = _seconds(queue), _seconds(burst)
    fleet = Fleet(hosts, rate_bps, prefix=prefix, queue_latency=queue_s, burst_seconds=burst_s)
    workers = _Workers()
    codes: list[int | None] = [None] * hosts
    started = time.perf_counter()
    result = FleetResult(returncode=1, exit_codes=codes, wall_seconds=0.0, run_dir=folder, prefix=prefix,
                         cpus=[sorted(cpus) for cpus in cpu_sets] if cpu_sets else None)  # fmt: skip
    try:
        _bring_up(fleet, hosts, rate_bps, prefix, folder, out)
        env = functools.partial(_worker_env, fleet, hosts=hosts, port=port, local_world_size=local_world_size,
                                pinned=bool(cpu_sets), delay=delay)
        previous = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():  # Ctrl-C: the workers stop as train.py does
            signal.signal(signal.SIGINT, workers.interrupt)
        try:
            _start_hosts(workers, fleet, command, hosts, env, folder, cpu_sets, out)
            _wait_for_workers(workers.procs, codes, grace, out, workers)
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, previous)
        for thread in workers.threads:
            thread.join(5)
        _record_result(result, fleet, command, hosts, rate_bps, queue_s, started)
        result.interrupted = workers.interrupts > 0
        return result
    finally:
        _tear_down(workers, fleet)


def _check_request(command: list[str], latency: str | float | None) -> float:
    """Refuse a launch that cannot run (not root, tools missing, bad latency, no command); returns the latency
    in seconds (0 when none is given)."""
    if not is_root():
        raise FleetError(NOT_ROOT)
    if missing_tools():
        raise FleetError(f"noloco-fleet: missing {', '.join(missing_tools())} (install iproute2)")
    delay = 0.0
    if latency not in (None, ""):
        delay = _seconds(latency)
        if not delay >= 0:
            raise FleetError(f"noloco-fleet: latency must be >= 0, got {latency!r}")
    if not command:
        raise FleetError("noloco-fleet: no command given (put it after --)")
    return delay


def _seconds(value: str | float) -> float:
    """Seconds from a number or a duration such as ``"20ms"`` (ValueError for anything else)."""
    return float(value) if isinstance(value, (int, float)) else parse_duration(value)


def _rate_bps(rate: str | float | None) -> float | None:
    """The per-host link rate in bits/s, or None for unshaped links."""
    if rate in (None, "", "none"):
        rate_bps = None
    else:
        rate_bps = float(rate) if isinstance(rate, (int, float)) else parse_rate(rate)
    return rate_bps


@dataclass
class _Workers:
    """What :func:`launch` started and must undo: the workers' processes, their log threads and log files."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    logs: list[TextIO] = field(default_factory=list)
    interrupts: int = 0  # Ctrl-C passed on to the workers

    def interrupt(self, signum: int, frame: object) -> None:
        """SIGINT handler: pass it on to every running worker's process group (they stop and save)."""
        self.interrupts += 1
        _signal_running(self.procs, signal.SIGINT)


def _bring_up(fleet: Fleet, hosts: int, rate_bps: float | None, prefix: str, folder: Path | None,
              out: TextIO) -> None:
    """Build the fleet's namespaces and links, say so on ``out``, and create the run folder."""
    fleet.up()
    shaping = f"{rate_bps / 1e6:g} Mbit/s each way (ingress via {fleet.ingress_mode})" if rate_bps else "unshaped"
    out.write(f"noloco-fleet: {hosts} hosts {fleet.ip(0)}..{fleet.ip(hosts - 1)} ({prefix}-h*), {shaping}\n")
    out.flush()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)


def _worker_env(fleet: Fleet, host: int, *, hosts: int, port: int, local_world_size: int | None, pinned: bool,
                delay: float) -> dict[str, str]:
    """The environment of host ``host``'s worker: its torch.distributed rank and rendezvous, and noloco's."""
    return {
        "RANK": str(host),
        "WORLD_SIZE": str(hosts),
        "MASTER_ADDR": fleet.ip(0),
        "MASTER_PORT": str(port),
        "LOCAL_WORLD_SIZE": str(local_world_size or (1 if pinned else hosts)),
        "GLOO_SOCKET_IFNAME": IFNAME,
        "TP_SOCKET_IFNAME": IFNAME,
        "PYTHONUNBUFFERED": "1",
        "NOLOCO_FLEET_HOST": str(host),
        "NOLOCO_LINK_LATENCY": repr(delay),
    }


def _start_hosts(workers: _Workers, fleet: Fleet, command: list[str], hosts: int, env: Callable[[int], dict],
                 folder: Path | None, cpu_sets: list[set[int]] | None, out: TextIO) -> None:
    """Start ``command`` once per host (pinned to its cores if ``cpu_sets``), each with a thread that streams
    its output to ``out`` (and its log file in ``folder``); everything started goes into ``workers`` at once,
    so that teardown finds it if a later host fails to start."""
    lock = threading.Lock()
    for host in range(hosts):
        host_env = env(host)
        log = open(folder / f"fleet.h{host}.log", "w") if folder is not None else None  # noqa: SIM115
        if log is not None:
            workers.logs.append(log)
        start = functools.partial(
            fleet.popen, host, command, host_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, bufsize=1, errors="replace",
        )  # fmt: skip
        proc = _pinned(cpu_sets[host], start) if cpu_sets is not None else start()
        workers.procs.append(proc)
        thread = threading.Thread(target=_stream, args=(proc, host, out, log, lock), daemon=True)
        thread.start()
        workers.threads.append(thread)


def _wait_for_workers(procs: list[subprocess.Popen], codes: list[int | None], grace: float, out: TextIO,
                      workers: _Workers | None = None) -> None:
    """Poll the workers into ``codes`` until all exited; once one failed, stop the others after ``grace`` s (not
    after a Ctrl-C passed on to them: each saves its checkpoint, however long that takes, and exits 130)."""
    failed_at = None
    while True:
        for host, proc in enumerate(procs):
            codes[host] = proc.poll()
        if all(code is not None for code in codes):
            break
        stopping = workers is not None and workers.interrupts > 0
        if failed_at is None and not stopping and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            out.write(f"noloco-fleet: a worker failed; stopping the others after {grace:g} s\n")
            _stop(procs, 3.0)
            codes[:] = [proc.poll() for proc in procs]
            break
        time.sleep(0.1)


def _record_result(result: FleetResult, fleet: Fleet, command: list[str], hosts: int, rate_bps: float | None,
                   queue_s: float, started: float) -> None:
    """Fill in ``result`` (link stats, wall time, exit status, summary) and write ``fleet.json`` to the run folder."""
    codes, folder = result.exit_codes, result.run_dir
    result.link_stats = [fleet.link_stats(host) for host in range(hosts)]
    result.wall_seconds = time.perf_counter() - started
    # the first worker that failed on its own (a positive code), not the ones stopped after it
    failed = [code for code in codes if code is not None and code > 0]
    result.returncode = failed[0] if failed else (0 if all(code == 0 for code in codes) else 1)
    if folder is not None and folder.is_dir():  # the workers are gone: their metrics parts become metrics.jsonl
        merge_parts(folder)  # (a finished run's rank 0 did it already; a stopped or failed run's parts are here)
    if folder is not None and (folder / "summary.json").exists():
        result.summary = json.loads((folder / "summary.json").read_text())
    if folder is not None:
        record = {
            "hosts": hosts,
            "rate_bps": rate_bps,
            "ingress": fleet.ingress_mode,
            "queue_seconds": queue_s,
            "burst_seconds": fleet.burst_seconds,
            "cpus": result.cpus,
            "command": command,
            "exit_codes": codes,
            "wall_seconds": result.wall_seconds,
            "link_stats": result.link_stats,
        }
        (folder / "fleet.json").write_text(json.dumps(record, indent=1))


def _tear_down(workers: _Workers, fleet: Fleet) -> None:
    """Stop every worker still running, close the log files and delete the namespaces."""
    _stop(workers.procs, 3.0)
    for log in workers.logs:
        log.close()
    fleet.down()


def _pinned(cpus: set[int], start):
    """``start()`` with this thread's CPU affinity set to ``cpus``, so the process it forks (``ip netns exec``,
    which execs the worker) and all of that worker's threads inherit it; the thread's own affinity is restored.
    (No ``preexec_fn``: that is unsafe while the launcher's log threads run.)"""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return start()
    finally:
        os.sched_setaffinity(0, old)


def host_cpu_sets(hosts: int, cpus_per_host: int) -> list[set[int]]:
    """Disjoint core sets, ``cpus_per_host`` each, for ``hosts`` hosts, taken in order from the cores this process
    may use. Raises :class:`FleetError` when there are not enough."""
    if cpus_per_host < 1:
        raise FleetError(f"noloco-fleet: --cpus-per-host must be >= 1, got {cpus_per_host}")
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError as exc:  # pragma: no cover - Linux always has it
        raise FleetError("noloco-fleet: --cpus-per-host needs os.sched_setaffinity (Linux)") from exc
    if hosts * cpus_per_host > len(usable):
        raise FleetError(
            f"noloco-fleet: {hosts} hosts x {cpus_per_host} cores need {hosts * cpus_per_host} cores, "
            f"this machine lets us use {len(usable)}; lower --cpus-per-host or leave it out to share the cores"
        )
    return [set(usable[i * cpus_per_host : (i + 1) * cpus_per_host]) for i in range(hosts)]


def cleanup(out: TextIO | None = None) -> list[str]:
    """``noloco-fleet --cleanup``: remove the namespaces of launchers whose pid is gone and say, per namespace,
    what went with it (links by kind with their addresses, tc qdiscs, processes killed), then a total line; or
    ``nothing to clean up``. Returns the names removed (namespaces, then any root-namespace links)."""
    out = out or sys.stdout
    removed: list[str] = []
    totals: dict[str, int] = {}
    for prefix in stale_prefixes():
        inventories = [namespace_inventory(ns) for ns in list_namespaces() if ns.startswith(prefix + "-")]
        gone = cleanup_prefix(prefix)
        removed += gone
        out.write(f"noloco-fleet: removed {prefix}-* (launcher pid {prefix[3:].split('x')[0]} is gone):\n")
        for inventory in inventories:
            out.write(f"  namespace {inventory.namespace}: {inventory.describe()}\n")
            totals["namespace"] = totals.get("namespace", 0) + 1
            for kind, _ in inventory.links:
                totals[kind] = totals.get(kind, 0) + 1
            totals["tc qdisc"] = totals.get("tc qdisc", 0) + len(inventory.qdiscs)
            totals["process"] = totals.get("process", 0) + len(inventory.pids)
        namespaces = {inventory.namespace for inventory in inventories}
        for name in gone:
            if name not in namespaces:
                out.write(f"  root-namespace link {name}\n")
                totals["root-namespace link"] = totals.get("root-namespace link", 0) + 1
    if removed:
        out.write(f"noloco-fleet: cleaned up {', '.join(plural(n, kind) for kind, n in totals.items() if n)}\n")
    else:
        out.write("noloco-fleet: nothing to clean up (no namespaces of dead launchers)\n")
    out.flush()
    return removed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="noloco-fleet",
        description="Run one worker per network namespace behind rate-limited links (root only).",
        epilog="example: noloco-fleet --hosts 4 --rate 50mbit -- python train.py backend=torch workers=4",
    )
    parser.add_argument("--hosts", type=int, help="number of hosts (namespaces), one worker each")
    parser.add_argument("--rate", default=None, help="per-host link rate, each direction: 50mbit, 500kbit, 1gbit")
    parser.add_argument(
        "--latency", default=None, help="one-way delay per message, e.g. 20ms (user space: NOLOCO_LINK_LATENCY)"
    )
    parser.add_argument("--queue", default="100ms", help="tbf queue bound per link (default 100ms)")
    parser.add_argument("--burst", default="5ms", help="tbf bucket per link, as traffic time at --rate "
                        "(default 5ms, at least 16 KiB; access links often burst 50ms or more)")  # fmt: skip
    parser.add_argument("--port", type=int, default=29500, help="MASTER_PORT on host 0 (default 29500)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/fleet"), help="run.dir for train commands")
    parser.add_argument("--name", default=None, help="run.name for train commands (default fleet-<N>h-<time>)")
    parser.add_argument("--prefix", default=None, help="namespace name prefix (default nlc<pid>)")
    parser.add_argument("--local-world-size", type=int, default=None,
                        help="LOCAL_WORLD_SIZE per worker (torch threads = cores / it; default --hosts)")
    parser.add_argument("--cpus-per-host", type=int, default=None, metavar="N",
                        help="pin each host's worker to N cores of its own (default: all hosts share every core)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds the others get after a worker fails")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove the namespaces of launchers that died without cleaning up, then exit")
    args = parser.parse_args(argv)
    if not is_root():
        print(NOT_ROOT, file=sys.stderr)
        return 2
    if args.cleanup:
        cleanup()
        return 0
    if not args.hosts or args.hosts < 1:
        parser.error("--hosts N is required (N >= 1)")
    if not command:
        parser.error("no command: put it after --, e.g. -- python train.py backend=torch")
    old = {sig: signal.signal(sig, _raise_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = launch(
            command, args.hosts, rate=args.rate, latency=args.latency, port=args.port, run_dir=args.run_dir,
            name=args.name, prefix=args.prefix, local_world_size=args.local_world_size,
            cpus_per_host=args.cpus_per_host, grace=args.grace,
            queue=args.queue, burst=args.burst,
        )  # fmt: skip
    except (FleetError, ValueError) as exc:
        print(str(exc) if str(exc).startswith("noloco-fleet") else f"noloco-fleet: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("noloco-fleet: interrupted; workers stopped and namespaces removed", file=sys.stderr)
        return 130
    except _Terminated as exc:
        print(f"noloco-fleet: got signal {exc.signum}; workers stopped and namespaces removed", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if result.interrupted:
        where = f"resume={result.run_dir} " if result.run_dir is not None else "resume=<run folder> "
        print(f"noloco-fleet: interrupted; namespaces removed; resume with the same noloco-fleet command, its "
              f"train command given {where.strip()}", file=sys.stderr)  # fmt: skip
    line = f"noloco-fleet: exit {result.returncode} (worker exit codes {result.exit_codes})"
    line += f", {result.wall_seconds:.1f} s"
    if result.run_dir is not None:
        line += f", run folder {result.run_dir}"
    print(line)
    for host, stats in enumerate(result.link_stats):
        if stats:
            sent, received = stats.get("tx_bytes", 0) / 1e6, stats.get("rx_bytes", 0) / 1e6
            print(
                f"  h{host}: sent {sent:.2f} MB, received {received:.2f} MB "
                f"(link layer; dropped {stats.get('tx_dropped', 0)}/{stats.get('rx_dropped', 0)} packets)"
            )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
