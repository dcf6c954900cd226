"""A coset code in a reduction: members whose values are close return bit-identical means, by all-gather whatever
reduction is asked, within half a grid step of the exact mean."""

import pytest
import torch

from noloco.collectives import allreduce, get_codec
from noloco.comm import LocalFabric
from noloco.quant import coset

from .helpers import exact_mean


def _close_inputs(world: int, numel: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=gen)
    return [base + 0.01 * torch.randn(numel, generator=gen) for _ in range(world)]


def _reduce(world, xs, codec, **kw):
    return LocalFabric(world).run(lambda t: allreduce(xs[t.rank], t, codec=codec, min_compress_numel=0, **kw))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_close_members_return_bit_identical_means_near_the_exact_one(world):
    numel = 1000 + world
    xs = _close_inputs(world, numel, seed=world)
    codec = get_codec("coset3").with_spread(torch.full((coset.blocks(numel),), 0.1))
    outs = _reduce(world, xs, codec)
    assert all(torch.equal(out, outs[0]) for out in outs)
    step = 2.0 ** coset.grid_exponents(xs[0], torch.full((coset.blocks(numel),), 0.1), 3, 2.0).double().max()
    assert float((outs[0].double() - exact_mean(xs)).abs().max()) <= float(step) / 2


@pytest.mark.parametrize("reduction", ["two_phase", "ring", "naive_ring"])
def test_every_reduction_runs_the_allgather(reduction):
    xs = _close_inputs(3, 700, seed=7)
    codec = get_codec("coset4").with_spread(torch.full((coset.blocks(700),), 0.1))
    asked = _reduce(3, xs, codec, reduction=reduction)
    gathered = _reduce(3, xs, codec, reduction="allgather")
    assert all(torch.equal(a, b) for a, b in zip(asked, gathered))
