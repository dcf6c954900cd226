"""NoLoCo's slow-weight term through a coset code (``comm.slow_codec=coset3``, docs/design.md §3.2): fewer bytes than
int4, grids learned from the last exchange, exact resume, and the refusals."""

from __future__ import annotations

import pytest
import torch

# the flat two-parameter model of the staggered slow term's tests, and its outer settings (group of 2, μ = 0.5)
from test_slow_stagger import EVERY, WORKERS, N, _build, _steps  # tests/optim is on the path

from noloco.comm import LocalFabric
from noloco.optim import NoLoCo
from noloco.optim.spread import UNKNOWN, SpreadHistory
from noloco.state import StateError

COSET = dict(codec="topk:64/4096+int2", slow_codec="coset3", slow_every=3, slow_stagger=True)


def test_a_cycle_sends_fewer_bytes_than_int4_and_learns_every_blocks_spread():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)

    def worker(kw):
        def run(t):
            model, algo = _build(t, start, **kw)
            sent = _steps(model, algo, targets[t.rank], 6 * EVERY)
            return sent[-1], algo.slow_spread

        return run

    coset = LocalFabric(WORKERS).run(worker(COSET))
    int4 = LocalFabric(WORKERS).run(worker({**COSET, "slow_codec": "int4"}))
    for (coset_bytes, spread), (int4_bytes, none) in zip(coset, int4):
        assert none is None and coset_bytes < int4_bytes
        assert bool((spread.blocks >= 0).all())  # every block exchanged at least once: a distance is known
        assert float(spread.blocks.max()) > 0


def test_a_state_saved_inside_a_cycle_resumes_exactly_with_its_grids():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    half = 4 * EVERY

    def straight(t):
        model, algo = _build(t, start, **COSET)
        _steps(model, algo, targets[t.rank], half + 4 * EVERY)
        return algo.slow

    def first(t):
        model, algo = _build(t, start, **COSET)
        _steps(model, algo, targets[t.rank], half)
        state = algo.state_dict()
        NoLoCo.check_state(state, N)
        return state, model.state_dict()

    saved = LocalFabric(WORKERS).run(first)
    assert bool((saved[0][0]["slow_spread"]["blocks"] >= 0).any())

    def second(t):
        model, algo = _build(t, start, **COSET)
        model.load_state_dict(saved[t.rank][1])
        algo.load_state_dict(saved[t.rank][0])
        _steps(model, algo, targets[t.rank], 4 * EVERY)
        return algo.slow

    for a, b in zip(LocalFabric(WORKERS).run(straight), LocalFabric(WORKERS).run(second)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "blocks, match",
    [
        (torch.zeros(3), "shape"),
        (torch.full((N // 128,), -2.0), "negative"),
        (torch.zeros(N // 128, dtype=torch.float64), "dtype"),
    ],
)
def test_a_bad_spread_history_is_refused(blocks, match):
    with pytest.raises(StateError, match=match):
        SpreadHistory.check_state({"version": 1, "blocks": blocks, "ratio": UNKNOWN}, N)
    with pytest.raises(StateError, match="spread history"):
        SpreadHistory.check_state({"version": 1, "blocks": blocks}, N)


@pytest.mark.parametrize("ratio", [-0.5, float("nan"), float("inf"), True, "0.3", None])
def test_a_bad_ratio_is_refused(ratio):
    with pytest.raises(StateError, match="ratio"):
        SpreadHistory.check_state({"version": 1, "blocks": torch.zeros(N // 128), "ratio": ratio}, N)


def test_the_history_reads_the_blocks_a_slice_overlaps():
    history = SpreadHistory(1000)
    assert torch.isnan(history.spread_for(slice(0, 300))).all()
    history.update(slice(100, 400), torch.zeros(300), torch.arange(300.0) / 100, members=2, step=torch.zeros(300))
    assert history.blocks[0] == 2 * 27 / 100 and history.blocks[3] == 2 * 2.99 and history.blocks[4] == UNKNOWN
    spread = history.spread_for(slice(200, 460))  # the slice's blocks from 200 overlap history blocks 1-2, 2-3, 3
    assert spread.tolist() == pytest.approx([2 * 2.83, 2 * 2.99, 2 * 2.99])


def test_a_block_never_exchanged_is_guessed_from_the_ratio_of_those_that_were():
    history = SpreadHistory(1024)
    own = torch.zeros(512)
    own[::128] = 10.0  # each block's largest value: 10
    mean = own + torch.linspace(0, 2, 512)  # distances up to 2 × 2: blocks' ratios 0.1 .. 0.4
    history.update(slice(0, 512), own, mean, members=2, step=torch.zeros(512))
    assert history.ratio == pytest.approx(float(torch.quantile(history.blocks[:4].double() / 10, 0.9)))
    values = torch.zeros(512)
    values[::128] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    spread = history.spread_for(slice(512, 1024), values)
    assert spread.tolist() == pytest.approx([history.ratio * v for v in (1, 2, 3, 4)])
    assert torch.isnan(SpreadHistory(1024).spread_for(slice(0, 512), values)).all()  # no ratio yet: no guess


def test_the_coding_noise_is_taken_out_of_a_measured_distance():
    history = SpreadHistory(256)
    history.update(slice(0, 256), torch.zeros(256), torch.full((256,), 0.5), members=2, step=torch.full((256,), 0.25))
    assert history.blocks.tolist() == [0.5, 0.5]  # 2 × 0.5 seen, less two steps of 0.25
    history.update(slice(0, 256), torch.zeros(256), torch.full((256,), 0.1), members=2, step=torch.full((256,), 0.25))
    assert history.blocks.tolist() == [0.0, 0.0]  # all of it noise


def test_a_coset_code_for_the_pseudo_gradient_is_refused():
    with pytest.raises(ValueError, match="slow-weight term"):
        LocalFabric(2).run(lambda t: _build(t, torch.zeros(N), codec="coset3"))
