"""N workers of one small model stepped together: parameters stacked along a worker dimension.

Every parameter of the model gets a leading dimension of size N (all workers start from the same weights); one
``torch.func.vmap`` of ``functional_call`` computes all N workers' losses in one batched graph, one backward pass
of their sum gives each worker its own gradient (the workers share no parameter), and one AdamW over the stacked
tensors steps them all. AdamW's update is elementwise, so AdamW on a stacked tensor is N independent AdamWs;
gradient clipping is not (it uses each worker's own norm) and is done per worker here.

The outer step flattens the stacked slow weights into an ``(N, P)`` matrix, forms each worker's group means
from the seeded schedule of :mod:`noloco.gossip` and hands the matrices to the library's own pure rule
(:class:`noloco.optim.NoLoCoRule`, :class:`noloco.optim.DiLoCoRule`). Those rules are elementwise in
``φ``, the means and their momentum, so one rule object applied to ``(N, P)`` matrices is the rule of each
worker applied to its row, with the momentum of all N workers in one ``(N, P)`` buffer (tested against N
separate rule objects in ``tests/sim``). NoLoCo: arXiv 2506.10911; DiLoCo: arXiv 2311.08105.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from noloco.gossip import GroupSchedule
from noloco.optim import OuterRule


class StackedWorkers:
    """N replicas of ``model`` as stacked tensors: ``params[name]`` is ``(N, *shape)``, fp32, on ``device``.

    All replicas start from ``model``'s weights (as data-parallel workers do). ``inner`` is an AdamW over the
    stacked tensors; :meth:`inner_step` runs one step of every worker on its own batch. ``chunk``: workers per
    forward and backward pass (None: all at once); the activations of one pass are what grows with N, so a
    chunk bounds the memory of N = 1,024 workers to that of ``chunk`` (the results are the same).
    """

    def __init__(self, model: nn.Module, workers: int, lr: float, weight_decay: float = 0.1,
                 grad_clip: float = 1.0, device: str | torch.device = "cpu", chunk: int | None = None):  # fmt: skip
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1 or None, got {chunk}")
        self.workers, self.grad_clip = workers, grad_clip
        self.chunk = workers if chunk is None else min(int(chunk), workers)
        # tied weights appear once in named_parameters; functional_call ties them again
        self.params = {
            name: value.detach().to(device).expand(workers, *value.shape).clone()
            for name, value in model.named_parameters()
        }
        self.buffers = {name: b.to(device) for name, b in model.named_buffers()}
        self.base = copy.deepcopy(model).to(device)  # its structure; its own weights are never read
        self.inner = torch.optim.AdamW(list(self.params.values()), lr=lr, betas=(0.9, 0.95),
                                       weight_decay=weight_decay)  # fmt: skip
        self._losses = vmap(self._loss, in_dims=(0, 0, 0))
        self._eval = vmap(self._loss, in_dims=(0, None, None))

    def _loss(self, params: dict[str, torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # the math attention backend is made of matmuls, which vmap batches; the fused kernels would run per worker
        with sdpa_kernel(SDPBackend.MATH):
            _, loss = functional_call(self.base, (params, self.buffers), (inputs, targets))
        return loss

    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One AdamW step of every worker; ``inputs``/``targets``: ``(N, batch, seq)`` int64. Returns ``(N,)`` losses.

        Each worker's gradient is clipped to ``grad_clip`` by its own global norm (as ``clip_grad_norm_`` does
        for one worker). Mutates ``params`` and the AdamW state.
        """
        # the workers are independent, so the gradient of the sum of their losses is each worker's own gradient
        # (one backward pass through the batched graph; faster here than vmap over torch.func.grad), one pass per
        # chunk of workers
        grads = {name: torch.empty_like(p) for name, p in self.params.items()}
        losses = torch.empty(self.workers, device=inputs.device)
        for a in range(0, self.workers, self.chunk):
            b = min(a + self.chunk, self.workers)
            params = {name: p[a:b].detach().requires_grad_(True) for name, p in self.params.items()}
            chunk_losses = self._losses(params, inputs[a:b], targets[a:b])
            for name, grad in zip(params, torch.autograd.grad(chunk_losses.sum(), list(params.values()))):
                grads[name][a:b] = grad
            losses[a:b] = chunk_losses.detach()
        if self.grad_clip:
            norms = torch.sqrt(sum(g.pow(2).flatten(1).sum(1) for g in grads.values()))
            scale = (self.grad_clip / (norms + 1e-6)).clamp(max=1.0)
        for name, param in self.params.items():
            grad = grads[name]
            param.grad = grad * scale.view(-1, *[1] * (grad.dim() - 1)) if self.grad_clip else grad
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        return losses.detach()

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``(N,)`` mean held-out loss of each worker on the same ``(batch, seq)`` windows (``chunk`` workers at
        a time)."""
        return torch.cat([self._eval({name: p[a : a + self.chunk] for name, p in self.params.items()}, inputs, targets)
                          for a in range(0, self.workers, self.chunk)])  # fmt: skip

    def flat(self) -> torch.Tensor:
        """All parameters of each worker as one ``(N, P)`` fp32 matrix (a copy)."""
        return torch.cat([p.detach().flatten(1) for p in self.params.values()], dim=1)

    @torch.no_grad()
    def load_flat(self, flat: torch.Tensor) -> None:
        """Copy an ``(N, P)`` matrix into the stacked parameters (inverse of :meth:`flat`)."""
        offset = 0
        for param in self.params.values():
            size = param[0].numel()
            param.copy_(flat[:, offset : offset + size].view_as(param))
            offset += size

    def num_parameters(self) -> int:
        """Parameters of one worker."""
        return sum(p[0].numel() for p in self.params.values())


def group_matrix(schedule: GroupSchedule, round_index: int) -> torch.Tensor:
    """The round's groups as an int64 ``(N / g, g)`` matrix of worker indices (rows: groups)."""
    return torch.tensor(schedule.groups(round_index), dtype=torch.int64)


