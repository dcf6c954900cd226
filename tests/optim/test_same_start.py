"""Workers of one group start from the same weights, whatever each thread built (README, "As a library")."""

import threading

import pytest
import torch

from noloco.comm import LocalFabric
from noloco.optim import DDP, DiLoCo, NoLoCo


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo, DDP])
def test_replicas_built_from_the_global_rng_start_from_rank_0s_weights(cls):
    def worker(transport):
        torch.manual_seed(100 + transport.rank)  # every thread builds other weights, as MyModel() would
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        algo = cls(model, opt, transport, **({} if cls is DDP else {"every": 5}))
        before = algo.counter.bytes_sent
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(), before

    results = LocalFabric(4).run(worker)
    for weights, sent in results:
        assert torch.equal(weights, results[0][0])
        assert sent == 0  # the start-up agreement is not training traffic


def test_check_mode_refuses_different_starting_weights_with_a_clear_error():
    def worker(transport):
        torch.manual_seed(transport.rank)
        model = _model()
        NoLoCo(model, torch.optim.AdamW(model.parameters()), transport, every=5, same_start="check")

    with pytest.raises(ValueError, match="starts from other weights than rank 0"):
        LocalFabric(2).run(worker)


def test_equal_starting_weights_pass_unchanged():
    build = threading.Lock()  # the global generator is shared by the threads: seed and build in one go

    def worker(transport):
        with build:
            torch.manual_seed(7)
            model = _model()
        expected = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        NoLoCo(model, torch.optim.AdamW(model.parameters()), transport, every=5, same_start="check")
        return torch.equal(expected, torch.nn.utils.parameters_to_vector(model.parameters()))

    assert all(LocalFabric(2).run(worker))
