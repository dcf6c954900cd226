import pytest
import torch

from noloco.quant import dequantize, dequantize_accumulate, dequantize_accumulate_requantize, quantize

from .helpers import awkward


@pytest.mark.parametrize("specs", [["int4"] * 3, ["int8", "mxfp4", "bf16", "int4+hadamard", "mxfp6"], ["mxfp8"] * 6])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dequantize_accumulate_adds_every_input_in_place(specs, backend):
    xs = [awkward("gauss", 1000 + 7, seed=i) for i in range(len(specs))]
    ps = [quantize(x, s) for x, s in zip(xs, specs)]
    acc = torch.ones(1007)
    expected = torch.ones(1007)
    for p in ps:
        expected = expected + dequantize(p)
    out = dequantize_accumulate(acc, ps, backend=backend)
    assert out is acc
    assert torch.equal(acc, expected)  # same left-to-right fp32 order on every backend


def test_dequantize_accumulate_rejects_mismatched_sizes_and_dtypes():
    p = quantize(torch.randn(10), "int8")
    with pytest.raises(ValueError):
        dequantize_accumulate(torch.zeros(11), [p])
    with pytest.raises(ValueError):
        dequantize_accumulate(torch.zeros(10, dtype=torch.float64), [p])


@pytest.mark.parametrize("out_spec", ["int8", "int4", "mxfp8", "int8+hadamard"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_requantize_equals_quantize_of_the_fp32_sum(out_spec, backend):
    in_spec = "mxfp8" if out_spec == "mxfp8" else "int8"
    xs = [awkward("gauss", 2000 + 1, seed=i) for i in range(3)]
    ps = [quantize(x, in_spec) for x in xs]
    acc = awkward("gauss", 2001, seed=9)
    total = acc.clone()
    for p in ps:
        total += dequantize(p)
    got = dequantize_accumulate_requantize(acc, ps, out_spec, backend=backend)
    want = quantize(total, out_spec, backend="torch")
    for a, b in zip(got.sections(), want.sections()):
        assert torch.equal(a, b)
    assert torch.equal(acc, awkward("gauss", 2001, seed=9))  # acc not modified


def test_requantize_without_accumulator_reencodes_the_sum_of_inputs():
    ps = [quantize(torch.randn(300), "int8") for _ in range(2)]
    got = dequantize(dequantize_accumulate_requantize(None, ps, "int8", backend="triton"))
    want = dequantize(ps[0]) + dequantize(ps[1])
    assert ((got - want).abs().max() <= (want.abs().max() / 100)).item()


def test_multi_hop_ring_error_stays_bounded_with_int8_carry():
    # 8 hops of a ring: each hop adds its own value and re-encodes the partial sum.
    xs = [awkward("gauss", 4096, seed=i) for i in range(8)]
    carry = quantize(xs[0], "int8")
    for x in xs[1:]:
        carry = dequantize_accumulate_requantize(x, [carry], "int8")
    exact = torch.stack(xs).double().sum(0)
    err = (dequantize(carry).double() - exact).norm() / exact.norm()
    assert err < 0.02
