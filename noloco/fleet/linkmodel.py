"""An in-process model of rate-limited worker links, for users who cannot build a root fleet.

Each worker has an uplink and a downlink, each a token bucket (``rate`` bits/s, ``burst`` bytes)
followed by a fixed one-way ``latency`` — the same shape as the fleet's ``tc tbf`` links
(:mod:`noloco.fleet.netns`). :func:`predict` replays the bytes a finished run actually sent and
received per worker and per step (its ``metrics*.jsonl``, from any backend) through those links and
predicts how long the communication takes:

* a step's exchange on worker *i* lasts ``max(up_i(sent_i), down_i(received_i)) + phases · latency``
  with ``duplex="full"`` (both directions at once; a two-phase reduction has two sequential phases,
  docs/design.md §3.4), or ``up_i(sent_i) + down_i(received_i) + ...`` with ``duplex="half"`` (the directions
  take turns). Measured on the fleet: gloo exchanges whose receive is posted before the send run
  full duplex (within 3% of the link rate). The torch backend's transport posts the receives a reduction
  announces ahead of their frames, so its exchanges run full duplex too (``full``, the default; within 8%
  of a fleet run). ``half`` models a transport that posts a payload's receive only once its frame header
  arrived, as this one did before: its exchanges took turns (docs/fleet.md has the numbers);
* the run is synchronous, so a step costs the slowest worker's exchange;
* bytes on the wire = payload × ``overhead``: Ethernet + IP + TCP headers (66 B per 1448-B segment,
  4.6%) plus the delayed ACKs of the reverse flow (66 B per two segments, 2.3%) → 1.07 by default.

``predicted wall = compute wall + predicted communication``, where the compute wall comes from an
unshaped run of the same job (``--baseline``), or from the run itself when it was unshaped.
:func:`compare` checks a prediction against a fleet run (``fleet.json`` beside the metrics) and
reports the gap. Not modelled: TCP slow start and loss recovery, CPU contention between workers,
and overlap of communication with compute (``outer.overlap``). Fails with
``FileNotFoundError``/``ValueError`` when a folder has no metrics or a rate is malformed.

    python -m noloco.fleet.linkmodel runs/a --rate 50mbit [--latency 20ms] [--baseline runs/a-unshaped]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from noloco.fleet.netns import parse_duration, parse_rate

DEFAULT_OVERHEAD = 1.07


@dataclass
class TokenBucket:
    """One direction of one link: a token bucket of ``rate_bps`` bits/s and ``burst`` bytes, then ``latency`` s.

    :meth:`transmit` is called in time order; it mutates the bucket's tokens and clock.
    """

    rate_bps: float
    burst: float = 16 * 1024
    latency: float = 0.0
    tokens: float = field(init=False)
    clock: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.rate_bps <= 0:
            raise ValueError(f"rate must be positive, got {self.rate_bps}")
        self.tokens = self.burst

    def transmit(self, nbytes: float, at: float) -> float:
        """Send ``nbytes`` wire bytes starting no earlier than ``at`` (s); returns when the last byte arrives."""
        rate = self.rate_bps / 8
        start = max(at, self.clock)
        self.tokens = min(self.burst, self.tokens + (start - self.clock) * rate)
        deficit = nbytes - self.tokens
        if deficit <= 0:
            self.tokens -= nbytes
            done = start
        else:
            self.tokens = 0.0
            done = start + deficit / rate
        self.clock = done
        return done + self.latency


@dataclass
class Prediction:
    """A run's predicted communication: total seconds, per exchange step, and the bytes replayed."""

    comm_seconds: float
    exchanges: int
    per_step: dict[int, float]
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    compute_seconds: float | None = None

    @property
    def wall_seconds(self) -> float | None:
        return None if self.compute_seconds is None else self.compute_seconds + self.comm_seconds


def step_bytes(run_dir: Path | str) -> tuple[dict[int, dict[int, tuple[int, int]]], float]:
    """Per step, per worker, the (sent, received) payload bytes of that step; and the loop's wall time (s).

    Reads every ``metrics*.jsonl`` of ``run_dir`` (cumulative counters → per-step deltas).
    """
    paths = sorted(Path(run_dir).glob("metrics*.jsonl"))
    if not paths:
        raise FileNotFoundError(f"{run_dir}: no metrics*.jsonl")
    per_worker: dict[int, list[dict]] = defaultdict(list)
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                per_worker[record["worker"]].append(record)
    steps: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    wall = 0.0
    for worker, records in per_worker.items():
        records.sort(key=lambda r: r["step"])
        sent = received = 0
        for record in records:
            d_sent, d_recv = record["bytes_sent"] - sent, record["bytes_received"] - received
            sent, received = record["bytes_sent"], record["bytes_received"]
            if d_sent or d_recv:
                steps[record["step"]][worker] = (d_sent, d_recv)
        wall = max(wall, records[-1]["wall"])
    return dict(steps), wall


