"""One message through a fleet link, one way and both ways at once: how fast TCP moves it through the shaper.

Two hosts of a fleet (``noloco.fleet.netns.Fleet``: network namespaces, ``tc tbf`` on every link, root needed)
and one TCP connection between them. Each repetition waits ``--idle`` seconds (the link's bucket refills, as
between two outer rounds), then sends a message of each ``--sizes`` value: *one way* (host 0 to host 1, a one-byte
ack back) and *both ways* (each host sends it to the other at once, as the two halves of an all-reduce do).
Efficiency = payload bits ÷ (link rate × seconds): the time model's link carries 1 ÷ 1.07 of its rate as payload
(headers and ACKs), and its bucket passes the first ``burst`` bytes at once.

    python -m benchmarks.link_probe --rate 50mbit --bursts 5ms 50ms --sizes 350000 2800000
    python -m benchmarks.link_probe --rate 50mbit --bursts 5ms --sizes 2760000 --ring 4
    python -m benchmarks.link_probe --rate 50mbit --bursts 5ms --sizes 2760000 --two-phase 4

``--ring N`` times a ring all-reduce's traffic instead, among N hosts with plain sockets (no training, no
reduction): each size is the all-reduce's payload M, sent as 2(N−1) steps of M/N, each host sending a step's
chunk to the next while it receives the previous host's, and starting the next step once both are done. Its
efficiency counts the 2(N−1)/N · M bytes each host sent.

``--two-phase N`` times the traffic of noloco's two-phase all-reduce (``comm.reduction=two_phase``, the default,
which DDP and DiLoCo run) instead: one connection between every two of N hosts, and two phases in each of which
every host sends M/N to each of the others at once while it receives M/N from each; the same bytes as the ring.

Every repetition but the first is reported (the first opens the connection's window).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from benchmarks import common

#: What the scripts below start with: the imports; ``take(conn, n)``, which reads n bytes from a socket;
#: ``listener(address, port, backlog)``; ``connect(address, port)``, retried while the other side starts.
PRELUDE = r"""
import json, socket, sys, threading, time
def take(conn, n):
    got = 0
    while got < n:
        chunk = conn.recv(min(1 << 20, n - got))
        if not chunk:
            raise SystemExit("connection closed")
        got += len(chunk)
def listener(address, port, backlog):
    server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, port)); server.listen(backlog)
    return server
def connect(address, port):
    for _ in range(199):
        try:
            return socket.create_connection((address, port))
        except OSError:
            time.sleep(0.1)
    return socket.create_connection((address, port))
"""

#: What the all-reduce scripts (``me hosts addresses size reps idle``) read from their command line, and
#: ``timed(conns, rendezvous, traffic)``: ``reps`` times, the rendezvous, ``idle`` seconds, then the timed traffic;
#: prints the seconds of each as a JSON list.
HOSTS = r"""
me, n, addresses, size, reps, idle = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4]), \
    int(sys.argv[5]), float(sys.argv[6])
