"""Triton kernels vs the torch reference: bit-exact codes/scales for deterministic modes.

On CPU these run under TRITON_INTERPRET=1 (set by tests/conftest.py), on small sizes; the ``gpu``
tests run the compiled kernels on large tensors.
"""

import pytest
import torch

from noloco.quant import ErrorFeedback, dequantize, dequantize_accumulate, quantize
from noloco.quant.intq import bf16_bits_to_float

from .helpers import awkward

DETERMINISTIC = ["int4", "int8", "int4:g64", "int8:g256", "int4:sym", "int8:sym", "int4:naive",
                 "int8:naive", "int4:g16", "int4:g4096", "mxfp4", "mxfp8", "int4+hadamard", "mxfp8+hadamard"]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.sections(), b.sections()))


@pytest.mark.parametrize("spec", DETERMINISTIC)
@pytest.mark.parametrize("n", [1, 127, 129, 4099])
@pytest.mark.parametrize("kind", ["gauss", "outlier", "zeros", "student"])
def test_triton_codes_and_scales_match_reference_bit_for_bit(spec, n, kind):
    x = awkward(kind, n, seed=n)
    if kind == "gauss" and n > 2:
        x[::3] = 0.0
    ref = quantize(x, spec, backend="torch")
    tri = quantize(x, spec, backend="triton")
    assert _same(ref, tri)
    assert torch.equal(dequantize(tri, backend="triton"), dequantize(ref, backend="torch"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_reads_every_input_dtype_like_the_reference(dtype):
    x = awkward("gauss", 3000, seed=1).to(dtype)
    for spec in ["int4", "mxfp4"]:
        assert _same(quantize(x, spec, backend="torch"), quantize(x, spec, backend="triton"))


@pytest.mark.parametrize("spec", ["int4", "mxfp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_triton_flags_non_finite_input(spec, bad):
    x = torch.randn(1000)
    x[999] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, spec, backend="triton")


def test_triton_stochastic_rounding_is_unbiased_and_seedable():
    x = awkward("gauss", 512, seed=3)
    gen = torch.Generator().manual_seed(5)
    draws = 200
    acc = torch.zeros(512, dtype=torch.float64)
    for _ in range(draws):
        p = quantize(x, "int4:stochastic", generator=gen, backend="triton")
        acc += dequantize(p).double()
    s = bf16_bits_to_float(p.scales).double().repeat_interleave(128)
    assert ((acc / draws - x.double()).abs() <= 6 * (s / 2) / draws**0.5).all()
    a = quantize(x, "int4:stochastic", generator=torch.Generator().manual_seed(1), backend="triton")
    b = quantize(x, "int4:stochastic", generator=torch.Generator().manual_seed(1), backend="triton")
    assert torch.equal(a.codes, b.codes)


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "int8", "int4:sym", "int4:naive", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernels_match_reference_bit_for_bit_on_large_tensors(spec, dtype):
    x = awkward("student", (1 << 22) + 77, seed=0).to(dtype).cuda()
    x[::5] = 0
    ref = quantize(x, spec, backend="torch")
    tri = quantize(x, spec, backend="triton")
    for a, b in zip(ref.sections(), tri.sections()):
        assert torch.equal(a, b), f"{spec} {dtype}: {(a != b).sum().item()} mismatching entries"
    assert torch.equal(dequantize(tri), dequantize(ref, backend="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4"])
def test_gpu_fused_error_feedback_and_accumulate_match_reference(spec):
    x = torch.randn((1 << 20) + 3, device="cuda")
    a, b = ErrorFeedback(spec, backend="torch"), ErrorFeedback(spec, backend="triton")
    for _ in range(3):
        pa, pb = a.quantize(x), b.quantize(x)
        assert _same(pa, pb)
    assert torch.equal(a.residual(), b.residual())
    ps = [quantize(torch.randn(x.numel(), device="cuda"), spec) for _ in range(5)]
    acc_t, acc_r = torch.zeros_like(x), torch.zeros_like(x)
    dequantize_accumulate(acc_t, ps, backend="triton")
    dequantize_accumulate(acc_r, ps, backend="torch")
    assert torch.equal(acc_t, acc_r)


@pytest.mark.gpu
def test_gpu_payload_round_trips_through_bytes():
    from noloco.quant import Packed

    x = torch.randn(12345, device="cuda")
    p = quantize(x, "int4")
    q = Packed.from_bytes(p.to_bytes(), device="cuda")
    assert torch.equal(dequantize(q), dequantize(p))
