"""The overlapped-fleet benchmark's analysis: the per-round split, its targets, and time to DDP's loss."""

from __future__ import annotations

import pytest

from benchmarks import overlap_fleet


def _result(method: str, loop: float, blocked: float, rounds: int = 10, final: float = 5.5, long: bool = False,
            curve: list | None = None) -> dict:  # fmt: skip
    return {"method": method, "final_eval_loss": final, "wall_seconds": loop, "bytes_sent_per_worker": 2e6,
            "rounds": rounds, "long": long, "steps": 100 if not long else 300,
            "seconds_per_round": loop / rounds, "compute_per_round": (loop - blocked) / rounds,
            "blocked_per_round": blocked / rounds, "idle_fraction": blocked / loop,
            "curve": curve or [(0, 0.0, 0, 8.0), (100, loop, 2e6, final)]}  # fmt: skip


def test_the_blocking_counterpart_drops_the_overlap_and_fragment_keys_only():
    assert overlap_fleet.blocking_of("noloco/int4/outer.overlap=true/outer.fragments=4") == "noloco/int4"
    assert overlap_fleet.blocking_of("diloco/fp32/outer.momentum=0.5/outer.overlap=true/outer.overlap_steps=5") == (
        "diloco/fp32/outer.momentum=0.5"
    )


def test_an_overlapped_run_is_judged_against_max_of_its_blocking_runs_compute_and_exchange():
    # blocking: 10 rounds of 1.0 s compute + 0.9 s exchange; overlapped 1.1 s per round (1.1x max), 3% idle
    blocking = _result("noloco/int4", 19.0, 9.0)
    overlapped = _result("noloco/int4/outer.overlap=true", 11.0, 0.33)
    slow = _result("noloco/int4/outer.overlap=true/outer.fragments=4", 16.0, 4.0)  # 1.6x, 25% idle
    lines, verdicts = overlap_fleet.analyse([_result("ddp/fp32", 50.0, 0.0, final=5.0), blocking, overlapped, slow])
    checks = {v["target"]: v for v in verdicts}
    fast = checks["noloco/int4/outer.overlap=true: s per round ≤ 1.15 × max(compute, blocked) of noloco/int4"]
    assert fast["met"] and fast["value"].startswith("1.10×")
    assert checks["noloco/int4/outer.overlap=true: idle fraction ≤ 5%"]["met"]
    late = checks["noloco/int4/outer.overlap=true/outer.fragments=4: s per round ≤ 1.15 × max(compute, blocked) "
                  "of noloco/int4"]  # fmt: skip
    assert not late["met"] and late["value"].startswith("1.60×")
    assert not checks["noloco/int4/outer.overlap=true/outer.fragments=4: idle fraction ≤ 5%"]["met"]
    assert any(line.startswith("| noloco/int4 | 5.5000 | 19.0 | 1.90 | 1.00 | 0.90 | 47.4% |") for line in lines)


def test_longer_runs_say_how_much_sooner_overlap_reaches_ddps_loss():
    ddp = {**_result("ddp/fp32", 50.0, 0.0, final=5.0), "rate_bps": 1e10}  # --ddp-rate 10gbit: only the target
    # the longer runs cross 5.0 half-way between evaluations: overlapped at 15 s, blocking at 30 s, DiLoCo never
    mine = _result(
        "noloco/int4/outer.overlap=true",
        40.0,
        1.0,
        long=True,
        final=4.8,
        curve=[(0, 0.0, 0, 8.0), (100, 10.0, 0, 5.2), (200, 20.0, 0, 4.8)],
    )
    theirs = _result(
        "noloco/int4",
        80.0,
        40.0,
        long=True,
        final=4.8,
        curve=[(0, 0.0, 0, 8.0), (100, 20.0, 0, 5.2), (200, 40.0, 0, 4.8)],
    )
    never = _result("diloco/fp32/outer.momentum=0.5", 60.0, 20.0, long=True, final=5.1)
    frag = _result(
        "noloco/int4/outer.overlap=true/outer.fragments=4",
        40.0,
        1.0,
        long=True,
        final=4.8,
        curve=[(0, 0.0, 0, 8.0), (100, 25.0, 0, 5.2), (200, 50.0, 0, 4.8)],
    )  # crosses at 37.5 s
    lines, verdicts = overlap_fleet.analyse([ddp, mine, theirs, never, frag])
    checks = {v["target"]: v for v in verdicts}
    vs_noloco = checks["overlapped NoLoCo-int4 reaches DDP-fp32's loss ≥ 1.5× sooner than blocking noloco/int4"]
    assert vs_noloco["met"] and vs_noloco["value"] == "2.00×"
    vs_diloco = checks["overlapped NoLoCo-int4 reaches DDP-fp32's loss ≥ 1.5× sooner than blocking "
                       "diloco/fp32/outer.momentum=0.5"]  # fmt: skip
    assert vs_diloco["met"] and vs_diloco["value"].startswith("> 4.00×")  # a bound: DiLoCo's whole 60 s run
    assert mine["step_to_target"] == pytest.approx(150)
    slower = checks["overlapped NoLoCo-int4 (noloco/int4/outer.overlap=true/outer.fragments=4) reaches DDP-fp32's "
                    "loss ≥ 1.5× sooner than blocking noloco/int4"]  # fmt: skip
    assert not slower["met"] and slower["value"] == "0.80×"  # 30 s against its 37.5 s
    assert len(verdicts) == 4  # two overlapped runs, each against the two blocking ones
    assert any(line.startswith("| diloco/fp32/outer.momentum=0.5 | 300 | – | – |") for line in lines)
    assert any("(DDP-fp32: step 100, 50.0 s at 10000 Mbit/s)" in line for line in lines)


