"""MX formats against known vectors and a float64 reading of the OCP Microscaling v1.0 spec."""

import pytest
import torch

from noloco.quant import dequantize, quantize
from noloco.quant.mx import element_params

from .helpers import awkward, mx_reference

PARAMS = {"mxfp4": (2, 1, 2, 1), "mxfp6": (3, 2, 4, 3), "mxfp8": (4, 3, 8, 6)}


def test_mxfp4_known_vector_and_nibble_order():
    x = torch.zeros(32)
    x[:6] = torch.tensor([6.0, 3.0, -1.5, 0.5, 0.25, 0.75])
    p = quantize(x, "mxfp4")
    assert p.scales.tolist() == [127]  # amax 6 = 1.5 * 2**2, emax 2 -> X = 0
    # codes: 6->0111, 3->0101, -1.5->1011, 0.5->0001, 0.25->0 (tie to even), 0.75->0010 (1.0? tie -> 1.0)
    assert p.codes[:3].tolist() == [0x57, 0x1B, (0x2 << 4) | 0x0]
    assert dequantize(p)[:6].tolist() == [6.0, 3.0, -1.5, 0.5, 0.0, 1.0]


def test_mxfp4_shared_scale_is_power_of_two_of_the_block_max():
    x = torch.zeros(64)
    x[0], x[32] = 12.0, 0.1  # X = floor(log2 12) - 2 = 1 ; floor(log2 0.1) - 2 = -6
    p = quantize(x, "mxfp4")
    assert p.scales.tolist() == [128, 121]
    assert dequantize(p)[0].item() == 12.0


def test_mxfp6_e3m2_known_vector_and_packing():
    x = torch.zeros(32)
    x[:4] = torch.tensor([28.0, 1.0, 0.0, 0.0625])
    p = quantize(x, "mxfp6")
    assert p.scales.tolist() == [127]  # 28 = 1.75 * 2**4, emax 4
    # codes 31 (0 111 11), 12 (0 011 00), 0, 1 (subnormal 2**-4) -> word 31 | 12<<6 | 0 | 1<<18
    assert p.codes[:3].tolist() == [0x1F, 0x03, 0x04]
    assert dequantize(p)[:4].tolist() == [28.0, 1.0, 0.0, 0.0625]


def test_mxfp8_e4m3_known_vector():
    x = torch.zeros(32)
    x[:5] = torch.tensor([448.0, 1.0, -2.0, 2.0**-9, -0.0])
    p = quantize(x, "mxfp8")
    assert p.scales.tolist() == [127]
    assert p.codes[:5].tolist() == [0x7E, 0x38, 0xC0, 0x01, 0x00]


def test_mxfp8_elements_match_torch_float8_e4m3fn_cast():
    x = awkward("gauss", 32 * 200, seed=1)
    p = quantize(x, "mxfp8")
    X = p.scales.long() - 127
    w = x.view(-1, 32) / (2.0 ** X.double())[:, None].float()
    assert torch.equal(p.codes.view(-1, 32), w.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("name", ["mxfp4", "mxfp6", "mxfp8"])
@pytest.mark.parametrize("kind", ["gauss", "student", "outlier"])
def test_mx_decode_is_the_nearest_grid_value_of_a_float64_reference(name, kind):
    x = awkward(kind, 32 * 64 + 5, seed=2)
    y = dequantize(quantize(x, name)).double()
    ref = mx_reference(x, *PARAMS[name])
    # identical except at exact ties, where both neighbours are equally near
    diff = (y - ref).abs() > 0
    gap = ((y - x.double()).abs()[diff] - (ref - x.double()).abs()[diff]).abs()
    assert gap.numel() == 0 or gap.max() < 1e-12
    assert diff.float().mean() < 0.01


def test_mx_saturates_rather_than_overflowing():
    p = element_params("mxfp8")
    assert p["max_value"] == 448.0 and p["max_code"] == 0x7E
    x = torch.tensor([1.0] * 31 + [1.99])  # amax < 2 -> X = -8, 1.99 * 256 > 448 saturates
    y = dequantize(quantize(x, "mxfp8"))
    assert y[-1].item() == 448.0 / 256


# ----------------------------------------------------------------------------- ceil (non-clipping) block scale


def test_ceil_scale_spec_round_trips_and_floor_is_the_default():
    from noloco.quant import QuantSpec

    assert str(QuantSpec.parse("mxfp4:ceil+hadamard")) == "mxfp4:ceil+hadamard"
    assert QuantSpec.parse("mxfp8:floor") == QuantSpec.parse("mxfp8")
    assert QuantSpec.parse("mxfp8").mx_scale == "floor"
    with pytest.raises(ValueError):
        QuantSpec.parse("mxfp4:g64")


def test_ceil_scale_keeps_the_block_max_that_the_ocp_floor_scale_clips():
    x = torch.zeros(32)
    x[0] = 7.5  # floor: X = 0, 7.5 saturates to 6; ceil: X = 1, 7.5 / 2 = 3.75 -> 4 -> 8
    assert dequantize(quantize(x, "mxfp4"))[0].item() == 6.0
    p = quantize(x, "mxfp4:ceil")
    assert p.scales.tolist() == [128] and dequantize(p)[0].item() == 8.0
    y = torch.tensor([1.0] * 31 + [1.99])  # E4M3: floor gives 448 / 256 = 1.75, ceil 256 / 128 = 2.0
    assert dequantize(quantize(y, "mxfp8:ceil"))[-1].item() == 2.0


@pytest.mark.parametrize("name", ["mxfp4", "mxfp6", "mxfp8"])
def test_ceil_scale_never_saturates_and_only_differs_where_floor_would_clip(name):
    from noloco.quant import Packed

    p_ = element_params(name)
    x = awkward("student", 32 * 300, seed=5)
    floor, ceil = quantize(x, name), quantize(x, f"{name}:ceil")
    amax = x.view(-1, 32).abs().amax(1)
    Xf, Xc = floor.scales.long() - 127, ceil.scales.long() - 127
    clips = amax / 2.0 ** Xf.double() > p_["max_value"]
    assert torch.equal(Xc, Xf + clips.long())
    assert (amax / 2.0 ** Xc.double() <= p_["max_value"]).all()
    q = Packed.from_bytes(ceil.to_bytes())
    assert str(q.spec) == f"{name}:ceil" and torch.equal(dequantize(q), dequantize(ceil))
