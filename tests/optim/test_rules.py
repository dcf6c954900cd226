import pytest
import torch

from noloco.optim import AveragingRule, DiLoCoRule, NoLoCoRule


def test_noloco_update_matches_float64_hand_computation():
    gen = torch.Generator().manual_seed(0)
    n, beta, gamma, mu = 1000, 0.7, 0.3, 0.5
    slow = torch.randn(n, generator=gen, dtype=torch.float64)
    rule = NoLoCoRule(lr=beta, pull=gamma, momentum=mu)
    phi32 = slow.float().clone()
    m = torch.zeros(n, dtype=torch.float64)
    phi = slow.clone()
    for _ in range(3):
        mean_delta = torch.randn(n, generator=gen, dtype=torch.float64)
        mean_slow = phi + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
        rule.step(phi32, mean_delta.float(), mean_slow.float())
        m = mu * m + beta * mean_delta + gamma * (mean_slow - phi)
        phi = phi + m
    assert torch.allclose(phi32.double(), phi, atol=1e-5, rtol=1e-5)


def test_noloco_with_equal_lr_and_pull_depends_only_on_mean_fast_weights():
    gen = torch.Generator().manual_seed(1)
    phi = torch.randn(50, generator=gen)
    mean_fast = torch.randn(50, generator=gen)
    mean_slow = torch.randn(50, generator=gen)
    a, b = NoLoCoRule(0.7, 0.7, 0.0), NoLoCoRule(0.7, 0.7, 0.0)
    split, fused = phi.clone(), phi.clone()
    a.step(split, mean_fast - mean_slow, mean_slow)  # β·mean_Δ + γ·(mean_φ − φ)
    b.step(fused, mean_fast - phi, phi.clone())  # β·(mean_θ − φ)
    assert torch.allclose(split, fused, atol=1e-6)


def test_diloco_matches_torch_sgd_nesterov():
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(100, generator=gen)
    param = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    rule, slow = DiLoCoRule(lr=0.7, momentum=0.9), start.clone()
    for _ in range(4):
        mean_delta = torch.randn(100, generator=gen)
        param.grad = -mean_delta.clone()
        sgd.step()
        rule.step(slow, mean_delta, None)
    assert torch.allclose(slow, param.detach(), atol=1e-6)


def test_averaging_sets_slow_weights_to_mean_fast_weights():
    slow = torch.tensor([1.0, 2.0])
    AveragingRule().step(slow, torch.tensor([0.5, -1.0]), None)
    assert slow.tolist() == [1.5, 1.0]


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(pull=-0.1), dict(momentum=-0.5)])
def test_noloco_rejects_negative_coefficients(kwargs):
    with pytest.raises(ValueError):
        NoLoCoRule(**kwargs)


def test_rule_state_round_trips():
    rule = NoLoCoRule()
    slow = torch.zeros(4)
    rule.step(slow, torch.ones(4), torch.zeros(4))
    other = NoLoCoRule()
    other.load_state_dict(rule.state_dict())
    a, b = slow.clone(), slow.clone()
    rule.step(a, torch.ones(4), torch.zeros(4))
    other.step(b, torch.ones(4), torch.zeros(4))
    assert torch.equal(a, b)
