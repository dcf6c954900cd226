"""A real throttled fleet: measured link rate, a short training job, teardown after success, failure
and SIGTERM. Needs root, ``ip`` and ``tc`` (CI runs as root); skipped otherwise."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from noloco.fleet import launcher
from noloco.fleet.launcher import NOT_ROOT, launch
from noloco.fleet.netns import NETNS_ETC, Fleet, is_root, list_namespaces, missing_tools
from noloco.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(
    not is_root() or bool(missing_tools()),
    reason="needs root and iproute2 (ip, tc) to build network namespaces",
)
_count = itertools.count()
TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.vocab_size=512", "data.seq_len=32",
    "data.batch_size=4", "eval.batches=2", "eval.every=3", "log.progress=false", "log.tensorboard=false",
]  # fmt: skip


def _prefix() -> str:
    return f"nlc{os.getpid()}x{next(_count)}"


def _leftovers(prefix: str) -> list[str]:
    """Namespaces, root-namespace links and processes of this prefix that still exist."""
    left = [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left += [line for line in links.splitlines() if prefix in line]
    procs = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left += [line for line in procs.splitlines() if f"netns exec {prefix}-" in line]
    left += [str(folder) for folder in NETNS_ETC.glob(f"{prefix}-*")]
    return left


def _pids_inside(prefix: str) -> dict[str, list[int]]:
    """The processes inside each namespace of this prefix."""
    names = [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]
    return {ns: [int(pid) for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                                    text=True).stdout.split()] for ns in names}  # fmt: skip


def _hosts_running(prefix: str) -> int:
    """Namespaces of this prefix with a process inside."""
    return sum(bool(pids) for pids in _pids_inside(prefix).values())


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(") ", 1)[-1][:1] != "Z"  # a zombie has exited


RECEIVER = """
import socket, sys, time
server = socket.socket(); server.bind((sys.argv[1], 5001)); server.listen(1)
conn, _ = server.accept(); total, start = 0, None
while True:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    start = start or time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - start)
"""
SENDER = """
import socket, sys, time
for attempt in range(100):
    try:
        conn = socket.create_connection((sys.argv[1], 5001)); break
    except OSError:
        time.sleep(0.05)
block, left = b"x" * (1 << 16), int(sys.argv[2])
while left > 0:
    conn.sendall(block[:left]); left -= len(block)
