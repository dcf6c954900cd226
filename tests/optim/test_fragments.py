"""Streamed fragments (``fragments=k``): the split, the per-fragment rule against its float64 reference, bytes
per exchange, error feedback per fragment, and exact resume from a state with an exchange in flight."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from noloco.collectives import NormRejections, ReductionErrorFeedback, allreduce
from noloco.comm import LocalFabric
from noloco.gossip import random_groups
from noloco.optim import DiLoCo, NoLoCo, NoLoCoRule, PeriodicAveraging
from noloco.optim.fragments import BALANCE, fragment_sizes, split_fragments
from noloco.optim.stagger import stagger_slices

# --- the split ---------------------------------------------------------------------------------------------


def _covers_in_order(parts: list[slice], total: int) -> bool:
    return parts[0].start == 0 and parts[-1].stop == total and all(a.stop == b.start for a, b in zip(parts, parts[1:]))


def test_fragments_cover_every_parameter_exactly_once_in_order_on_random_shapes():
    rng = random.Random()
    for _ in range(50):
        shapes = [tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(4, 30))]
        total = sum(torch.Size(s).numel() for s in shapes)
        rows = sum(s[0] for s in shapes)
        for k in range(1, min(rows, 9) + 1):
            parts = split_fragments(shapes, k)
            assert len(parts) == k and _covers_in_order(parts, total), (shapes, k, parts)
            assert all(p.stop > p.start for p in parts)


@pytest.mark.parametrize("k", [2, 4, 5])
def test_fragment_sizes_on_the_default_model_are_within_20_percent(k):
    from noloco.models.llama import LLaMA, model_config

    with torch.device("meta"):
        model = LLaMA(model_config("tiny", vocab_size=2048), seed=0)
    sizes = fragment_sizes(split_fragments([p.shape for p in model.parameters()], k))
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    assert max(sizes) <= BALANCE * min(sizes), sizes


def test_whole_tensors_are_kept_together_when_they_balance():
    shapes = [(6,), (2, 3), (6,), (3, 2)]
    assert split_fragments(shapes, 2) == [slice(0, 12), slice(12, 24)]
    assert split_fragments(shapes, 4) == [slice(0, 6), slice(6, 12), slice(12, 18), slice(18, 24)]


def test_a_huge_embedding_is_cut_between_its_rows():
    shapes = [(1000, 8), (8,), (8, 8), (8,)]  # the embedding holds 98% of the parameters
    parts = split_fragments(shapes, 4)
    sizes = fragment_sizes(parts)
    assert max(sizes) <= BALANCE * min(sizes), sizes
    assert all(p.start % 8 == 0 for p in parts)  # every cut falls on a row boundary of the embedding


def test_more_fragments_than_rows_is_refused():
    with pytest.raises(ValueError, match="too few rows"):
        split_fragments([(2, 3), (1,)], 4)


# --- the rule against its float64 reference -----------------------------------------------------------------

WORKERS, EVERY, STEPS, LR = 4, 4, 16, 0.1
SHAPES = [(6,), (2, 3), (6,), (3, 2)]  # 24 parameters; fragments of whole tensors for k = 2 and 4
N = 24
BETA, PULL, MU = 0.7, 0.5, 0.5


class Params(torch.nn.Module):
    def __init__(self, start: torch.Tensor, shapes=SHAPES):
        super().__init__()
        tensors, offset = [], 0
        for shape in shapes:
            n = torch.Size(shape).numel()
            tensors.append(torch.nn.Parameter(start[offset : offset + n].float().reshape(shape).clone()))
            offset += n
        self.tensors = torch.nn.ParameterList(tensors)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.tensors])


def _build(cls, transport, start, k, overlap, shapes=SHAPES, **kw):
    model = Params(start, shapes)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"noloco": dict(lr=BETA, pull=PULL, momentum=MU, group_size=2, seed=3),
               "diloco": dict(lr=BETA, momentum=MU), "avg": {}}[cls.name]  # fmt: skip
    algo = cls(model, opt, transport, every=EVERY, fragments=k, overlap=overlap, timeout=5.0, **options, **kw)
    return model, opt, algo


def _inner(model, target):
    loss = 0.5 * (model.flat().double() - target).pow(2).sum()
    loss.backward()


def _train(cls, transport, start, targets, k, overlap, **kw):
    model, _, algo = _build(cls, transport, start, k, overlap, **kw)
    for _ in range(STEPS):
        _inner(model, targets[transport.rank])
        algo.step()
    algo.finish()
    return model.flat().detach().double(), algo.slow.double()


def _reference(name: str, start, targets, k: int, overlap: bool | str, slow_every: int = 1, stagger: bool = False):
    """The fragment rule of docs/design.md §3.1 in float64, all workers in lockstep.

    Exchange q (q = 0, 1, ...) ends step (q + 1)·H/k and carries fragment (q + 1) mod k; NoLoCo draws its
    groups for exchange q. Blocking: the update is applied at once. Delayed: it is applied at the next
    exchange (or after the last step), keeping the fragment's progress made meanwhile. Eager: each exchange
    applies at once its own share w = 1/n of its means and its partners' share of the fragment's last means
    that arrived (the means less w of its own); after the last step each fragment's partners' share left is
    applied with no progress of its own, the fragment's θ − φ kept on top. Provisional: θ starts from the step
    the rule would take with this worker's own Δ as the mean (no pull, the momentum not kept); at the next
    exchange φ takes the real step and θ the difference between the two.
    """
    period = EVERY // k
    parts = [slice(j * N // k, (j + 1) * N // k) for j in range(k)]
    share = 1 / (2 if name == "noloco" else WORKERS)
    start = start.float().double()
    theta = [start.clone() for _ in range(WORKERS)]
    slow = [start.clone() for _ in range(WORKERS)]
    velocity = [torch.zeros(N, dtype=torch.float64) for _ in range(WORKERS)]
    pending = None  # (part, snapshots, means per worker, slow weights sent against)
    partners = [{} for _ in range(WORKERS)]  # eager: fragment -> (partners' Δ-share, partners' φ-share)

    def means(q: int, part: slice, fast: list[torch.Tensor]):
        groups = random_groups(WORKERS, 2, 3, q) if name == "noloco" else [list(range(WORKERS))]
        pulls = (q // k) % slow_every == slow_every - 1  # outer.slow_every: else each worker's own φ, no pull
        # outer.slow_stagger: every cycle pulls on its slice (cycle mod slow_every) of the fragment, nowhere else
        piece = stagger_slices(part.stop - part.start, slow_every)[(q // k) % slow_every] if stagger else None
        out = [None] * WORKERS
        for group in groups:
            mean_delta = sum(fast[j] - slow[j][part] for j in group) / len(group)
            mean_slow = sum(slow[j][part] for j in group) / len(group)
            for i in group:
                own = slow[i][part].clone()
                if piece is not None:
                    own[piece] = mean_slow[piece]
                out[i] = (mean_delta, mean_slow if pulls and piece is None else own)
        return out

    def apply(part: slice, i: int, mean_delta, mean_slow):
        if name == "noloco":
            velocity[i][part] = MU * velocity[i][part] + BETA * mean_delta + PULL * (mean_slow - slow[i][part])
            slow[i][part] = slow[i][part] + velocity[i][part]
        elif name == "diloco":
            grad = -mean_delta
            velocity[i][part] = MU * velocity[i][part] + grad
            slow[i][part] = slow[i][part] - BETA * (grad + MU * velocity[i][part])
        else:
            slow[i][part] = slow[i][part] + mean_delta

    def provisional(part: slice, i: int, own_delta) -> torch.Tensor:  # the rule's step with own Δ, on copies
        if name == "noloco":
            return slow[i][part] + MU * velocity[i][part] + BETA * own_delta
        if name == "diloco":
            return slow[i][part] - BETA * (-own_delta + MU * (MU * velocity[i][part] - own_delta))
        return slow[i][part] + own_delta

    def merge():
        part, snapshots, result, sent_slow = pending
        for i in range(WORKERS):
            if overlap == "provisional":
                start = provisional(part, i, snapshots[i] - slow[i][part])
                apply(part, i, *result[i])
                theta[i][part] = theta[i][part] + (slow[i][part] - start)
                continue
            if overlap == "eager":  # the partners' share: the means less this worker's own w
                mean_delta, mean_slow = result[i]
                own_delta = snapshots[i] - sent_slow[i]
                partners[i][part.start] = (mean_delta - share * own_delta, mean_slow - share * sent_slow[i])
                continue
            apply(part, i, *result[i])
            theta[i][part] = slow[i][part] + (theta[i][part] - snapshots[i])

    def eager(part: slice, i: int, own_delta):
        zero = torch.zeros(part.stop - part.start, dtype=torch.float64)
        others = partners[i].pop(part.start, (zero, (1 - share) * slow[i][part]))
        apply(part, i, others[0] + share * own_delta, others[1] + share * slow[i][part])

    for step in range(1, STEPS + 1):
        theta = [w - LR * (w - t) for w, t in zip(theta, targets)]
        if step % period:
            continue
        q = step // period - 1
        part = parts[(q + 1) % k]
        if overlap:
            if pending is not None:
                merge()
            snapshots = [w[part].clone() for w in theta]
            pending = (part, snapshots, means(q, part, snapshots), [w[part].clone() for w in slow])
            if overlap == "eager":
                for i in range(WORKERS):
                    eager(part, i, snapshots[i] - slow[i][part])
                    theta[i][part] = slow[i][part].clone()
            elif overlap == "provisional":
                for i in range(WORKERS):
                    theta[i][part] = provisional(part, i, snapshots[i] - slow[i][part])
        else:
            result = means(q, part, [w[part] for w in theta])
            for i in range(WORKERS):
                apply(part, i, *result[i])
                theta[i][part] = slow[i][part].clone()
    if pending is not None:
        merge()
    for part in parts if overlap == "eager" else []:
        for i in range(WORKERS):
            if part.start in partners[i]:
                progress = theta[i][part] - slow[i][part]
                eager(part, i, torch.zeros(part.stop - part.start, dtype=torch.float64))
                theta[i][part] = slow[i][part] + progress
    return list(zip(theta, slow))


@pytest.mark.parametrize("overlap", [False, "delayed", "eager", "provisional"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo, PeriodicAveraging])
def test_each_fragment_follows_the_rule_of_its_float64_reference(cls, k, overlap):
    start = torch.randn(N, dtype=torch.float64)
    targets = torch.randn(WORKERS, N, dtype=torch.float64) * 2
    # no norm bound: the reference has none (6-value fragments make per-segment norms of one or two values)
    results = LocalFabric(WORKERS).run(lambda t: _train(cls, t, start, targets, k, overlap, codec="fp32",
                                                        max_norm_ratio=None))  # fmt: skip
    for rank, ((theta, slow), (ref_theta, ref_slow)) in enumerate(zip(results, _reference(cls.name, start, targets,
                                                                                       k, overlap))):  # fmt: skip
        assert torch.allclose(theta, ref_theta, atol=1e-5), (rank, theta - ref_theta)
        assert torch.allclose(slow, ref_slow, atol=1e-5), (rank, slow - ref_slow)


@pytest.mark.parametrize("overlap", [False, "delayed", "provisional"])
@pytest.mark.parametrize("k", [1, 2])
def test_the_slow_term_every_second_cycle_follows_its_float64_reference(k, overlap):
    """outer.slow_every=2: the pull in every second cycle of k exchanges only; blocking and the overlap rules that
    leave φ alone until the means land (eager is refused)."""
    start = torch.randn(N, dtype=torch.float64)
    targets = torch.randn(WORKERS, N, dtype=torch.float64) * 2
    results = LocalFabric(WORKERS).run(lambda t: _train(NoLoCo, t, start, targets, k, overlap, codec="fp32",
                                                        max_norm_ratio=None, slow_every=2))  # fmt: skip
    reference = _reference("noloco", start, targets, k, overlap, slow_every=2)
    for rank, ((theta, slow), (ref_theta, ref_slow)) in enumerate(zip(results, reference)):
        assert torch.allclose(theta, ref_theta, atol=1e-5), (rank, theta - ref_theta)
        assert torch.allclose(slow, ref_slow, atol=1e-5), (rank, slow - ref_slow)
    assert not torch.allclose(reference[0][1], _reference("noloco", start, targets, k, overlap)[0][1])


@pytest.mark.parametrize("overlap", [False, "delayed", "provisional"])
@pytest.mark.parametrize("k", [1, 2])
def test_the_staggered_slow_term_follows_its_float64_reference(k, overlap):
    """outer.slow_stagger with slow_every=3: each cycle of k exchanges pulls on its third of each fragment only;
    blocking and the overlap rules that leave φ alone until the means land, as the unstaggered split."""
    start = torch.randn(N, dtype=torch.float64)
    targets = torch.randn(WORKERS, N, dtype=torch.float64) * 2
    results = LocalFabric(WORKERS).run(
        lambda t: _train(
            NoLoCo, t, start, targets, k, overlap, codec="fp32", max_norm_ratio=None, slow_every=3, slow_stagger=True
        )
    )
    reference = _reference("noloco", start, targets, k, overlap, slow_every=3, stagger=True)
    for rank, ((theta, slow), (ref_theta, ref_slow)) in enumerate(zip(results, reference)):
        assert torch.allclose(theta, ref_theta, atol=1e-5), (rank, theta - ref_theta)
        assert torch.allclose(slow, ref_slow, atol=1e-5), (rank, slow - ref_slow)
    assert not torch.allclose(reference[0][1], _reference("noloco", start, targets, k, overlap, slow_every=3)[0][1])


def test_the_slow_term_every_kth_round_refuses_the_eager_overlap():
    transport = LocalFabric(1).transports[0]
    with pytest.raises(ValueError, match="does not run with outer.overlap=eager"):
        _build(NoLoCo, transport, torch.randn(N, dtype=torch.float64), 1, "eager", slow_every=2)


def test_fragments_change_the_trajectory():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    one = LocalFabric(WORKERS).run(lambda t: _train(NoLoCo, t, start, targets, 1, False, codec="fp32"))
    four = LocalFabric(WORKERS).run(lambda t: _train(NoLoCo, t, start, targets, 4, False, codec="fp32"))
    assert not torch.allclose(one[0][1], four[0][1])


def test_a_fragment_count_that_does_not_divide_every_is_refused():
    with pytest.raises(ValueError, match="does not divide outer.every=4"):
        LocalFabric(1).run(lambda t: _build(NoLoCo, t, torch.zeros(N), 3, False))


# --- one fragment is today's exchange, bit for bit ----------------------------------------------------------


def _unfragmented_replay(transport, start, targets):
    """NoLoCo's blocking outer step as it was before fragments (β = γ: one fused int4 exchange of θ − φ₀ with
    error feedback), written out with the collective and the rule directly."""
    model = Params(start)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rule, feedback, rejections = NoLoCoRule(BETA, BETA, MU), ReductionErrorFeedback(), NormRejections()
    reference = model.flat().detach().float().clone()
    slow = reference.clone()
    for step in range(1, STEPS + 1):
        _inner(model, targets[transport.rank])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % EVERY == 0:
            r = step // EVERY - 1
            group = [g for g in random_groups(WORKERS, 2, 3, r) if transport.rank in g][0]
            fast = model.flat().detach().float()
            mean = reference + allreduce(fast - reference, transport, group, codec="int4", timeout=5.0,
                                         tag=f"outer/r{r}/fast", error_feedback=feedback, max_norm_ratio=10.0,
                                         norm_rejections=rejections)  # fmt: skip
            rule.step(slow, mean - slow, slow.clone())
            with torch.no_grad():
                offset = 0
                for p in model.tensors:
                    p.copy_(slow[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
    return model.flat().detach(), slow


def _noloco_int4(transport, start, targets):
    model = Params(start)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = NoLoCo(model, opt, transport, every=EVERY, lr=BETA, pull=BETA, momentum=MU, group_size=2, seed=3,
                  codec="int4", timeout=5.0, fragments=1)  # fmt: skip
    for _ in range(STEPS):
        _inner(model, targets[transport.rank])
        algo.step()
    return model.flat().detach(), algo.slow


def test_one_fragment_is_bit_identical_to_the_unfragmented_exchange():
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    replay = LocalFabric(WORKERS).run(lambda t: _unfragmented_replay(t, start, targets))
    algo = LocalFabric(WORKERS).run(lambda t: _noloco_int4(t, start, targets))
    for (theta, slow), (ref_theta, ref_slow) in zip(algo, replay):
        assert torch.equal(theta, ref_theta) and torch.equal(slow, ref_slow)


# --- bytes, error feedback, resume --------------------------------------------------------------------------


def _peak_bytes(cls, k: int, codec: str) -> int:
    """The most bytes one worker sent in one exchange (from its transport's counter), on a small LLaMA."""
    from noloco.models.llama import LLaMA, model_config

    def worker(transport):
        model = LLaMA(model_config("tiny", vocab_size=512, dim=64, n_layers=2, n_heads=2), seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        options = dict(group_size=2) if cls is NoLoCo else {}
        algo = cls(model, opt, transport, every=8, fragments=k, codec=codec, **options)
        generator = torch.Generator().manual_seed(transport.rank)
        peak = 0
        for _ in range(16):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator)
            before = algo.counter.bytes_sent
            if algo.step() is not None:
                peak = max(peak, algo.counter.bytes_sent - before)
        return peak

    return max(LocalFabric(2).run(worker))


@pytest.mark.parametrize("codec", ["int4", "fp32"])
@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo])
def test_peak_bytes_per_exchange_with_four_fragments_are_at_most_0_3_of_one(cls, codec):
    one, four = _peak_bytes(cls, 1, codec), _peak_bytes(cls, 4, codec)
    assert 0 < four <= 0.3 * one, (four, one)


