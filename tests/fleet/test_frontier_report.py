"""The frontier benchmark's report: bits/param/step, ratios to NoLoCo-fp32 per seed, the targets, the points."""

from __future__ import annotations

import json

import pytest

from benchmarks import frontier

PARAMS, STEPS = 1_000_000, 100


def _summary(loss: float, bits: float) -> dict:
    return {"final_eval_loss": loss, "bytes_sent_per_worker": bits * PARAMS * STEPS / 8, "params": PARAMS,
            "steps": STEPS, "workers": 4, "outer_every": 5}  # fmt: skip


def _point(algo: str, point: str, seed: int, loss: float, bits: float) -> dict:
    return frontier.measure(frontier.Run(algo, point, seed, ()), _summary(loss, bits))


def test_bits_per_param_per_step_are_bytes_times_8_over_params_over_steps():
    point = frontier.measure(frontier.Run("noloco", "int4", 0, ()), _summary(5.0, 0.21))
    assert point["bits"] == pytest.approx(0.21)
    assert point["name"] == "noloco-int4-s0"


def test_ratios_pair_each_seed_with_its_own_reference_and_the_targets_are_marked():
    results = [
        _point("noloco", "fp32", 0, 5.00, 1.6), _point("noloco", "fp32", 1, 4.00, 1.6),
        # 1.01 and 1.019 of their own seed's reference: mean 1.0145 (met), 40x fewer bytes
        _point("noloco", "topk:64/4096+int2", 0, 5.05, 0.04), _point("noloco", "topk:64/4096+int2", 1, 4.076, 0.04),
        # 0.005 bits (320x fewer) but +3%
        _point("noloco", "sign", 0, 5.15, 0.005), _point("noloco", "sign", 1, 4.12, 0.005),
        # within the loss target, only 8x fewer
        _point("noloco", "int4", 0, 5.0, 0.2), _point("noloco", "int4", 1, 4.0, 0.2),
        _point("diloco", "int2", 0, 4.9, 0.006),
    ]  # fmt: skip
    rows = {(r["algo"], r["point"]): r for r in frontier.summarize(results, min_seeds=2)}
    topk = rows["noloco", "topk:64/4096+int2"]
    assert topk["ratio"] == pytest.approx(1.0145) and topk["ratio_sd"] == pytest.approx(0.00636, abs=1e-4)
    assert topk["fewer_bytes"] == pytest.approx(40) and topk["target_30x"] and not topk["target_bits"]
    assert not rows["noloco", "sign"]["target_30x"] and not rows["noloco", "sign"]["target_bits"]
    assert not rows["noloco", "int4"]["target_30x"]
    diloco = rows["diloco", "int2"]  # seed 1 has no DiLoCo run: one seed, no sd
    assert diloco["ratio"] == pytest.approx(0.98) and diloco["ratio_sd"] is None and diloco["target_bits"]
    lines = frontier.table(list(rows.values()))
    assert any(line.startswith("| noloco | `topk:64/4096+int2` | 2 | 0.04 ± 0 | 40.0× |") and "≥30×" in line
               for line in lines)  # fmt: skip
    verdict = frontier.verdicts(list(rows.values()))
    assert verdict[0].startswith("- NoLoCo within +1.5% at ≥ 30× fewer bytes: **met** by `topk:64/4096+int2`")
    assert "**not met**" in verdict[1] and "`topk:64/4096+int2`, 0.04 bits/param/step" in verdict[1]


def test_only_points_with_enough_seeds_decide_a_target():
    """By default three seeds decide: a two-seed point that meets the target is shown, marked, and not counted."""
    results = [_point("noloco", "fp32", s, 5.0, 1.6) for s in (0, 1, 2)] + [
        _point("noloco", "topk:64/4096+int2", s, 5.05, 0.04) for s in (0, 1)] + [
        _point("noloco", "int4", s, 5.0, 0.2) for s in (0, 1, 2)]  # fmt: skip
    rows = frontier.summarize(results)
    topk = next(r for r in rows if r["point"] == "topk:64/4096+int2")
    assert topk["target_30x"] and not topk["decided"]
    assert any("`topk:64/4096+int2` | 2 |" in line and "≥30× within +1.5% (2 seeds: not decided)" in line
               for line in frontier.table(rows))  # fmt: skip
    verdict = frontier.verdicts(rows)[0]
    assert "**not met**" in verdict and "`int4`" in verdict
    one_seed = frontier.summarize([r for r in results if r["seed"] == 0])
    assert frontier.verdicts(one_seed) == ["- No NoLoCo point has enough seeds (each with its NoLoCo-fp32) to decide "
                                           "a target."]  # fmt: skip


