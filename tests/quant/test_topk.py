"""Chunked top-k (optionally over the DCT-II of each chunk): selection, ties, sizes, wire checks, error feedback."""

import math
import struct
import zlib

import pytest
import torch

from noloco.quant import ErrorFeedback, Packed, PayloadError, QuantSpec, dequantize, quantize
from noloco.quant.intq import pack_bits, unpack_bits
from noloco.quant.topk import dct2, idct2


@pytest.mark.parametrize(
    "bad, match",
    [
        ("topk:65/64+int2", "K must be in 1..C"),
        ("topk:0/64+int2", "K must be in 1..C"),
        ("topk:4/100+int2", "power of two"),
        ("topk:4/131072+int2", "power of two"),
        ("topk:4/64+nope", "bad value codec"),
        ("topk:4/64", "names no value codec"),
        ("topk:4/64+dct", "names no value codec"),
        ("topk4/64+int2", "must read"),
        ("topk:4/64+topk:2/4+int2", "cannot be top-k"),
        ("topk:4/64+int2+hadamard", "cannot be top-k or rotated"),
    ],
)
def test_bad_spellings_fail_with_one_line(bad, match):
    with pytest.raises(ValueError, match=match) as err:
        QuantSpec.parse(bad)
    assert "\n" not in str(err.value)


def test_spelling_round_trips_and_index_bits_fit_the_chunk():
    for text, bits in [
        ("topk:64/4096+int2", 12),
        ("topk:8/4096+dct+sign", 12),
        ("topk:1/2+fp32", 1),
        ("topk:3/64+int4:g64:sym", 6),
    ]:
        spec = QuantSpec.parse(text)
        assert str(spec) == text and QuantSpec.parse(str(spec)) == spec and spec.bits == bits and spec.sparse


