"""Overlapped outer steps (``overlap=True``): the one-round-delayed rule, its speed, and failures in flight."""

from __future__ import annotations

import time

import pytest
import torch

from noloco.comm import LocalFabric
from noloco.comm.base import Transport
from noloco.optim import DiLoCo, NoLoCo

TARGETS = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-1.0, 0.0, 2.5, -0.5]], dtype=torch.float64)
START = torch.tensor([0.2, 0.1, -0.3, 0.4], dtype=torch.float64)
LR, EVERY, STEPS, BETA, MU = 0.1, 3, 12, 0.7, 0.5


def _train(transport: Transport, overlap: bool, wrap=None, step_seconds: float = 0.0, cls=NoLoCo, **kw):
    """Worker ``rank`` pulls w toward its target with plain SGD (loss ½‖w − t‖²); returns its final w and slow."""
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(START.float())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    transport = wrap(transport) if wrap else transport
    options = dict(lr=BETA, pull=BETA, group_size=2) if cls is NoLoCo else {}
    algo = cls(model, opt, transport, every=EVERY, momentum=MU, overlap=overlap, timeout=2.0, **options, **kw)
    for step in range(1, STEPS + 1):
        loss = 0.5 * (model.weight.double().reshape(-1) - TARGETS[transport.rank]).pow(2).sum()
        loss.backward()
        time.sleep(step_seconds)  # stands in for compute
        algo.step()
        if step == STEPS:
            algo.finish()
    return model.weight.detach().double().reshape(-1).clone(), algo.slow.double().clone()


def _reference() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rule of OuterAlgorithm._overlapped_round in float64, both workers in lockstep (β = γ, one group)."""
    theta = [START.clone(), START.clone()]
    slow = [START.clone(), START.clone()]
    momentum = [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
    pending = None  # (snapshots, mean of the snapshots)
    for step in range(1, STEPS + 1):
        theta = [w - LR * (w - t) for w, t in zip(theta, TARGETS)]
        if step % EVERY == 0:
            if pending is not None:
                snapshots, mean = pending
                for i in range(2):
                    momentum[i] = MU * momentum[i] + BETA * (mean - slow[i])
                    slow[i] = slow[i] + momentum[i]
                    theta[i] = slow[i] + (theta[i] - snapshots[i])
                pending = None
            if step % EVERY == 0 and step < STEPS:
                pending = ([w.clone() for w in theta], (theta[0] + theta[1]) / 2)
            elif step % EVERY == 0:  # the last round's exchange is sent, then applied by finish()
                snapshots, mean = [w.clone() for w in theta], (theta[0] + theta[1]) / 2
                for i in range(2):
                    momentum[i] = MU * momentum[i] + BETA * (mean - slow[i])
                    slow[i] = slow[i] + momentum[i]
                    theta[i] = slow[i] + (theta[i] - snapshots[i])
    return list(zip(theta, slow))


def test_overlapped_noloco_follows_the_one_round_delayed_rule_of_its_float64_reference():
    results = LocalFabric(2).run(lambda t: _train(t, overlap=True, codec="fp32"))
    for (theta, slow), (ref_theta, ref_slow) in zip(results, _reference()):
        assert torch.allclose(theta, ref_theta, atol=1e-5) and torch.allclose(slow, ref_slow, atol=1e-5)


def test_overlap_changes_the_trajectory_from_the_blocking_one():
    blocking = LocalFabric(2).run(lambda t: _train(t, overlap=False, codec="fp32"))
    overlapped = LocalFabric(2).run(lambda t: _train(t, overlap=True, codec="fp32"))
    assert not torch.allclose(blocking[0][1], overlapped[0][1])


class SlowLink(Transport):
    """Every message leaves ``delay`` seconds late (a slow link), as seen by its sender."""

    def __init__(self, inner: Transport, delay: float):
        self.inner, self.delay = inner, delay
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter

    def send(self, dst: int, tag: str, payload: bytes) -> None:
        if tag.startswith("outer/"):
            time.sleep(self.delay)
        self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout: float) -> bytes:
        return self.inner.recv(src, tag, timeout)


@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo])
def test_overlapped_training_over_a_slow_link_finishes_sooner_than_blocking(cls):
    def wall(overlap: bool) -> float:
        started = time.perf_counter()
        LocalFabric(2).run(lambda t: _train(t, overlap, wrap=lambda x: SlowLink(x, 0.1), step_seconds=0.05, cls=cls,
                                            codec="int8"))  # fmt: skip
        return time.perf_counter() - started

    blocking, overlapped = wall(False), wall(True)
    # 4 rounds: blocking pays compute (0.15 s) + exchange (2 messages, 0.2 s) per round; overlapped about max of both
    assert overlapped < 0.8 * blocking, (overlapped, blocking)


class DeadLink(Transport):
    """Rank 1's outer messages of round 1 are lost (a peer that died mid-exchange, as its partner sees it)."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter

    def send(self, dst: int, tag: str, payload: bytes) -> None:
        if not (self.rank == 1 and tag.startswith("outer/r1/")):
            self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout: float) -> bytes:
        return self.inner.recv(src, tag, timeout)


def test_a_dead_peer_during_an_exchange_in_flight_costs_at_most_the_timeout():
    started = time.perf_counter()
    results = LocalFabric(2).run(lambda t: _train(t, overlap=True, wrap=DeadLink, codec="fp32"))
    assert time.perf_counter() - started < 2.0 * 2 + 3.0  # the timeout (2 s) once or twice, not more
    for theta, slow in results:
        assert torch.isfinite(theta).all() and torch.isfinite(slow).all()
