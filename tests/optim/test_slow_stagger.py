"""NoLoCo's staggered slow-weight term (``slow_stagger``, docs/design.md §3.2): the slices, the same slice and the
same decoded means on every member of a group, the same bytes every round, exact resume inside a cycle, refusals.
The update against its float64 reference (with fragments and overlap): tests/optim/test_fragments.py."""

from __future__ import annotations

import random

import pytest
import torch

from noloco.collectives import ReductionErrorFeedback
from noloco.comm import LocalFabric
from noloco.optim import NoLoCo
from noloco.optim.stagger import ALIGN, SliceFeedback, stagger_index, stagger_slices

WORKERS, EVERY, LR, N = 4, 3, 0.1, 3 * 8192  # top-k chunks of 4,096: six; three slices of 8,192
BETA, PULL, MU, SEED = 0.7, 0.7, 0.5, 5


# --- the slices ------------------------------------------------------------------------------------------------


def test_slices_cover_the_vector_in_order_non_empty_and_aligned():
    rng = random.Random()
    for _ in range(300):
        numel = rng.choice([rng.randint(1, 300), rng.randint(1, 40_000), rng.randint(1, 2_000_000)])
        k = rng.randint(1, 40)
        if numel < k:
            with pytest.raises(ValueError, match="non-empty"):
                stagger_slices(numel, k)
            continue
        parts = stagger_slices(numel, k)
        assert len(parts) == k and parts[0].start == 0 and parts[-1].stop == numel
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:])) and all(p.stop > p.start for p in parts)
        align = next(a for a in (ALIGN, 128, 1) if numel // a >= k)
        assert all(p.start % align == 0 for p in parts)
        assert all(abs((p.stop - p.start) - numel / k) < align for p in parts), (numel, k, parts)


def test_a_large_vector_is_cut_on_top_k_chunks():
    assert stagger_slices(10 * 4096 + 5, 4) == [slice(0, 8192), slice(8192, 20480), slice(20480, 28672),
                                                slice(28672, 10 * 4096 + 5)]  # fmt: skip


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_slice_count_is_refused(bad):
    with pytest.raises(ValueError, match="k >= 1"):
        stagger_slices(100, bad)


def test_the_slice_of_a_round_follows_its_cycle():
    assert [stagger_index(r, 1, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [stagger_index(r, 2, 3) for r in range(8)] == [0, 0, 1, 1, 2, 2, 0, 0]


def test_slice_feedback_reads_and_writes_its_positions_of_the_full_state():
    full = ReductionErrorFeedback(decay=0.5)
    piece = slice(3, 7)
    sliced = SliceFeedback(full, piece, 10)
    contribution, result = sliced.residuals_for(4)
    assert torch.equal(contribution, torch.zeros(4)) and torch.equal(result, torch.zeros(4))
    sliced.commit(torch.arange(4.0), -torch.arange(4.0))
    expected = torch.zeros(10)
    expected[piece] = torch.arange(4.0)
    assert torch.equal(full.contribution, expected) and torch.equal(full.result, -expected)
    contribution, _ = sliced.residuals_for(4)
    assert torch.equal(contribution, 0.5 * torch.arange(4.0))  # a copy, decayed; the state is untouched
    assert torch.equal(full.contribution, expected)
    with pytest.raises(ValueError, match="called on 5"):
        sliced.residuals_for(5)


# --- the algorithm --------------------------------------------------------------------------------------------


class Flat(torch.nn.Module):
    def __init__(self, start: torch.Tensor):
        super().__init__()
        self.a = torch.nn.Parameter(start[: N // 3].float().clone())
        self.b = torch.nn.Parameter(start[N // 3 :].float().clone())

    def flat(self) -> torch.Tensor:
        return torch.cat([self.a, self.b])


def _build(transport, start, **kw):
    model = Flat(start)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = NoLoCo(model, opt, transport, every=EVERY, timeout=10.0, lr=BETA, pull=PULL, momentum=MU, group_size=2,
                  seed=SEED, **kw)  # fmt: skip
    return model, algo


def _steps(model, algo, target, steps):
    sent = []
    for _ in range(steps):
        (0.5 * (model.flat().double() - target).pow(2).sum()).backward()
        if algo.step() is not None:
            sent.append(algo.counter.bytes_sent)
    return sent


SPARSE = dict(codec="topk:64/4096+int2", slow_codec="int4", slow_every=3, slow_stagger=True)


def test_every_member_of_a_group_pulls_on_the_same_slice_toward_the_same_mean():
    """top-k Δ, int4 slices with error feedback: in every round both members of a group decode the same
    mean_Δ and the same mean of the round's slice of φ, bit for bit, and leave the rest of φ unpulled."""
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64) * 2
    slices = stagger_slices(N, 3)

    def worker(transport):
        model, algo = _build(transport, start, **SPARSE)
        seen, exchange = [], algo._exchange

        def recording(group, fast, guarded, part=None, slow=None):
            mean_delta, mean_slow = exchange(group, fast, guarded, part, slow)
            piece = slices[group.round % 3]
            outside = torch.ones(N, dtype=torch.bool)
            outside[piece] = False
            assert torch.equal(mean_slow[outside], algo.slow[outside])  # φ itself: no pull there
            seen.append((group.round, tuple(group.members), mean_delta.clone(), mean_slow[piece].clone()))
            return mean_delta, mean_slow

        algo._exchange = recording
        _steps(model, algo, targets[transport.rank], 7 * EVERY)
        return seen

    records = LocalFabric(WORKERS).run(worker)
    compared = 0
    for r in range(7):
        by_group = {}
        for rank_records in records:
            rnd, members, mean_delta, mean_piece = rank_records[r]
            by_group.setdefault(members, []).append((mean_delta, mean_piece))
        for pairs in by_group.values():
            assert len(pairs) == 2
            assert torch.equal(pairs[0][0], pairs[1][0]) and torch.equal(pairs[0][1], pairs[1][1])
            compared += 1
    assert compared == 14


def test_every_round_sends_the_same_bytes_and_a_cycle_what_the_unstaggered_split_sends():
    """int4 Δ and int4 slices, k = 3: every round sends Δ and a third of φ − φ_0 (slices of 8,192 values: equal
    messages); over a cycle the bytes are the unstaggered split's, whose third round carries the whole term."""
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    kw = dict(codec="int4", slow_codec="int4", slow_every=3)
    staggered = LocalFabric(WORKERS).run(lambda t: _steps(*_build(t, start, slow_stagger=True, **kw), targets[t.rank],
                                                          6 * EVERY))  # fmt: skip
    split = LocalFabric(WORKERS).run(lambda t: _steps(*_build(t, start, **kw), targets[t.rank], 6 * EVERY))
    for sent, split_sent in zip(staggered, split):
        per_round = [b - a for a, b in zip([0, *sent], sent)]
        split_round = [b - a for a, b in zip([0, *split_sent], split_sent)]
        assert len(per_round) == 6 and len(set(per_round)) == 1, per_round
        delta_only, spike = min(split_round), max(split_round)  # the unstaggered split: the whole term at once
        assert per_round[0] - delta_only == pytest.approx((spike - delta_only) / 3, rel=0.01)
        assert sum(per_round) == pytest.approx(sum(split_round), rel=0.01)


def test_a_state_saved_inside_a_cycle_resumes_exactly():
    """top-k Δ and int4 slices with error feedback, k = 3: saved after round 4, loaded into fresh workers, five
    more rounds end bit-identical to the run that never stopped (the slice follows from the round's index, the
    slices' residuals are the term's one error-feedback state)."""
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    half = 5 * EVERY

    def straight(t):
        model, algo = _build(t, start, **SPARSE)
        _steps(model, algo, targets[t.rank], half + 5 * EVERY)
        return algo.slow

    def first(t):
        model, algo = _build(t, start, **SPARSE)
        _steps(model, algo, targets[t.rank], half)
        return algo.state_dict(), model.state_dict()

    saved = LocalFabric(WORKERS).run(first)
    assert saved[0][0]["slow_feedback"]["contribution"].numel() == N

    def second(t):
        model, algo = _build(t, start, **SPARSE)
        model.load_state_dict(saved[t.rank][1])
        algo.load_state_dict(saved[t.rank][0])
        _steps(model, algo, targets[t.rank], 5 * EVERY)
        return algo.slow

    for a, b in zip(LocalFabric(WORKERS).run(straight), LocalFabric(WORKERS).run(second)):
        assert torch.equal(a, b)


def test_staggering_changes_the_trajectory():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    kw = dict(codec="fp32", slow_codec="fp32", slow_every=3, max_norm_ratio=None)

    def run(stagger):
        def worker(t):
            model, algo = _build(t, start, slow_stagger=stagger, **kw)
            _steps(model, algo, targets[t.rank], 6 * EVERY)
            return algo.slow

        return LocalFabric(WORKERS).run(worker)

    assert not torch.equal(run(True)[0], run(False)[0])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(slow_stagger=True), "needs outer.slow_every > 1"),
        (dict(slow_stagger="yes", slow_every=2), "must be true or false"),
        (dict(slow_stagger=True, slow_every=2, overlap="eager"), "eager"),
    ],
)
def test_a_bad_stagger_is_refused(kw, match):
    transport = LocalFabric(1).transports[0]
    with pytest.raises(ValueError, match=match):
        _build(transport, torch.randn(N, dtype=torch.float64), **kw)


def test_more_slices_than_values_are_refused():
    transport = LocalFabric(1).transports[0]
    with pytest.raises(ValueError, match="non-empty slices"):
        _build(transport, torch.randn(N, dtype=torch.float64), slow_every=N + 1, slow_stagger=True)