def group_means(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each worker's group mean of ``values`` ``(N, P)``: row i is the mean of the rows of i's group.

    ``groups``: ``(N / g, g)`` worker indices, every worker in exactly one row. Returns a new ``(N, P)`` tensor.
    """
    means = values[groups].mean(dim=1)  # (N/g, P)
    out = torch.empty_like(values)
    out[groups.flatten()] = means.repeat_interleave(groups.shape[1], dim=0)
    return out


class StackedOuter:
    """The outer step of N stacked workers with the library's rule: slow weights ``φ`` ``(N, P)`` and one rule.

    ``schedule``: the seeded groups of :mod:`noloco.gossip` (group size = world size: everyone, as DiLoCo).
    """

    def __init__(self, rule: OuterRule, schedule: GroupSchedule, slow: torch.Tensor):
        self.rule, self.schedule = rule, schedule
        self.slow = slow.detach().clone().float()

    @torch.no_grad()
    def step(self, fast: torch.Tensor, round_index: int) -> torch.Tensor:
        """Apply round ``round_index``: ``fast`` ``(N, P)`` are the workers' θ after H inner steps.

        Mutates :attr:`slow` and the rule's momentum; returns the new ``φ`` (θ restarts from it).
        """
        groups = group_matrix(self.schedule, round_index).to(self.slow.device)
        mean_delta = group_means(fast - self.slow, groups)
        mean_slow = group_means(self.slow, groups) if self.rule.needs_slow_mean else None
        self.rule.step(self.slow, mean_delta, mean_slow)
        return self.slow


def spread(flat: torch.Tensor) -> float:
    """Spread of the workers' weights ``flat`` ``(N, P)``: ``sqrt(mean_i ‖x_i − x̄‖²)``, in float64.

    The root-mean-square distance of a worker from the workers' mean (0: all workers equal).
    """
    flat = flat.double()
    return float((flat - flat.mean(dim=0)).pow(2).sum(dim=1).mean().sqrt())


def consensus_distance(flat: torch.Tensor) -> float:
    """The consensus distance: :func:`spread` of ``flat`` ``(N, P)`` relative to the norm of the workers' mean,
    ``sqrt(mean_i ‖x_i − x̄‖²) / ‖x̄‖`` (dimensionless; 0: all workers equal)."""
    norm = float(flat.double().mean(dim=0).norm())
    return spread(flat) / max(norm, 1e-30)