def test_error_feedback_of_a_fragment_changes_only_at_its_own_positions():
    shapes = [(64, 160)] * 4  # fragments of 10240 values: large enough to be quantized (not sent in fp32)
    n = 4 * 64 * 160
    start, targets = torch.randn(n, dtype=torch.float64), torch.randn(WORKERS, n, dtype=torch.float64)

    def worker(transport):
        model, _, algo = _build(NoLoCo, transport, start, 4, False, shapes, codec="int4", slow_codec="int8")
        changed = []
        for _ in range(STEPS):
            _inner(model, targets[transport.rank])
            before = copy.deepcopy(algo.state_dict())
            info = algo.step()
            if info is not None:
                after = algo.state_dict()
                where = torch.zeros(n, dtype=torch.bool)
                for key in ("feedback", "slow_feedback"):
                    for part in ("contribution", "result"):
                        old, new = before[key][part], after[key][part]
                        where |= new != (torch.zeros(n) if old is None else old)
                changed.append((algo.fragments[info.fragment], where))
        return changed

    for changed in LocalFabric(WORKERS).run(worker):
        assert len(changed) == 16
        for part, where in changed:
            outside = torch.ones(n, dtype=torch.bool)
            outside[part] = False
            assert not where[outside].any() and where[part].any()


@pytest.mark.parametrize("overlap", [False, "delayed", "eager", "provisional"])
@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo])
def test_a_state_saved_between_fragments_resumes_exactly(cls, overlap):
    # k = 2, H = 4: exchanges end steps 2, 4, 6, ...; saved after step 6 (with overlap, fragment 1's is in flight;
    # eager: fragment 0's partners' share of step 4's exchange is held, applied at step 8)
    start, targets = torch.randn(N, dtype=torch.float64), torch.randn(WORKERS, N, dtype=torch.float64)
    codec = dict(codec="int4", slow_codec="int8")

    def worker(transport, stop_at=None):
        model, opt, algo = _build(cls, transport, start, 2, overlap, **codec)
        for step in range(1, STEPS + 1):
            _inner(model, targets[transport.rank])
            algo.step()
            if step == stop_at:
                saved = copy.deepcopy((model.state_dict(), opt.state_dict(), algo.state_dict()))
                if overlap == "eager":  # fragment 0's partners' share (its exchange of step 4) is held
                    assert [entry["part"] for entry in saved[2]["partners"]] == [[0, 12]]
                model, opt, algo = _build(cls, transport, start * 0, 2, overlap, **codec)  # a fresh worker
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                algo.load_state_dict(saved[2])
        algo.finish()
        return model.flat().detach(), algo.slow

    full = LocalFabric(WORKERS).run(worker)
    resumed = LocalFabric(WORKERS).run(lambda t: worker(t, stop_at=6))
    for (theta, slow), (ref_theta, ref_slow) in zip(resumed, full):
        assert torch.equal(theta, ref_theta) and torch.equal(slow, ref_slow)
