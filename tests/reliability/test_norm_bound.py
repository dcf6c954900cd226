"""The norm bound on peers' contributions: a peer sending huge values cannot move its partners.

At the reduction (``allreduce(..., max_norm_ratio=)``) and in training (NoLoCo over the in-process
fabric, a worker whose pseudo-gradient is scaled by 1e30 before it is sent): the honest partner ends
exactly where it would have ended alone (fp32; int4 within its quantization error), every refusal is
counted, and without the bound the same attack wrecks it.
"""

from __future__ import annotations

import pytest
import torch

from noloco.collectives import NormRejections, allreduce, segment_bounds
from noloco.comm import LocalFabric
from noloco.models.llama import LLaMA, model_config
from noloco.optim.algorithms import DEFAULT_MAX_NORM_RATIO, NoLoCo
from noloco.train.config import ConfigError, load_config

REDUCTIONS = ["two_phase", "ring", "naive_ring"]

# ----------------------------------------------------------------------------------------- allreduce


def _reduce(xs, **kw):
    rejections = [NormRejections() for _ in xs]
    outs = LocalFabric(len(xs)).run(lambda t: allreduce(xs[t.rank], t, min_compress_numel=0, tag="bound",
                                                        norm_rejections=rejections[t.rank], **kw))  # fmt: skip
    return outs, rejections


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_member_sending_1e30_values_is_dropped_and_the_others_get_their_own_mean(reduction, codec):
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(3001, generator=gen) * 1e-3 for _ in range(3)]
    xs[2] = xs[2] * 1e30
    outs, rejections = _reduce(xs, codec=codec, reduction=reduction, max_norm_ratio=10.0)
    honest_mean = (xs[0] + xs[1]) / 2
    for rank in (0, 1):
        out = outs[rank]
        assert bool(torch.isfinite(out).all()) and float(out.abs().max()) < 0.1
        assert rejections[rank].total >= 1 and set(rejections[rank].by_rank) <= {0, 1, 2}
        for start, end in segment_bounds(3001, 3):
            # each segment is the mean of a subset of the honest members (both; or one: a receiver keeps
            # its own where the attacker owns the segment, a ring hop drops partial sums through the
            # attacker): never more than this member's own bound
            candidates = [xs[0][start:end], xs[1][start:end], honest_mean[start:end]]
            closest = min(float((out[start:end] - c).norm()) for c in candidates)
            tolerance = 1e-9 if codec == "fp32" else 0.2 * float(honest_mean[start:end].norm())
            assert closest <= tolerance
            assert float(out[start:end].norm()) <= 10 * float(xs[rank][start:end].norm())
    assert rejections[2].total == 0  # the attacker admits everyone: honest values are far below its own


def test_two_phase_fp32_result_is_exact_over_the_admitted_members():
    xs = [torch.arange(12.0) + r for r in range(3)]
    xs[1] = xs[1] * 1e30
    outs, _ = _reduce(xs, codec="fp32", reduction="two_phase", max_norm_ratio=10.0)
    # member 0 owns [0, 4): it drops member 1 and averages itself with member 2; member 1's segment [4, 8)
    # is refused on receipt (member 0 keeps its own values); member 2's segment [8, 12) is member 0's and 2's mean
    expected = torch.cat([(xs[0][:4] + xs[2][:4]) / 2, xs[0][4:8], (xs[0][8:] + xs[2][8:]) / 2])
    assert torch.equal(outs[0], expected)
    assert torch.equal(outs[0][:4], outs[2][:4]) and torch.equal(outs[0][8:], outs[2][8:])  # honest owners: identical


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_honest_contributions_of_different_sizes_are_never_refused(reduction):
    gen = torch.Generator().manual_seed(2)
    scales = [1.0, 3.0, 0.4, 2.0]  # wider than measured honest spreads (<= 1.25)
    xs = [torch.randn(4000, generator=gen) * s for s in scales]
    bounded, rejections = _reduce(xs, codec="int8", reduction=reduction, max_norm_ratio=DEFAULT_MAX_NORM_RATIO)
    plain, _ = _reduce(xs, codec="int8", reduction=reduction)
    assert all(r.total == 0 for r in rejections)
    assert all(torch.equal(out, bounded[0]) for out in bounded)  # bit-identical on every member
    if reduction == "two_phase":
        assert torch.equal(bounded[0], plain[0])  # the bound changes nothing when it refuses nothing


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_zero_contributions_pass_the_floor(reduction):
    xs = [torch.zeros(500) for _ in range(3)]
    outs, rejections = _reduce(xs, codec="int4", reduction=reduction, max_norm_ratio=10.0)
    assert all(r.total == 0 for r in rejections) and all(torch.equal(out, xs[0]) for out in outs)


