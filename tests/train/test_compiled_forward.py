"""K models of one structure share one compiled graph (noloco.train.device.CompiledForward), here on the CPU."""

from __future__ import annotations

import torch

from noloco.train.device import CompiledForward


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_models_of_one_structure_share_a_graph_and_match_eager_forward_and_backward():
    models = [_model(0), _model(1)]
    forwards = [CompiledForward(m) for m in models]
    assert forwards[0].compiled is forwards[1].compiled  # compiled once for both
    x = torch.randn(4, 8)
    for model, forward in zip(models, forwards):
        out = forward(x)
        assert torch.allclose(out, model(x), atol=1e-6)  # each with its own weights
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), grads))
    with torch.no_grad():  # weights written in place (an AdamW or outer step, a checkpoint load) are seen
        models[0][0].weight.add_(1.0)
    assert torch.allclose(forwards[0](x), models[0](x), atol=1e-6)
