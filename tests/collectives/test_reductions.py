import pytest
import torch

from noloco.collectives import allreduce, get_codec, partial_sum_codec
from noloco.comm import LocalFabric

from .helpers import exact_mean, gaussian_inputs, rel_error

REDUCTIONS = ["two_phase", "ring", "naive_ring"]
CODECS = [
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int4",
    "mxfp4",
    "mxfp6",
    "mxfp8",
    "int4:g64:sym",
    "int8:stochastic",
    "int4+hadamard",
]


def _reduce(world, xs, **kw):
    return LocalFabric(world).run(lambda t: allreduce(xs[t.rank], t, min_compress_numel=0, **kw))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("codec", CODECS)
def test_every_member_returns_a_bit_identical_result(reduction, codec):
    world = 3
    xs = gaussian_inputs(world, 777, seed=len(codec))
    outs = _reduce(world, xs, codec=codec, reduction=reduction)
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert rel_error(outs[0], exact_mean(xs)) < 0.35


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("world", [2, 5, 32])
def test_fp32_sum_path_is_exact(reduction, world):
    # small integers: every fp32 partial sum is exact, whatever the order
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randint(-1000, 1000, (123,), generator=gen).float() for _ in range(world)]
    outs = _reduce(world, xs, codec="fp32", reduction=reduction, op="sum")
    expected = torch.stack(xs).sum(0)
    assert all(torch.equal(out, expected) for out in outs)


@pytest.mark.parametrize("reduction", ["ring", "naive_ring"])
@pytest.mark.parametrize("numel", [0, 1, 5])
def test_rings_handle_tiny_and_empty_vectors(reduction, numel):
    xs = gaussian_inputs(4, numel)
    outs = _reduce(4, xs, codec="int4", reduction=reduction)
    assert all(torch.equal(out, outs[0]) and out.shape == (numel,) for out in outs)


def test_quantized_reduction_over_32_members_is_bit_identical():
    world = 32
    xs = gaussian_inputs(world, 32 * 256, seed=3)
    for reduction in ("two_phase", "ring"):
        outs = _reduce(world, xs, codec="int8", reduction=reduction)
        assert all(torch.equal(out, outs[0]) for out in outs)
        assert rel_error(outs[0], exact_mean(xs)) < 0.02


def _error(world, reduction, codec="int4", numel=8192, seed=0):
    xs = gaussian_inputs(world, numel, seed=seed)
    return rel_error(_reduce(world, xs, codec=codec, reduction=reduction)[0], exact_mean(xs))


def test_two_phase_error_does_not_grow_with_group_size():
    small, large = _error(2, "two_phase"), _error(32, "two_phase")
    assert large < 1.25 * small


def test_ring_beats_naive_ring_and_naive_ring_grows_with_hops():
    ring16, naive16 = _error(16, "ring"), _error(16, "naive_ring")
    naive2, two16 = _error(2, "naive_ring"), _error(16, "two_phase")
    assert ring16 < naive16
    assert ring16 < 1.3 * two16
    assert naive16 > 1.8 * naive2


def test_partial_sum_format_widens_with_contributors():
    int4 = get_codec("int4")
    assert partial_sum_codec(int4, 1, naive=False) is int4
    assert partial_sum_codec(int4, 2, naive=False).name == "int8"
    assert partial_sum_codec(int4, 30, naive=True) is int4
    assert [partial_sum_codec(get_codec("mxfp4"), c, naive=False).name for c in (1, 3, 400, 5000, 6000)] == [
        "mxfp4",
        "int8",
        "int8",
        "bf16",
        "fp32",
    ]
