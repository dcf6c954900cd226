"""The consensus distance comes from weight sketches: close to the exact value, and no weights shipped."""

import torch

from noloco.train.run import SKETCH_BUCKETS, consensus_distance, relative_spread, weight_sketch


def _exact(slow: list[torch.Tensor]) -> float:
    stacked = torch.stack([s.double() for s in slow])
    mean = stacked.mean(0)
    return relative_spread(mean, (stacked - mean).pow(2).sum(1).mean())


def test_sketched_consensus_distance_is_within_a_few_percent_of_the_exact_one():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(2_000_000, generator=generator)
    for spread in (1e-3, 1e-2, 1e-1):
        slow = [base + spread * torch.randn(base.numel(), generator=generator) for _ in range(4)]
        assert abs(consensus_distance(slow) / _exact(slow) - 1) < 0.03


def test_a_sketch_is_linear_and_small_vectors_stay_exact():
    x, y = torch.randn(300_000, dtype=torch.float64), torch.randn(300_000, dtype=torch.float64)
    assert weight_sketch(x).numel() == SKETCH_BUCKETS
    assert torch.allclose(weight_sketch(x) - weight_sketch(y), weight_sketch(x - y), atol=1e-9)
    small = torch.randn(1000)
    assert torch.equal(weight_sketch(small), small.double())
