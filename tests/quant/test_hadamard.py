import pytest
import torch

from noloco.quant import QuantSpec, dequantize, quantize
from noloco.quant.hadamard import factors, rotate, unrotate

from .helpers import awkward, rel_l2


@pytest.mark.parametrize("text", ["int4+hadamard", "int4+hadamard:b16:s3", "mxfp8+hadamard:b1024"])
def test_rotation_is_orthonormal_and_inverts(text):
    spec = QuantSpec.parse(text)
    h, d = factors(spec, torch.device("cpu"))
    assert torch.allclose(h.double() @ h.double().T, torch.eye(h.shape[0], dtype=torch.float64), atol=1e-6)
    assert set(d.tolist()) <= {-1.0, 1.0}
    x = awkward("gauss", 3 * spec.hadamard_block + 5, seed=1)
    y = rotate(x, spec)
    assert y.numel() == 4 * spec.hadamard_block
    assert torch.allclose(y.norm(), x.norm(), rtol=1e-5)
    assert torch.allclose(unrotate(y, spec, x.numel()), x, atol=1e-5)


def test_seed_changes_the_signs_and_travels_in_the_spec():
    a = factors(QuantSpec.parse("int4+hadamard:s1"), torch.device("cpu"))[1]
    b = factors(QuantSpec.parse("int4+hadamard:s2"), torch.device("cpu"))[1]
    assert not torch.equal(a, b)
    assert str(QuantSpec.parse("int4+hadamard:s2")) == "int4+hadamard:s2"


def test_rotation_lowers_int4_error_on_heavy_tailed_data():
    torch.manual_seed(0)
    x = torch.distributions.StudentT(2.0).sample((1 << 15,))
    plain = rel_l2(dequantize(quantize(x, "int4")), x)
    rotated = rel_l2(dequantize(quantize(x, "int4+hadamard")), x)
    assert rotated < 0.7 * plain
