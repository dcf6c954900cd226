"""The quantized DDP comm hook, trained in 2 gloo processes against uncompressed DDP."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from noloco.collectives.ddp_hook import QuantizedHookState, quantized_allreduce_hook
from noloco.comm.torchdist import launch_local

STEPS = 60
LOSS_TOLERANCE = 0.01  # relative difference of the final training loss allowed vs uncompressed DDP


def _data(rank):
    gen = torch.Generator().manual_seed(1234)
    w_true = torch.randn(32, 4, generator=gen)
    gen.manual_seed(100 + rank)
    x = torch.randn(STEPS, 64, 32, generator=gen)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(STEPS, 64, 4, generator=gen)
    return x, y


def _train(t, mode):
    torch.manual_seed(0)  # identical initial weights on every process and in every mode
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 4)
    )
    ddp = DistributedDataParallel(model)
    state = None
    if mode != "ddp":
        codec, ef = {"fp32": ("fp32", False), "int8": ("int8", False), "int8+ef": ("int8", True)}[mode]
        state = QuantizedHookState(t, codec=codec, error_feedback=ef)
        ddp.register_comm_hook(state, quantized_allreduce_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    x, y = _data(dist.get_rank())
    before = t.counter.bytes_sent
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[step]), y[step])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    final = sum(losses[-10:]) / 10
    weights = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    return final, t.counter.bytes_sent - before, weights


def _all_modes(t):
    return {mode: _train(t, mode) for mode in ("ddp", "fp32", "int8", "int8+ef")}


def test_int8_hook_trains_like_uncompressed_ddp_with_far_fewer_gradient_bytes():
    results = launch_local(_all_modes, 2, timeout=300)
    for mode in ("ddp", "fp32", "int8", "int8+ef"):
        # replicas stay bit-identical: every process decoded the same bytes
        assert torch.equal(results[0][mode][2], results[1][mode][2])
    ddp_loss = results[0]["ddp"][0]
    fp32_loss, fp32_bytes = results[0]["fp32"][:2]
    assert abs(fp32_loss - ddp_loss) <= 1e-4 * ddp_loss + 1e-6  # same math, other summation path
    for mode in ("int8", "int8+ef"):
        loss, sent = results[0][mode][:2]
        assert abs(loss - ddp_loss) <= LOSS_TOLERANCE * ddp_loss, (mode, loss, ddp_loss)
        assert fp32_bytes / sent >= 3.5, (mode, fp32_bytes, sent)
