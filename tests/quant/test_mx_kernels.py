"""MX element encoding/decoding in the Triton kernels: bit-exact with the torch reference on every edge case.

The kernels build MX element codes by direct bit construction (integer round-half-to-even for normal elements,
one fp32 addition for subnormal ones) and decode them the same way; the torch reference in ``mx.py`` searches the
exponent and rounds a scaled value. These tests sweep the element grids densely -- every grid point, every tie,
the fp32 neighbours of each tie, saturation, zeros and -0, fp32 subnormals, extreme block scales, tail blocks --
through quantize, error feedback (which decodes in-kernel) and dequantize-accumulate-requantize.
"""

import pytest
import torch

from noloco.quant import ErrorFeedback, dequantize, dequantize_accumulate_requantize, quantize
from noloco.quant.mx import element_params

from .helpers import mx_grid

GRIDS = {"mxfp4": (2, 1, 1), "mxfp8": (4, 3, 6)}  # e bits, m bits, top mantissa of the last binade
FORMATS = ["mxfp4", "mxfp8", "mxfp4:ceil", "mxfp8:ceil"]  # OCP floor scale and the non-clipping ceil scale


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.sections(), b.sections()))


def _neighbours(v: torch.Tensor) -> torch.Tensor:
    """v and its fp32 neighbours one ulp below and above."""
    return torch.cat([v, torch.nextafter(v, torch.full_like(v, -1e38)), torch.nextafter(v, torch.full_like(v, 1e38))])


def _element_sweep(name: str) -> torch.Tensor:
    """Element-domain values (block scale 1) covering the grid, its ties and their neighbours, beyond the top."""
    e, m, top = GRIDS[name]
    grid = torch.tensor(mx_grid(e, m, top), dtype=torch.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    emax_val = grid[-1].item()
    extra = torch.tensor(
        [
            0.0,
            emax_val * 1.01,
            emax_val * 1.2,
            2.0 ** (element_params(name)["emax"] + 1) * 0.999,
            grid[1].item() / 4,
            grid[1].item() / 2 * 0.999,
            1e-30,
            2.0**-140,
        ]
    )
    dense = torch.linspace(0, emax_val * 1.3, 4001, dtype=torch.float64)
    vals = _neighbours(torch.cat([grid, mids, extra, dense]).float())
    return torch.cat([vals, -vals])


def _blocks(values: torch.Tensor, lead: float) -> torch.Tensor:
    """Pack ``values`` 31 per block behind a leading element ``lead`` that fixes each block's scale."""
    per = 31
    pad = (-values.numel()) % per
    values = torch.cat([values, torch.zeros(pad)]).view(-1, per)
    lead_col = torch.full((values.shape[0], 1), lead)
    return torch.cat([lead_col, values.clamp(-abs(lead), abs(lead))], dim=1).reshape(-1)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("scale_log2", [0, -20, 30, -125, -140])
def test_kernel_encodes_every_grid_point_tie_and_neighbour_like_the_reference(name, scale_log2):
    base = name.split(":")[0]
    emax = element_params(base)["emax"]
    lead = 2.0 ** (emax + 1) * 0.9999  # largest binade of the block: X = scale_log2 exactly (before clamping)
    x = _blocks(_element_sweep(base), lead) * 2.0**scale_log2  # 2**-140 makes fp32 subnormals, X clamps at -127
    x = x[:-7]  # a tail block
    ref = quantize(x, name, backend="torch")
    tri = quantize(x, name, backend="triton")
    for a, b in zip(ref.sections(), tri.sections()):
        assert torch.equal(a, b), f"{(a != b).sum().item()} mismatches"
    assert torch.equal(dequantize(tri, backend="triton"), dequantize(ref, backend="torch"))


@pytest.mark.parametrize("name", FORMATS)
def test_negative_zero_and_values_rounding_to_zero_get_code_zero(name):
    x = torch.tensor([4.0, -0.0, -1e-30, 1e-30, -(2.0**-140), 0.0] + [0.0] * 26)
    for backend in ("torch", "triton"):
        p = quantize(x, name, backend=backend)
        codes = p.codes if name.startswith("mxfp8") else torch.stack([p.codes & 15, p.codes >> 4], 1).view(-1)
        assert codes[1:6].tolist() == [0] * 5, backend


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_feedback_decode_in_kernel_matches_reference_on_the_sweep(name, dtype):
    base = name.split(":")[0]
    x = _blocks(_element_sweep(base)[::3], 2.0 ** (element_params(base)["emax"] + 1) * 0.9999).to(dtype)
    x = x[:-3]
    ef_t, ef_r = ErrorFeedback(name, backend="triton"), ErrorFeedback(name, backend="torch")
    for _ in range(2):
        assert _same(ef_t.quantize(x), ef_r.quantize(x))
        assert torch.equal(ef_t.residual(), ef_r.residual())


@pytest.mark.parametrize("name", FORMATS)
def test_requantize_decodes_and_reencodes_every_code_like_the_reference(name):
    base = name.split(":")[0]
    x = _blocks(_element_sweep(base)[::2], 2.0 ** (element_params(base)["emax"] + 1) * 0.9999)
    x = x[: x.numel() - 5]
    p = quantize(x, name)
    acc = torch.linspace(-3, 3, x.numel())
    got = dequantize_accumulate_requantize(acc, [p, p], name, backend="triton")
    want = dequantize_accumulate_requantize(acc, [p, p], name, backend="torch")
    assert _same(got, want)


@pytest.mark.parametrize("name", FORMATS)
def test_block_scales_at_the_ends_of_the_fp32_range_match_and_decode(name):
    top = torch.tensor([3.4e38, -3.0e38, 2.0**127, 1.9 * 2.0**127])
    x = torch.cat([_blocks(top, 3.39e38), _blocks(torch.tensor([1e-38, 1e-45, 3e-39]), 1.1e-38)])
    ref = quantize(x, name, backend="torch")
    tri = quantize(x, name, backend="triton")
    assert _same(ref, tri)
    back = type(ref).from_bytes(tri.to_bytes())  # the capped ceil scale is still one a decoder accepts
    assert torch.equal(dequantize(back), dequantize(ref, backend="torch"))
    assert torch.isfinite(dequantize(back)).all()
