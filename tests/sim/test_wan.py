"""The WAN time model: ring, tree and group formulas against hand-computed cases; the fleet calibration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from noloco.fleet.linkmodel import DEFAULT_OVERHEAD, TokenBucket
from noloco.fleet.netns import DEFAULT_BURST_SECONDS
from noloco.sim.wan import (
    OVERLAP_FIT_REPORT,
    WanConfig,
    calibration,
    claim_conditions,
    draw_peers,
    group_exchange,
    link_efficiency,
    load_link_probes,
    matchmaking_seconds,
    overlap_slowdown,
    payload_bytes,
    predict_exchange,
    ring_allreduce,
    simulate_rounds,
    sync_times,
    tree_allreduce,
    uniform_peers,
    window_read_seconds,
)

MB = 1e6
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_ring_of_identical_peers_is_2_n_minus_1_steps_of_m_over_n():
    n, rate, latency, nbytes = 4, 8e6, 0.01, 4 * MB  # 1 MB/s links
    got = ring_allreduce(uniform_peers(n, rate, latency), nbytes, overhead=1.0)
    step = (nbytes / n) / (rate / 8) + 2 * latency  # a chunk, then the hop's two access latencies
    assert np.allclose(got, 2 * (n - 1) * step)
    half = ring_allreduce(uniform_peers(n, rate, 0.0), nbytes, overhead=1.0, duplex="half")
    assert np.allclose(half, 2 * (n - 1) * 2 * (nbytes / n) / (rate / 8))


def test_ring_is_paced_by_its_slowest_link_and_waits_for_the_last_ready_peer():
    peers = uniform_peers(4, 8e6)
    peers.rate[2] = 4e6  # links 1->2 and 2->3 run at half rate
    got = ring_allreduce(peers, 4 * MB, overhead=1.0)
    # steady state: peer 2's uplink needs 2 s a chunk, every step waits for it -> 6 steps of 2 s
    assert got.max() == pytest.approx(6 * 2.0)
    late = ring_allreduce(uniform_peers(4, 8e6), 4 * MB, ready=np.array([0.0, 0.0, 5.0, 0.0]), overhead=1.0)
    assert late.min() >= 5.0 and late.max() == pytest.approx(5.0 + 6 * 1.0, abs=1.0 + 1e-9)


def test_tree_of_identical_peers_matches_the_pipelined_hand_count():
    # 3 peers: 0 the root, 1 and 2 its children; the root's downlink (reduce) and uplink (broadcast) are shared
    rate, nbytes, chunks = 8e6, 2 * MB, 2
    got = tree_allreduce(uniform_peers(3, rate), nbytes, overhead=1.0, chunks=chunks)
    piece = nbytes / chunks / (rate / 2 / 8)  # each child's flow gets half the root's rate: 2 s a piece
    # reduce: the children send piece 1 (t = 2), piece 2 (t = 4); the broadcast of piece 1 starts as it is reduced
    # (full duplex: the root's uplink is free), t = 2..4, piece 2 t = 4..6
    assert got[0] == pytest.approx(2 * piece)
    assert got[1:] == pytest.approx([3 * piece, 3 * piece])
    # two peers: one link at the full rate each way
    two = tree_allreduce(uniform_peers(2, rate), nbytes, overhead=1.0, chunks=1)
    assert two.max() == pytest.approx(2 * nbytes / (rate / 8))


def test_group_exchange_is_two_phases_of_the_linkmodel_buckets():
    rate, nbytes, latency = 8e6, 2 * MB, 0.02
    peers = uniform_peers(2, rate, latency)
    got = group_exchange(peers, [0, 1], nbytes, start=1.0, overhead=1.0)
    phase = (nbytes / 2 - 16 * 1024) / (rate / 8)  # half the payload each way per phase; the burst is free
    # the bucket refills its burst during the 2 · latency between the phases (40 kB at 1 MB/s)
    assert got == pytest.approx(1.0 + 2 * (phase + 2 * latency))
    # the same through TokenBucket by hand: uplink of member 0 over two phases
    bucket = TokenBucket(rate)
    first = bucket.transmit(nbytes / 2, 1.0) + 2 * latency
    assert bucket.transmit(nbytes / 2, first) + 2 * latency == pytest.approx(got)
    # a group of 4: each member sends 3/4 of the payload per phase; the slowest member sets the pace
    four = uniform_peers(4, rate)
    four.rate[3] = rate / 2
    t4 = group_exchange(four, [0, 1, 2, 3], nbytes, 0.0, overhead=1.0)
    assert t4 == pytest.approx(2 * (0.75 * nbytes - 16 * 1024) / (rate / 2 / 8), rel=1e-9, abs=0.2)
    assert t4 > 2 * (0.75 * nbytes - 16 * 1024) / (rate / 2 / 8) - 1e-9


def test_payload_comes_from_the_codec():
    assert payload_bytes(1000, "fp32") == 4000
    assert 1_280_000 * 4.1875 / 8 <= payload_bytes(1_280_000, "int4") < 1_280_000 * 4.2 / 8  # 4 bits + 24 per 128
    with pytest.raises(ValueError, match="codec"):
        payload_bytes(10, "int3x")


def test_pairs_do_not_grow_with_n_while_the_ring_does():
    cfg = WanConfig(parameters=1_000_000, rounds=2, bandwidth_sigma=0.0, rtt_sigma=0.0)
    small, large = draw_peers(8, cfg), draw_peers(256, cfg)
    pairs = [sync_times("noloco-g2", p, cfg).mean() for p in (small, large)]
    ring = [sync_times("diloco-ring", p, cfg).mean() for p in (small, large)]
    assert pairs[1] == pytest.approx(pairs[0], rel=1e-6)
    assert ring[1] > 5 * ring[0]  # 2(N−1) latency-bound steps


def test_a_straggler_holds_back_the_all_reduce_and_scheduled_pairs_but_not_the_swarm():
    cfg = WanConfig(parameters=100_000, compute=1.0, rounds=12, bandwidth=1e9, bandwidth_sigma=0.0, rtt_sigma=0.0,
                    straggler_fraction=1 / 16, straggler_factor=4.0)  # fmt: skip
    peers = draw_peers(16, cfg)
    assert (peers.slowdown == 4).sum() == 1
    ring = simulate_rounds("diloco-ring", peers, cfg)
    scheduled = simulate_rounds("noloco-g2", peers, cfg)
    swarm = simulate_rounds("swarm-g2", peers, cfg)
    assert ring["round_s_normal"] > 4.0  # everyone waits for the straggler's 4 s of compute
    assert scheduled["round_s_normal"] > 2.0  # its delay spreads through the pairs
    assert swarm["round_s_normal"] < 1.0 + matchmaking_seconds(peers, [0, 1], cfg) + 0.5
    assert swarm["idle_fraction"] < ring["idle_fraction"]


def test_window_reads_grow_with_the_square_of_n_at_the_key_holders():
    cfg = WanConfig(record_bytes=300, window_reads=8, dht_replicas=5, overhead=1.0)
    small, large = uniform_peers(64, 100e6), uniform_peers(1024, 100e6)
    # 1,024 peers: each reads 8 × 1,024 × 300 B a round; 5 holders upload all 1,024 peers' reads
    one_peer_bits = 8 * 1024 * 300 * 8
    assert window_read_seconds(large, [0, 1], cfg) == pytest.approx(1024 * one_peer_bits / (5 * 100e6))
    assert window_read_seconds(large, [0, 1], cfg) == pytest.approx(256 * window_read_seconds(small, [0, 1], cfg))
    # below the replicas the reader's own download bounds it: 3 peers, 3 holders, one read each
    few = uniform_peers(3, 1e6)
    assert window_read_seconds(few, [0, 1], cfg) == pytest.approx(8 * 3 * 300 * 8 / 1e6)
    # B keys (peer.buckets): each peer reads N/B announcements, each key's holders serve (N/B)² of them
    spread = WanConfig(record_bytes=300, window_reads=8, dht_replicas=5, overhead=1.0, buckets=16)
    assert window_read_seconds(large, [0, 1], spread) == pytest.approx(window_read_seconds(small, [0, 1], cfg))
    free = WanConfig(record_bytes=0)
    assert window_read_seconds(large, [0, 1], free) == 0.0
    added = matchmaking_seconds(large, [0, 1], cfg) - matchmaking_seconds(large, [0, 1], free)
    assert added == pytest.approx(window_read_seconds(large, [0, 1], cfg))  # the model's matchmaking includes it


def test_window_read_keys_are_checked():
    for bad in (dict(record_bytes=-1), dict(window_reads=-1), dict(dht_replicas=0), dict(buckets=0)):
        with pytest.raises(ValueError, match="record-bytes|window-reads|dht-replicas|buckets"):
            WanConfig(**bad).check()


def test_calibration_reads_the_fleet_reports_and_fits_one_point_per_report():
    points = calibration()
    assert points, "no fleet reports in docs/results"
    for report in {p["report"] for p in points}:
        fits = [p for p in points if p["report"] == report and p.get("fit")]
        assert len(fits) == len({(p["hosts"], p["rate_mbit"]) for p in fits})
        assert all(p["error"] == pytest.approx(0.0, abs=1e-12) for p in fits)
    ddp = [p for p in points if p["report"] == "throttled-duplex.json" and p["method"] == "ddp/fp32"]
    # 4 hosts at 50 Mbit/s: 2·3/4 · 2.76 MB at the link rate and the efficiency the probe of the two-phase
    # reduction's traffic among 4 hosts (what the fleet runs) measured for it, less the 5 ms bucket's head start
    sent = 495.936e6 / 120
    efficiency = link_efficiency(load_link_probes(), 50e6, DEFAULT_BURST_SECONDS, sent, "two_phase")
    ring = link_efficiency(load_link_probes(), 50e6, DEFAULT_BURST_SECONDS, sent, "ring")
    assert 0.7 < efficiency < 0.9 and ring > efficiency  # all at once is slower through the 5 ms bucket
    assert ddp and ddp[0]["efficiency_full"] == pytest.approx(efficiency)
    assert ddp[0]["link_full"] == pytest.approx(sent * 8 / 50e6 / efficiency - DEFAULT_BURST_SECONDS, rel=1e-3)
    # NoLoCo's pair: one connection both ways at once, the probe's stream
    rows = json.loads((RESULTS / "throttled-duplex.json").read_text())["results"]
    row = next(r for r in rows if r["method"] == "noloco/fp32" and not r.get("long"))
    pair = next(p for p in points if p["report"] == "throttled-duplex.json" and p["method"] == "noloco/fp32")
    sent_pair = row["bytes_sent_per_worker"] / 6
    both = link_efficiency(load_link_probes(), 50e6, DEFAULT_BURST_SECONDS, sent_pair, "both ways")
    assert pair["efficiency_full"] == pytest.approx(both) and both != pytest.approx(efficiency)


def _probe_row(nbytes: int, median: float, both_ways: bool = True, burst: float = 0.005) -> dict:
    return {"burst_seconds": burst, "bytes": nbytes, "both_ways": both_ways, "median": median, "rate_bps": 50e6}


def test_link_efficiency_is_the_probes_interpolated_in_log_size_without_the_buckets_head_start():
    # 1 MB both ways in 0.195 s (+ the 5 ms bucket = 0.2 s): 8e6 / (5e7 · 0.2) = 0.8
    slow = 0.795 * 0.8 / 0.9
    probes = [_probe_row(1_000_000, 0.195), _probe_row(4_000_000, slow), _probe_row(1_000_000, 0.1, False),
              _probe_row(1_000_000, 0.1, burst=0.05),
              {**_probe_row(2_000_000, 0.245), "pattern": "ring", "hosts": 4},
              {**_probe_row(2_000_000, 0.295), "pattern": "two_phase", "hosts": 4}]  # fmt: skip
    at_4 = 32e6 / (50e6 * (slow + 0.005))
    assert link_efficiency(probes, 50e6, 0.005, 1e6, "both ways") == pytest.approx(0.8)
    assert link_efficiency(probes, 50e6, 0.005, 4e6, "both ways") == pytest.approx(at_4)
    assert link_efficiency(probes, 50e6, 0.005, 2e6, "both ways") == pytest.approx((0.8 + at_4) / 2)  # log middle
    assert link_efficiency(probes, 50e6, 0.005, 1e3, "both ways") == pytest.approx(0.8)  # clamped
    assert link_efficiency(probes, 50e6, 0.005, 1e6, "one way") == pytest.approx(8e6 / (50e6 * 0.105))
    assert link_efficiency(probes, 50e6, 0.05, 1e6, "both ways") == pytest.approx(8e6 / (50e6 * 0.15))
    # a ring of 4 with a 2 MB payload: each host sent 2·3/4 of it, 3 MB, in 0.245 s (+ 5 ms)
    assert link_efficiency(probes, 50e6, 0.005, 3e6, "ring") == pytest.approx(24e6 / (50e6 * 0.25))
    assert link_efficiency(probes, 50e6, 0.005, 3e6, "two_phase") == pytest.approx(24e6 / (50e6 * 0.3))
    for other in ((500e6, 0.005), (50e6, 0.02)):  # a rate or a bucket the probe did not measure: the default
        assert link_efficiency(probes, *other, 1e6, "both ways") is None
    assert link_efficiency([], 50e6, 0.005, 1e6, "both ways") is None


def test_a_buckets_head_start_comes_off_the_exchange_once():
    plain = predict_exchange("diloco", "fp32", 4, 50e6, 3e6, "full")
    assert predict_exchange("diloco", "fp32", 4, 50e6, 3e6, "full", burst_seconds=0.05) == pytest.approx(plain - 0.05)
    slower = predict_exchange("diloco", "fp32", 4, 50e6, 3e6, "full", overhead=2 * DEFAULT_OVERHEAD)
    assert slower == pytest.approx(2 * plain)
    pair = predict_exchange("noloco", "int4", 4, 50e6, 3e6, "full")
    deep = predict_exchange("noloco", "int4", 4, 50e6, 3e6, "full", burst_seconds=0.05)
    assert pair - 0.06 < deep < pair - 0.04  # the pair's buckets pass 312 KB at once, in its first phase


def _fleet_row(method: str, blocked: float, compute: float, exchange: float | None = None) -> dict:
    """One row of an overlap_fleet report as the calibration reads it: 4 hosts at 50 Mbit/s, 10 rounds."""
    row = {
        "method": method,
        "hosts": 4,
        "rate_bps": 50e6,
        "steps": 400,
        "rounds": 10,
        "idle_fraction": 0.1,
        "wall_seconds": 10.0,
        "bytes_sent_per_worker": 10 * 1.5e6,
        "steady": {"blocked_per_round": blocked, "compute_per_round": compute, "seconds_per_round": compute + 0.1},
    }
    if exchange is not None:
        row["exchanges"] = {"exchange_seconds": exchange, "wait_seconds": 0.1}
    return row


def test_overlapped_rounds_take_the_slowdown_fitted_on_one_report(tmp_path):
    assert overlap_slowdown(tmp_path) == 1.0  # no report: the link model alone
    fit = [_fleet_row("noloco/int4", 0.40, 0.70), _fleet_row("noloco/int4/outer.overlap=true", 0.0, 0.70, 0.50)]
    (tmp_path / OVERLAP_FIT_REPORT).write_text(json.dumps({"results": fit}))
    assert overlap_slowdown(tmp_path) == pytest.approx(0.50 / 0.40)
    # another report whose exchange outlasts its compute: the slowdown decides its overlapped round
    other = [_fleet_row("noloco/int4", 0.60, 0.30), _fleet_row("noloco/int4/outer.overlap=true", 0.0, 0.30, 0.8)]
    (tmp_path / "overlap_fleet-h200-duplex.json").write_text(json.dumps({"results": other}))
    points = {(p["report"], p["method"]): p for p in calibration(tmp_path)}
    blocking = points["overlap_fleet-h200-duplex.json", "noloco/int4"]
    overlapped = points["overlap_fleet-h200-duplex.json", "noloco/int4/outer.overlap=true"]
    assert blocking["fit"] and blocking["predicted"] == pytest.approx(0.60)  # link + fixed = the measured 0.60
    assert overlapped["slowdown"] == pytest.approx(1.25)
    assert overlapped["predicted"] == pytest.approx(max(0.30, 1.25 * 0.60))
    # where compute is longer than the slowed exchange, the round is the compute
    assert points[OVERLAP_FIT_REPORT, "noloco/int4/outer.overlap=true"]["predicted"] == pytest.approx(0.70)


def test_claim_conditions_vary_what_they_say():
    rows = claim_conditions(WanConfig(parameters=1_000_000, rounds=1), n=64)
    names = [r["scenario"] for r in rows]
    assert "as configured" in names and "10% stragglers 4× slower" in names
    by = {r["scenario"]: r for r in rows}
    assert by["10% stragglers 4× slower"]["tree_over_pairs"] > by["no spread, no stragglers"]["tree_over_pairs"]
