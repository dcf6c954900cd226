import pytest
import torch

from noloco.quant import QuantSpec

from .helpers import ALL_SPECS


@pytest.mark.parametrize("text", ALL_SPECS + ["int8:g256:naive:stochastic", "mxfp8+hadamard:b64:s7"])
def test_spec_string_round_trips_through_parse(text):
    spec = QuantSpec.parse(text)
    assert QuantSpec.parse(str(spec)) == spec


def test_spec_defaults_match_design():
    s = QuantSpec.parse("int4")
    assert (s.kind, s.bits, s.group, s.mode, s.stochastic, s.hadamard) == ("int", 4, 128, "zero", False, False)
    assert QuantSpec.parse("mxfp6").group == 32
    assert QuantSpec.parse("int4+hadamard").hadamard_block == 128


@pytest.mark.parametrize(
    "bad",
    ["", "int5", "int4:g100", "int4:g8", "int4:foo", "mxfp4:g64", "int4+rot", "int4+hadamard:b100", "fp64", "x" * 80],
)
def test_bad_spec_strings_raise_value_error(bad):
    with pytest.raises(ValueError):
        QuantSpec.parse(bad)


def test_bits_per_element_match_design():
    n = 1 << 20
    assert QuantSpec.parse("int4").bits_per_element(n) == pytest.approx(4 + 24 / 128)
    assert QuantSpec.parse("int8").bits_per_element(n) == pytest.approx(8 + 24 / 128)
    assert QuantSpec.parse("mxfp4").bits_per_element(n) == pytest.approx(4.25)
    assert QuantSpec.parse("mxfp6").bits_per_element(n) == pytest.approx(6.25)
    assert QuantSpec.parse("mxfp8").bits_per_element(n) == pytest.approx(8.25)
    assert QuantSpec.parse("int4:sym").bits_per_element(n) == pytest.approx(4 + 16 / 128)


def test_payload_layout_counts_tail_groups():
    spec = QuantSpec.parse("int4")
    layout = {name: count for name, _, count in spec.layout(129)}
    assert layout == {"codes": 65, "scales": 2, "zero_points": 2}
    assert spec.payload_nbytes(0) == 0
    assert torch.empty(0).numel() == 0