def test_bad_ratios_and_references_are_refused_before_sending():
    fabric = LocalFabric(2)
    for ratio in (1.0, 0.5, -1, float("inf"), float("nan"), True, "10"):
        with pytest.raises(ValueError, match="max_norm_ratio"):
            allreduce(torch.ones(4), fabric.transports[0], max_norm_ratio=ratio)
    with pytest.raises(ValueError, match="norm_reference"):
        allreduce(torch.ones(4), fabric.transports[0], max_norm_ratio=10, norm_reference=torch.ones(5))
    assert fabric.pending() == 0


@pytest.mark.parametrize("value, ok", [("10", True), ("1.5", True), ("null", True), ("1", False), ("0.5", False),
                                       ("-3", False), ("abc", False), ("true", False), ("inf", False)])  # fmt: skip
def test_comm_max_norm_ratio_is_validated(value, ok):
    if ok:
        load_config([f"comm.max_norm_ratio={value}"])
    else:
        with pytest.raises(ConfigError, match="comm.max_norm_ratio must be a number > 1"):
            load_config([f"comm.max_norm_ratio={value}"])


def test_default_ratio_matches_the_config_default():
    assert load_config([]).comm.max_norm_ratio == DEFAULT_MAX_NORM_RATIO == 10.0


# ----------------------------------------------------------------------------------------- training

MODEL = model_config("tiny", dim=32, n_layers=1, n_heads=2, vocab_size=64)


class Scaled(NoLoCo):
    """A test worker whose pseudo-gradient θ − φ is multiplied by ``scale`` before it is sent."""

    scale = 1e30

    def _exchange(self, group, fast, guarded, part=None, slow=None):
        against = (self.slow if part is None else self.slow[part]) if slow is None else slow
        return super()._exchange(group, against + self.scale * (fast - against), guarded, part, slow)


def _train(world: int, rounds: int, every: int = 3, attacker: int | None = None, **kw):
    """NoLoCo over the in-process fabric; returns (slow weights, initial slow, rejections, round infos) by rank."""

    def fn(transport):
        model = LLaMA(MODEL, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cls = Scaled if transport.rank == attacker else NoLoCo
        algo = cls(model, opt, transport, every=every, group_size=2, **kw)
        start = algo.slow_weights()
        gen = torch.Generator().manual_seed(transport.rank)
        infos = []
        for _ in range(rounds * every):
            x = torch.randint(0, 64, (2, 8), generator=gen)
            model(x, x)[1].backward()
            algo.sync_gradients()
            if (info := algo.step()) is not None:
                infos.append(info)
        return algo.slow_weights(), start, algo.norm_rejections, infos

    return LocalFabric(world).run(fn)


EXCHANGES = {
    "fp32": dict(codec="fp32", slow_codec="fp32", lr=0.7, pull=0.5),
    "int4": dict(codec="int4", slow_codec="int8", lr=0.7, pull=0.7),
    "fused-fp32": dict(codec="fp32", slow_codec="fp32", lr=0.7, pull=0.7),  # β = γ: one exchange of θ − φ_0
}


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_a_partner_sending_1e30_updates_moves_a_worker_no_more_than_its_own_update(exchange):
    kw = EXCHANGES[exchange]
    attacked = _train(2, rounds=1, attacker=1, **kw)
    alone = _train(1, rounds=1, **kw)  # what the honest worker's own update allows: a group of itself
    slow, start, rejections, infos = attacked[0]
    solo = alone[0][0]
    assert bool(torch.isfinite(slow).all()) and rejections.total >= 1 and infos[0].rejected >= 1
    assert infos[0].skipped is None
    if exchange == "int4":  # the honest owner's reduced segment still goes through int4 once
        assert float((slow - solo).norm()) <= 0.1 * float((solo - start).norm())
    else:
        assert torch.equal(slow, solo)
    assert float(attacked[1][0].abs().max()) > 1e20  # the attacker did send (and keep) huge values


def test_over_several_rounds_the_attacked_worker_stays_within_its_own_updates():
    kw = EXCHANGES["int4"]
    slow, start, rejections, infos = _train(2, rounds=3, attacker=1, **kw)[0]
    solo, solo_start, _, _ = _train(1, rounds=3, **kw)[0]
    assert bool(torch.isfinite(slow).all()) and len(infos) == 3 and rejections.total >= 3
    assert float((slow - start).norm()) <= 2 * float((solo - solo_start).norm())


def test_without_the_bound_the_same_attack_wrecks_the_partner():
    slow, _, rejections, _ = _train(2, rounds=1, attacker=1, max_norm_ratio=None, **EXCHANGES["fp32"])[0]
    assert rejections.total == 0 and float(slow.abs().max()) > 1e20
