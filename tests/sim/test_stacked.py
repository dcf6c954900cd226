"""Stacked workers: the vmapped inner step and the stacked outer step equal the per-worker library code."""

from __future__ import annotations

import pytest
import torch

from noloco.gossip import GroupSchedule
from noloco.models.llama import LLaMA, model_config
from noloco.optim import DiLoCoRule, NoLoCoRule
from noloco.sim.consensus import averaging_rounds, large_n_rounds
from noloco.sim.stacked import StackedOuter, StackedWorkers, consensus_distance, group_means, spread


def _reference_outer(rules, slow, fast, groups):
    """Per worker: its own rule object on its own 1-D slow weights, group means summed in float64."""
    out = slow.clone()
    for members in groups:
        mean_delta = (fast[members].double() - slow[members].double()).mean(0).float()
        mean_slow = slow[members].double().mean(0).float()
        for i in members:
            row = out[i].clone()
            rules[i].step(row, mean_delta, mean_slow if rules[i].needs_slow_mean else None)
            out[i] = row
    return out


@pytest.mark.parametrize("method", ["noloco-g2", "noloco-g4", "diloco"])
def test_stacked_outer_step_equals_the_library_rule_on_each_worker(method):
    workers, size = 8, 4000
    group = {"noloco-g2": 2, "noloco-g4": 4, "diloco": None}[method]
    make = (lambda: NoLoCoRule(lr=0.7, pull=0.6, momentum=0.5)) if group else (lambda: DiLoCoRule())
    generator = torch.Generator().manual_seed(1)
    slow = torch.randn(workers, size, generator=generator)
    schedule = GroupSchedule(workers, group, seed=3)
    stacked = StackedOuter(make(), schedule, slow)
    rules = [make() for _ in range(workers)]
    reference = slow.clone()
    for r in range(5):  # several rounds: the momentum of each worker carries over
        fast = stacked.slow + 0.1 * torch.randn(workers, size, generator=generator)
        got = stacked.step(fast.clone(), r).clone()
        reference = _reference_outer(rules, reference, fast, schedule.groups(r))
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stacked.rule.velocity, torch.stack([rule.velocity for rule in rules]),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


def test_group_means_put_each_groups_mean_on_its_members():
    values = torch.arange(12.0).view(6, 2)
    groups = torch.tensor([[0, 5], [1, 2], [3, 4]])
    means = group_means(values, groups)
    assert means[0].tolist() == means[5].tolist() == [5.0, 6.0]
    assert means[1].tolist() == means[2].tolist() == [3.0, 4.0]
    assert means[3].tolist() == means[4].tolist() == [7.0, 8.0]


def test_vmapped_inner_step_equals_each_worker_trained_alone():
    cfg = model_config("tiny", dim=16, n_layers=1, n_heads=2, vocab_size=300, max_seq_len=16)
    model = LLaMA(cfg, seed=0)
    workers = 3
    stack = StackedWorkers(model, workers, lr=1e-2, grad_clip=0.05)  # a low clip: every worker is clipped
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (2, workers, 2, 9), generator=generator)
    replicas = [LLaMA(cfg, seed=0) for _ in range(workers)]
    optimizers = [torch.optim.AdamW(r.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1) for r in replicas]
    for step in range(2):
        x, y = tokens[step, ..., :-1], tokens[step, ..., 1:]
        losses = stack.inner_step(x, y)
        for i, (replica, opt) in enumerate(zip(replicas, optimizers)):
            _, loss = replica(x[i], y[i])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(replica.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            assert abs(float(loss) - float(losses[i])) < 1e-5
    for i, replica in enumerate(replicas):
        for name, param in replica.named_parameters():
            if name in stack.params:
                # Adam turns gradients near zero into whole steps of either sign: a tolerance of 5% of a step (lr)
                torch.testing.assert_close(stack.params[name][i], param.detach(), rtol=1e-3, atol=5e-4)
    flat = stack.flat()
    assert flat.shape == (workers, replicas[0].num_parameters())
    stack.load_flat(flat * 0 + 1)
    assert all(bool((p == 1).all()) for p in stack.params.values())


def test_chunked_passes_give_the_same_steps_and_losses_as_one_pass():
    """Workers in chunks of 2 (of 5: chunks 2, 2, 1) train and evaluate exactly as in one batched pass."""
    cfg = model_config("tiny", dim=16, n_layers=1, n_heads=2, vocab_size=300, max_seq_len=16)
    tokens = torch.randint(0, 300, (2, 5, 2, 9), generator=torch.Generator().manual_seed(1))
    whole = StackedWorkers(LLaMA(cfg, seed=0), 5, lr=1e-2)
    chunked = StackedWorkers(LLaMA(cfg, seed=0), 5, lr=1e-2, chunk=2)
    for step in range(2):
        x, y = tokens[step, ..., :-1], tokens[step, ..., 1:]
        torch.testing.assert_close(chunked.inner_step(x, y), whole.inner_step(x, y), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.flat(), whole.flat(), rtol=1e-5, atol=1e-6)
    x, y = tokens[0, 0, :, :-1], tokens[0, 0, :, 1:]
    torch.testing.assert_close(chunked.eval_loss(x, y), whole.eval_loss(x, y), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        StackedWorkers(LLaMA(cfg, seed=0), 5, lr=1e-2, chunk=0)


def test_consensus_distance_is_zero_for_equal_workers_and_scale_free():
    same = torch.ones(4, 10)
    assert consensus_distance(same) == 0.0
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) + 3
    assert consensus_distance(3 * x) == pytest.approx(consensus_distance(x), rel=1e-6)
    two = torch.tensor([[0.0, 0.0], [2.0, 0.0]])  # mean (1, 0); each worker 1 away
    assert spread(two) == pytest.approx(1.0)


def test_pure_pair_averaging_shrinks_the_spread_as_predicted():
    # one round of pairs with pull γ: each worker's distance to its pair mean shrinks by (1 − γ); in expectation the
    # squared spread is multiplied by 1 − γ + γ²/2 for large N, so about 15 rounds for 100× at γ = 0.7
    assert large_n_rounds(0.7) == pytest.approx(15.17, abs=0.01)
    counts = [averaging_rounds(256, 2, 0.7, seed=s) for s in range(3)]
    assert all(15 <= c <= 17 for c in counts), counts
    small = [averaging_rounds(8, 2, 0.7, seed=s) for s in range(6)]
    assert all(c is not None and 8 <= c <= 16 for c in small), small
    assert sum(small) / len(small) < sum(counts) / len(counts)  # fewer rounds at small N
    # γ = 1 in a world of 2: one round makes both equal
    assert averaging_rounds(2, 2, 1.0) == 1
    # groups of 4 mix faster than pairs
    assert averaging_rounds(256, 4, 0.7) < averaging_rounds(256, 2, 0.7)


@pytest.mark.gpu
def test_stacked_workers_on_a_gpu_match_the_cpu():
    cfg = model_config("tiny", dim=16, n_layers=1, n_heads=2, vocab_size=300, max_seq_len=16)
    tokens = torch.randint(0, 300, (4, 2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for device in ("cpu", "cuda"):
        stack = StackedWorkers(LLaMA(cfg, seed=0), 4, lr=1e-3, device=device)
        outer = StackedOuter(NoLoCoRule(), GroupSchedule(4, 2, seed=0), stack.flat())
        stack.inner_step(tokens[..., :-1].to(device), tokens[..., 1:].to(device))
        stack.load_flat(outer.step(stack.flat(), 0))
        results.append(stack.flat().cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-3, atol=1e-4)