def predict(
    run_dir: Path | str,
    rate_bps: float,
    latency: float = 0.0,
    overhead: float = DEFAULT_OVERHEAD,
    phases: int = 2,
    burst: float = 16 * 1024,
    baseline: Path | str | None = None,
    duplex: str = "full",
) -> Prediction:
    """Predict the communication time of ``run_dir``'s traffic on links of ``rate_bps`` each way.

    ``latency``: one-way seconds per phase; ``phases``: sequential message phases per exchange;
    ``baseline``: an unshaped run of the same job whose loop wall time is the compute time (default:
    none, so :attr:`Prediction.wall_seconds` is ``None`` unless ``baseline`` is given);
    ``duplex``: ``"full"`` (directions at once) or ``"half"`` (directions take turns).
    """
    if duplex not in ("full", "half"):
        raise ValueError(f"duplex must be 'full' or 'half', got {duplex!r}")
    steps, _ = step_bytes(run_dir)
    workers = sorted({w for per in steps.values() for w in per})
    up = {w: TokenBucket(rate_bps, burst, latency) for w in workers}
    down = {w: TokenBucket(rate_bps, burst, 0.0) for w in workers}
    now, per_step = 0.0, {}
    sent_total: dict[int, int] = defaultdict(int)
    recv_total: dict[int, int] = defaultdict(int)
    for step in sorted(steps):
        finish = now
        for worker, (sent, received) in steps[step].items():
            sent_total[worker] += sent
            recv_total[worker] += received
            # the phases share the bytes; each phase waits one latency before the next starts
            t_up = up[worker].transmit(sent * overhead, now) + (phases - 1) * latency
            start_down = t_up - (phases - 1) * latency if duplex == "half" else now
            t_down = down[worker].transmit(received * overhead, start_down) + phases * latency
            finish = max(finish, t_up, t_down)
        per_step[step] = finish - now
        now = finish
    compute = step_bytes(baseline)[1] if baseline is not None else None
    return Prediction(sum(per_step.values()), len(per_step), per_step, dict(sent_total), dict(recv_total), compute)


def compare(run_dir: Path | str, baseline: Path | str, **kwargs) -> dict:
    """Predict ``run_dir`` (a fleet run with ``fleet.json``) from its bytes and ``baseline``'s compute time.

    Returns measured and predicted communication and wall seconds and the relative gaps
    ``(predicted − measured) / measured``. Measured communication = fleet loop wall − baseline loop wall.
    """
    fleet = json.loads((Path(run_dir) / "fleet.json").read_text())
    if not fleet.get("rate_bps"):
        raise ValueError(f"{run_dir}: the fleet run was unshaped; nothing to compare")
    prediction = predict(run_dir, fleet["rate_bps"], baseline=baseline, **kwargs)
    measured_wall = step_bytes(run_dir)[1]
    assert prediction.compute_seconds is not None and prediction.wall_seconds is not None
    measured_comm = measured_wall - prediction.compute_seconds
    return {
        "rate_bps": fleet["rate_bps"],
        "exchanges": prediction.exchanges,
        "compute_seconds": prediction.compute_seconds,
        "measured_wall": measured_wall,
        "predicted_wall": prediction.wall_seconds,
        "wall_gap": (prediction.wall_seconds - measured_wall) / measured_wall,
        "measured_comm": measured_comm,
        "predicted_comm": prediction.comm_seconds,
        "comm_gap": (prediction.comm_seconds - measured_comm) / measured_comm if measured_comm > 0 else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m noloco.fleet.linkmodel",
        description="Predict a run's communication time on rate-limited links from the bytes it sent.",
    )
    parser.add_argument("run_dir", type=Path, help="a finished run folder (metrics*.jsonl)")
    parser.add_argument(
        "--rate",
        default=None,
        help="per-worker link rate each way, e.g. 50mbit (default: the rate in the folder's fleet.json)",
    )
    parser.add_argument("--latency", default="0ms", help="one-way latency per message phase, e.g. 20ms")
    parser.add_argument("--phases", type=int, default=2, help="sequential message phases per exchange (2)")
    parser.add_argument("--overhead", type=float, default=DEFAULT_OVERHEAD, help="wire bytes per payload byte")
    parser.add_argument(
        "--duplex",
        choices=("full", "half"),
        default="full",
        help="directions at once (full, the torch transport) or taking turns (half)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="an unshaped run of the same job: its loop wall time is the compute time",
    )
    args = parser.parse_args(argv)
    fleet_json = args.run_dir / "fleet.json"
    if args.rate is not None:
        rate = parse_rate(args.rate)
    elif fleet_json.exists() and json.loads(fleet_json.read_text()).get("rate_bps"):
        rate = json.loads(fleet_json.read_text())["rate_bps"]
    else:
        parser.error("--rate is required (the folder has no shaped fleet.json)")
    latency = parse_duration(args.latency)
    prediction = predict(
        args.run_dir, rate, latency, args.overhead, args.phases, baseline=args.baseline, duplex=args.duplex
    )
    print(f"{args.run_dir}: {prediction.exchanges} exchanges at {rate / 1e6:g} Mbit/s, latency {latency * 1e3:g} ms")
    for worker in sorted(prediction.bytes_sent):
        print(
            f"  worker {worker}: sent {prediction.bytes_sent[worker] / 1e6:.2f} MB, "
            f"received {prediction.bytes_received[worker] / 1e6:.2f} MB"
        )
    print(f"  predicted communication {prediction.comm_seconds:.2f} s")
    if prediction.wall_seconds is not None:
        print(
            f"  compute (baseline loop) {prediction.compute_seconds:.2f} s, "
            f"predicted wall {prediction.wall_seconds:.2f} s"
        )
    if args.baseline is not None and fleet_json.exists() and json.loads(fleet_json.read_text()).get("rate_bps"):
        gap = compare(
            args.run_dir, args.baseline, latency=latency, overhead=args.overhead, phases=args.phases, duplex=args.duplex
        )
        print(
            f"  measured wall {gap['measured_wall']:.2f} s (gap {gap['wall_gap']:+.1%}); measured communication "
            f"{gap['measured_comm']:.2f} s (gap {gap['comm_gap']:+.1%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