@pytest.mark.parametrize("n", [0, 1, 3, 63, 64, 65, 200, 4096 + 5])
@pytest.mark.parametrize("name", ["topk:4/64+fp32", "topk:4/64+int2", "topk:4/64+dct+int3", "topk:2/16+sign"])
def test_awkward_sizes_keep_k_per_chunk_and_round_trip(name, n):
    spec = QuantSpec.parse(name)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    p = quantize(x, spec)
    full, tail = divmod(n, spec.group)
    assert spec.selected(n) == full * spec.topk + min(spec.topk, tail)
    assert p.indices.numel() == -(-spec.selected(n) * spec.bits // 8)
    assert len(p.to_bytes()) == p.nbytes
    y = dequantize(Packed.from_bytes(p.to_bytes()))
    assert torch.equal(y, dequantize(p)) and y.shape == x.shape


def test_fp32_values_keep_exactly_the_k_largest_magnitudes_per_chunk():
    x = torch.randn(64 * 3 + 10, generator=torch.Generator().manual_seed(3))
    y = dequantize(quantize(x, "topk:5/64+fp32"))
    for start in range(0, x.numel(), 64):
        seg, out = x[start : start + 64], y[start : start + 64]
        keep = seg.abs().topk(min(5, seg.numel())).indices
        expect = torch.zeros_like(seg)
        expect[keep] = seg[keep]
        assert torch.equal(out, expect)


def test_ties_go_to_the_lower_index_and_zero_chunks_send_lowest_zeros():
    x = torch.zeros(32)
    x[[3, 9, 20, 30]] = torch.tensor([1.0, -1.0, 1.0, -1.0])  # four equal magnitudes, keep 2
    p = quantize(x, "topk:2/16+fp32")  # chunk 0 = [0, 16), chunk 1 = [16, 32)
    assert unpack_bits(p.indices, 4, 4).tolist() == [3, 9, 4, 14]  # chunk 1: 20 - 16 = 4, 30 - 16 = 14
    z = quantize(torch.zeros(20), "topk:3/16+int2")
    assert unpack_bits(z.indices, 5, 4).tolist() == [0, 1, 2, 0, 1]
    assert torch.equal(dequantize(z), torch.zeros(20))


def test_dct_is_orthonormal_dct_ii_for_any_length():
    for n in (1, 5, 16, 64):
        k, m = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        mat = torch.cos(math.pi * (2 * m + 1) * k / (2 * n)) * math.sqrt(2 / n)
        mat[0] /= math.sqrt(2)
        x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
        assert torch.allclose(dct2(x), (x.double() @ mat.double().T).float(), atol=1e-5)
        assert torch.allclose(idct2(dct2(x)), x, atol=1e-5)


def test_dct_selection_captures_smooth_chunks():
    t = torch.arange(4096, dtype=torch.float32)
    x = torch.cos(t * 0.01) + 0.5 * torch.cos(t * 0.003)
    plain = dequantize(quantize(x, "topk:8/1024+fp32"))
    dct = dequantize(quantize(x, "topk:8/1024+dct+fp32"))
    assert float((dct - x).norm()) < 0.2 * float((plain - x).norm())


@pytest.mark.parametrize("name", ["topk:4/64+int2", "topk:4/64+dct+fp32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_refused(name, bad):
    x = torch.randn(100)
    x[70] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, name)


def _forge(p: Packed, **sections) -> bytes:
    fields = {k: getattr(p, k) for k in ("codes", "scales", "zero_points", "mins", "indices")}
    fields.update(sections)
    return Packed(p.spec, p.shape, p.dtype, **fields).to_bytes()


def test_lying_indices_and_values_are_refused_before_decoding():
    x = torch.randn(64 + 20, generator=torch.Generator().manual_seed(5))  # one full chunk of 64, a tail of 20
    p = quantize(x, "topk:4/64+int2")
    idx = unpack_bits(p.indices, 8, 6)
    for forged, why in [([0, 0, 5, 9], "duplicated"), ([9, 5, 3, 1], "not ascending"), ([1, 2, 3, 20], "range")]:
        forged = torch.tensor(forged)
        bad = torch.cat([forged, idx[4:]]) if why != "range" else torch.cat([idx[:4], forged])
        with pytest.raises(PayloadError, match="top-k indices"):
            Packed.from_bytes(_forge(p, indices=pack_bits(bad, 6)))
    with pytest.raises(PayloadError, match="zero point"):
        Packed.from_bytes(_forge(p, zero_points=torch.tensor([9], dtype=torch.uint8)))
    b = p.to_bytes()
    with pytest.raises(PayloadError, match="checksum"):
        Packed.from_bytes(b[:-3])
    # a header that claims fewer kept values than the payload holds (checksum recomputed): refused on the length
    other = quantize(torch.randn(84), "topk:8/64+int2").to_bytes()[:-4].replace(b"topk:8/64", b"topk:4/64")
    with pytest.raises(PayloadError, match="declared payload length"):
        Packed.from_bytes(other + struct.pack("<I", zlib.crc32(other)))


def test_a_forged_dct_payload_that_overflows_is_refused():
    p = quantize(torch.randn(2), "topk:2/2+dct+fp32")
    huge = torch.full((2,), 3e38).view(torch.uint8)  # x0 = (c0 + c1) / sqrt(2) overflows
    with pytest.raises(PayloadError, match="non-finite"):
        dequantize(Packed.from_bytes(_forge(p, codes=huge)))
    with pytest.raises(ValueError, match="non-finite"):  # and the encoder refuses input whose transform overflows
        quantize(torch.full((2,), 3e38), "topk:2/2+dct+fp32")


@pytest.mark.parametrize("name", ["topk:4/64+int2", "topk:4/64+dct+int2", "topk:8/64+sign", "topk:4/64+fp32"])
def test_error_feedback_keeps_everything_not_sent_and_stays_bounded(name):
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(name)
    sent, total = torch.zeros(256), torch.zeros(256)
    for _ in range(1000):
        x = torch.randn(256, generator=gen)
        total += x
        sent += dequantize(ef.quantize(x, "k"))
    assert torch.allclose(total - sent, ef.residual("k"), atol=2e-3)
    # keeping 1/16 of the values the residual settles near sqrt(C/K) inputs' worth; a leak would grow as sqrt(t)
    assert float(ef.residual("k").norm()) < 16.0 * 16


def test_error_feedback_decay_shrinks_what_is_kept():
    gen = torch.Generator().manual_seed(0)
    plain, decayed = ErrorFeedback("topk:4/64+fp32"), ErrorFeedback("topk:4/64+fp32", decay=0.5)
    for _ in range(50):
        x = torch.randn(256, generator=gen)
        plain.quantize(x, "k"), decayed.quantize(x, "k")
    assert float(decayed.residual("k").norm()) < 0.7 * float(plain.residual("k").norm())  # ~15 vs ~26
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            ErrorFeedback("int4", decay=bad)
