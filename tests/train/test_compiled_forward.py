"""K models of one structure share one compiled graph (noloco.train.device.CompiledForward), here on the CPU."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from noloco.train.device import CompiledForward


class _Scaled(torch.nn.Module):
    """A layer with a buffer, like the model's rotary tables: the case that used to compile a second graph."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.linear(x) * self.scale


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(_Scaled(), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_models_of_one_structure_share_a_graph_and_match_eager_forward_and_backward():
    models = [_model(0), _model(1)]
    forwards = [CompiledForward(m) for m in models]
    assert forwards[0].compiled is forwards[1].compiled  # compiled once for both
    x = torch.randn(4, 8)
    graphs = counters["stats"]["unique_graphs"]
    for model, forward in zip(models, forwards):
        out = forward(x)
        assert torch.allclose(out, model(x), atol=1e-6)  # each with its own weights
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), grads))
    # one dynamo graph for both workers: the template owns none of their tensors, so nothing guards on identity
    assert counters["stats"]["unique_graphs"] - graphs == 1
    with torch.no_grad():  # weights written in place (an AdamW or outer step, a checkpoint load) are seen
        models[0][0].linear.weight.add_(1.0)
    assert torch.allclose(forwards[0](x), models[0](x), atol=1e-6)
