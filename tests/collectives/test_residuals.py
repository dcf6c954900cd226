import pytest
import torch

from noloco.collectives import ReductionErrorFeedback, allreduce
from noloco.comm import LocalFabric

from .helpers import exact_mean, gaussian_inputs


def _repeat(world, xs, calls, codec, reduction, states=None, start=0):
    """``calls`` successive reductions of the same inputs; returns sum over calls of (out - exact)."""
    exact = exact_mean(xs)
    fabric = LocalFabric(world)

    def fn(t):
        drift = torch.zeros_like(exact)
        for call in range(start, start + calls):
            ef = None if states is None else states[t.rank]
            out = allreduce(
                xs[t.rank],
                t,
                codec=codec,
                reduction=reduction,
                error_feedback=ef,
                min_compress_numel=0,
                tag=f"rep/{call}",
            )
            drift += out.double() - exact
        return drift

    return fabric.run(fn), exact


@pytest.mark.parametrize("reduction", ["two_phase", "ring"])
def test_error_feedback_keeps_accumulated_error_of_repeated_calls_bounded(reduction):
    world, numel, calls = 3, 1536, 40
    xs = gaussian_inputs(world, numel, seed=5)
    plain, exact = _repeat(world, xs, calls, "int4", reduction)
    states = [ReductionErrorFeedback() for _ in range(world)]
    fed, _ = _repeat(world, xs, calls, "int4", reduction, states)
    one_call = float(plain[0].norm()) / calls  # without EF the same bias adds up every call
    assert float(plain[0].norm()) > 0.9 * calls * one_call
    # with EF the accumulated error stays about one quantization error, not `calls` of them
    assert float(fed[0].norm()) < 3 * one_call
    assert all(torch.equal(fed[0], f) for f in fed)


def test_error_feedback_state_round_trips_through_state_dict():
    world, numel = 2, 1024
    xs = gaussian_inputs(world, numel, seed=9)
    straight = [ReductionErrorFeedback() for _ in range(world)]
    full, _ = _repeat(world, xs, 6, "int8", "two_phase", straight)
    resumed = [ReductionErrorFeedback() for _ in range(world)]
    first, _ = _repeat(world, xs, 3, "int8", "two_phase", resumed)
    reloaded = []
    for state in resumed:
        fresh = ReductionErrorFeedback()
        fresh.load_state_dict(state.state_dict())
        reloaded.append(fresh)
    second, _ = _repeat(world, xs, 3, "int8", "two_phase", reloaded, start=3)
    assert torch.equal(first[0] + second[0], full[0])
    for a, b in zip(straight, reloaded):
        assert torch.equal(a.contribution, b.contribution) and torch.equal(a.result, b.result)


def test_error_feedback_rejects_other_sizes_and_bad_state():
    ef = ReductionErrorFeedback()
    fabric = LocalFabric(2)
    fabric.run(
        lambda t: allreduce(
            torch.ones(100), t, codec="int8", min_compress_numel=0, error_feedback=ReductionErrorFeedback()
        )
    )
    ef.load_state_dict({"version": 1, "contribution": torch.zeros(10), "result": torch.zeros(10)})
    with pytest.raises(ValueError, match="tracks 10"):
        allreduce(torch.ones(12), fabric.transports[0], error_feedback=ef)
    assert fabric.transports[0].counter.messages_sent == 2  # nothing more was sent
    with pytest.raises(ValueError):
        ef.load_state_dict({"version": 1, "contribution": torch.tensor([float("nan")]), "result": torch.zeros(1)})
    with pytest.raises(ValueError):
        ef.load_state_dict({"version": 1, "contribution": torch.zeros(2), "result": None})


def test_failed_call_leaves_error_feedback_untouched():
    ef = ReductionErrorFeedback()
    fabric = LocalFabric(2)
    t = fabric.transports[0]
    with pytest.raises(Exception):  # noqa: B017 - peer never answers
        allreduce(torch.randn(64), t, codec="int8", min_compress_numel=0, error_feedback=ef, timeout=0.1)
    assert ef.contribution is None and ef.numel is None
