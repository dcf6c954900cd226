"""The state-owner protocol (noloco/state.py): every owner's ``check_state`` accepts its own ``state_dict`` and
refuses, with one :class:`StateError` naming the entry, a state of another shape, dtype or kind."""

import pytest
import torch

from noloco.collectives import NormRejections, ReductionErrorFeedback
from noloco.comm.base import ByteCounter
from noloco.comm.local import LocalFabric
from noloco.optim import NoLoCo
from noloco.optim.base import OuterRule
from noloco.optim.fragments import Fragment
from noloco.quant.feedback import ErrorFeedback
from noloco.state import StateError


def test_error_feedback_checks_its_residuals():
    feedback = ReductionErrorFeedback()
    feedback.commit(torch.ones(6), torch.zeros(6))
    ReductionErrorFeedback.check_state(feedback.state_dict(), 6)
    with pytest.raises(StateError, match="feedback/contribution: shape"):
        ReductionErrorFeedback.check_state(feedback.state_dict(), 7)
    with pytest.raises(StateError, match="not an error-feedback state"):
        ReductionErrorFeedback.check_state({"version": 1, "contribution": torch.ones(6), "result": None}, 6)
    quant = ErrorFeedback("int4")
    quant.quantize(torch.randn(300), key="w")
    quant.check_state(quant.state_dict())
    with pytest.raises(StateError, match="spec"):
        ErrorFeedback("int8").check_state(quant.state_dict())
    bad = quant.state_dict()
    bad["residuals"]["w"] = bad["residuals"]["w"].double()
    with pytest.raises(StateError, match="dtype float64"):
        quant.check_state(bad)


def test_counters_rules_and_fragments_check_their_state():
    counter = ByteCounter()
    counter.count_sent(10)
    ByteCounter.check_state(counter.state_dict())
    with pytest.raises(StateError, match="counter"):
        ByteCounter.check_state({"bytes_sent": -1})
    NormRejections.check_state({"contributions": 1, "results": 0, "by_rank": {"3": 1}})
    with pytest.raises(StateError, match="norm_rejections"):
        NormRejections.check_state({"by_rank": {"x": 1}})
    OuterRule.check_state({"velocity": torch.zeros(4)}, 4)
    with pytest.raises(StateError, match="rule/velocity: shape"):
        OuterRule.check_state({"velocity": torch.zeros(5)}, 4)
    fragment = Fragment(slice(4, 10), ReductionErrorFeedback(), None)
    fragment.feedback.commit(torch.ones(6), torch.ones(6))
    fragment.check_state(fragment.state_dict())
    with pytest.raises(StateError, match="fragment/feedback/contribution: shape"):
        Fragment(slice(0, 5), ReductionErrorFeedback(), None).check_state(fragment.state_dict())


def test_an_outer_algorithm_checks_its_state_and_loads_it_back():
    """After two rounds of int4 NoLoCo over two fragments: the state passes its own check, a state for another
    model size is refused, and loading it into a fresh algorithm gives the same state again."""

    def worker(transport):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        algo = NoLoCo(model, opt, transport, every=2, codec="int4", fragments=2)
        for _ in range(4):
            model(torch.randn(3, 8)).square().sum().backward()
            algo.step()
        state = algo.state_dict()
        numel = sum(p.numel() for p in model.parameters())
        NoLoCo.check_state(state, numel)
        with pytest.raises(StateError, match="algorithm/feedback/contribution: shape"):
            NoLoCo.check_state(state, numel + 1)
        fresh = NoLoCo(torch.nn.Linear(8, 4), torch.optim.SGD(model.parameters(), lr=0.1), transport, every=2,
                       codec="int4", fragments=2, same_start="trust")  # fmt: skip
        fresh.load_state_dict(state)
        again = fresh.state_dict()
        return all(torch.equal(again[k]["contribution"], state[k]["contribution"]) for k in ("feedback",))

    assert all(LocalFabric(2).run(worker))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_a_nan_or_inf_anywhere_and_is_not_fooled_by_an_overflowing_sum(dtype):
    from noloco.state import all_finite

    big = torch.finfo(dtype).max
    values = torch.full((1000,), big / 4, dtype=dtype)  # finite values whose sum overflows
    assert all_finite(values) and all_finite(torch.tensor([big, -big, big], dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 517, 999):
            broken = values.clone()
            broken[at] = bad
            assert not all_finite(broken), (bad, at)
    assert all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(5))