conn.close()
"""


@needs_root
def test_tcp_throughput_through_a_shaped_link_respects_the_rate():
    rate = 16e6
    with Fleet(2, rate, prefix=_prefix()) as fleet:
        receiver = fleet.popen(1, [sys.executable, "-c", RECEIVER, fleet.ip(1)], stdout=subprocess.PIPE, text=True)
        sender = fleet.popen(0, [sys.executable, "-c", SENDER, fleet.ip(1), str(int(rate / 8 * 3))])  # ~3 s
        assert sender.wait(60) == 0
        total, seconds = receiver.communicate(timeout=60)[0].split()
        goodput = int(total) * 8 / float(seconds)
        wire = fleet.link_stats(0)["tx_bytes"] * 8 / float(seconds)
        prefix = fleet.prefix
    # TCP payload is ~95% of the link-layer rate tbf enforces; the wire rate itself is within 10%
    assert 0.85 * rate <= goodput <= 1.0 * rate, f"goodput {goodput / 1e6:.2f} Mbit/s at {rate / 1e6:g} Mbit/s"
    assert 0.9 * rate <= wire <= 1.1 * rate, f"link-layer {wire / 1e6:.2f} Mbit/s at {rate / 1e6:g} Mbit/s"
    assert _leftovers(prefix) == []


LOOKUP = """
import socket, sys
print(*(socket.getnameinfo((address, 0), 0)[0] for address in sys.argv[1:]))
"""


@needs_root
def test_every_host_resolves_the_fleet_addresses_by_name_without_dns():
    # a dual-stack listener (torch.distributed's store) sees peers as ::ffff:10.201.0.x and looks each one
    # up; with no name inside the namespace the lookup fell through to an unreachable DNS server and failed
    with Fleet(2, None, prefix=_prefix()) as fleet:
        addresses = [fleet.ip(1), f"::ffff:{fleet.ip(1)}", fleet.ip(0), "127.0.0.1"]
        lookup = subprocess.run(fleet.exec_args(0, [sys.executable, "-c", LOOKUP, *addresses]),
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        names, prefix = lookup.stdout.split(), fleet.prefix
    assert lookup.returncode == 0, lookup.stderr
    assert names[:3] == [f"{prefix}-h1", f"{prefix}-h1", f"{prefix}-h0"] and names[3] != "127.0.0.1"
    assert _leftovers(prefix) == []


@needs_root
@pytest.mark.slow
def test_short_training_job_runs_through_the_launcher_and_everything_is_torn_down(tmp_path):
    prefix, out = _prefix(), io.StringIO()
    command = [sys.executable, str(REPO / "train.py"), "backend=torch", "workers=2", "steps=6", "outer.every=3", *TINY]
    result = launch(command, hosts=2, rate="16mbit", run_dir=tmp_path, name="job", prefix=prefix, out=out)
    assert result.returncode == 0, out.getvalue()[-3000:]
    assert result.summary is not None and result.summary["workers"] == 2
    assert (tmp_path / "job" / "fleet.json").exists() and (tmp_path / "job" / "fleet.h1.log").exists()
    lines = out.getvalue().splitlines()[1:]  # after the banner: rank 0's progress; rank 1 has nothing to say
    assert any(line.startswith("[h0] ") for line in lines) and all(line[:5] in ("[h0] ", "[h1] ") for line in lines)
    # each host names its peers: no "[c10d] The hostname of the client socket cannot be retrieved" from either
    assert not any("hostname of the client socket" in line for line in lines), lines
    # every payload byte crossed a shaped link: the shapers saw at least what the workers counted
    for host, stats in enumerate(result.link_stats):
        last = [r for r in read_metrics(tmp_path / "job") if r["worker"] == host][-1]
        assert stats["tx_bytes"] >= last["bytes_sent"] > 0
    assert not list((tmp_path / "job").glob("metrics.rank*.jsonl"))  # merged into metrics.jsonl
    assert _leftovers(prefix) == []


@needs_root
def test_a_failing_worker_fails_the_launch_and_the_others_are_stopped():
    prefix, out = _prefix(), io.StringIO()
    command = ["sh", "-c", 'if [ "$RANK" = 1 ]; then echo bad config; exit 3; fi; sleep 120']
    started = time.monotonic()
    result = launch(command, hosts=3, rate="8mbit", prefix=prefix, grace=1.0, out=out)
    assert result.returncode == 3 and result.exit_codes[1] == 3
    assert time.monotonic() - started < 100  # the others' `sleep 120` was cut (margin for a loaded machine)
    assert "[h1] bad config" in out.getvalue()
    assert _leftovers(prefix) == []


@needs_root
def test_sigterm_to_the_launcher_stops_workers_and_removes_the_namespaces():
    prefix = _prefix()
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco.fleet.launcher", "--hosts", "2", "--rate", "8mbit", "--prefix", prefix,
         "--", "sleep", "300"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60  # until both hosts' commands run (`ip netns exec` has exec'd into them)
        while time.monotonic() < deadline and _hosts_running(prefix) < 2:
            time.sleep(0.2)
        if _hosts_running(prefix) < 2:
            state = "still running" if proc.poll() is None else f"exited {proc.returncode}"
            proc.kill()
            output = proc.communicate(timeout=30)[0]
            pytest.fail(f"the fleet's two commands never started (launcher {state}):\n{output[-3000:]}")
        inside = [pid for pids in _pids_inside(prefix).values() for pid in pids]
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
        assert proc.returncode == 128 + signal.SIGTERM, output
        assert _leftovers(prefix) == []
        assert not [pid for pid in inside if _alive(pid)], "a host's command outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        from noloco.fleet.netns import cleanup_prefix

        cleanup_prefix(prefix)


def test_without_root_it_refuses_in_one_line_and_points_to_the_link_model(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "is_root", lambda: False)
    assert launcher.main(["--hosts", "2", "--rate", "8mbit", "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == NOT_ROOT and "noloco.fleet.linkmodel" in err and "\n" not in err


PING = """
import json, sys, time
import torch.distributed as dist
from noloco.comm.torchdist import TorchDistTransport

dist.init_process_group("gloo")
t, rtts = TorchDistTransport(), []
for i in range(3):  # rank 0 times three round trips of a small message to rank 1
    if t.rank == 0:
        start = time.monotonic()
        t.send(1, f"ping{i}", bytes(100))
        t.recv(1, f"pong{i}", 30.0)
        rtts.append(time.monotonic() - start)
    else:
        t.send(0, f"pong{i}", t.recv(0, f"ping{i}", 30.0))
t.close()
print("RTTS", json.dumps(rtts), t.latency, flush=True)
"""


@needs_root
def test_latency_reaches_the_workers_and_delays_every_message(tmp_path):
    prefix, out = _prefix(), io.StringIO()
    script = tmp_path / "ping.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + PING)
    result = launch([sys.executable, str(script)], hosts=2, rate="16mbit", latency="100ms", prefix=prefix, out=out,
                    run_dir=tmp_path)  # fmt: skip
    assert result.returncode == 0, out.getvalue()[-3000:]
    line = next(line for line in out.getvalue().splitlines() if "RTTS" in line and line.startswith("[h0]"))
    rtts, latency = json.loads(line.split("RTTS ")[1].rsplit(" ", 1)[0]), float(line.rsplit(" ", 1)[1])
    assert latency == 0.1
    assert all(0.2 <= rtt < 1.0 for rtt in rtts), rtts  # each round trip: two one-way latencies
    assert _leftovers(prefix) == []


AFFINITY = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from noloco.train.device import usable_cores
print("CPUS", json.dumps(sorted(os.sched_getaffinity(0))), usable_cores(), os.environ["LOCAL_WORLD_SIZE"], flush=True)
"""


