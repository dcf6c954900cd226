"""NoLoCo's slow-weight term sent every k-th cycle of rounds (``slow_every=k``, docs/design.md §3.2): the update
against its float64 reference, the bytes of each round, that the split exchange is never fused, resume."""

from __future__ import annotations

import pytest
import torch

from noloco.comm import LocalFabric
from noloco.gossip import random_groups
from noloco.optim import DiLoCo, NoLoCo

WORKERS, EVERY, STEPS, LR, N = 4, 3, 36, 0.1, 12000  # 12 rounds; segments of 6000 values are compressed
BETA, PULL, MU, SEED = 0.7, 0.7, 0.5, 5


class Flat(torch.nn.Module):
    def __init__(self, start: torch.Tensor):
        super().__init__()
        self.a = torch.nn.Parameter(start[: N // 3].float().clone())
        self.b = torch.nn.Parameter(start[N // 3 :].float().clone())

    def flat(self) -> torch.Tensor:
        return torch.cat([self.a, self.b])


def _build(transport, start, cls=NoLoCo, **kw):
    model = Flat(start)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    own = dict(lr=BETA, momentum=MU)
    if cls is NoLoCo:
        own.update(pull=PULL, group_size=2, seed=SEED)
    return model, cls(model, opt, transport, every=EVERY, timeout=5.0, **own, **kw)


def _steps(model, algo, target, steps):
    rounds = []
    for _ in range(steps):
        (0.5 * (model.flat().double() - target).pow(2).sum()).backward()
        if algo.step() is not None:
            rounds.append(algo.counter.bytes_sent)
    return rounds


def _train(transport, start, targets, **kw):
    model, algo = _build(transport, start, **kw)
    sent = _steps(model, algo, targets[transport.rank], STEPS)
    return algo.slow.double(), sent


def _reference(start, targets, k: int) -> list[torch.Tensor]:
    """NoLoCo of docs/design.md §3.1 in float64, with the pull term γ·(mean_φ − φ_i) applied in rounds r with
    r mod k = k − 1 only (one fragment), the momentum and β·mean_Δ every round."""
    theta = [start.float().double().clone() for _ in range(WORKERS)]
    slow = [t.clone() for t in theta]
    velocity = [torch.zeros(N, dtype=torch.float64) for _ in range(WORKERS)]
    for step in range(1, STEPS + 1):
        theta = [w - LR * (w - t) for w, t in zip(theta, targets)]
        if step % EVERY:
            continue
        r = step // EVERY - 1
        new = [s.clone() for s in slow]
        for group in random_groups(WORKERS, 2, SEED, r):
            mean_delta = sum(theta[j] - slow[j] for j in group) / len(group)
            mean_slow = sum(slow[j] for j in group) / len(group)
            for i in group:
                pull = PULL * (mean_slow - slow[i]) if r % k == k - 1 else 0
                velocity[i] = MU * velocity[i] + BETA * mean_delta + pull
                new[i] = slow[i] + velocity[i]
        slow = new
        theta = [s.clone() for s in slow]
    return slow


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_pull_comes_every_kth_round_as_the_float64_reference_says(k):
    start = torch.randn(N, dtype=torch.float64)
    targets = torch.randn(WORKERS, N, dtype=torch.float64) * 2
    results = LocalFabric(WORKERS).run(lambda t: _train(t, start, targets, codec="fp32", slow_every=k,
                                                        max_norm_ratio=None))  # fmt: skip
    for rank, ((slow, _), ref) in enumerate(zip(results, _reference(start, targets, k))):
        assert torch.allclose(slow, ref, atol=1e-5), (rank, (slow - ref).abs().max())


def test_skipping_the_pull_changes_the_trajectory():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    one = _reference(start, targets, 1)[0]
    assert not torch.allclose(one, _reference(start, targets, 3)[0])


def test_rounds_without_the_slow_term_send_the_pseudo_gradient_alone():
    """int4 for both terms, k = 3: rounds 2, 5, 8, 11 carry Δ and φ − φ_0 (twice a Δ-only round's bytes); with
    k = 1 the exchange is fused, one int4 message of θ − φ_0 per round, the bytes of a Δ-only round."""
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    split = LocalFabric(WORKERS).run(lambda t: _train(t, start, targets, codec="int4", slow_every=3))
    fused = LocalFabric(WORKERS).run(lambda t: _train(t, start, targets, codec="int4"))
    for (_, sent), (_, fused_sent) in zip(split, fused):
        per_round = [b - a for a, b in zip([0, *sent], sent)]
        fused_round = [b - a for a, b in zip([0, *fused_sent], fused_sent)]
        delta_only = per_round[0]
        assert per_round == [2 * delta_only if r % 3 == 2 else delta_only for r in range(len(per_round))]
        assert fused_round == [delta_only] * len(per_round)


def test_a_slow_codec_of_its_own_carries_the_slow_term():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    results = LocalFabric(WORKERS).run(lambda t: _train(t, start, targets, codec="int4", slow_codec="int8",
                                                        slow_every=2))  # fmt: skip
    for _, sent in results:
        per_round = [b - a for a, b in zip([0, *sent], sent)]
        assert per_round[1] > per_round[0] * 2  # Δ at int4 plus φ − φ_0 at int8
        assert per_round[::2] == [per_round[0]] * 6


def test_diloco_ignores_the_slow_term_and_sends_delta_at_its_codec():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    results = LocalFabric(WORKERS).run(lambda t: _train(t, start, targets, cls=DiLoCo, codec="int4"))
    for _, sent in results:
        per_round = [b - a for a, b in zip([0, *sent], sent)]
        assert len(set(per_round)) == 1 and per_round[0] > 0


def test_slow_every_and_slow_codec_default_by_the_codec():
    """Null (None) keys: the fused exchange at 4 bits and above; below, Δ alone through the codec every round and
    φ − φ_0 at int4 one round in 8. Explicit values are kept; DiLoCo has no slow term to split."""
    transport = LocalFabric(1).transports[0]
    start = torch.randn(N, dtype=torch.float64)
    for codec, every, slow, fused in (("int4", 1, "int4", True), ("fp32", 1, "fp32", True),
                                      ("int2", 8, "int4", False), ("topk:64/4096+int2", 8, "int4", False)):  # fmt: skip
        algo = _build(transport, start, codec=codec)[1]
        assert (algo.slow_every, algo.slow_codec.name, algo._fused_exchange()) == (every, slow, fused), codec
    algo = _build(transport, start, codec="int2", slow_every=1)[1]
    assert (algo.slow_every, algo.slow_codec.name, algo._fused_exchange()) == (1, "int4", False)
    algo = _build(transport, start, codec="int2", slow_codec="int3", slow_every=4)[1]
    assert (algo.slow_every, algo.slow_codec.name) == (4, "int3")
    algo = _build(transport, start, cls=DiLoCo, codec="int2")[1]
    assert (algo.slow_every, algo.slow_codec.name) == (1, "int2")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_slow_every_is_refused(bad):
    transport = LocalFabric(1).transports[0]
    with pytest.raises(ValueError, match="slow_every"):
        _build(transport, torch.randn(N, dtype=torch.float64), slow_every=bad)


def test_a_state_saved_inside_a_cycle_resumes_exactly():
    """int4 with error feedback and k = 3: saved after round 4 (inside the second cycle), loaded into fresh
    workers, six more rounds end bit-identical to the run that never stopped."""
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    kw = dict(codec="int4", slow_every=3)
    half = 5 * EVERY

    def straight(t):
        model, algo = _build(t, start, **kw)
        _steps(model, algo, targets[t.rank], half + 6 * EVERY)
        return algo.slow

    def first(t):
        model, algo = _build(t, start, **kw)
        _steps(model, algo, targets[t.rank], half)
        return algo.state_dict(), model.state_dict()

    saved = LocalFabric(WORKERS).run(first)

    def second(t):
        model, algo = _build(t, start, **kw)
        model.load_state_dict(saved[t.rank][1])
        algo.load_state_dict(saved[t.rank][0])
        _steps(model, algo, targets[t.rank], 6 * EVERY)
        return algo.slow

    for a, b in zip(LocalFabric(WORKERS).run(straight), LocalFabric(WORKERS).run(second)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo])
def test_the_error_feedback_decay_reaches_every_residual_and_changes_the_trajectory(cls):
    """``comm.error_feedback_decay`` → ``error_feedback_decay``: every residual (Δ, φ − φ_0, each fragment) decays
    by it, and where a message is compressed a decay below 1 gives another trajectory than keeping the whole error."""
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    extra = dict(slow_codec="int4", slow_every=2) if cls is NoLoCo else {}

    def run(decay):
        def worker(transport):
            model, algo = _build(transport, start, cls=cls, codec="int2", error_feedback_decay=decay, **extra)
            feedbacks = [f for fragment in algo.fragment_states for f in fragment.feedbacks if f is not None]
            assert feedbacks and {f.decay for f in feedbacks} == {decay}
            _steps(model, algo, targets[transport.rank], STEPS)
            return algo.slow.double()

        return LocalFabric(WORKERS).run(worker)

    kept, decayed = run(1.0), run(0.5)
    if cls is NoLoCo:  # DiLoCo's four segments of 3,000 values here travel exact (small messages), no residual
        assert not torch.equal(kept[0], decayed[0])
    with pytest.raises(ValueError, match="decay"):
        LocalFabric(WORKERS).run(lambda t: _build(t, start, cls=cls, codec="int2", error_feedback_decay=1.5))
