"""Network namespaces, links and rate shaping for a throttled fleet on one machine (docs/design.md §5).

:class:`Fleet` builds, as root, one network namespace per host (``<prefix>-h<i>``) plus one for a
bridge (``<prefix>-br``). Host *i* gets a veth pair: ``veth0`` inside its namespace with address
``10.201.0.<i+1>/24`` and a peer ``p<i>`` enslaved to the bridge ``br0``. Nothing is created in the
root namespace: every link is created directly inside the namespaces, so deleting the namespaces
removes every link, ifb and qdisc with them, and the private /24 is only ever visible there.

Shaping, per host, with ``tc`` (this kernel has tbf/htb but no netem):

* egress: a ``tbf`` qdisc at ``rate`` on ``veth0``;
* ingress: an ``ingress`` qdisc on ``veth0`` whose u32 catch-all filter redirects every packet to an
  ``ifb0`` device inside the host namespace, which carries a second ``tbf`` at ``rate``. If the
  kernel cannot create an ifb, the bridge-side peer ``p<i>`` gets the tbf instead (same effect: all
  traffic to host *i* leaves the bridge through ``p<i>``) and :attr:`Fleet.ingress_mode` says so.

Names: each host namespace gets its own ``/etc/hosts`` (``ip netns exec`` bind-mounts
``/etc/netns/<namespace>/hosts`` over it): the machine's entries plus every fleet address, as IPv4 and as
the IPv4-mapped IPv6 address a dual-stack listener sees, named ``<prefix>-h<i>``. Without them a reverse
lookup of a peer (torch.distributed's TCPStore does one for every connection it accepts) falls through
to DNS, which no namespace can reach, and fails (``[c10d] The hostname of the client socket cannot be
retrieved``).

tbf counts link-layer bytes (Ethernet + IP + TCP headers), so TCP goodput through a link is ~95% of
``rate`` at MTU 1500. Latency is *not* added here (no netem); see ``docs/fleet.md``.

Failure: any ``ip``/``tc`` command that fails raises :class:`FleetError` with the command and its
stderr; :meth:`Fleet.down` (and :func:`cleanup_prefix`) are idempotent and never raise, they kill
every process still inside the namespaces and delete them. :func:`stale_prefixes` finds the
leftovers of launchers that died without cleaning up (their pid is part of the prefix).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.201.0"  # the private /24, only inside namespaces created here
IFNAME = "veth0"  # the host's interface name inside its namespace (GLOO_SOCKET_IFNAME)
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts NETNS_ETC/NS/<file> over /etc/<file>
PREFIX_RE = re.compile(r"^nlc(\d+)(?:x\w+)?-(?:h\d+|br)$")


class FleetError(RuntimeError):
    """A namespace, link or qdisc could not be set up (the message holds the command and its stderr)."""


def missing_tools() -> list[str]:
    """Names of the command-line tools a fleet needs that are not on ``PATH``."""
    return [tool for tool in ("ip", "tc") if shutil.which(tool) is None]


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text: str) -> float:
    """``"50mbit"`` → 5e7 bits per second (tc's units: bit, kbit, mbit, gbit, bps = bytes/s, ...)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = (match.group(2).lower() or "bit") if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"bad rate {text!r}: expected e.g. 50mbit, 500kbit, 1gbit")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"bad rate {text!r}: must be positive")
    return value


def parse_duration(text: str) -> float:
    """``"20ms"`` → 0.02 seconds (units: us, ms, s; a bare number is milliseconds)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s|)\s*", str(text))
    if not match:
        raise ValueError(f"bad duration {text!r}: expected e.g. 20ms, 0.5s")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1e-3}[match.group(2)]
    return float(match.group(1)) * scale


def run_cmd(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command; raise :class:`FleetError` with its stderr when ``check`` and it fails."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise FleetError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def list_namespaces() -> list[str]:
    out = run_cmd("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    out = run_cmd("ip", "netns", "pids", namespace, check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(namespace: str, grace: float = 3.0) -> None:
    """SIGTERM every process inside ``namespace``, then SIGKILL whatever is left after ``grace`` s."""
    pids = namespace_pids(namespace)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _pid_alive(pid)]
        time.sleep(0.05)
    for pid in namespace_pids(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cleanup_prefix(prefix: str, grace: float = 3.0) -> list[str]:
    """Kill the processes inside and delete every namespace named ``<prefix>-*``; returns their names.

    Links, ifbs, bridges and qdiscs live inside those namespaces and go with them. Never raises.
    """
    removed = []
    for namespace in list_namespaces():
        if namespace.startswith(prefix + "-"):
            try:
                kill_namespace_processes(namespace, grace)
            finally:
                run_cmd("ip", "netns", "del", namespace, check=False)
            removed.append(namespace)
    for folder in NETNS_ETC.glob(f"{prefix}-*") if NETNS_ETC.is_dir() else []:
        shutil.rmtree(folder, ignore_errors=True)
    # A crash between `ip link add` and moving a link could only leave links named after the prefix.
    for line in run_cmd("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                run_cmd("ip", "link", "del", name, check=False)
                removed.append(name)
    return removed


def plural(n: int, word: str) -> str:
    """``plural(2, "process")`` → ``"2 processes"``, ``plural(1, "veth")`` → ``"1 veth"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


DEFAULT_QDISCS = ("noqueue", "pfifo_fast", "fq_codel", "mq")  # what the kernel puts on a link by itself


@dataclass
class NamespaceInventory:
    """What a fleet namespace holds (for ``noloco-fleet --cleanup`` to say what it removes): its links by kind
    (``veth``, ``bridge``, ``ifb``, ...; loopback left out), their IPv4 addresses, the tc qdiscs noloco added
    (``(kind, dev)``: ``tbf``, ``ingress``; the kernel's defaults left out) and the pids of its processes."""

    namespace: str
    links: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    addresses: dict[str, list[str]] = field(default_factory=dict)  # name -> ["10.201.0.1/24", ...]
    qdiscs: list[tuple[str, str]] = field(default_factory=list)  # (kind, dev)
    pids: list[int] = field(default_factory=list)

    def describe(self) -> str:
        """e.g. ``veth veth0 (10.201.0.1/24); ifb ifb0; tc tbf on veth0, ingress on veth0; 1 process killed``."""
        parts = []
        kinds: dict[str, list[str]] = {}
        for kind, name in self.links:
            label = name + (f" ({', '.join(self.addresses[name])})" if self.addresses.get(name) else "")
            kinds.setdefault(kind, []).append(label)
        parts += [f"{kind} {', '.join(names)}" for kind, names in kinds.items()]
        if self.qdiscs:
            parts.append("tc " + ", ".join(f"{kind} on {dev}" for kind, dev in self.qdiscs))
        if self.pids:
            parts.append(f"{plural(len(self.pids), 'process')} killed ({' '.join(map(str, self.pids))})")
        return "; ".join(parts) or "empty"


def namespace_inventory(namespace: str) -> NamespaceInventory:
    """The links, addresses, added qdiscs and processes inside ``namespace`` (never raises; empty if unreadable)."""
    inventory = NamespaceInventory(namespace, pids=namespace_pids(namespace))
    try:
        links = json.loads(run_cmd("ip", "-n", namespace, "-j", "-d", "link", "show", check=False).stdout or "[]")
    except ValueError:  # an iproute2 without -j: names only, kind unknown
        links = [{"ifname": line.split(":")[1].strip().split("@")[0]}
                 for line in run_cmd("ip", "-n", namespace, "-o", "link", "show", check=False).stdout.splitlines()
                 if len(line.split(":")) > 1]  # fmt: skip
    for link in links:
        name = link.get("ifname", "?")
        if name == "lo" or link.get("link_type") == "loopback":
            continue
        inventory.links.append((link.get("linkinfo", {}).get("info_kind", "link"), name))
    for line in run_cmd("ip", "-n", namespace, "-o", "-4", "addr", "show", check=False).stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "inet" and fields[1] != "lo":
            inventory.addresses.setdefault(fields[1], []).append(fields[3])
    for line in run_cmd("tc", "-n", namespace, "qdisc", "show", check=False).stdout.splitlines():
        match = re.match(r"qdisc (\S+) \S+ dev (\S+)", line)
        if match and match.group(1) not in DEFAULT_QDISCS:
            inventory.qdiscs.append((match.group(1), match.group(2)))
    return inventory


def stale_prefixes() -> list[str]:
    """Prefixes of fleet namespaces whose launcher process (pid in the name) no longer exists."""
    stale = set()
    for namespace in list_namespaces():
        match = PREFIX_RE.match(namespace)
        if match and not _pid_alive(int(match.group(1))):
            stale.add(namespace.rsplit("-", 1)[0])
    return sorted(stale)


#: tbf's bucket by default, as seconds of traffic at the link rate (at least :data:`MIN_BURST_BYTES`)
DEFAULT_BURST_SECONDS = 0.005
MIN_BURST_BYTES = 16 * 1024
#: the deepest bucket a fleet takes, in seconds of traffic (a link that bursts this long is hardly shaped)
MAX_BURST_SECONDS = 10.0


def burst_bytes(rate_bps: float, seconds: float = DEFAULT_BURST_SECONDS) -> int:
    # tbf needs burst >= rate/HZ and >= one MTU-sized packet. The default is small so the link rate holds over
    # short windows (5 ms of traffic, at least 16 KiB); TCP then moves a multi-megabyte message one way at 96-98%
    # of the rate and both ways at once at 87-90% (benchmarks/link_probe.py; docs/results/scale.md, "Calibration");
    # real access links often have deeper buckets (``--burst``).
    return max(MIN_BURST_BYTES, int(rate_bps / 8 * seconds))


@dataclass
class Fleet:
    """N hosts, each in its own namespace behind a rate-limited veth link to one bridge.

    Args:
        hosts: number of host namespaces (1..250).
        rate_bps: per-host rate in bits/s, applied to egress and to ingress; ``None`` = unshaped.
        prefix: unique name prefix of this fleet's namespaces (default ``nlc<pid>``).
        queue_latency: tbf's queue bound in seconds (packets waiting longer are dropped).
        burst_seconds: tbf's bucket, in seconds of traffic at ``rate_bps`` (at least 16 KiB; default 5 ms).

    Use as a context manager (``with Fleet(4, 50e6) as fleet:``) or call :meth:`up`/:meth:`down`.
    """

    hosts: int
    rate_bps: float | None = None
    prefix: str = field(default_factory=lambda: f"nlc{os.getpid()}")
    queue_latency: float = 0.1
    burst_seconds: float = DEFAULT_BURST_SECONDS
    ingress_mode: str = "none"
    _built: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {self.hosts}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,23}", self.prefix):
            raise ValueError(f"bad prefix {self.prefix!r}: lowercase letters/digits, at most 24")
        if not (math.isfinite(self.burst_seconds) and 0 < self.burst_seconds <= MAX_BURST_SECONDS):
            raise ValueError(f"burst {self.burst_seconds!r} s is not in (0, {MAX_BURST_SECONDS:g}] seconds of traffic")

    # names -------------------------------------------------------------------------------------
    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def ip(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_ns] + [self.namespace(i) for i in range(self.hosts)]

    # building ----------------------------------------------------------------------------------
    def _ns(self, namespace: str, *args: str) -> None:
        run_cmd("ip", "netns", "exec", namespace, *args)

    def _add_namespace(self, namespace: str) -> None:
        run_cmd("ip", "netns", "add", namespace)
        self._built.append(namespace)
        run_cmd("ip", "-n", namespace, "link", "set", "lo", "up")

    def _tbf(self, namespace: str, dev: str) -> None:
        assert self.rate_bps is not None
        self._ns(
            namespace, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{int(self.rate_bps)}bit", "burst", str(burst_bytes(self.rate_bps, self.burst_seconds)),
            "latency", f"{int(self.queue_latency * 1000)}ms",
        )  # fmt: skip

    def up(self) -> Fleet:
        """Create the namespaces, bridge, links and qdiscs. On any failure, tear down and raise."""
        if not is_root():
            raise FleetError("building a fleet needs root (network namespaces and tc)")
        missing = missing_tools()
        if missing:
            raise FleetError(f"missing tools: {', '.join(missing)} (install iproute2)")
        try:
            self._add_namespace(self.bridge_ns)
            run_cmd("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            run_cmd("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for host in range(self.hosts):
                self._add_host(host)
        except BaseException:
            self.down()
            raise
        return self

    def hosts_file(self) -> str:
        """The ``/etc/hosts`` every host namespace sees: the machine's own, then one name per fleet address."""
        try:
            base = Path("/etc/hosts").read_text()
        except OSError:
            base = "127.0.0.1 localhost\n::1 localhost\n"
        lines = [f"# noloco fleet {self.prefix}: IPv4 and IPv4-mapped IPv6 (what a dual-stack listener sees)"]
        for host in range(self.hosts):
            lines += [f"{self.ip(host)} {self.namespace(host)}", f"::ffff:{self.ip(host)} {self.namespace(host)}"]
        return base.rstrip("\n") + "\n" + "\n".join(lines) + "\n"

    def _add_host(self, host: int) -> None:
        ns, peer = self.namespace(host), f"p{host}"
        self._add_namespace(ns)
        try:
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(self.hosts_file())
        except OSError as exc:
            raise FleetError(f"cannot write {NETNS_ETC / ns / 'hosts'}: {exc}") from exc
        run_cmd("ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.bridge_ns)
        run_cmd("ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0")
        run_cmd("ip", "-n", self.bridge_ns, "link", "set", peer, "up")
        run_cmd("ip", "-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", IFNAME)
        run_cmd("ip", "-n", ns, "link", "set", IFNAME, "up")
        if self.rate_bps is None:
            return
        self._tbf(ns, IFNAME)
        if run_cmd("ip", "-n", ns, "link", "add", "ifb0", "type", "ifb", check=False).returncode == 0:
            run_cmd("ip", "-n", ns, "link", "set", "ifb0", "up")
            self._ns(ns, "tc", "qdisc", "add", "dev", IFNAME, "handle", "ffff:", "ingress")
            self._ns(
                ns, "tc", "filter", "add", "dev", IFNAME, "parent", "ffff:", "protocol", "all",
                "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "ifb0",
            )  # fmt: skip
            self._tbf(ns, "ifb0")
            self.ingress_mode = "ifb"
        else:  # no ifb: shape the bridge-side peer's egress, which is exactly this host's ingress
            self._tbf(self.bridge_ns, peer)
            self.ingress_mode = "bridge-peer"

    def down(self, grace: float = 3.0) -> None:
        """Kill every process in this fleet's namespaces and delete them (idempotent, never raises)."""
        cleanup_prefix(self.prefix, grace)
        self._built.clear()

    def __enter__(self) -> Fleet:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # running -----------------------------------------------------------------------------------
    def exec_args(self, host: int, command: list[str], env: dict[str, str] | None = None) -> list[str]:
        """The argv that runs ``command`` inside host ``host``'s namespace with ``env`` added."""
        extra = [f"{key}={value}" for key, value in (env or {}).items()]
        return ["ip", "netns", "exec", self.namespace(host), "env", *extra, *command]

    def popen(self, host: int, command: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``command`` in host ``host``'s namespace, in its own session (so its group can be killed)."""
        return subprocess.Popen(self.exec_args(host, command, env), start_new_session=True, **kwargs)

    def link_stats(self, host: int) -> dict[str, int]:
        """Link-layer bytes/packets/drops through host ``host``'s shapers: ``{"tx_bytes", "rx_bytes", ...}``."""
        ns = self.namespace(host)
        stats = {}
        sources = [("tx", ns, IFNAME)]
        if self.ingress_mode == "ifb":
            sources.append(("rx", ns, "ifb0"))
        elif self.ingress_mode == "bridge-peer":
            sources.append(("rx", self.bridge_ns, f"p{host}"))
        for direction, namespace, dev in sources:
            out = run_cmd("ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", dev, check=False).stdout
            match = re.search(r"qdisc tbf .*?Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", out, re.S)
            if match:
                stats[f"{direction}_bytes"] = int(match.group(1))
                stats[f"{direction}_packets"] = int(match.group(2))
                stats[f"{direction}_dropped"] = int(match.group(3))
        return stats
