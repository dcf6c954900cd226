import pytest
import torch

from noloco.quant import ErrorFeedback, dequantize

from .helpers import awkward


@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "int4+hadamard", "bf16"])
def test_error_feedback_keeps_accumulated_error_bounded(spec):
    # Sending the same x for T rounds: sum(sent) = T*x - e_T, so the running-mean error shrinks as 1/T
    # while the residual itself stays within a few quantization steps.
    x = awkward("gauss", 2048, seed=1) * 1e-3
    ef = ErrorFeedback(spec)
    sent = torch.zeros(2048, dtype=torch.float64)
    rounds = 200
    for _ in range(rounds):
        sent += dequantize(ef.quantize(x, key="w")).double()
    e = ef.residual("w")
    assert e.abs().max() < 0.5 * x.abs().max()  # bounded, not growing with T
    assert torch.allclose(sent, rounds * x.double() - e.double(), atol=1e-7)
    no_ef = dequantize(ErrorFeedback(spec).quantize(x)).double()
    assert (sent / rounds - x.double()).norm() < 0.05 * max((no_ef - x.double()).norm(), 1e-12)


def test_error_feedback_keeps_one_residual_per_key():
    ef = ErrorFeedback("int4")
    ef.quantize(torch.randn(10), key="a")
    ef.quantize(torch.randn(20), key="b")
    assert ef.residual("a").numel() == 10 and ef.residual("b").numel() == 20
    with pytest.raises(ValueError, match="holds 10"):
        ef.quantize(torch.randn(11), key="a")
    ef.reset("a")
    assert ef.residual("a") is None
    state = ef.state_dict()
    other = ErrorFeedback("int8")
    other.load_state_dict(state)
    assert str(other.spec) == "int4" and torch.equal(other.residual("b"), ef.residual("b"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_input_raises_and_leaves_the_residual_untouched(backend):
    ef = ErrorFeedback("int8", backend=backend)
    ef.quantize(torch.randn(300), key="g")
    before = ef.residual("g").clone()
    bad = torch.randn(300)
    bad[5] = float("nan")
    with pytest.raises(ValueError):
        ef.quantize(bad, key="g")
    assert torch.equal(ef.residual("g"), before)


@pytest.mark.parametrize("spec", ["int4", "int8:sym", "int4:naive", "mxfp4", "mxfp8"])
def test_fused_triton_error_feedback_matches_torch_bit_for_bit(spec):
    a, b = ErrorFeedback(spec, backend="torch"), ErrorFeedback(spec, backend="triton")
    for step in range(3):
        x = awkward("gauss", 1000 + 3, seed=step).to(torch.bfloat16)
        pa, pb = a.quantize(x), b.quantize(x)
        for sa, sb in zip(pa.sections(), pb.sections()):
            assert torch.equal(sa, sb)
        assert torch.equal(a.residual(), b.residual())