def test_a_method_the_config_refuses_stops_the_benchmark_before_any_fleet_run(tmp_path, capsys):
    """fragments=4 does not divide H = 5: refused in a second, not after the runs before it (minutes)."""
    from benchmarks import throttled

    plan = [(2, "50mbit", "noloco/int4", 20), (2, "50mbit", "noloco/int4/outer.overlap=true/outer.fragments=4", 20)]
    assert throttled.run_plan(plan, tmp_path / "runs", [*throttled.MODEL, "outer.every=5"], 20, None) == 2
    assert "outer.fragments=4 does not divide outer.every=5" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def _metrics(run_dir, rank: int, bounds: list[tuple[int, float, float]]) -> None:
    """A worker's metrics file with a boundary record (step, wall, outer ms) per exchange, an eval record
    repeating the last one, and inner-step records between them (no outer_ms)."""
    import json

    lines = []
    for step, wall, outer_ms in bounds:
        lines.append({"step": step - 1, "wall": wall - 0.1, "loss": 5.0})
        lines.append({"step": step, "wall": wall, "outer_ms": outer_ms})
    lines.append({**lines[-1], "eval_loss": 5.0})  # the final step's eval repeats its boundary record
    (run_dir / f"metrics.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_steady_rounds_leave_out_the_first_two_and_the_last_and_count_per_h(tmp_path):
    # rounds of 3 s wall: the first two slower (kernels compile, then the first exchange is waited for), the
    # last with the unhidden last exchange; the steady ones spend 0.5 s of their 3 s inside outer steps
    walls = [5.0, 4.0, 3.0, 3.0, 3.0, 7.0]
    blocked = [2000.0, 1500.0, 500.0, 500.0, 500.0, 4000.0]
    bounds, t = [], 0.0
    for i, (w, b) in enumerate(zip(walls, blocked), 1):
        t += w
        bounds.append((10 * i, t, b))
    for rank in (0, 1):
        _metrics(tmp_path, rank, bounds)
    st = overlap_fleet.steady(tmp_path)
    assert st["steady_rounds"] == 3
    assert st["seconds_per_round"] == pytest.approx(3.0)
    assert st["blocked_per_round"] == pytest.approx(0.5)
    assert st["compute_per_round"] == pytest.approx(2.5)
    assert st["idle_fraction"] == pytest.approx(0.5 / 3.0)
    # the same boundaries as exchanges of 2 fragments: 2 per H; the first 4 are left out, the mean is per H
    frag = overlap_fleet.steady(tmp_path, fragments=2)
    assert frag["steady_rounds"] == 0.5 and frag["seconds_per_round"] == pytest.approx(6.0)
    assert overlap_fleet.steady(tmp_path, fragments=3) == {}  # nothing left between the warm-up and the end


def test_step_times_are_per_worker_over_the_steady_rounds_without_boundaries_and_evaluations(tmp_path):
    import json

    # H = 4, 6 rounds: steady inner steps are 9..20 (after 2 rounds, before the last); worker 1's take 30 ms
    # against worker 0's 10 ms; every step ending a round takes 1 s, and the steps around an evaluation 0.5 s
    for rank, dt in ((0, 0.010), (1, 0.030)):
        lines, wall = [], 0.0
        for step in range(1, 25):
            wall += 1.0 if step % 4 == 0 else 0.5 if step in (10, 11) else dt
            record = {"step": step, "wall": wall, "loss": 5.0}
            lines.append({**record, "outer_ms": 900.0} if step % 4 == 0 else record)
            if step == 10:  # an evaluation after step 10 (counted in step 11's wall, and step 10's record)
                lines.append({"step": step, "wall": wall, "eval_loss": 5.0})
        (tmp_path / f"metrics.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    times = overlap_fleet.step_times(tmp_path, every=4)
    assert times == [pytest.approx(0.010), pytest.approx(0.030)]
    assert overlap_fleet.step_times(tmp_path, every=4, fragments=2) == [pytest.approx(0.010), pytest.approx(0.030)]


def test_exchange_times_are_the_steady_rounds_exchanges_and_waits(tmp_path):
    import json

    # 6 boundaries: exchange q (sent at boundary q + 1) lands at boundary q + 2, the last two at the last step.
    # The steady rounds end at boundaries 3..5: their landings are exchanges 1..3 (the first and the two at
    # the end, one of which nothing hid, are left out)
    ran = [900.0, 400.0, 500.0, 600.0, 400.0, 3000.0]  # ms on the exchange thread, exchanges 0..5
    waited = [700.0, 0.0, 30.0, 60.0, 0.0, 2800.0]
    for rank in (0, 1):
        lines = [{"step": 10, "wall": 1.0, "outer_ms": 5.0}]
        for q, (e, w) in enumerate(zip(ran, waited)):
            step = 10 * min(q + 2, 6)
            lines.append(
                {
                    "step": step,
                    "wall": float(step),
                    "outer_ms": w + 5.0,
                    "outer_round": q,
                    "exchange_ms": e + 100.0 * rank,
                    "wait_ms": w * (1 + rank),
                }
            )
        (tmp_path / f"metrics.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    times = overlap_fleet.exchange_times(tmp_path)
    assert times["exchange_seconds"] == pytest.approx(0.550)  # the workers' means: 500 and 600 ms
    assert times["wait_seconds"] == pytest.approx(0.045)  # 30 and 60 ms
    assert times["max_wait_seconds"] == pytest.approx(0.060)
    for rank in (0, 1):  # a blocking run records no exchange of its own thread
        (tmp_path / f"metrics.rank{rank}.jsonl").write_text(json.dumps({"step": 10, "wall": 1.0, "outer_ms": 5}))
    assert overlap_fleet.exchange_times(tmp_path) == {}
