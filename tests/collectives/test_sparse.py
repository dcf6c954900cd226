"""Sparse and low-bit codecs in reductions: bit-identical groups, the all-gather path, the rings' refusal."""

import pytest
import torch

from noloco.collectives import ReductionErrorFeedback, allreduce, get_codec
from noloco.comm import LocalFabric

from .helpers import exact_mean, gaussian_inputs, rel_error

SPARSE = ["topk:8/256+int2", "topk:8/256+dct+int2", "topk:16/256+sign", "topk:4/64+fp32", "topk:8/256+int4:g64"]
LOW_BIT = ["int2", "int3", "sign"]


def _reduce(world, xs, **kw):
    return LocalFabric(world).run(lambda t: allreduce(xs[t.rank], t, min_compress_numel=0, **kw))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("reduction", ["two_phase", "allgather"])
@pytest.mark.parametrize("codec", SPARSE + LOW_BIT)
def test_every_member_returns_a_bit_identical_result(codec, reduction, world):
    xs = gaussian_inputs(world, 1000 + world, seed=world)
    outs = _reduce(world, xs, codec=codec, reduction=reduction)
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert rel_error(outs[0], exact_mean(xs)) < 1.0


def test_allgather_sums_every_members_decoded_message_in_member_order():
    xs = gaussian_inputs(3, 700, seed=1)
    codec = get_codec("topk:8/256+int2")
    outs = _reduce(3, xs, codec=codec, reduction="allgather", op="sum")
    expect = torch.zeros(700)
    for x in xs:
        expect += codec.decode(codec.encode(x), 700)
    assert torch.equal(outs[0], expect)


def test_two_members_with_a_sparse_codec_run_the_allgather():
    xs = gaussian_inputs(2, 600, seed=2)
    two_phase = _reduce(2, xs, codec="topk:8/256+int2")
    gather = _reduce(2, xs, codec="topk:8/256+int2", reduction="allgather")
    assert torch.equal(two_phase[0], gather[0])
    three = _reduce(3, gaussian_inputs(3, 600, seed=2), codec="topk:8/256+int2")  # n = 3 stays two-phase
    assert not torch.equal(
        three[0], _reduce(3, gaussian_inputs(3, 600, seed=2), codec="topk:8/256+int2", reduction="allgather")[0]
    )


@pytest.mark.parametrize("reduction", ["ring", "naive_ring"])
def test_rings_refuse_sparse_codecs_before_sending(reduction):
    fabric = LocalFabric(2)

    def run(t):
        with pytest.raises(ValueError, match="cannot carry the sparse codec"):
            allreduce(torch.randn(5000), t, codec="topk:8/256+int2", reduction=reduction)
        return fabric.pending()

    assert fabric.run(run) == [0, 0]  # nothing was sent


@pytest.mark.parametrize("reduction", ["two_phase", "allgather"])
@pytest.mark.parametrize("codec", ["topk:8/256+int2", "sign", "int2"])
def test_error_feedback_over_many_calls_tracks_the_sum_of_means(codec, reduction):
    world, numel, calls = 2, 512, 200
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(numel, generator=gen) for _ in range(world)] for _ in range(calls)]
    efs = [ReductionErrorFeedback() for _ in range(world)]

    def run(t):
        total = torch.zeros(numel)
        for c in range(calls):
            total += allreduce(
                inputs[c][t.rank],
                t,
                codec=codec,
                reduction=reduction,
                min_compress_numel=0,
                error_feedback=efs[t.rank],
                tag=f"ef/{c}",
            )
        return total

    outs = LocalFabric(world).run(run, timeout=300)
    exact = sum(torch.stack(xs).mean(0) for xs in inputs)
    gap = float((outs[0] - exact).norm())
    residual = sum(float(ef.contribution.norm() + ef.result.norm()) for ef in efs)
    assert torch.equal(outs[0], outs[1])
    assert gap <= residual + 1e-3  # what is missing from the running sum is what the residuals still hold
    assert residual < 20 * numel**0.5  # bounded: a leak would grow with the number of calls


def test_device_path_refuses_sparse_codecs_before_any_collective():
    from noloco.collectives import allreduce_device

    with pytest.raises(ValueError, match="does not carry the sparse codec"):
        allreduce_device(torch.randn(5000), codec="topk:8/256+int2")  # no process group needed: refused first
