"""Time at scale: a WAN model of the outer exchange, sync time and idle fraction against N.

Each of N peers has one access link, the shape of :mod:`noloco.fleet.linkmodel`'s: a rate each way (bits/s)
and a one-way latency to the internet's core, drawn from log-normal distributions (seeded); a fraction of
peers are stragglers, ``k``× slower in both link rate and compute. A message from i to j runs at
``min(rate_i, rate_j)`` and arrives ``latency_i + latency_j`` after its last byte left; wire bytes are payload
× :data:`noloco.fleet.linkmodel.DEFAULT_OVERHEAD` (TCP/IP headers and ACKs). The payload is the codec's size
of the parameters (``noloco.collectives.get_codec(codec).nbytes(parameters)``). Methods:

* ``ring``: the bandwidth-optimal ring all-reduce, pipelined: 2(N−1) steps of M/N bytes; peer i sends step s
  once it has step s−1 from its predecessor and its uplink is free (a max-plus recurrence over all peers).
* ``tree``: a binary-tree reduce to peer 0 then a broadcast, pipelined in chunks; a parent's downlink (and in the
  broadcast its uplink) is shared by its two children.
* ``noloco-gN``: NoLoCo (arXiv 2506.10911) in groups of N from the seeded schedule of :mod:`noloco.gossip`; a
  group's two-phase exchange (each member sends and receives (n−1)/n of M per phase) replayed through the
  linkmodel's :class:`~noloco.fleet.linkmodel.TokenBucket` of each member; a group waits only on its members.
* ``swarm-gN``: NoLoCo groups formed by matchmaking among the peers that are ready (the hivemind swarm): the
  first n peers to be ready form a group, plus the matchmaking cost: a fixed part (measured on loopback), two
  DHT lookups of ⌈log₂ N⌉ hops at the median round trip, one round trip within the group to confirm, and the
  reads of the round's announcements: every peer reads all N of them several times a window from the few DHT
  nodes that hold the round's key, so those nodes upload N² records a round (:func:`window_read_seconds`);
  ``buckets`` (``peer.buckets``) divides the reads among B keys. Groups still form among the first ready peers
  of the whole swarm: with tens of peers per key, drawing within a key changes who waits little.

DiLoCo (arXiv 2311.08105) runs ``ring`` or ``tree`` once per outer round; DDP runs ``ring`` every inner step
(``ddp-ring``: H all-reduces of the fp32 gradients per round). :func:`sync_times` gives one exchange started by
every peer at once (the sync time the paper compares); :func:`simulate_rounds` runs rounds of compute and
exchange with each peer's own clock and gives round time and idle fraction. :func:`calibration` checks the
model against the throttled fleet's measured exchanges in ``docs/results``, its links taken at the payload
efficiency bare TCP traffic of the exchange's pattern had through them (``benchmarks/link_probe.py``: through the
fleet's 5 ms bucket, a pair's connection both ways at once 0.87–0.89, the two-phase reduction's traffic among 4
hosts 0.78–0.82 at 2.76 MB, a ring's 0.90–0.92, against the 0.93 of headers and ACKs).

Not modelled: TCP slow start and loss, congestion inside the core (only access links limit), NAT relays.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from noloco.fleet.linkmodel import DEFAULT_OVERHEAD, TokenBucket
from noloco.fleet.netns import DEFAULT_BURST_SECONDS, MIN_BURST_BYTES, burst_bytes, parse_duration, parse_rate
from noloco.gossip import GroupSchedule, round_seed

METHODS = ("ddp-ring", "diloco-ring", "diloco-tree", "noloco-g2", "noloco-g4", "swarm-g2")
#: matchmaking's fixed part: the median matchmaking time of 4 swarm peers on loopback, noloco int4/fp32
#: (docs/results/swarm.md: 0.095 and 0.118 s; 0.33 s at 8 peers on a loaded 2-core machine)
MATCHMAKING_S = 0.1
#: bytes of one peer's readiness announcement as a DHT read returns it: its msgpack value (time, name, window,
#: the run key's MAC and the Ed25519 signature in hex) 242 B, its subkey (the peer id) 54 B, expiry and framing
RECORD_BYTES = 310
#: reads of a round's announcements per peer and round: (peer.min_window + peer.slack) / poll = (1 + 1) / 0.25 s
WINDOW_READS = 8
#: DHT nodes that hold a key (hivemind's ``num_replicas``), so serve every read of the round's announcements
DHT_REPLICAS = 5


@dataclass
class WanConfig:
    """The WAN and the job. Rates in bits/s, times in seconds."""

    workers: list[int] = field(default_factory=lambda: [8, 32, 128, 512, 1024, 4096])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    bandwidth: float = 100e6  # median access rate each way
    bandwidth_sigma: float = 0.5  # σ of ln(rate)
    rtt: float = 0.05  # median round trip between two peers
    rtt_sigma: float = 0.5  # σ of ln(one-way access latency)
    straggler_fraction: float = 0.0
    straggler_factor: float = 4.0
    parameters: int = 124_000_000
    codec: str = "int4"
    ddp_codec: str = "fp32"
    compute: float = 1.6  # seconds of compute per outer round (H inner steps) of a normal peer
    every: int = 50  # H
    overhead: float = DEFAULT_OVERHEAD
    matchmaking: float = MATCHMAKING_S
    dht_lookups: int = 2
    record_bytes: int = RECORD_BYTES
    window_reads: int = WINDOW_READS
    dht_replicas: int = DHT_REPLICAS
    buckets: int = 1  # peer.buckets: DHT keys a round's announcements are spread over
    chunks: int = 16  # pipelining of the tree
    rounds: int = 10
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError (one line) on a value the model cannot use."""
        if not self.workers or min(self.workers) < 2:
            raise ValueError("worker counts must be >= 2")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method {unknown[0] if unknown else '(none)'}; known: {', '.join(METHODS)}")
        for name in ("bandwidth", "rtt", "compute", "straggler_factor", "overhead"):
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("bandwidth_sigma", "rtt_sigma", "matchmaking", "record_bytes", "window_reads"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.straggler_fraction <= 1:
            raise ValueError(f"straggler-fraction must be in [0, 1], got {self.straggler_fraction}")
        for name in ("parameters", "every", "chunks", "rounds", "dht_replicas", "buckets"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for n in self.workers:
            for method in self.methods:
                size = group_size(method)
                if size and n % size:
                    raise ValueError(f"{method}: groups of {size} do not divide {n} workers")
        payload_bytes(1, self.codec)
        payload_bytes(1, self.ddp_codec)


def group_size(method: str) -> int | None:
    """The group size of a NoLoCo method (``noloco-g2`` → 2), None for an all-reduce."""
    return int(method.rsplit("-g", 1)[1]) if "-g" in method else None


def payload_bytes(parameters: int, codec: str) -> int:
    """Bytes of ``parameters`` values encoded with ``codec`` (``fp32``, ``int4``, ``mxfp4``, ...)."""
    from noloco.collectives.codec import get_codec

    try:
        return get_codec(codec).nbytes(parameters)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"unknown codec {codec!r}") from exc


@dataclass
class Peers:
    """N peers: ``rate`` (bits/s each way), ``latency`` (one-way to the core, s), ``slowdown`` (compute factor)."""

    rate: np.ndarray
    latency: np.ndarray
    slowdown: np.ndarray

    def __len__(self) -> int:
        return len(self.rate)


def draw_peers(n: int, cfg: WanConfig, seed: int | None = None) -> Peers:
    """``n`` peers drawn from ``cfg``'s distributions with a generator seeded by (seed, n): rates log-normal around
    ``cfg.bandwidth``, one-way access latencies log-normal around ``cfg.rtt / 4`` (a pair's round trip is
    ``2·(latency_i + latency_j)``, median ≈ ``cfg.rtt``); ``round(straggler_fraction·n)`` stragglers, chosen at
    random, get rate ÷ k and compute × k."""
    rng = np.random.default_rng(round_seed(cfg.seed if seed is None else seed, n, "sim/wan"))
    rate = cfg.bandwidth * np.exp(cfg.bandwidth_sigma * rng.standard_normal(n))
    latency = cfg.rtt / 4 * np.exp(cfg.rtt_sigma * rng.standard_normal(n))
    slowdown = np.ones(n)
    stragglers = rng.permutation(n)[: round(cfg.straggler_fraction * n)]
    rate[stragglers] /= cfg.straggler_factor
    slowdown[stragglers] = cfg.straggler_factor
    return Peers(rate, latency, slowdown)


def uniform_peers(n: int, rate_bps: float, latency: float = 0.0) -> Peers:
    """``n`` identical peers (the throttled fleet: every host behind the same ``tc tbf`` rate)."""
    return Peers(np.full(n, float(rate_bps)), np.full(n, float(latency)), np.ones(n))


# --- one collective ------------------------------------------------------------------------------------


def ring_allreduce(peers: Peers, nbytes: float, ready: np.ndarray | None = None,
                   overhead: float = DEFAULT_OVERHEAD, duplex: str = "full") -> np.ndarray:  # fmt: skip
    """When each peer holds the result of a ring all-reduce of ``nbytes`` started at ``ready`` (s, default 0).

    2(N−1) steps (reduce-scatter, then all-gather) of ``nbytes/N``; peer i sends to i+1 at link rate
    ``min(rate_i, rate_{i+1})``, latency ``latency_i + latency_{i+1}``. ``duplex="half"``: a peer's send and
    receive of a step take turns (twice the transfer time). Returns ``(N,)`` finish times."""
    n = len(peers)
    ready = np.zeros(n) if ready is None else np.asarray(ready, dtype=float)
    if n == 1:
        return ready.copy()
    nxt = np.roll(np.arange(n), -1)
    transfer = nbytes / n * overhead * 8 / np.minimum(peers.rate, peers.rate[nxt])
    if duplex == "half":
        transfer = 2 * transfer
    hop = peers.latency + peers.latency[nxt]
    have, free = ready.copy(), ready.copy()
    for _ in range(2 * (n - 1)):
        free = np.maximum(have, free) + transfer
        have = np.maximum(np.roll(free + hop, 1), ready)  # peer i+1 has step s from peer i
    return np.maximum(have, free)


def tree_allreduce(peers: Peers, nbytes: float, ready: np.ndarray | None = None,
                   overhead: float = DEFAULT_OVERHEAD, chunks: int = 16) -> np.ndarray:  # fmt: skip
    """When each peer holds the result of a binary-tree all-reduce (reduce to peer 0, then broadcast) of
    ``nbytes`` in ``chunks`` pipelined pieces, started at ``ready``. Peer i's parent is (i−1)//2; a parent's
    downlink in the reduce and uplink in the broadcast are shared by its children. Returns ``(N,)`` times."""
    n = len(peers)
    ready = np.zeros(n) if ready is None else np.asarray(ready, dtype=float)
    if n == 1:
        return ready.copy()
    index = np.arange(n)
    parent = np.maximum((index - 1) // 2, 0)
    kids = np.array([(2 * i + 1 < n) + (2 * i + 2 < n) for i in range(n)], dtype=float)
    piece = nbytes / chunks * overhead * 8
    up_rate = np.minimum(peers.rate, peers.rate[parent] / np.maximum(kids[parent], 1))
    down_rate = np.minimum(peers.rate, peers.rate[parent] / np.maximum(kids[parent], 1))
    hop = peers.latency + peers.latency[parent]
    depth = np.floor(np.log2(index + 1)).astype(int)
    levels = [index[depth == d] for d in range(depth.max() + 1)]
    up_free = ready.copy()
    at_root = np.zeros(chunks)
    for c in range(chunks):  # reduce: children before parents
        got = ready.copy()  # when a peer has chunk c from all its children
        for d in range(len(levels) - 1, 0, -1):
            nodes = levels[d]
            send = np.maximum(got[nodes], up_free[nodes]) + piece / up_rate[nodes]
            up_free[nodes] = send
            np.maximum.at(got, parent[nodes], send + hop[nodes])
        at_root[c] = got[0]
    finish = np.zeros(n)
    finish[0] = at_root[-1]
    down_free = ready.copy()  # the parent's uplink, per child slot
    for c in range(chunks):  # broadcast: parents before children
        have = np.full(n, -np.inf)
        have[0] = at_root[c]
        for d in range(1, len(levels)):
            nodes = levels[d]
            send = np.maximum(have[parent[nodes]], down_free[nodes]) + piece / down_rate[nodes]
            down_free[nodes] = send
            have[nodes] = send + hop[nodes]
        finish = np.maximum(finish, have)
    return finish


def group_exchange(peers: Peers, members: list[int], nbytes: float, start: float,
                   overhead: float = DEFAULT_OVERHEAD, duplex: str = "full",
                   burst: float = MIN_BURST_BYTES) -> float:  # fmt: skip
    """When a group's two-phase exchange of ``nbytes`` per member, started at ``start``, ends (every member).

    Each phase every member sends ``(n−1)/n`` of the payload to the others and receives as much, through its
    own uplink and downlink (:class:`noloco.fleet.linkmodel.TokenBucket`, ``burst`` bytes); a phase ends when the
    slowest member has sent and received, plus the longest one-way latency in the group."""
    n = len(members)
    if n == 1:
        return start
    share = nbytes * (n - 1) / n * overhead
    up = {m: TokenBucket(float(peers.rate[m]), burst) for m in members}
    down = {m: TokenBucket(float(peers.rate[m]), burst) for m in members}
    lat = peers.latency[members]
    worst = float(lat.max() + np.sort(lat)[-2])
    now = start
    for _ in range(2):
        ends = []
        for m in members:
            sent = up[m].transmit(share, now)
            received = down[m].transmit(share, sent if duplex == "half" else now)
            ends.append(max(sent, received))
        now = max(ends) + worst
    return now


def matchmaking_seconds(peers: Peers, members: list[int], cfg: WanConfig) -> float:
    """A swarm group's matchmaking: the fixed part, ``dht_lookups`` DHT lookups of ⌈log₂ N⌉ hops (Kademlia's
    bound) at the median round trip, one round trip within the group (the confirmation), and the reads of the
    round's announcements (:func:`window_read_seconds`)."""
    n = len(peers)
    lat = peers.latency[members]
    confirm = 2 * float(lat.max() + np.sort(lat)[-2]) if len(members) > 1 else 0.0
    lookups = cfg.dht_lookups * math.ceil(math.log2(max(n, 2))) * cfg.rtt
    return cfg.matchmaking + lookups + confirm + window_read_seconds(peers, members, cfg)


def window_read_seconds(peers: Peers, members: list[int], cfg: WanConfig) -> float:
    """Seconds a round's reads of the readiness announcements add to a swarm group's matchmaking.

    The swarm keeps a round's announcements under one DHT key, one subkey per peer; each peer reads the whole
    key ``window_reads`` times while its window gathers (``record_bytes`` per announcement, N of them). A member
    downloads its reads at its own rate; the ``dht_replicas`` nodes holding the key upload every peer's reads,
    N² records × reads a round, at the median rate. The reads run side by side, so the slower of the two bounds
    the group: the holders' upload once N passes the replicas, O(N²) bytes. A lower bound: a read that visits
    several holders, or the registry reads, cost more. With ``buckets`` = B keys (``peer.buckets``) a peer reads
    its key's N/B announcements and each key's holders serve (N/B)² records."""
    n = math.ceil(len(peers) / cfg.buckets)
    bits = cfg.window_reads * n * cfg.record_bytes * cfg.overhead * 8  # one peer's reads of the round
    reader = bits / float(peers.rate[members].min())
    holders = n * bits / (min(cfg.dht_replicas, n) * float(np.median(peers.rate)))
    return max(reader, holders)


def allreduce(method: str, peers: Peers, nbytes: float, ready: np.ndarray, cfg: WanConfig) -> np.ndarray:
    """Finish times of one all-reduce of ``method`` (``ring``/``tree`` in its name)."""
    if "tree" in method:
        return tree_allreduce(peers, nbytes, ready, cfg.overhead, cfg.chunks)
    return ring_allreduce(peers, nbytes, ready, cfg.overhead)


# --- rounds --------------------------------------------------------------------------------------------


def method_bytes(method: str, cfg: WanConfig) -> float:
    """Payload of one exchange of ``method``: the gradients in ``ddp_codec`` for DDP, else φ/θ in ``codec``."""
    return payload_bytes(cfg.parameters, cfg.ddp_codec if method.startswith("ddp") else cfg.codec)


def sync_times(method: str, peers: Peers, cfg: WanConfig) -> np.ndarray:
    """Each peer's sync time (s) of one outer round when every peer is ready at once (DDP: its H all-reduces)."""
    n = len(peers)
    nbytes = method_bytes(method, cfg)
    ready = np.zeros(n)
    if method.startswith("ddp"):
        return allreduce(method, peers, nbytes, ready, cfg) * cfg.every  # identical steps, back to back
    if "-g" not in method:
        return allreduce(method, peers, nbytes, ready, cfg)
    out = np.zeros(n)
    groups = GroupSchedule(n, group_size(method), cfg.seed).groups(0) if method.startswith("noloco") else \
        [list(g) for g in np.arange(n).reshape(-1, group_size(method))]  # fmt: skip
    for members in groups:
        cost = matchmaking_seconds(peers, members, cfg) if method.startswith("swarm") else 0.0
        out[members] = group_exchange(peers, members, nbytes, cost, cfg.overhead)
    return out


def simulate_rounds(method: str, peers: Peers, cfg: WanConfig) -> dict:
    """``cfg.rounds`` rounds of compute then exchange, each peer on its own clock; round time and idle fraction.

    Compute per round: ``cfg.compute × slowdown`` (DDP: one round of H steps, each followed by an all-reduce).
    All-reduce and scheduled NoLoCo groups start when their last member is ready; swarm groups are the first ready
    peers.
    Idle = time not computing (waiting for others, matchmaking, the exchange) over each peer's wall time."""
    n = len(peers)
    compute = cfg.compute * peers.slowdown
    nbytes = method_bytes(method, cfg)
    if method.startswith("swarm"):
        return _swarm_rounds(peers, compute, nbytes, group_size(method) or 2, cfg)
    clock = np.zeros(n)
    schedule = GroupSchedule(n, group_size(method), cfg.seed) if group_size(method) else None
    rounds = 1 if method.startswith("ddp") else cfg.rounds  # DDP: H identical all-reduces a round already
    for r in range(rounds):
        if method.startswith("ddp"):
            for _ in range(cfg.every):
                clock = allreduce(method, peers, nbytes, clock + compute / cfg.every, cfg)
        elif schedule is None:
            clock = allreduce(method, peers, nbytes, clock + compute, cfg)
        else:
            ready = clock + compute
            for members in schedule.groups(r):
                clock[members] = group_exchange(peers, members, nbytes, float(ready[members].max()), cfg.overhead)
    return _summary(clock, compute * rounds, np.full(n, rounds), peers)


def _swarm_rounds(peers: Peers, compute: np.ndarray, nbytes: float, size: int, cfg: WanConfig) -> dict:
    """Groups formed by readiness: the earliest ``size`` ready peers form a group (any round numbers), until the
    peers have made ``cfg.rounds`` rounds on average."""
    n = len(peers)
    heap = [(float(compute[i]), i) for i in range(n)]
    heapq.heapify(heap)
    done = np.zeros(n, dtype=int)
    clock = np.zeros(n)
    while done.sum() < cfg.rounds * n:
        members = [heapq.heappop(heap)[1] for _ in range(size)]
        start = float(max(compute[m] + clock[m] for m in members))
        finish = group_exchange(peers, members, nbytes, start + matchmaking_seconds(peers, members, cfg),
                                cfg.overhead)  # fmt: skip
        for m in members:
            clock[m] = finish
            done[m] += 1
            heapq.heappush(heap, (finish + float(compute[m]), m))
    return _summary(clock, compute * done, done, peers)


def _summary(clock: np.ndarray, busy: np.ndarray, rounds: np.ndarray, peers: Peers) -> dict:
    normal = peers.slowdown == 1
    per_round = clock / np.maximum(rounds, 1)
    return {
        "round_s": float(per_round.mean()),
        "round_s_normal": float(per_round[normal].mean()) if normal.any() else None,
        "idle_fraction": float(1 - busy.sum() / clock.sum()),
        "rounds_per_peer_min": int(rounds.min()),
        "rounds_per_peer_max": int(rounds.max()),
    }


# --- the study ----------------------------------------------------------------------------------------


def run_study(cfg: WanConfig, log=print) -> dict:
    """Per N and method: sync time of one round (all ready at once; mean and max over peers), and round time and
    idle fraction over ``cfg.rounds`` rounds; the calibration against the fleet; the paper's claim's conditions."""
    cfg.check()
    rows = []
    for n in cfg.workers:
        peers = draw_peers(n, cfg)
        for method in cfg.methods:
            sync = sync_times(method, peers, cfg)
            rounds = simulate_rounds(method, peers, cfg)
            rows.append({"workers": n, "method": method, "sync_s": float(sync.mean()), "sync_s_max": float(sync.max()),
                         **rounds})  # fmt: skip
        log(f"  N={n}: " + ", ".join(f"{r['method']} {r['sync_s']:.2f} s" for r in rows if r["workers"] == n))
    return {"config": asdict(cfg), "payload_bytes": method_bytes("noloco", cfg),
            "ddp_payload_bytes": method_bytes("ddp", cfg), "rows": rows, "calibration": calibration(),
            "claim": claim_conditions(cfg)}  # fmt: skip


def claim_conditions(cfg: WanConfig, n: int = 1024) -> list[dict]:
    """The paper's "≈10× faster sync than all-reduce at ~1k": tree and ring all-reduce over NoLoCo pairs' sync
    time (all peers ready at once) at ``n`` peers, under varied payloads, latency, spread and stragglers."""
    base = asdict(cfg)
    base.update(workers=[n], methods=["diloco-ring", "diloco-tree", "noloco-g2", "swarm-g2"])
    scenarios = [
        ("as configured", {}),
        ("no spread, no stragglers", {"bandwidth_sigma": 0.0, "rtt_sigma": 0.0, "straggler_fraction": 0.0}),
        ("small payload (1M params)", {"parameters": 1_000_000}),
        ("tiny payload (10k params)", {"parameters": 10_000}),
        ("1 Gbit/s links", {"bandwidth": 1e9}),
        ("wide spread (σ = 1)", {"bandwidth_sigma": 1.0, "rtt_sigma": 1.0}),
        ("1% stragglers 4× slower", {"straggler_fraction": 0.01}),
        ("10% stragglers 4× slower", {"straggler_fraction": 0.1}),
    ]
    out = []
    for label, change in scenarios:
        scenario = WanConfig(**{**base, **change})
        peers = draw_peers(n, scenario)
        sync = {m: float(sync_times(m, peers, scenario).mean()) for m in scenario.methods}
        out.append({"scenario": label, **{f"{m}_s": v for m, v in sync.items()},
                    "tree_over_pairs": sync["diloco-tree"] / sync["noloco-g2"],
                    "ring_over_pairs": sync["diloco-ring"] / sync["noloco-g2"],
                    "tree_over_swarm": sync["diloco-tree"] / sync["swarm-g2"]})  # fmt: skip
    return out


# --- calibration against the throttled fleet ---------------------------------------------------------------

#: fleet reports with measured exchanges, and their transport: "half" before receives were posted ahead
#: (docs/fleet.md, "Receives posted ahead"), "full" after
FLEET_REPORTS = {
    "throttled.json": "half",
    "throttled-duplex.json": "full",
    "throttled-duplex-diloco-mu-1.json": "full",
    "throttled-duplex-diloco-mu-2.json": "full",
    "throttled-duplex-2hosts.json": "full",
    "throttled-burst-5ms-1.json": "full",
    "throttled-burst-50ms-1.json": "full",
    "throttled-burst-5ms-2.json": "full",
    "throttled-burst-50ms-2.json": "full",
    "overlap_fleet-2cores.json": "half",
    "overlap_fleet-16cores.json": "half",
    "overlap_fleet-h200.json": "half",
    "overlap_fleet-h200-balanced.json": "half",
    "overlap_fleet-h200-small.json": "half",
    "overlap_fleet-h200-duplex.json": "full",
    "overlap_fleet-h100-balanced-phi.json": "full",
}

#: the report whose overlapped exchanges set the model's overlap slowdown (:func:`overlap_slowdown`)
OVERLAP_FIT_REPORT = "overlap_fleet-h100-balanced-phi.json"
#: the fleet's links measured alone (``benchmarks/link_probe.py``): one TCP connection, one way and both ways at once
#: (a pair's exchange), a ring's traffic (each host sending to its successor while receiving from its predecessor) and
#: the two-phase reduction's (each host sending to every other at once while receiving from each)
LINK_PROBE_REPORTS = ("link-probe-50mbit.json", "link-probe-ring4-50mbit.json", "link-probe-two-phase4-50mbit.json")
#: the all-reduce patterns a probe row can have measured among ``hosts`` hosts (each host sends 2(n−1)/n of the payload)
ALL_REDUCE_PATTERNS = ("ring", "two_phase")  # named as comm.reduction names them


def load_link_probes(folder: Path | str | None = None) -> list[dict]:
    """The rows of the link probe reports in ``folder`` (default: this checkout's ``docs/results``), each with its
    report's ``rate_bps``; [] without them."""
    folder = _results_folder(folder)
    rows = []
    for name in LINK_PROBE_REPORTS:
        if (folder / name).is_file():
            report = json.loads((folder / name).read_text())
            rows += [{**r, "rate_bps": float(report["rate_bps"])} for r in report.get("rows", [])]
    return rows


def probe_pattern(row: dict) -> str:
    """What a probe row measured: ``"ring"`` or ``"two_phase"`` (an all-reduce's traffic among its ``hosts``),
    ``"both ways"`` (one connection, both directions) or ``"one way"``."""
    if row.get("pattern") in ALL_REDUCE_PATTERNS:
        return row["pattern"]
    return "both ways" if row["both_ways"] else "one way"


def link_efficiency(probes: list[dict], rate_bps: float, burst_seconds: float, nbytes: float,
                    pattern: str) -> float | None:  # fmt: skip
    """Payload bits over (rate × seconds) of ``nbytes`` sent per host through a fleet link of ``rate_bps`` and a
    bucket of ``burst_seconds``, in traffic of ``pattern`` (:func:`probe_pattern`), as the link probe measured it
    (``probes``: :func:`load_link_probes`), without the bucket's head start (its seconds added back: the model passes
    a bucket's bytes at once itself). Interpolated in log size between the probe's sizes, clamped at its smallest
    and largest; None where the probe measured no such link (another rate, bucket or pattern)."""
    points = []
    for r in probes:
        if (probe_pattern(r) != pattern or not math.isclose(r["rate_bps"], rate_bps, rel_tol=1e-6)
                or not math.isclose(r["burst_seconds"], burst_seconds, rel_tol=1e-6)):  # fmt: skip
            continue
        sent = 2 * (r["hosts"] - 1) / r["hosts"] * r["bytes"] if pattern in ALL_REDUCE_PATTERNS else r["bytes"]
        points.append((sent, sent * 8 / (rate_bps * (r["median"] + burst_seconds))))
    if not points:
        return None
    points.sort()
    return float(np.interp(math.log(max(nbytes, 1.0)), [math.log(b) for b, _ in points], [e for _, e in points]))


def overlap_slowdown(folder: Path | str | None = None) -> float:
    """How much longer an exchange takes beside training than alone, fitted on one fleet report
    (:data:`OVERLAP_FIT_REPORT`): its overlapped ``noloco/int4`` run's mean exchange (steady rounds, from its send to
    its end) over its blocking ``noloco/int4`` run's seconds blocked per exchange. The workers' training and the
    exchange thread share the host's cores (and the interpreter), which the link model leaves out. 1 without the
    report."""
    folder = _results_folder(folder)
    path = folder / OVERLAP_FIT_REPORT
    if not path.is_file():
        return 1.0
    rows = {r["method"]: r for r in json.loads(path.read_text())["results"]}
    overlapped = (rows.get("noloco/int4/outer.overlap=true") or {}).get("exchanges") or {}
    blocked = ((rows.get("noloco/int4") or {}).get("steady") or {}).get("blocked_per_round")
    if not overlapped.get("exchange_seconds") or not blocked:
        return 1.0
    return float(overlapped["exchange_seconds"]) / float(blocked)


def _results_folder(folder: Path | str | None) -> Path:
    return Path(__file__).resolve().parents[2] / "docs" / "results" if folder is None else Path(folder)


def predict_exchange(method: str, codec: str, hosts: int, rate_bps: float, sent_per_exchange: float,
                     duplex: str, overhead: float = DEFAULT_OVERHEAD, burst_seconds: float = 0.0) -> float:  # fmt: skip
    """The model's seconds for one exchange of a fleet run: exact (fp32) reductions are rings, quantized ones
    two-phase; NoLoCo's group is a pair, the others' every host. The payload M comes from the bytes one worker
    sent per exchange (both send ``2(n−1)/n · M``). Identical peers at ``rate_bps``, no latency (namespaces),
    wire bytes = payload × ``overhead``; each link's bucket of ``burst_seconds`` of traffic, full after the idle
    time between exchanges, passes its bytes at once (the ring's first step; the two-phase exchange's buckets)."""
    n = 2 if method.startswith("noloco") else hosts
    payload = sent_per_exchange * n / (2 * (n - 1))
    peers = uniform_peers(n, rate_bps)
    if codec == "fp32":
        ring = float(ring_allreduce(peers, payload, overhead=overhead, duplex=duplex).max())
        step = payload / n * overhead * 8 / rate_bps
        return ring - min(burst_seconds, step)
    burst = burst_bytes(rate_bps, burst_seconds)
    return group_exchange(peers, list(range(n)), payload, 0.0, overhead=overhead, duplex=duplex, burst=burst)


def calibration(folder: Path | str | None = None) -> list[dict]:
    """Prediction against measurement for every shaped fleet run reported in ``folder`` (default: this checkout's
    ``docs/results``; missing reports are skipped).

    Measured: blocking runs' seconds blocked per exchange (the steady rounds' where reported, else idle × loop
    wall ÷ exchanges); overlapped runs' seconds per round. Predicted: the link time of the exchange
    (:func:`predict_exchange`, full and half duplex, at the payload efficiency the link probe measured for the
    run's rate, bucket, traffic pattern and size (:func:`link_efficiency`, reports :data:`LINK_PROBE_REPORTS`),
    else headers and ACKs alone; the bucket's head start taken off), plus for outer exchanges one fixed seconds per
    exchange per report, fitted on that report's blocking ``noloco/int4`` run (the point marked ``fit``): the
    waits that are not the link's (compute skew between workers sharing cores, encoding, handshakes). DDP's
    per-step exchanges get no fixed term. Overlapped: ``max(compute of the blocking run, c · exchange)``, c the
    exchange's slowdown beside training (:func:`overlap_slowdown`, one figure fitted on one report and applied to
    every report)."""
    folder = _results_folder(folder)
    slowdown = overlap_slowdown(folder)
    probes = load_link_probes(folder)
    points = []
    for name, transport in FLEET_REPORTS.items():
        path = folder / name
        if not path.is_file():
            continue
        rows = [r for r in json.loads(path.read_text())["results"] if not r.get("long") and r.get("rate_bps")
                and r["rate_bps"] < 1e9 and "fragments" not in r["method"]]  # fmt: skip
        rows.sort(key=lambda r: ("overlap" in r["method"], r["method"] != "noloco/int4"))
        fixed: dict[tuple, dict] = {}
        compute: dict[tuple, float] = {}
        for row in rows:
            point = _fleet_point(name, transport, row, fixed, compute, slowdown, probes)
            if point is not None:
                points.append(point)
    return points


def _fleet_link(algo: str, codec: str, row: dict, sent: float, probes: list[dict]) -> tuple[dict, dict]:
    """The model's link seconds of one exchange of a fleet run, full and half duplex, and the payload efficiency
    each used: the link probe's for the run's bucket, else the headers-and-ACKs default (``1 / DEFAULT_OVERHEAD``).
    Full duplex: a pair's traffic is one connection both ways at once; three or more hosts run the fleet's
    reduction, the two-phase one (``comm.reduction``'s default; a row's ``reduction`` names another), each host
    sending to every other at once while it receives from each, which the probe's two-phase traffic measured.
    Half duplex: one way."""
    burst = row.get("burst_seconds") or DEFAULT_BURST_SECONDS
    members = 2 if algo == "noloco" else row["hosts"]
    reduction = row.get("reduction", "two_phase")
    link, efficiency = {}, {}
    for d in ("full", "half"):
        pattern = "one way" if d == "half" else "both ways" if members == 2 else reduction
        measured = link_efficiency(probes, row["rate_bps"], burst, sent, pattern)
        efficiency[d] = measured if measured is not None else 1 / DEFAULT_OVERHEAD
        link[d] = predict_exchange(algo, codec, row["hosts"], row["rate_bps"], sent, d, overhead=1 / efficiency[d],
                                   burst_seconds=burst)  # fmt: skip
    return link, efficiency


def _fleet_point(name: str, transport: str, row: dict, fixed: dict, compute: dict,
                 slowdown: float = 1.0, probes: list[dict] | None = None) -> dict | None:  # fmt: skip
    algo, codec = row["method"].split("/")[:2]
    every = row["steps"] / row["rounds"] if row.get("rounds") else (1 if algo == "ddp" else 20)
    exchanges = row["steps"] / every
    steady = row.get("steady") or {}
    sent = row["bytes_sent_per_worker"] / exchanges
    link, efficiency = _fleet_link(algo, codec, row, sent, probes or [])
    key = (row["hosts"], row["rate_bps"], row.get("burst_seconds") or DEFAULT_BURST_SECONDS)
    point = {
        "report": name,
        "method": row["method"],
        "hosts": row["hosts"],
        "rate_mbit": row["rate_bps"] / 1e6,
        "transport": transport,
        "exchanges": exchanges,
        "burst_seconds": row.get("burst_seconds") or DEFAULT_BURST_SECONDS,
        "link_full": link["full"],
        "link_half": link["half"],
        "efficiency_full": efficiency["full"],
        "efficiency_half": efficiency["half"],
    }
    overlapped = "overlap=true" in row["method"]
    if overlapped:
        measured = steady.get("seconds_per_round")
        if key + (algo, codec) not in compute or measured is None:
            return None
        point["quantity"] = "s per round, overlapped"
        point["slowdown"] = slowdown
    else:
        measured = steady.get("blocked_per_round", row.get("blocked_per_round"))
        if measured is None:
            measured = row["idle_fraction"] * row["wall_seconds"] / exchanges
        if steady.get("compute_per_round", row.get("compute_per_round")) is not None:
            compute[key + (algo, codec)] = steady.get("compute_per_round", row.get("compute_per_round"))
        point["quantity"] = "s blocked per exchange"
    if row["method"] == "noloco/int4" and key not in fixed:
        fixed[key] = {d: measured - link[d] for d in ("full", "half")}
        point["fit"] = True
    extra = fixed.get(key, {"full": 0.0, "half": 0.0}) if algo != "ddp" else {"full": 0.0, "half": 0.0}
    for d in ("full", "half"):
        exchange = link[d] + extra[d]
        predicted = max(compute[key + (algo, codec)], slowdown * exchange) if overlapped else exchange
        point[f"predicted_{d}"] = predicted
        point[f"error_{d}"] = (predicted - measured) / measured
    point.update(measured=measured, fixed=extra["full"], predicted=point[f"predicted_{transport}"],
                 error=point[f"error_{transport}"])  # fmt: skip
    return point


# --- command line -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, ints) -> None:
    """The ``time`` study's options on ``parser``; ``ints`` parses a comma-separated list of integers."""
    d = WanConfig()
    parser.add_argument("--workers", type=ints, default=d.workers, help="N values (8,...,4096)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=", ".join(METHODS))
    parser.add_argument("--bandwidth", default="100mbit", help="median access rate each way (100mbit)")
    parser.add_argument("--bandwidth-sigma", type=float, default=d.bandwidth_sigma, help="σ of ln(rate) (0.5)")
    parser.add_argument("--rtt", default="50ms", help="median round trip between two peers (50ms)")
    parser.add_argument("--rtt-sigma", type=float, default=d.rtt_sigma, help="σ of ln(latency) (0.5)")
    parser.add_argument("--stragglers", type=float, default=0.0, help="fraction of peers k× slower (0)")
    parser.add_argument("--straggler-factor", type=float, default=d.straggler_factor, help="k (4)")
    parser.add_argument("--parameters", type=int, default=d.parameters, help="parameters per worker (124M)")
    parser.add_argument("--codec", default=d.codec, help="codec of the outer exchange (int4)")
    parser.add_argument("--compute", type=float, default=d.compute, help="compute seconds per outer round (1.6)")
    parser.add_argument("--every", type=int, default=d.every, help="inner steps H per outer round (50)")
    parser.add_argument("--matchmaking", type=float, default=d.matchmaking, help="matchmaking's fixed seconds (0.1)")
    parser.add_argument("--record-bytes", type=int, default=d.record_bytes, help=f"bytes of one readiness "
                        f"announcement as read ({RECORD_BYTES}; 0: reads cost nothing)")  # fmt: skip
    parser.add_argument("--window-reads", type=int, default=d.window_reads, help=f"reads of a round's "
                        f"announcements per peer ({WINDOW_READS})")  # fmt: skip
    parser.add_argument("--dht-replicas", type=int, default=d.dht_replicas, help=f"DHT nodes that hold the "
                        f"round's key and serve its reads ({DHT_REPLICAS})")  # fmt: skip
    parser.add_argument("--buckets", type=int, default=d.buckets, help="DHT keys a round's announcements are "
                        "spread over, peer.buckets (1)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=d.rounds, help="rounds simulated for idle fractions (10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/sim"), help="report folder (runs/sim)")
    parser.add_argument("--name", default="time", help="report file names (time)")


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the ``time`` study from parsed ``args``; bad values end in ``parser.error`` (one line, exit 2)."""
    from noloco.sim.report import stamp, write_time

    try:
        cfg = WanConfig(workers=args.workers, methods=args.methods, bandwidth=parse_rate(args.bandwidth),
                        bandwidth_sigma=args.bandwidth_sigma, rtt=parse_duration(args.rtt), rtt_sigma=args.rtt_sigma,
                        straggler_fraction=args.stragglers, straggler_factor=args.straggler_factor,
                        parameters=args.parameters, codec=args.codec, compute=args.compute, every=args.every,
                        matchmaking=args.matchmaking, record_bytes=args.record_bytes, window_reads=args.window_reads,
                        dht_replicas=args.dht_replicas, buckets=args.buckets, rounds=args.rounds,
                        seed=args.seed)  # fmt: skip
        cfg.check()
    except ValueError as exc:
        parser.error(str(exc).splitlines()[0])
    data = run_study(cfg)
    path = write_time(stamp(data, args.argv), args.out, args.name)
    print(f"wrote {path}")
    return 0
