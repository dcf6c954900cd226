import pytest
import torch

from noloco.collectives import HEADER_BYTES, PayloadMismatch, allreduce, segment_bounds
from noloco.comm import CommError, CommTimeout, LocalFabric


def _inputs(world, numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 16, 32])
@pytest.mark.parametrize("numel", [0, 1, 5, 1000])
def test_fp32_two_phase_mean_is_exact_and_bit_identical(world, numel):
    xs = _inputs(world, numel, seed=world * 1000 + numel)
    outs = LocalFabric(world).run(lambda t: allreduce(xs[t.rank], t, op="mean"))
    expected = torch.stack([x.double() for x in xs]).mean(0)
    for out in outs:
        assert torch.equal(out, outs[0])
        assert torch.allclose(out.double(), expected, atol=1e-6)


def test_subgroup_reduction_leaves_other_ranks_alone_and_sum_op_works():
    xs = _inputs(4, 10)

    def fn(t):
        group = [0, 2] if t.rank in (0, 2) else [1, 3]
        return allreduce(xs[t.rank], t, group=group, op="sum")

    outs = LocalFabric(4).run(fn)
    assert torch.allclose(outs[0], xs[0] + xs[2]) and torch.equal(outs[0], outs[2])
    assert torch.allclose(outs[1], xs[1] + xs[3])


def test_bytes_per_member_match_theory():
    world, numel = 4, 1000
    fabric = LocalFabric(world)
    xs = _inputs(world, numel)
    fabric.run(lambda t: allreduce(xs[t.rank], t))
    # each member sends (n-1) of n segments twice: 2 (n-1)/n * 4 bytes * numel, plus one
    # protocol header per message (numel, codec, op, round... checked by the receiver)
    for t in fabric.transports:
        assert t.counter.bytes_sent == 2 * (world - 1) * ((numel // world) * 4 + HEADER_BYTES)


def test_segments_cover_the_vector():
    for numel in (0, 1, 7, 100):
        for parts in (1, 3, 8):
            bounds = segment_bounds(numel, parts)
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_shape_and_shape_preserved():
    xs = [torch.ones(3, 4) * r for r in range(2)]
    outs = LocalFabric(2).run(lambda t: allreduce(xs[t.rank], t))
    assert outs[0].shape == (3, 4) and torch.allclose(outs[0], torch.full((3, 4), 0.5))


def test_dead_member_makes_others_raise_within_timeout():
    fabric = LocalFabric(3)
    x = torch.ones(100)
    errors = []

    def fn(t):
        if t.rank == 2:
            return None  # never shows up
        try:
            allreduce(x, t, timeout=0.3)
        except CommTimeout as exc:
            errors.append(exc)

    fabric.run(fn)
    assert len(errors) == 2


def test_mis_sized_payload_is_rejected():
    xs = [torch.ones(10), torch.ones(12)]

    def fn(t):
        return allreduce(xs[t.rank], t, timeout=2.0)

    with pytest.raises((PayloadMismatch, CommError)):
        LocalFabric(2).run(fn)


def test_bad_arguments_fail_before_sending():
    t = LocalFabric(2).transports[0]
    with pytest.raises(ValueError):
        allreduce(torch.ones(2), t, group=[1])
    with pytest.raises(ValueError):
        allreduce(torch.ones(2), t, op="max")
    with pytest.raises(TypeError):
        allreduce(torch.ones(2, dtype=torch.int64), t)
    assert t.counter.bytes_sent == 0