chunk = bytes(size // n)
def timed(conns, rendezvous, traffic):
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    seconds = []
    for _ in range(reps):
        rendezvous()
        time.sleep(idle)
        start = time.monotonic()
        traffic()
        seconds.append(time.monotonic() - start)
    print(json.dumps(seconds))
"""

#: One host's side (host 0 listens): ``role size reps idle`` on the command line; prints the seconds of each
#: message as a JSON list. A rendezvous byte each way starts every repetition on both hosts together.
PEER = (
    PRELUDE
    + r"""
me, address, size, reps, idle, both = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
    float(sys.argv[5]), sys.argv[6] == "both"
conn = listener(address, 5997, 1).accept()[0] if me == 0 else connect(address, 5997)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
message, seconds = bytes(size), []
for _ in range(reps):
    conn.sendall(b"s"); take(conn, 1)
    time.sleep(idle)
    start = time.monotonic()
    if both:
        reader = threading.Thread(target=take, args=(conn, size)); reader.start(); conn.sendall(message)
        reader.join()
    elif me == 0:
        conn.sendall(message); take(conn, 1)
    else:
        take(conn, size); conn.sendall(b"k")
    seconds.append(time.monotonic() - start)
print(json.dumps(seconds))
"""
)


#: One host of a ring (``me hosts addresses size reps idle``): it listens for its predecessor and connects to its
#: successor; a token sent around the ring starts each repetition; prints the seconds of each all-reduce's traffic.
RING = (
    PRELUDE
    + HOSTS
    + r"""
server = listener(addresses[me], 5998, 1)
out = connect(addresses[(me + 1) % n], 5998)
inc, _ = server.accept()
def rendezvous():
    if me == 0:
        out.sendall(b"s"); take(inc, 1)
    else:
        take(inc, 1); out.sendall(b"s")
def traffic():
    for _ in range(2 * (n - 1)):
        reader = threading.Thread(target=take, args=(inc, len(chunk)))
        reader.start(); out.sendall(chunk); reader.join()
timed((out, inc), rendezvous, traffic)
"""
)


#: One host of the two-phase traffic (``me hosts addresses size reps idle``): a connection to every other host (the
#: lower-numbered ones listen); host 0 starts each repetition; prints the seconds of each all-reduce's traffic.
MESH = (
    PRELUDE
    + HOSTS
    + r"""
server, conns = listener(addresses[me], 5996, n), {}
for j in range(me):
    conns[j] = connect(addresses[j], 5996)
    conns[j].sendall(bytes([me]))
while len(conns) < n - 1:
    conn, _ = server.accept()
    conns[conn.recv(1)[0]] = conn
def rendezvous():
    if me == 0:
        for conn in conns.values():
            conn.sendall(b"s")
        for conn in conns.values():
            take(conn, 1)
    else:
        take(conns[0], 1); conns[0].sendall(b"s")
def traffic():
    for _ in range(2):
        threads = [threading.Thread(target=take, args=(conn, len(chunk))) for conn in conns.values()]
        threads += [threading.Thread(target=conn.sendall, args=(chunk,)) for conn in conns.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
timed(conns.values(), rendezvous, traffic)
"""
)


def _rate_bps(text: str) -> float:
    from noloco.fleet.netns import parse_rate

    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    value = float(text[:-2]) / 1000 if text.endswith("ms") else float(text.rstrip("s"))
    if not 0 < value <= 10:
        raise argparse.ArgumentTypeError(f"burst {text!r}: seconds of traffic in (0, 10] (5ms, 0.05)")
    return value


def probe(rate_bps: float, burst: float, size: int, reps: int, idle: float, both: bool) -> list[float]:
    """Seconds of each message after the first (host 0's clock), through a fresh 2-host fleet."""
    from noloco.fleet.netns import Fleet

    mode = "both" if both else "one"
    with Fleet(2, rate_bps, burst_seconds=burst) as fleet:
        peers = [fleet.popen(h, [sys.executable, "-c", PEER, str(h), fleet.ip(0), str(size), str(reps), str(idle),
                                 mode], stdout=subprocess.PIPE, text=True) for h in (0, 1)]  # fmt: skip
        out = [p.communicate(timeout=120 + reps * (idle + 60))[0] for p in peers]
        if any(p.returncode != 0 for p in peers):
            raise RuntimeError(f"probe peers exited {[p.returncode for p in peers]}")
    return json.loads(out[0])[1:]


def probe_ring(rate_bps: float, burst: float, size: int, reps: int, idle: float, hosts: int,
               pattern: str = "ring") -> list[float]:  # fmt: skip
    """Seconds of each all-reduce's traffic after the first (host 0's clock), through a fresh fleet: ``pattern``
    ``"ring"`` (:data:`RING`) or ``"two_phase"`` (:data:`MESH`)."""
    from noloco.fleet.netns import Fleet

    script = {"ring": RING, "two_phase": MESH}[pattern]
    with Fleet(hosts, rate_bps, burst_seconds=burst) as fleet:
        addresses = ",".join(fleet.ip(h) for h in range(hosts))
        peers = [fleet.popen(h, [sys.executable, "-c", script, str(h), str(hosts), addresses, str(size), str(reps),
                                 str(idle)], stdout=subprocess.PIPE, text=True) for h in range(hosts)]  # fmt: skip
        out = [p.communicate(timeout=120 + reps * (idle + 60))[0] for p in peers]
        if any(p.returncode != 0 for p in peers):
            raise RuntimeError(f"{pattern} peers exited {[p.returncode for p in peers]}")
    return json.loads(out[0])[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.link_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rate", type=_rate_bps, default=50e6, metavar="RATE", help="link rate (50mbit)")
    parser.add_argument("--bursts", type=_seconds, nargs="+", default=[0.005, 0.05], metavar="B",
                        help="tbf buckets as traffic time (5ms 50ms; the fleet's default is 5ms)")  # fmt: skip
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[350_000, 2_800_000],
        metavar="BYTES",
        help="message sizes in bytes (350000 2800000: an int4 and an fp32 half of a 1.4M model)",
    )
    parser.add_argument("--reps", type=int, default=7, help="messages per size and direction, the first dropped (7)")
    parser.add_argument("--idle", type=float, default=1.0, help="seconds between messages (1)")
    among = parser.add_mutually_exclusive_group()
    among.add_argument("--ring", type=int, default=0, metavar="N",
                       help="time a ring all-reduce's traffic among N hosts (each size: its payload)")  # fmt: skip
    among.add_argument("--two-phase", type=int, default=0, metavar="N",
                       help="time the two-phase all-reduce's traffic among N hosts (each size: its "
                            "payload)")  # fmt: skip
    parser.add_argument("--name", default="link_probe", help="report file names (link_probe)")
    common.add_out(parser, "link_probe")
    args = parser.parse_args(argv)
    if args.reps < 2 or args.idle < 0 or min(args.sizes) <= 0:
        parser.error("--reps must be at least 2, --idle at least 0 and every size positive")
    if args.ring and not 2 <= args.ring <= 16:
        parser.error(f"--ring {args.ring}: a ring of 2 to 16 hosts")
    if args.two_phase and not 2 <= args.two_phase <= 16:
        parser.error(f"--two-phase {args.two_phase}: 2 to 16 hosts")
    args.pattern, args.hosts = ("ring", args.ring) if args.ring else ("two_phase", args.two_phase)
    rows = _ring_rows(args) if args.hosts else _stream_rows(args)
    command, machine = common.command("link_probe", argv), common.machine()
    lines = _report(args, rows, command, machine)
    print("\n".join(lines))
    common.write_report(args.out, args.name, lines, {"rate_bps": args.rate, "rows": rows}, command=command,
                        machine=machine)  # fmt: skip
    return 0


def _ring_rows(args) -> list[dict]:
    rows = []
    for burst in args.bursts:
        for size in args.sizes:
            seconds = probe_ring(args.rate, burst, size, args.reps, args.idle, args.hosts, args.pattern)
            median = statistics.median(seconds)
            sent = 2 * (args.hosts - 1) / args.hosts * size
            rows.append({"pattern": args.pattern, "hosts": args.hosts, "burst_seconds": burst, "bytes": size,
                         "both_ways": True, "seconds": seconds, "median": median,
                         "efficiency": sent * 8 / args.rate / median})  # fmt: skip
            print(f"burst {burst * 1000:g} ms, {args.pattern} of {args.hosts}, {size:,} B: {median:.3f} s, "
                  f"efficiency {rows[-1]['efficiency']:.2f}", flush=True)  # fmt: skip
    return rows


def _stream_rows(args) -> list[dict]:
    rows = []
    for burst in args.bursts:
        for size in args.sizes:
            for both in (False, True):
                seconds = probe(args.rate, burst, size, args.reps, args.idle, both)
                median = statistics.median(seconds)
                rows.append({"burst_seconds": burst, "bytes": size, "both_ways": both, "seconds": seconds,
                             "median": median, "efficiency": size * 8 / args.rate / median})  # fmt: skip
                print(
                    f"burst {burst * 1000:g} ms, {size:,} B, {'both ways' if both else 'one way'}: "
                    f"{median:.3f} s, efficiency {rows[-1]['efficiency']:.2f}",
                    flush=True,
                )
    return rows


def _ring_model(args, size: int, burst: float) -> float:
    """The time model's seconds for this ring with its default link (``noloco.sim.wan.predict_exchange``: headers
    and ACKs, × 1.07), less the bucket's head start."""
    from noloco.sim.wan import predict_exchange

    sent = 2 * (args.hosts - 1) / args.hosts * size
    return predict_exchange("diloco", "fp32", args.hosts, args.rate, sent, "full", burst_seconds=burst)


def _ring_report(args, rows: list[dict], command: str, machine: str) -> list[str]:
    n = args.hosts
    traffic = (
        f"plain TCP sockets in a ring; per row {args.reps - 1} all-reduces' traffic ({args.idle:g} s idle before "
        f"each): 2({n}−1) steps of payload ÷ {n}, each host sending to the next while receiving from the previous."
        if args.pattern == "ring"
        else f"plain TCP sockets, one between every two hosts; per row {args.reps - 1} two-phase all-reduces' "
        f"traffic ({args.idle:g} s idle before each): 2 phases, in each every host sending payload ÷ {n} to each "
        "of the others at once while receiving as much from each."
    )
    title = "A ring all-reduce's" if args.pattern == "ring" else "The two-phase all-reduce's"
    lines = [
        f"# {title} traffic through fleet links, {n} hosts",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}",
        "",
        f"{n} fleet hosts, `tc tbf` at {args.rate / 1e6:g} Mbit/s on every link (queue 100 ms), {traffic} "
        "Efficiency = bits each host sent ÷ (rate × seconds). Model: the time model's ring with its "
        "default link (headers and ACKs: 1 ÷ 1.07 = 0.93 of the rate), less the bucket's head start.",
        "",
        "| bucket | payload | median (s) | fastest, slowest (s) | efficiency | model (s) | measured ÷ model |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        model = _ring_model(args, r["bytes"], r["burst_seconds"])
        lines.append(f"| {r['burst_seconds'] * 1000:g} ms | {r['bytes'] / 1e6:.2f} MB | {r['median']:.3f} | "
                     f"{min(r['seconds']):.3f}, {max(r['seconds']):.3f} | {r['efficiency']:.2f} | {model:.3f} | "
                     f"{r['median'] / model:.2f} |")  # fmt: skip
    return lines


def _report(args, rows: list[dict], command: str, machine: str) -> list[str]:
    if args.hosts:
        return _ring_report(args, rows, command, machine)
    lines = [
        "# One message through a fleet link, one way and both ways at once",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}",
        "",
        f"Two fleet hosts, `tc tbf` at {args.rate / 1e6:g} Mbit/s on every link (queue 100 ms), one TCP connection; "
        f"{args.reps - 1} messages per row ({args.idle:g} s idle before each). Efficiency = payload bits ÷ (rate × "
        "seconds); the time model's link: 1 ÷ 1.07 = 0.93 (headers and ACKs), plus its bucket at once.",
        "",
        "| bucket | message | direction | median (s) | fastest, slowest (s) | efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['burst_seconds'] * 1000:g} ms | {r['bytes'] / 1e6:.2f} MB | "
                     f"{'both ways' if r['both_ways'] else 'one way'} | {r['median']:.3f} | "
                     f"{min(r['seconds']):.3f}, {max(r['seconds']):.3f} | {r['efficiency']:.2f} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
