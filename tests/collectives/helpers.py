"""Shared helpers for the collectives tests."""

from __future__ import annotations

import time

import torch

from noloco.comm import LocalFabric


def gaussian_inputs(world: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(world)]


def exact_mean(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in xs]).mean(0)


def rel_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).norm() / exact.norm())


def run_collecting(world: int, fn) -> tuple[list[object], float]:
    """Run ``fn(transport)`` on every rank without aborting the fabric on failure.

    Returns each rank's result or the exception it raised, and the wall time, so a test can check
    that *every* member failed by itself (no fabric abort helps them) and how fast.
    """
    fabric = LocalFabric(world)

    def wrapped(t):
        try:
            return fn(t)
        except Exception as exc:  # noqa: BLE001 - returned for inspection
            return exc

    start = time.monotonic()
    results = fabric.run(wrapped, timeout=120)
    return results, time.monotonic() - start
