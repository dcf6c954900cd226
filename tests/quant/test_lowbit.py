"""int2 / int3 (zero-aware group-wise) and the 1-bit sign codec: exact packing, payload sizes, math, refusals."""

import pytest
import torch

from noloco.quant import ErrorFeedback, Packed, PayloadError, QuantSpec, dequantize, quantize
from noloco.quant.intq import pack_bits, unpack_bits

SIZES = [0, 1, 7, 8, 9, 127, 128, 129, 1000]


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 12, 16])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33])
def test_bit_stream_packing_is_exact_and_little_endian(bits, n):
    q = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack_bits(q, bits)
    assert packed.numel() == -(-n * bits // 8)
    assert torch.equal(unpack_bits(packed, n, bits), q.int())
    if n:  # element 0 sits in the lowest bits of byte 0
        assert int(packed[0]) & ((1 << min(bits, 8)) - 1) == int(q[0]) & ((1 << min(bits, 8)) - 1)


def test_int3_packs_eight_codes_into_three_bytes():
    q = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    word = sum(int(c) << (3 * i) for i, c in enumerate(q))
    assert pack_bits(q, 3).tolist() == [word & 255, (word >> 8) & 255, word >> 16]


@pytest.mark.parametrize(
    "name", ["int2", "int3", "int2:g16", "int3:g4096", "int2:sym", "int3:naive", "sign", "sign:g16"]
)
@pytest.mark.parametrize("n", SIZES)
def test_payload_size_is_what_the_spec_promises_and_round_trips(name, n):
    spec = QuantSpec.parse(name)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    p = quantize(x, spec)
    groups = -(-n // spec.group)
    per_group = 2 + (spec.mode == "zero" and spec.kind == "int") + 2 * (spec.mode == "naive")
    assert spec.payload_nbytes(n) == -(-n * spec.bits // 8) + groups * per_group
    assert len(p.to_bytes()) == p.nbytes
    q = Packed.from_bytes(p.to_bytes())
    assert torch.equal(dequantize(q), dequantize(p))
    assert dequantize(p).shape == x.shape


@pytest.mark.parametrize("bits", [2, 3])
def test_int_low_bits_follow_the_zero_aware_formula(bits):
    x = torch.randn(300, generator=torch.Generator().manual_seed(bits))
    x[5] = 0.0
    y = dequantize(quantize(x, f"int{bits}"))
    L = (1 << bits) - 1
    for g in range(3):
        seg, out = x[128 * g : 128 * (g + 1)], y[128 * g : 128 * (g + 1)]
        step = (seg.max().clamp_min(0) - seg.min().clamp_max(0)) / L
        assert float((seg - out).abs().max()) <= float(step) * 0.51
    assert float(y[5]) == 0.0  # zero is on the grid


def test_sign_uses_the_group_mean_magnitude_and_zero_decodes_to_plus_scale():
    x = torch.tensor([1.0, -3.0, 0.0, 2.0] * 8)  # one group of 32 (g16: two groups)
    y = dequantize(quantize(x, "sign:g16"))
    s = float(torch.tensor(1.5).to(torch.bfloat16).float())
    assert y.tolist() == [s, -s, s, s] * 8
    assert float(dequantize(quantize(torch.tensor([-0.0]), "sign"))[0]) == 0.0  # all-zero group: s = 0


def test_sign_scale_is_independent_of_summation_order_and_keeps_the_tail_mean():
    x = torch.randn(200, generator=torch.Generator().manual_seed(1)) * 1e-30
    y = dequantize(quantize(x, "sign"))
    tail = x[128:].abs().mean()
    assert abs(float(y[128:].abs()[0]) - float(tail)) <= float(tail) * 2**-8
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(dequantize(quantize(x[:128][perm], "sign")).abs(), y[:128].abs())


@pytest.mark.parametrize("name", ["int2", "int3", "sign"])
def test_all_zero_groups_decode_to_exact_zeros(name):
    assert torch.equal(dequantize(quantize(torch.zeros(300), name)), torch.zeros(300))


@pytest.mark.parametrize("name", ["int2", "int3", "sign"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(name, bad):
    x = torch.randn(200)
    x[150] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, name)


def _forge(p: Packed, **sections) -> bytes:
    """``p`` with some sections replaced, serialized with a valid checksum (a forger's payload)."""
    fields = {k: getattr(p, k) for k in ("codes", "scales", "zero_points", "mins", "indices")}
    fields.update(sections)
    return Packed(p.spec, p.shape, p.dtype, **fields).to_bytes()


def test_lying_low_bit_payloads_are_refused():
    x = torch.randn(101)
    p2, p3, ps = quantize(x, "int2"), quantize(x, "int3"), quantize(x, "sign")
    codes = p2.codes.clone()
    codes[-1] |= 0xC0  # 101 * 2 bits: the top 6 bits of the last byte are padding
    with pytest.raises(PayloadError, match="padding"):
        Packed.from_bytes(_forge(p2, codes=codes))
    codes = p3.codes.clone()
    codes[-1] |= 0x80  # 303 bits: the top bit is padding
    with pytest.raises(PayloadError, match="padding"):
        Packed.from_bytes(_forge(p3, codes=codes))
    with pytest.raises(PayloadError, match="zero point"):
        Packed.from_bytes(_forge(p2, zero_points=torch.tensor([4], dtype=torch.uint8)))
    for bits in (-1, 0x7F80, 0x7FC0):
        with pytest.raises(PayloadError, match="sign scale"):
            Packed.from_bytes(_forge(ps, scales=torch.tensor([bits], dtype=torch.int16)))
    codes = ps.codes.clone()
    codes[-1] |= 0x80  # 101 bits: the top 3 bits are padding
    with pytest.raises(PayloadError, match="padding"):
        Packed.from_bytes(_forge(ps, codes=codes))
    b = p3.to_bytes()
    for cut in (1, 5, len(b) // 2):
        with pytest.raises(PayloadError):
            Packed.from_bytes(b[:-cut])


@pytest.mark.parametrize("name", ["int2", "int3", "sign", "int2:stochastic"])
def test_error_feedback_stays_bounded_over_1000_calls(name):
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(name)
    sent = torch.zeros(256)
    total = torch.zeros(256)
    for _ in range(1000):
        x = torch.randn(256, generator=gen)
        total += x
        sent += dequantize(ef.quantize(x, "k", generator=gen))
    # what was sent tracks what came in: the gap is exactly the last residual, and that stays O(one input)
    assert torch.allclose(total - sent, ef.residual("k"), atol=1e-3)
    assert float(ef.residual("k").norm()) < 5 * 16.0  # ||x|| ~ 16 for 256 standard normals
