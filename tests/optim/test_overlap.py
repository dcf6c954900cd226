"""Overlapped outer steps (``overlap=``): the eager and the one-round-delayed rules against their float64
references, exact resume with an exchange in flight, training that goes on while an exchange is on the link, and
failures in flight. (How much time overlap saves is measured by ``benchmarks/``, not asserted here.)"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from noloco.comm import LocalFabric
from noloco.comm.base import CommTimeout, Transport
from noloco.optim import DiLoCo, NoLoCo

TARGETS = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-1.0, 0.0, 2.5, -0.5]], dtype=torch.float64)
START = torch.tensor([0.2, 0.1, -0.3, 0.4], dtype=torch.float64)
LR, EVERY, STEPS, BETA, MU = 0.1, 3, 12, 0.7, 0.5


def _train(transport: Transport, overlap: bool, wrap=None, step_seconds: float = 0.0, cls=NoLoCo, ticks=None, **kw):
    """Worker ``rank`` pulls w toward its target with plain SGD (loss ½‖w − t‖²); returns its final w and slow.
    ``ticks`` (a :class:`Ticks`) hears of each inner step taken and of the end of training."""
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(START.float())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    transport = wrap(transport) if wrap else transport
    options = dict(lr=BETA, pull=kw.pop("pull", BETA), group_size=2) if cls is NoLoCo else {}
    quartic = kw.pop("quartic", 0.0)  # a loss whose SGD steps are not affine in the start: ¼·q·Σ(w − t)⁴ more
    algo = cls(model, opt, transport, every=EVERY, momentum=MU, overlap=overlap, timeout=2.0, **options, **kw)
    for step in range(1, STEPS + 1):
        error = model.weight.double().reshape(-1) - TARGETS[transport.rank]
        loss = 0.5 * error.pow(2).sum() + 0.25 * quartic * error.pow(4).sum()
        loss.backward()
        time.sleep(step_seconds)  # stands in for compute
        if ticks is not None and step % EVERY == 0:
            ticks.launch()
        algo.step()
        if ticks is not None:
            ticks.advance(last=step == STEPS)
        if step == STEPS:
            algo.finish()
    return model.weight.detach().double().reshape(-1).clone(), algo.slow.double().clone()


def _reference() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rule of OuterAlgorithm._overlapped_round in float64, both workers in lockstep (β = γ, one group)."""
    theta = [START.clone(), START.clone()]
    slow = [START.clone(), START.clone()]
    momentum = [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
    pending = None  # (snapshots, mean of the snapshots)
    for step in range(1, STEPS + 1):
        theta = [w - LR * (w - t) for w, t in zip(theta, TARGETS)]
        if step % EVERY == 0:
            if pending is not None:
                snapshots, mean = pending
                for i in range(2):
                    momentum[i] = MU * momentum[i] + BETA * (mean - slow[i])
                    slow[i] = slow[i] + momentum[i]
                    theta[i] = slow[i] + (theta[i] - snapshots[i])
                pending = None
            if step % EVERY == 0 and step < STEPS:
                pending = ([w.clone() for w in theta], (theta[0] + theta[1]) / 2)
            elif step % EVERY == 0:  # the last round's exchange is sent, then applied by finish()
                snapshots, mean = [w.clone() for w in theta], (theta[0] + theta[1]) / 2
                for i in range(2):
                    momentum[i] = MU * momentum[i] + BETA * (mean - slow[i])
                    slow[i] = slow[i] + momentum[i]
                    theta[i] = slow[i] + (theta[i] - snapshots[i])
    return list(zip(theta, slow))


def _eager_reference(pull: float = BETA) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eager rule of docs/design.md §3.1 in float64 for NoLoCo, both workers in one group (w = ½, γ = ``pull``).

    At the end of round r, with Δ_r = θ − φ and φ_r the φ it is measured against, and the means of round r − 1
    just arrived: Δ̃ = ½·Δ_r + (mean_Δ,r−1 − ½·Δ_r−1), φ̃ = ½·φ_r + (mean_φ,r−1 − ½·φ_r−1);
    m ← μ·m + β·Δ̃ + γ·(φ̃ − φ); φ ← φ + m; θ ← φ. Round 0 has no partners' share yet: Δ̃ = ½·Δ_0, φ̃ = φ_0.
    After the last round, the partners' share of its means is applied the same way with no progress of its own.
    """
    theta = [START.clone(), START.clone()]
    slow = [START.clone(), START.clone()]
    momentum = [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
    sent = None  # what each worker sent for the round in flight: (Δ_i, φ_i); its means are the means of those

    def apply(i: int, delta: torch.Tensor, mean_slow: torch.Tensor) -> None:
        momentum[i] = MU * momentum[i] + BETA * delta + pull * (mean_slow - slow[i])
        slow[i] = slow[i] + momentum[i]

    def partners(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # the arrived means less worker i's own half
        mean_delta = (sent[0][0] + sent[1][0]) / 2
        mean_slow = (sent[0][1] + sent[1][1]) / 2
        return mean_delta - sent[i][0] / 2, mean_slow - sent[i][1] / 2

    for step in range(1, STEPS + 1):
        theta = [w - LR * (w - t) for w, t in zip(theta, TARGETS)]
        if step % EVERY == 0:
            now = [(theta[i] - slow[i], slow[i].clone()) for i in range(2)]
            for i in range(2):
                others = partners(i) if sent is not None else (torch.zeros(4, dtype=torch.float64), now[i][1] / 2)
                apply(i, others[0] + now[i][0] / 2, others[1] + now[i][1] / 2)
                theta[i] = slow[i].clone()
            sent = now
    for i in range(2):  # finish(): the last round's partners' share, no progress of its own (θ = φ here)
        others = partners(i)
        apply(i, others[0], others[1] + slow[i] / 2)
        theta[i] = slow[i].clone()
    return list(zip(theta, slow))


def _provisional_reference(pull: float = BETA) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The provisional rule of docs/design.md §3.1 in float64 for NoLoCo, both workers in one group (γ = ``pull``).

    At the end of round r: φ takes round r − 1's real step, m ← μ·m + β·mean_Δ + γ·(mean_φ − φ), φ ← φ + m, and θ
    the difference between it and the provisional step L of round r − 1 (θ ← θ + (φ − L)); then θ ← L_r, the step
    with this worker's own Δ_r as the group mean: L_r = φ + μ·m + β·Δ_r (no pull, m not kept). After the last
    round, finish() applies the last real step the same way.
    """
    theta = [START.clone(), START.clone()]
    slow = [START.clone(), START.clone()]
    momentum = [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
    pending = None  # (what each worker sent: Δ_i, its provisional start L_i), of the round in flight

    def merge():
        mean_delta = (pending[0][0] + pending[1][0]) / 2
        mean_slow = (slow[0] + slow[1]) / 2
        for i in range(2):
            momentum[i] = MU * momentum[i] + BETA * mean_delta + pull * (mean_slow - slow[i])
            slow[i] = slow[i] + momentum[i]
            theta[i] = theta[i] + (slow[i] - pending[i][1])

    for step in range(1, STEPS + 1):
        theta = [w - LR * (w - t) for w, t in zip(theta, TARGETS)]
        if step % EVERY == 0:
            if pending is not None:
                merge()
            deltas = [theta[i] - slow[i] for i in range(2)]
            pending = [(deltas[i], slow[i] + MU * momentum[i] + BETA * deltas[i]) for i in range(2)]
            theta = [start.clone() for _, start in pending]
    merge()
    return list(zip(theta, slow))


def test_provisional_diloco_keeps_one_slow_weights_on_every_worker():
    results = LocalFabric(2).run(lambda t: _train(t, overlap="provisional", cls=DiLoCo, codec="int4"))
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("rule,reference", [("provisional", _provisional_reference), ("eager", _eager_reference)],
                         ids=["provisional", "eager"])  # fmt: skip
@pytest.mark.parametrize("pull", [BETA, 0.4], ids=["fused", "two-vector"])
def test_noloco_overlap_rules_follow_their_float64_references(rule, reference, pull):
    # β = γ (one codec): the fused exchange of θ − φ_0, whose means are (mean_θ − φ_i, φ_i); γ ≠ β: mean_Δ and mean_φ
    results = LocalFabric(2).run(lambda t: _train(t, overlap=rule, codec="fp32", pull=pull))
    for (theta, slow), (ref_theta, ref_slow) in zip(results, reference(pull)):
        assert torch.allclose(theta, ref_theta, atol=1e-5) and torch.allclose(slow, ref_slow, atol=1e-5)


def test_overlap_true_is_the_provisional_rule():
    eager = LocalFabric(2).run(lambda t: _train(t, overlap="provisional", codec="fp32"))
    default = LocalFabric(2).run(lambda t: _train(t, overlap=True, codec="fp32"))
    for (theta, slow), (ref_theta, ref_slow) in zip(default, eager):
        assert torch.equal(theta, ref_theta) and torch.equal(slow, ref_slow)


@pytest.mark.parametrize("pull", [BETA, 0.4], ids=["fused", "two-vector"])
def test_the_coded_rule_is_the_provisional_rule_for_an_exact_codec(pull):
    provisional = LocalFabric(2).run(lambda t: _train(t, overlap="provisional", codec="fp32", pull=pull))
    coded = LocalFabric(2).run(lambda t: _train(t, overlap="coded", codec="fp32", pull=pull))
    for (theta, slow), (ref_theta, ref_slow) in zip(coded, provisional):
        assert torch.equal(theta, ref_theta) and torch.equal(slow, ref_slow)


@pytest.mark.parametrize("codec,slow_codec,pull", [("int4", "int4", BETA), ("topk:64/4096+int2", "int8", 0.4)],
                         ids=["fused-int4", "two-vector-topk"])  # fmt: skip
def test_the_coded_rule_steps_with_the_pseudo_gradient_its_codec_sends(codec, slow_codec, pull):
    """16,384 weights, a lossy codec: after each send the coded rule's θ is φ stepped by the rule with
    decode(encode(Δ + e)) as the group mean (e: the error feedback's residual before the exchange; for the fused
    exchange the code of θ − φ₀ + e, less φ − φ₀), and not the provisional rule's θ, stepped with Δ itself."""
    from noloco.optim.overlap import provisional_step

    def worker(transport):
        torch.manual_seed(transport.rank)
        model = torch.nn.Linear(128, 128, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        algo = NoLoCo(model, opt, transport, every=EVERY, momentum=MU, lr=BETA, pull=pull, group_size=2,
                      overlap="coded", codec=codec, slow_codec=slow_codec, slow_every=1, timeout=5.0)  # fmt: skip
        target = torch.randn(128, 128, generator=torch.Generator().manual_seed(10 + transport.rank))
        seen = []
        for step in range(1, 4 * EVERY + 1):
            (0.5 * (model.weight - target).pow(2).sum()).backward()
            boundary = step % EVERY == 0
            if boundary:  # the residual the send codes with: the exchange in flight has committed its own first
                algo._overlapped.settle()
                numel = algo.slow.numel()
                residual = algo.feedback.residuals_for(numel)[0] if algo.feedback.numel else torch.zeros(numel)
            algo.step()
            if boundary:
                sent, slow = algo._overlapped.in_flight.snapshot, algo.slow.clone()
                reference = algo.reference if algo._fused_exchange() else slow
                _, value = algo.codec.encode_message(sent - reference + residual, with_value=True)
                coded = provisional_step(algo.rule, slow, value + reference - slow, None)
                dense = provisional_step(algo.rule, slow, sent - slow, None)
                theta = algo.read_fast(None)
                seen.append((torch.equal(theta, coded), torch.equal(theta, dense)))
        algo.finish()
        return seen, algo._fused_exchange()

    for seen, fused in LocalFabric(2).run(worker):
        assert fused == (codec == slow_codec)
        assert seen == [(True, False)] * 4, seen


def test_an_unknown_overlap_rule_is_refused():
    with pytest.raises(ValueError, match="'streaming' is not one of false, true, provisional, coded, eager, delayed"):
        LocalFabric(1).run(lambda t: _train(t, overlap="streaming"))


@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo])
@pytest.mark.parametrize("rule,tau", [("provisional", None), ("eager", None), ("delayed", None), ("provisional", 2),
                                      ("delayed", 2), ("coded", None), ("coded", 2)])  # fmt: skip
def test_a_state_saved_with_an_exchange_in_flight_resumes_exactly(rule, tau, cls):
    """Saved after step 7 (round 1's exchange left at step 6 and lands at step 9, or at step 8 with
    ``overlap_steps=2``): a fresh worker that loads the model, optimizer and algorithm states ends bit-identical
    to the uninterrupted one (int4, error feedback)."""

    def worker(transport, stop_at=None):
        def build(start):
            model = torch.nn.Linear(4, 1, bias=False)
            with torch.no_grad():
                model.weight.copy_(start.float())
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            options = dict(lr=BETA, pull=BETA, group_size=2) if cls is NoLoCo else {}
            return model, opt, cls(model, opt, transport, every=EVERY, momentum=MU, overlap=rule, codec="int4",
                                   timeout=5.0, overlap_steps=tau, **options)  # fmt: skip

        model, opt, algo = build(START)
        for step in range(1, STEPS + 1):
            loss = 0.5 * (model.weight.double().reshape(-1) - TARGETS[transport.rank]).pow(2).sum()
            loss.backward()
            algo.step()
            if step == stop_at:
                saved = copy.deepcopy((model.state_dict(), opt.state_dict(), algo.state_dict()))
                assert saved[2]["in_flight"] is not None and saved[2]["in_flight"]["round"] == 1
                model, opt, algo = build(START * 0)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                algo.load_state_dict(saved[2])
        algo.finish()
        return model.weight.detach().clone(), algo.slow.clone()

    full = LocalFabric(2).run(worker)
    resumed = LocalFabric(2).run(lambda t: worker(t, stop_at=7))
    for (theta, slow), (ref_theta, ref_slow) in zip(resumed, full):
        assert torch.equal(theta, ref_theta) and torch.equal(slow, ref_slow)


@pytest.mark.parametrize("saved_rule,resumed_rule", [("provisional", "coded"), ("coded", "provisional"),
                                                     ("provisional", True)])  # fmt: skip
def test_a_provisional_checkpoint_resumes_under_the_coded_rule_and_back(saved_rule, resumed_rule):
    """``outer.overlap=true`` named the provisional rule before it named the coded one: a checkpoint with an
    exchange in flight under one resumes under the other, that exchange landing as its own rule sent it (int4,
    error feedback): bit-identical to an uninterrupted run whose rule changes at the same step. Resumed with
    ``True`` (the setting that named provisional then), it stays provisional: it ends as if never interrupted."""

    def worker(transport, stop_at, save):
        def build(start, rule):
            model = torch.nn.Linear(4, 1, bias=False)
            with torch.no_grad():
                model.weight.copy_(start.float())
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            return model, opt, NoLoCo(model, opt, transport, every=EVERY, momentum=MU, overlap=rule, codec="int4",
                                      timeout=5.0, lr=BETA, pull=BETA, group_size=2)  # fmt: skip

        model, opt, algo = build(START, saved_rule)
        for step in range(1, STEPS + 1):
            loss = 0.5 * (model.weight.double().reshape(-1) - TARGETS[transport.rank]).pow(2).sum()
            loss.backward()
            algo.step()
            if step == stop_at and save:  # a fresh worker of the other rule loads the checkpoint
                saved = copy.deepcopy((model.state_dict(), opt.state_dict(), algo.state_dict()))
                assert saved[2]["in_flight"]["rule"] == saved_rule
                model, opt, algo = build(START * 0, resumed_rule)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                algo.load_state_dict(saved[2])
            elif step == stop_at and resumed_rule is not True:  # the same worker changes its rule there
                algo.overlap = algo._overlapped.rule = resumed_rule
        algo.finish()
        return model.weight.detach().clone(), algo.slow.clone()

    switched = LocalFabric(2).run(lambda t: worker(t, 7, save=False))
    resumed = LocalFabric(2).run(lambda t: worker(t, 7, save=True))
    unswitched = LocalFabric(2).run(lambda t: worker(t, None, save=False))
    for (theta, slow), (ref_theta, ref_slow) in zip(resumed, switched):
        assert torch.equal(theta, ref_theta) and torch.equal(slow, ref_slow)
    # the rules differ with int4: the switch was taken, or (True) not
    assert torch.equal(resumed[0][0], unswitched[0][0]) == (resumed_rule is True)


def test_a_checkpoint_of_one_rule_is_refused_by_the_other():
    def worker(transport):
        model = torch.nn.Linear(4, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        algo = NoLoCo(model, opt, transport, every=1, overlap="eager", codec="fp32", group_size=2)
        model.weight.grad = torch.ones_like(model.weight)
        algo.step()
        state = algo.state_dict()
        other = NoLoCo(model, opt, transport, every=1, overlap="delayed", codec="fp32", group_size=2)
        with pytest.raises(ValueError, match="is of the eager overlap rule, this run's is delayed"):
            other.load_state_dict(state)
        other = NoLoCo(model, opt, transport, every=1, overlap="provisional", codec="fp32", group_size=2)
        with pytest.raises(ValueError, match="is of the eager overlap rule, this run's is provisional"):
            other.load_state_dict(state)
        blocking = NoLoCo(model, opt, transport, every=1, codec="fp32", group_size=2)
        with pytest.raises(ValueError, match="this run does not overlap"):
            blocking.load_state_dict(state)
        algo.finish()

    LocalFabric(2).run(worker)


def test_overlapped_noloco_follows_the_one_round_delayed_rule_of_its_float64_reference():
    results = LocalFabric(2).run(lambda t: _train(t, overlap="delayed", codec="fp32"))
    for (theta, slow), (ref_theta, ref_slow) in zip(results, _reference()):
        assert torch.allclose(theta, ref_theta, atol=1e-5) and torch.allclose(slow, ref_slow, atol=1e-5)


def test_provisional_is_the_blocking_trajectory_when_inner_training_is_linear_and_the_group_is_everyone():
    # SGD on ½‖w − t_i‖² makes Δ_i affine in the start, with Δ_i − mean_Δ the same from any start; the provisional
    # starts then average to the blocking start, so the group means (and φ) are the blocking ones, a round late
    blocking = LocalFabric(2).run(lambda t: _train(t, overlap=False, codec="fp32"))
    provisional = LocalFabric(2).run(lambda t: _train(t, overlap="provisional", codec="fp32"))
    for (theta, slow), (ref_theta, ref_slow) in zip(provisional, blocking):
        assert torch.allclose(theta, ref_theta, atol=1e-5) and torch.allclose(slow, ref_slow, atol=1e-5)
    for rule in ("delayed", "eager"):  # the other rules change the trajectory
        overlapped = LocalFabric(2).run(lambda t, rule=rule: _train(t, overlap=rule, codec="fp32"))
        assert not torch.allclose(blocking[0][1], overlapped[0][1], atol=1e-3)


class Ticks:
    """A worker's inner steps, as its outer messages' sender sees them, and the step count at each outer step."""

    def __init__(self):
        self.steps, self.done, self.launches = 0, False, []
        self.changed = threading.Condition()

    def launch(self) -> None:
        """An outer step begins (before ``algo.step()`` of a round's last inner step)."""
        with self.changed:
            self.launches.append(self.steps)

    def advance(self, last: bool) -> None:
        with self.changed:
            self.steps += 1
            self.done = self.done or last
            self.changed.notify_all()

    def moves_on(self, launch: int, wait: float) -> bool:
        """Whether training took another inner step after its ``launch``-th outer step began, waiting up to
        ``wait`` s for one. Counted from the outer step, not from the send: a loaded machine may run the
        exchange's thread only after training has gone on to the next outer step, which then waits for it."""
        with self.changed:
            start = self.launches[launch]
            return self.changed.wait_for(lambda: self.steps > start or self.done, wait) and self.steps > start


class HeldLink(Transport):
    """The first outer message of each round leaves only once its sender's training has taken an inner step since
    the round's outer step began (or ``wait`` s passed, or training ended): ``moved`` records, per round, whether
    training went on meanwhile."""

    def __init__(self, inner: Transport, ticks: Ticks, wait: float, moved: list):
        self.inner, self.ticks, self.wait, self.moved = inner, ticks, wait, moved
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter
        self.rounds: list[str] = []  # in the order of the outer steps that sent them

    def send(self, dst: int, tag: str, payload: bytes) -> None:
        if tag.startswith("outer/") and tag.split("/")[1] not in self.rounds:
            self.rounds.append(tag.split("/")[1])
            self.moved.append(self.ticks.moves_on(len(self.rounds) - 1, self.wait))
        self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout: float) -> bytes:
        return self.inner.recv(src, tag, timeout)


@pytest.mark.parametrize("cls", [NoLoCo, DiLoCo])
def test_overlapped_training_goes_on_while_an_exchange_is_on_the_link(cls):
    """Held until its sender trains on: overlapped, every round's first message is let go by a step taken after its
    outer step began; blocking, none is (training waits in the outer step, so each leaves after the short wait)."""

    def moved(overlap: bool, wait: float) -> list[bool]:
        ticks, log = [Ticks(), Ticks()], []
        LocalFabric(2).run(lambda t: _train(t, overlap, wrap=lambda x: HeldLink(x, ticks[x.rank], wait, log),
                                            cls=cls, codec="int8", ticks=ticks[t.rank]))  # fmt: skip
        return log

    overlapped, blocking = moved(True, wait=120.0), moved(False, wait=0.05)
    assert overlapped and all(overlapped), overlapped  # (had it not, each would wait 120 s and fail)
    assert blocking and not any(blocking), blocking


class DeadLink(Transport):
    """Rank 1's outer messages of round 1 are lost (a peer that died mid-exchange, as its partner sees it)."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter

    def send(self, dst: int, tag: str, payload: bytes) -> None:
        if not (self.rank == 1 and tag.startswith("outer/r1/")):
            self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout: float) -> bytes:
        try:
            return self.inner.recv(src, tag, timeout)
        except CommTimeout:
            self.timeouts.append((self.rank, tag))
            raise


def test_a_dead_peer_during_an_exchange_in_flight_costs_at_most_the_timeout():
    """The lost round costs each waiting rank one receive timeout, and training goes on with finite weights."""
    timeouts: list = []

    def dead_link(inner: Transport) -> DeadLink:
        link = DeadLink(inner)
        link.timeouts = timeouts
        return link

    results = LocalFabric(2).run(lambda t: _train(t, overlap=True, wrap=dead_link, codec="fp32"))
    assert 1 <= len(timeouts) <= 2 and len({rank for rank, _ in timeouts}) == len(timeouts), timeouts
    for theta, slow in results:
        assert torch.isfinite(theta).all() and torch.isfinite(slow).all()


QUARTIC = 0.1  # the landing tests' loss is not quadratic: otherwise provisional's φ would not depend on τ


def _landing_reference(rule: str, tau: int | None, pull: float = BETA) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The provisional and delayed rules in float64 for NoLoCo (one group of both workers, γ = ``pull``), an
    exchange landing ``tau`` inner steps after its send (None: at the next round boundary, before the send), on
    the loss ½‖w − t‖² + ¼·q·Σ(w − t)⁴.

    Land: m ← μ·m + β·mean_Δ + γ·(mean_φ − φ), φ ← φ + m; provisional θ ← θ + (φ − L), delayed θ ← φ + (θ − s).
    Send (at a boundary): s = θ, Δ = θ − φ; provisional θ ← L = φ + μ·m + β·Δ (m not kept).
    """
    theta = [START.clone(), START.clone()]
    slow = [START.clone(), START.clone()]
    momentum = [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
    pending = None  # per worker: (what it sent s_i, Δ_i, its provisional start L_i)

    def land():
        nonlocal pending
        mean_delta = (pending[0][1] + pending[1][1]) / 2
        mean_slow = (slow[0] + slow[1]) / 2
        for i in range(2):
            momentum[i] = MU * momentum[i] + BETA * mean_delta + pull * (mean_slow - slow[i])
            slow[i] = slow[i] + momentum[i]
            sent, _, start = pending[i]
            theta[i] = theta[i] + (slow[i] - start) if rule == "provisional" else slow[i] + (theta[i] - sent)
        pending = None

    for step in range(1, STEPS + 1):
        theta = [w - LR * ((w - t) + QUARTIC * (w - t).pow(3)) for w, t in zip(theta, TARGETS)]
        if pending is not None and (step % EVERY == tau or (tau is None and step % EVERY == 0)):
            land()
        if step % EVERY == 0:
            pending = [(theta[i].clone(), theta[i] - slow[i], slow[i] + MU * momentum[i] + BETA * (theta[i] - slow[i]))
                       for i in range(2)]  # fmt: skip
            if rule == "provisional":
                theta = [start.clone() for _, _, start in pending]
    land()  # finish(): the last round's exchange
    return list(zip(theta, slow))


@pytest.mark.parametrize("rule", ["provisional", "delayed"])
@pytest.mark.parametrize("tau", [None, 1, 2], ids=["round", "tau1", "tau2"])
@pytest.mark.parametrize("pull", [BETA, 0.4], ids=["fused", "two-vector"])
def test_an_exchange_lands_overlap_steps_after_its_send_as_in_its_float64_reference(rule, tau, pull):
    results = LocalFabric(2).run(lambda t: _train(t, overlap=rule, codec="fp32", pull=pull, overlap_steps=tau,
                                                  quartic=QUARTIC))  # fmt: skip
    for (theta, slow), (ref_theta, ref_slow) in zip(results, _landing_reference(rule, tau, pull)):
        assert torch.allclose(theta, ref_theta, atol=1e-5) and torch.allclose(slow, ref_slow, atol=1e-5)
    others = [_landing_reference(rule, other, pull)[0][1] for other in (None, 1, 2) if other != tau]
    assert all(not torch.allclose(results[0][1], other, atol=1e-3) for other in others)  # τ changes the result


def test_overlap_steps_of_a_whole_round_is_the_default():
    default = LocalFabric(2).run(lambda t: _train(t, overlap=True, codec="int4"))
    whole = LocalFabric(2).run(lambda t: _train(t, overlap=True, codec="int4", overlap_steps=EVERY))
    for (theta, slow), (ref_theta, ref_slow) in zip(whole, default):
        assert torch.equal(theta, ref_theta) and torch.equal(slow, ref_slow)


@pytest.mark.parametrize("overlap,steps,message", [
    (True, 0, r"must be an integer in \[1, 3\]"), (True, EVERY + 1, r"must be an integer in \[1, 3\]"),
    (True, 1.5, "must be an integer"), ("eager", 1, "for the provisional, coded and delayed rules"),
    (False, 1, "needs outer.overlap"),
])  # fmt: skip
def test_a_bad_overlap_steps_is_refused(overlap, steps, message):
    with pytest.raises(ValueError, match=message):
        LocalFabric(1).run(lambda t: _train(t, overlap=overlap, overlap_steps=steps))
