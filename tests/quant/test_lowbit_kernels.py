"""The int2 / int3 / sign Triton kernels vs the torch reference, bit for bit (interpreter on CPU, compiled on GPU).

Kept small: the interpreter runs every lane in Python on a 2-core machine.
"""

import pytest
import torch

from noloco.quant import ErrorFeedback, dequantize, quantize
from noloco.quant import lowbit_kernels as lk
from noloco.quant.base import QuantSpec

from .helpers import awkward

SPECS = ["int2", "int3", "sign", "int3:g16", "sign:g16"]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.sections(), b.sections()))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(
    "n,kind", [(1, "gauss"), (7, "gauss"), (129, "gauss"), (129, "zeros"), (300, "outlier"), (300, "student")]
)
def test_kernel_codes_and_scales_match_the_reference_bit_for_bit(spec, n, kind):
    x = awkward(kind, n, seed=n)
    if kind == "gauss" and n > 2:
        x[::3] = 0.0
    ref = quantize(x, spec, backend="torch")
    tri = quantize(x, spec, backend="triton")
    assert _same(ref, tri)
    assert torch.equal(dequantize(tri, backend="triton"), dequantize(ref, backend="torch"))


@pytest.mark.parametrize("spec", ["int3", "sign"])
def test_kernel_reads_bf16_and_tiny_and_huge_values_like_the_reference(spec):
    x = awkward("gauss", 260, seed=3)
    x[:128] *= 1e-38  # a group of subnormal-scale values
    x[128:256] *= 1e30
    for v in (x, x.to(torch.bfloat16)):
        assert _same(quantize(v, spec, backend="torch"), quantize(v, spec, backend="triton"))


def test_kernels_serve_only_their_modes():
    assert lk.supports(QuantSpec.parse("int2")) and lk.supports(QuantSpec.parse("sign"))
    assert not any(lk.supports(QuantSpec.parse(s)) for s in ("int2:sym", "int3:naive", "int2:stochastic", "int4"))
    with pytest.raises(ValueError, match="no Triton kernel"):
        quantize(torch.randn(10), "int2:sym", backend="triton")


@pytest.mark.parametrize("spec", ["int2", "sign"])
def test_kernel_refuses_non_finite_input(spec):
    x = torch.randn(200)
    x[130] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, spec, backend="triton")


def test_error_feedback_and_top_k_values_through_the_kernels_match_the_reference():
    x = awkward("gauss", 300, seed=4)
    for spec in ("int3", "topk:8/64+int2", "topk:8/64+sign"):
        a, b = ErrorFeedback(spec, backend="torch"), ErrorFeedback(spec, backend="triton")
        for _ in range(2):
            assert _same(a.quantize(x, "k"), b.quantize(x, "k"))
        assert torch.equal(a.residual("k"), b.residual("k"))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS + ["topk:64/4096+int2", "topk:64/4096+sign"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernels_match_the_reference_on_large_tensors(spec, dtype):
    x = torch.randn((1 << 22) + 5, device="cuda").to(dtype)
    x[::5] = 0
    ref = quantize(x.cpu(), spec, backend="torch")
    tri = quantize(x, spec)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(ref.sections(), tri.sections()))
    assert torch.equal(dequantize(tri).cpu(), dequantize(ref))