def test_overlap_cost_pairs_each_overlapped_point_with_its_blocking_twin_by_seed():
    point = "topk:64/4096+int2@outer.slow_every=8@outer.slow_stagger=true"
    assert frontier.blocking_twin(f"{point}@outer.overlap=true") == point
    assert frontier.blocking_twin(f"{point}@outer.overlap=delayed@outer.overlap_steps=5") == point
    assert frontier.blocking_twin(f"{point}@outer.overlap=false") is None and frontier.blocking_twin(point) is None
    results = [_point("noloco", point, s, loss, 0.07) for s, loss in ((0, 5.0), (1, 4.0), (2, 4.5))] + [
        _point("noloco", f"{point}@outer.overlap=true", s, loss, 0.07)
        for s, loss in ((0, 5.05), (1, 4.0), (2, 4.5), (3, 9.0))]  # seed 3 has no twin: left out  # fmt: skip
    (cost,) = frontier.overlap_costs(results)
    assert cost["twin"] == point and cost["seeds"] == 3 and cost["decided"]
    assert cost["ratio"] == pytest.approx((1.01 + 1 + 1) / 3) and cost["within"]
    lines = frontier.overlap_table([cost])
    assert lines[-1].endswith("| 3 | 1.0033 ± 0.0058 | met |")
    (costly,) = frontier.overlap_costs([*results[:3], *[{**r, "loss": r["loss"] * 1.01} for r in results[3:]]])
    assert not costly["within"] and frontier.overlap_table([costly])[-1].endswith("| not met |")
    assert frontier.overlap_costs(results[:3]) == [] and frontier.overlap_table([]) == []


def test_a_missing_reference_leaves_the_ratio_out():
    rows = frontier.summarize([_point("noloco", "int4", 0, 5.0, 0.2)], min_seeds=1)
    assert rows[0]["ratio"] is None and not rows[0]["target_30x"] and not rows[0]["decided"]
    assert "No NoLoCo point has enough seeds" in frontier.verdicts(rows)[0]
    rows = frontier.summarize([_point("noloco", "fp32", 0, 5.0, 1.6), _point("noloco", "int4", 0, 5.2, 0.2)],
                              min_seeds=1)  # fmt: skip
    assert "**not met** (the fewest bits within the loss target: `fp32`, 1.6 bits/param/step" in frontier.verdicts(
        rows)[0]  # fmt: skip


def test_points_spell_their_overrides():
    assert frontier.point_overrides("noloco", "int2@noef", "int4", 8) == [
        "outer.algo=noloco", "comm.codec=int2", "comm.error_feedback=false", "comm.slow_codec=int4",
        "outer.slow_every=8"]  # fmt: skip
    assert frontier.point_overrides("noloco", "int4@fused", "int8", 8)[-2:] == [
        "comm.slow_codec=int4",
        "outer.slow_every=1",
    ]
    assert frontier.point_overrides("noloco", "fp32", "int4", 8)[-2:] == ["comm.slow_codec=fp32", "outer.slow_every=1"]
    assert frontier.point_overrides("diloco", "int2@outer.momentum=0.5", "int4", 8) == [
        "outer.algo=diloco", "comm.codec=int2", "outer.momentum=0.5"]  # fmt: skip
    for bad in ("@noef", "int2@what", "int2@=3"):
        with pytest.raises(ValueError):
            frontier.point_overrides("noloco", bad, "int4", 8)


def test_the_plan_adds_the_reference_and_skips_unknown_codecs():
    points = [
        "int4",
        "int4@fused",
        "fp32@outer.slow_every=8",
        "int2@outer.slow_stagger=true",
        "no-such-codec",
    ]  # the NoLoCo-only ones: not DiLoCo's
    runs, skipped = frontier.plan_of(["diloco"], points, [0, 1], "int4", 4, frontier.TINY)
    assert [(r.algo, r.point, r.seed) for r in runs] == [
        ("noloco", "fp32", 0), ("noloco", "fp32", 1), ("diloco", "fp32", 0), ("diloco", "fp32", 1),
        ("diloco", "int4", 0), ("diloco", "int4", 1)]  # fmt: skip
    assert skipped == ["skipped no-such-codec: codec 'no-such-codec' is not available in this checkout"]


def test_a_point_whose_slow_codec_is_unknown_is_skipped_once():
    runs, skipped = frontier.plan_of(["noloco", "diloco"], ["fp32", "int4@comm.slow_codec=no-such-codec"], [0],
                                     "int4", 4, frontier.TINY)  # fmt: skip
    assert [(r.algo, r.point) for r in runs] == [("noloco", "fp32"), ("diloco", "fp32")]
    assert len(skipped) == 1 and skipped[0].startswith("skipped int4@comm.slow_codec=no-such-codec: comm.slow_codec=")


def test_a_redraw_reads_the_finished_runs_of_its_plan_and_the_arguments_that_ran_them(tmp_path):
    runs = [frontier.Run("noloco", "fp32", 0, ("steps=500",)), frontier.Run("noloco", "int2", 0, ("steps=500",))]
    frontier.write_plan(tmp_path, runs, "settings.", ["--tiny", "--out", "docs/results", "--codecs", "int2"])
    (tmp_path / runs[0].name).mkdir()
    (tmp_path / runs[0].name / "summary.json").write_text(json.dumps(_summary(5.0, 6.4)))  # int2 never finished
    results, machine, settings, args = frontier.from_runs(tmp_path)
    assert [(r["point"], r["loss"]) for r in results] == [("fp32", 5.0)] and settings == "settings."
    assert machine and frontier._without_out(args) == ["--tiny", "--codecs", "int2"]
