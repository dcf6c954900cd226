"""The coset code of ``benchmarks.slow_term``: the partners' pulls always sum to zero, and they are exact on the grid
wherever the difference fits in the code's range."""

from __future__ import annotations

import torch

from benchmarks.slow_term import coset_means, pow2_ceil


def test_coset_pulls_cancel_and_are_exact_within_the_range():
    gen = torch.Generator().manual_seed(0)
    xi = torch.randn(64, 128, generator=gen) * 10  # far from zero: the progress φ − φ₀
    for bits in (2, 3, 4):
        half = (2**bits - 1) // 2
        for spread in (0.01, 0.1, 1.0):
            xj = xi + torch.randn(64, 128, generator=gen) * spread
            grid = pow2_ceil((xi - xj).abs().amax(1, keepdim=True) / half)
            mi, mj, wrapped = coset_means(xi, xj, grid, bits)
            # the pulls (mean − own) of the two members sum to minus their own rounding errors only
            qi, qj = torch.round(xi / grid) * grid, torch.round(xj / grid) * grid
            assert torch.allclose((mi - qi) + (mj - qj), torch.zeros_like(xi), atol=1e-5)
            fits = (qj - qi).abs() <= half * grid
            assert torch.equal(mi[fits], ((qi + qj) / 2)[fits]) and torch.equal(mj[fits], mi[fits])
            assert not wrapped[fits].any()
            # a grid sized from the largest difference leaves nothing outside, up to rounding at the edge
            assert wrapped.float().mean() < 0.01
    small = pow2_ceil(torch.tensor([[1e-3]]))
    assert small.item() == 2.0**-9  # the next power of two up
