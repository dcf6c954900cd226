"""benchmarks.compare without training: entries with per-entry overrides, run names, time to a target loss."""

from __future__ import annotations

import pytest

from benchmarks import compare


def test_plain_entries_give_the_same_overrides_as_before():
    assert compare.parse_entry("noloco") == ["outer.algo=noloco"]
    assert compare.parse_entry("ddp/fp32") == ["outer.algo=ddp", "comm.codec=fp32"]
    assert compare.parse_entry("noloco/int4/int8") == ["outer.algo=noloco", "comm.codec=int4", "comm.slow_codec=int8"]
    assert compare.parse_entry("noloco/int4:g64") == ["outer.algo=noloco", "comm.codec=int4:g64"]


def test_key_value_parts_after_the_codecs_are_overrides_of_that_entry():
    assert compare.parse_entry("diloco/int4/outer.momentum=0.5") == [
        "outer.algo=diloco", "comm.codec=int4", "outer.momentum=0.5"]  # fmt: skip
    assert compare.parse_entry("noloco/int4/int8/outer.lr=0.9/outer.pull=0.9") == [
        "outer.algo=noloco", "comm.codec=int4", "comm.slow_codec=int8", "outer.lr=0.9", "outer.pull=0.9"]  # fmt: skip
    # overrides without a codec keep the default codec
    assert compare.parse_entry("noloco/outer.every=10") == ["outer.algo=noloco", "outer.every=10"]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("nolcoo/int4", "not an algorithm"),
        ("steps=300", "after --"),  # a common override typed among the entries
        ("noloco/int4/int8/fp32", "at most two"),
        ("noloco/outer.lr=0.9/int4", "codecs come first"),
        ("noloco//int4", "empty part"),
        ("noloco/int4/=0.9", "empty part"),
    ],
)
def test_a_bad_entry_is_refused_with_one_line_naming_it(entry, says):
    with pytest.raises(ValueError, match=says) as caught:
        compare.parse_entry(entry)
    assert entry in str(caught.value) and "\n" not in str(caught.value)


def test_run_names_are_plain_folder_names():
    assert compare.run_name("noloco/int4/int8") == "noloco-int4-int8"
    assert compare.run_name("noloco/int4:g64") == "noloco-int4g64"
    assert compare.run_name("noloco/int4/outer.lr=0.9") == "noloco-int4-outer.lr-0.9"


def test_reach_interpolates_between_evaluations_and_says_when_never_reached():
    points = [(0, 0.0, 0.0, 8.0), (10, 10.0, 100.0, 6.0), (20, 30.0, 300.0, 5.0)]
    assert compare.reach(points, 8.0) == (0, 0.0, 0.0)
    assert compare.reach(points, 7.0) == pytest.approx((5.0, 5.0, 50.0))
    assert compare.reach(points, 5.5) == pytest.approx((15.0, 20.0, 200.0))
    assert compare.reach(points, 5.0) == pytest.approx((20.0, 30.0, 300.0))
    assert compare.reach(points, 4.9) is None
    assert compare.reach([], 5.0) is None
    # a loss that rises again after reaching the target: the first crossing counts
    assert compare.reach([(0, 0.0, 0.0, 6.0), (10, 1.0, 1.0, 4.0), (20, 2.0, 2.0, 7.0)], 5.0)[0] == pytest.approx(5.0)


def test_figures_hold_at_most_ten_lines_split_evenly_and_repeat_the_first_entry():
    assert compare.figures(3) == [[0, 1, 2]]
    assert compare.figures(10) == [list(range(10))]
    assert compare.figures(11) == [[0, 1, 2, 3, 4, 5], [0, 6, 7, 8, 9, 10]]
    for entries in range(11, 40):
        chunks = compare.figures(entries)
        assert all(len(c) <= 10 and c[0] == 0 for c in chunks)
        assert [i for c in chunks for i in c[1:]] == list(range(1, entries))  # each once, in order
        assert max(map(len, chunks)) - min(map(len, chunks)) <= 1
        assert len(chunks) == -(-(entries - 1) // 9)  # the fewest figures


def test_a_redrawn_run_is_named_by_its_seed_overlap_rule_and_fragments(tmp_path):
    from omegaconf import OmegaConf

    from noloco.train.config import load_config

    for overrides, entry in [
        ([], "noloco/int4"),
        (["outer.overlap=true"], "noloco/int4/outer.overlap=true"),
        (["outer.overlap=delayed", "outer.fragments=4"], "noloco/int4/outer.overlap=delayed/outer.fragments=4"),
        (["outer.momentum=0.2", "outer.overlap=eager"], "noloco/int4/outer.momentum=0.2/outer.overlap=eager"),
        (["outer.overlap=true", "run.seed=2"], "noloco/int4/run.seed=2/outer.overlap=true"),  # a seed study
    ]:
        run_dir = tmp_path / "-".join(overrides or ["plain"])
        run_dir.mkdir()
        (run_dir / "summary.json").write_text('{"algo": "noloco", "codec": "int4", "slow_codec": null}')
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(load_config(overrides)))
        assert compare.entry_of_run(run_dir) == entry


def test_a_top_k_codec_keeps_its_slash_in_method_spellings():
    from benchmarks import common, overlap_fleet, throttled

    assert common.split_method("noloco/topk:64/4096+int2/outer.overlap=true") == [
        "noloco", "topk:64/4096+int2", "outer.overlap=true"]  # fmt: skip
    assert compare.parse_entry("noloco/topk:64/4096+int2/int4")[1:] == [
        "comm.codec=topk:64/4096+int2", "comm.slow_codec=int4"]  # fmt: skip
    assert throttled.method_overrides("noloco/topk:64/4096+int2/outer.slow_every=8")[:2] == [
        "outer.algo=noloco", "comm.codec=topk:64/4096+int2"]  # fmt: skip
    assert overlap_fleet.blocking_of("noloco/topk:64/4096+int2/outer.overlap=true") == "noloco/topk:64/4096+int2"


def test_the_default_title_names_the_budget_and_an_earlier_report_is_not_overwritten(tmp_path):
    assert compare.report_title(None, []) == compare.TITLE
    assert compare.report_title(None, ["steps=300"]) == "Algorithm comparison with steps=300"
    assert compare.report_title("Mine", ["steps=300"]) == "Mine"
    assert compare.report_name(None, tmp_path, "20261204-070000") == "compare"
    (tmp_path / "compare.md").write_text("an earlier report")
    assert compare.report_name(None, tmp_path, "20261204-070000") == "compare-20261204-070000"
    assert compare.report_name("codecs", tmp_path, "20261204-070000") == "codecs"
    docs = tmp_path / "docs" / "results"
    docs.mkdir(parents=True)
    (docs / "compare.md").write_text("the committed report")
    assert compare.report_name(None, docs, "20261204-070000") == "compare"  # --out docs/results rewrites it
