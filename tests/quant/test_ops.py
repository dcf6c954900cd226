"""quantize/dequantize through the public API on awkward inputs, every spec, every input dtype."""

import pytest
import torch

from noloco.quant import Packed, QuantSpec, dequantize, quantize

from .helpers import ALL_SPECS, AWKWARD_SIZES, awkward, bound_for, rel_l2


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("n", AWKWARD_SIZES)
def test_every_spec_round_trips_awkward_sizes_within_its_error_bound(spec, n):
    x = awkward("gauss", n, seed=n)
    p = quantize(x, spec, generator=torch.Generator().manual_seed(1))
    y = dequantize(p)
    assert y.dtype == torch.float32 and y.shape == x.shape and y.device == x.device
    assert torch.isfinite(y).all()
    if n >= 127:
        assert rel_l2(y, x) < bound_for(spec, x)
    q = Packed.from_bytes(p.to_bytes())
    assert torch.equal(dequantize(q), y)
    assert p.nbytes == len(p.to_bytes())


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_all_zero_input_decodes_to_exact_zeros(spec):
    x = torch.zeros(300)
    y = dequantize(quantize(x, spec))
    assert torch.equal(y, torch.zeros(300))


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if "hadamard" not in s and "naive" not in s])
def test_exact_zeros_inside_a_group_decode_to_exact_zero(spec):
    x = awkward("gauss", 1000, seed=3) + 0.7  # shifted: zero is not the group centre
    x[::5] = 0.0
    y = dequantize(quantize(x, spec, generator=torch.Generator().manual_seed(0)))
    assert (y[::5] == 0).all()


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_value_error(spec, bad):
    x = torch.randn(200)
    x[17] = bad
    with pytest.raises(ValueError, match="non-finite|NaN"):
        quantize(x, spec)


@pytest.mark.parametrize("spec", ["int4", "int8", "int4:sym", "mxfp4", "mxfp8", "int4+hadamard"])
def test_single_outlier_only_costs_its_own_group(spec):
    x = awkward("outlier", 4096, seed=5)
    y = dequantize(quantize(x, spec))
    assert abs(y[2048].item() - 1e4) / 1e4 < (0.25 if spec == "mxfp4" else 0.1)  # E2M1: 4 -> 6 steps
    if "hadamard" not in spec:  # the outlier's group is ruined, the others are not
        far = torch.cat([x[:1024], x[3072:]])
        yfar = torch.cat([y[:1024], y[3072:]])
        assert rel_l2(yfar, far) < bound_for(spec, far)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8", "bf16", "int4+hadamard"])
def test_input_dtypes_decode_to_float32_of_original_shape(dtype, spec):
    x = torch.randn(3, 5, 17).to(dtype)
    p = quantize(x, spec)
    y = dequantize(p)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 17)
    assert p.dtype == dtype and Packed.from_bytes(p.to_bytes()).dtype == dtype
    assert rel_l2(y, x.float()) < bound_for(spec, x)


def test_scalar_and_empty_shapes_survive():
    for x in [torch.tensor(3.5), torch.empty(0, 7), torch.empty(4, 0, 2)]:
        for spec in ["int4", "mxfp6", "fp16+hadamard"]:
            p = Packed.from_bytes(quantize(x, spec).to_bytes())
            assert dequantize(p).shape == x.shape


def test_non_float_input_is_rejected():
    with pytest.raises(TypeError):
        quantize(torch.arange(10), "int8")


def test_quantize_does_not_modify_its_input():
    x = torch.randn(1000)
    x0 = x.clone()
    quantize(x, "int4+hadamard")
    quantize(x, "mxfp4", backend="triton")
    assert torch.equal(x, x0)


def test_forcing_an_unknown_backend_fails_clearly():
    with pytest.raises(ValueError):
        quantize(torch.randn(4), "int4", backend="cuda")
    with pytest.raises(ValueError):
        quantize(torch.randn(4), "mxfp6", backend="triton")
    assert QuantSpec.parse("int4").kind == "int"
