"""Triton kernels vs the torch reference: bit-exact codes/scales for deterministic modes.

On CPU these run under TRITON_INTERPRET=1 (set by tests/conftest.py), on small sizes; the ``gpu``
tests run the compiled kernels on large tensors.
"""

import pytest
import torch

from noloco.quant import ErrorFeedback, dequantize, dequantize_accumulate, quantize
from noloco.quant.intq import bf16_bits_to_float

from .helpers import awkward

DETERMINISTIC = [
    "int4",
    "int8",
    "int4:g64",
    "int8:g256",
    "int4:sym",
    "int8:sym",
    "int4:naive",
    "int8:naive",
    "int4:g16",
    "int4:g4096",
    "mxfp4",
    "mxfp8",
    "int4+hadamard",
    "mxfp8+hadamard",
]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.sections(), b.sections()))


# (n, kind): a 1-element group (one value: its distribution does not matter), then every kind at one whole
# group and a 1-element tail, and at many groups and a tail
SIZES_AND_KINDS = [(1, "gauss")] + [(n, kind) for n in (129, 4099) for kind in ("gauss", "outlier", "zeros", "student")]


@pytest.mark.parametrize("spec", DETERMINISTIC)
@pytest.mark.parametrize("n,kind", SIZES_AND_KINDS)
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
    draws = 64  # one call on 64 copies of x (whole groups of 128): 64 independent roundings of every value
    p = quantize(x.repeat(draws), "int4:stochastic", generator=torch.Generator().manual_seed(5), backend="triton")
    mean = dequantize(p).double().view(draws, 512).mean(0)
    s = bf16_bits_to_float(p.scales).double()[:4].repeat_interleave(128)  # every copy has x's 4 group scales
    assert torch.equal(bf16_bits_to_float(p.scales).view(draws, 4), bf16_bits_to_float(p.scales)[:4].expand(draws, 4))
    assert ((mean - x.double()).abs() <= 6 * (s / 2) / draws**0.5).all()
    a = quantize(x, "int4:stochastic", generator=torch.Generator().manual_seed(1), backend="triton")
    b = quantize(x, "int4:stochastic", generator=torch.Generator().manual_seed(1), backend="triton")
    assert torch.equal(a.codes, b.codes)


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec", ["int4", "int8", "int4:sym", "int4:naive", "mxfp4", "mxfp8", "mxfp4:ceil", "mxfp8:ceil"]
)
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


# ------------------------------------------------- paired tiles, word views, in-kernel non-finite flag
# int4/MXFP4 kernels read fp32 as 64-bit and 16-bit input as 32-bit words, handle an odd last element
# separately and copy misaligned views; these pin each of those paths against the reference.

PAIRED_SPECS = ["int4", "int4:sym", "int4:naive", "int4:g16", "mxfp4", "int8"]


@pytest.mark.parametrize("spec", PAIRED_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 3, 255, 2049])  # odd sizes: the last byte holds one code
def test_paired_kernels_match_reference_for_odd_sizes_and_every_dtype(spec, dtype, n):
    x = awkward("student", n, seed=n).to(dtype)
    ref = quantize(x, spec, backend="torch")
    tri = quantize(x, spec, backend="triton")
    assert _same(ref, tri)
    assert torch.equal(dequantize(tri, backend="triton"), dequantize(ref, backend="torch"))


@pytest.mark.parametrize("spec", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_views_are_read_and_accumulated_correctly(spec, dtype):
    base = awkward("gauss", 1000, seed=4).to(dtype)
    x = base[1:]  # one element past an aligned start: not readable as whole words
    assert _same(quantize(x, spec, backend="torch"), quantize(x, spec, backend="triton"))
    ef_t, ef_r = ErrorFeedback(spec, backend="triton"), ErrorFeedback(spec, backend="torch")
    for _ in range(2):
        assert _same(ef_t.quantize(x), ef_r.quantize(x))
    assert torch.equal(ef_t.residual(), ef_r.residual())
    p = quantize(x, spec)
    buf_t, buf_r = torch.ones(1000), torch.ones(1000)
    dequantize_accumulate(buf_t[1:], [p, p], backend="triton")
    dequantize_accumulate(buf_r[1:], [p, p], backend="torch")
    assert torch.equal(buf_t, buf_r)


@pytest.mark.parametrize("spec", ["int4", "int8", "int4:sym", "int4:naive", "int8:naive", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("bad,where", [(float("nan"), 0), (float("inf"), 130), (-float("inf"), 1000)],
                         ids=["nan-first", "inf-mid-group", "neg-inf-tail"])  # every value, every position  # fmt: skip
def test_non_finite_input_is_flagged_in_every_mode_and_position(spec, bad, where):
    x = torch.randn(1001)
    x[where] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, spec, backend="triton")
    ef = ErrorFeedback(spec, backend="triton")
    ef.quantize(torch.ones(1001))
    before = ef.residual().clone()
    with pytest.raises(ValueError, match="non-finite"):
        ef.quantize(x)
    assert torch.equal(ef.residual(), before)  # residual untouched by a refused call


@pytest.mark.parametrize(
    "in_spec,out_spec",
    [("int8", "int4"), ("int4", "int8"), ("int4", "int4"), ("mxfp4", "mxfp4"), ("int4:naive", "int4:naive")],
)
@pytest.mark.parametrize("n", [2001, 2048])
def test_requantize_kernel_matches_reference_across_code_widths(in_spec, out_spec, n):
    from noloco.quant import dequantize_accumulate_requantize

    ps = [quantize(awkward("gauss", n, seed=i), in_spec) for i in range(2)]
    acc = awkward("student", n, seed=7)
    got = dequantize_accumulate_requantize(acc, ps, out_spec, backend="triton")
    want = dequantize_accumulate_requantize(acc, ps, out_spec, backend="torch")
    assert _same(got, want)
    bad = acc.clone()
    bad[n - 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        dequantize_accumulate_requantize(bad, ps, out_spec, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8"])
def test_gpu_flag_views_and_requantize(spec):
    from noloco.quant import dequantize_accumulate_requantize

    x = torch.randn((1 << 21) + 1, device="cuda")
    v = x[1:]  # misaligned for word reads
    assert _same(quantize(v, spec, backend="torch"), quantize(v, spec, backend="triton"))
    bf = x.to(torch.bfloat16)
    assert _same(quantize(bf, spec, backend="torch"), quantize(bf, spec, backend="triton"))
    ps = [quantize(torch.randn(x.numel(), device="cuda"), spec) for _ in range(2)]
    assert _same(
        dequantize_accumulate_requantize(x, ps, spec, backend="triton"),
        dequantize_accumulate_requantize(x, ps, spec, backend="torch"),
    )
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[12345] = bad
        with pytest.raises(ValueError, match="non-finite"):
            quantize(y, spec, backend="triton").check()  # deferred on CUDA: raised at the first use
        with pytest.raises(ValueError, match="non-finite"):
            ErrorFeedback(spec, backend="triton").quantize(y).check()
    assert _same(quantize(x, spec, backend="triton"), quantize(x, spec, backend="torch"))  # flag is per call