@needs_root
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores")
def test_cpus_per_host_pins_each_worker_to_cores_of_its_own(tmp_path):
    prefix, out = _prefix(), io.StringIO()
    usable = sorted(os.sched_getaffinity(0))
    result = launch([sys.executable, "-c", AFFINITY, str(REPO)], hosts=2, cpus_per_host=1, prefix=prefix, out=out,
                    run_dir=tmp_path, name="pinned")  # fmt: skip
    assert result.returncode == 0, out.getvalue()[-3000:]
    seen = {}
    for line in out.getvalue().splitlines():
        if "CPUS" in line:
            host = int(line[2 : line.index("]")])
            cpus, cores, local_world = line.split("CPUS ")[1].rsplit(" ", 2)
            seen[host] = (json.loads(cpus), int(cores), local_world)
    # host i gets the i-th core of the launcher's own set; torch would use exactly that one core
    assert seen == {0: ([usable[0]], 1, "1"), 1: ([usable[1]], 1, "1")}
    assert result.cpus == [[usable[0]], [usable[1]]]
    assert sorted(os.sched_getaffinity(0)) == usable  # the launcher's own thread got its cores back
    assert _leftovers(prefix) == []


def test_cpus_per_host_beyond_the_machine_is_refused_before_anything_is_built(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "is_root", lambda: True)
    monkeypatch.setattr(launcher, "missing_tools", lambda: [])
    too_many = len(os.sched_getaffinity(0)) + 1
    code = launcher.main(["--hosts", "1", "--cpus-per-host", str(too_many), "--prefix", "nlcnever", "--", "true"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"need {too_many} cores" in err and "--cpus-per-host" in err
    assert not any(ns.startswith("nlcnever") for ns in list_namespaces())


@needs_root
def test_burst_sets_every_links_bucket_in_traffic_time_at_the_rate():
    """``burst_seconds`` (``noloco-fleet --burst``) is tbf's bucket on each shaped device: 50 ms at 50 Mbit/s is
    312,500 bytes; the default 5 ms is 31,250; a slow link keeps at least 16 KiB."""
    shown = {}
    for rate, seconds in ((50e6, 0.05), (50e6, None), (1e6, None)):
        kwargs = {} if seconds is None else {"burst_seconds": seconds}
        with Fleet(1, rate, prefix=_prefix(), **kwargs) as fleet:
            out = subprocess.run(["ip", "netns", "exec", fleet.namespace(0), "tc", "qdisc", "show"],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            prefix = fleet.prefix
        shown[rate, seconds] = out
        assert _leftovers(prefix) == []
    assert "burst 312500b" in shown[50e6, 0.05] and "burst 31250b" not in shown[50e6, 0.05]
    assert "burst 31250b" in shown[50e6, None]
    assert "burst 16Kb" in shown[1e6, None] or "burst 16384b" in shown[1e6, None], shown[1e6, None]


@pytest.mark.parametrize("burst", ["0ms", "20s", "fast"])
def test_a_burst_out_of_range_is_refused_in_one_line_before_anything_is_built(monkeypatch, capsys, burst):
    monkeypatch.setattr(launcher, "is_root", lambda: True)
    monkeypatch.setattr(launcher, "missing_tools", lambda: [])
    code = launcher.main(["--hosts", "1", "--rate", "50mbit", "--burst", burst, "--prefix", "nlcnever", "--", "true"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("noloco-fleet:") and ("burst" in err[0] or "duration" in err[0]), err
    assert not any(ns.startswith("nlcnever") for ns in list_namespaces())


@needs_root
def test_ctrl_c_on_the_fleet_saves_every_worker_at_one_step_then_tears_down(tmp_path):
    """SIGINT to noloco-fleet reaches the workers as train.py's Ctrl-C: they agree on one step, save it, exit 130;
    the launcher removes the namespaces, says how to resume and exits 130. The checkpoint is complete."""
    prefix = _prefix()
    command = [sys.executable, str(REPO / "train.py"), "backend=torch", "steps=400", "outer.every=3",
               "checkpoint.every=0", *TINY]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco.fleet.launcher", "--hosts", "2", "--prefix", prefix, "--run-dir",
         str(tmp_path), "--name", "stop", "--", *command],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    metrics = tmp_path / "stop" / "metrics.rank1.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 130, output[-3000:]
        assert f"resume={tmp_path / 'stop'}" in output and "resume with python train.py resume=" in output, output
        assert _leftovers(prefix) == []
        from noloco.train import checkpoint

        folder, _, step = checkpoint.resolve(tmp_path / "stop")  # complete, every worker at one step
        assert 0 < step < 400 and sorted(checkpoint.worker_ranks(folder)) == [0, 1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        from noloco.fleet.netns import cleanup_prefix

        cleanup_prefix(prefix)
