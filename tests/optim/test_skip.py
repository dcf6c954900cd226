"""``OuterAlgorithm.skip_to``: a resumed swarm peer moves to its swarm's round without training the steps between,
its round's pseudo-gradient holding the steps it did train (noloco/train/backends/hivemind.py, ``peer.catch_up``)."""

from __future__ import annotations

import copy

import pytest
import torch

from noloco.comm import LocalFabric
from noloco.optim import DiLoCo

EVERY, LR = 4, 0.1


def _worker(overlap: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # outer SGD of lr 1 without momentum: φ ← φ − (φ − θ̄) = θ̄, so a round's result is the mean of what was trained
    algo = DiLoCo(model, opt, LocalFabric(1).transports[0], every=EVERY, lr=1.0, momentum=0.0, codec="fp32",
                  overlap=overlap, timeout=5.0)  # fmt: skip
    return model, algo


def _train_step(model, algo, target: torch.Tensor):
    loss = (model(torch.ones(1, 3)) - target).pow(2).sum()
    loss.backward()
    return algo.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_skip_makes_the_next_step_end_the_round_it_lies_in_with_the_steps_trained():
    model, algo = _worker()
    plain = copy.deepcopy(model)  # the same three steps without the algorithm
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
    target = torch.tensor([[1.0, -2.0]])
    for _ in range(3):
        plain_opt.zero_grad()
        (plain(torch.ones(1, 3)) - target).pow(2).sum().backward()
        plain_opt.step()
    for _ in range(2):  # two steps into round 0 (steps 1 to 4)
        assert _train_step(model, algo, target) is None
    algo.skip_to(2 * EVERY - 1)  # to step 7: the next step ends round 1; round 0 never happens
    assert algo.inner_step == 2 * EVERY - 1
    info = _train_step(model, algo, target)
    assert info is not None and info.round == 1 and info.skipped is None
    assert algo.inner_step == 2 * EVERY
    # the round's slow weights are the fast weights of the three steps trained (the mean of one worker)
    assert torch.allclose(algo.slow, _flat(plain).float(), atol=1e-6), (algo.slow, _flat(plain))
    assert torch.equal(_flat(model).float(), algo.slow)
    # and the round after it comes EVERY steps later, on the swarm's grid
    rounds = [_train_step(model, algo, target) for _ in range(EVERY)]
    assert [r is not None for r in rounds] == [False] * (EVERY - 1) + [True] and rounds[-1].round == 2


def test_a_skip_backwards_or_with_overlap_is_refused_and_changes_nothing():
    model, algo = _worker()
    _train_step(model, algo, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="behind"):
        algo.skip_to(0)
    assert algo.inner_step == 1
    algo.skip_to(1)  # where it is: allowed, nothing moves
    assert algo.inner_step == 1
    model, overlapped = _worker(overlap=True)
    assert not overlapped.can_skip
    with pytest.raises(ValueError, match="outer.overlap"):
        overlapped.skip_to(5)
    assert overlapped.inner_step == 0
