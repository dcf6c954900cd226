"""The coset code (noloco.quant.coset, CosetCodec): exact against a close receiver, wraps where it says, the bytes,
refusals of inputs and payloads no encoder writes, and error feedback that stays bounded."""

from __future__ import annotations

import pytest
import torch

from noloco.collectives.codec import CosetCodec, PayloadMismatch, get_codec
from noloco.quant import coset

SIZES = [1, 127, 128, 129, 1000, 4096 + 5]


def _close(numel: int, distance: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A sender's values and a receiver's within ``distance`` of them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * 0.08  # max |x| / 8 stays under the spreads used (coset.FLOOR_RATIO)
    return x, x + (torch.rand(numel, generator=gen) * 2 - 1) * distance


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("bits", [3, 4, 5, 8])
def test_a_receiver_within_the_spread_decodes_the_senders_grid_value_exactly(bits, numel):
    x, y = _close(numel, 0.05, seed=bits + numel)
    codec = get_codec(f"coset{bits}:m2").with_spread(torch.full((coset.blocks(numel),), 0.05))
    body, value = codec.encode_with_value(x)
    assert len(body) == codec.nbytes(numel)
    decoded = codec.decode(body, numel, side=y)
    assert torch.equal(decoded, value)
    exps = torch.frombuffer(bytearray(body[: coset.blocks(numel)]), dtype=torch.int8).to(torch.int32)
    step = torch.ldexp(torch.ones(numel, dtype=torch.float64), exps.repeat_interleave(coset.BLOCK)[:numel])
    assert bool(((value.double() - x.double()).abs() <= step / 2).all())  # the grid's rounding, no more
    room = (1 << (bits - 1)) - 2  # the levels a distance may use; error feedback's half steps take the rest
    assert bool((step * room >= 2 * 0.05).all()) and bool((step * room < 4 * 0.05).all())  # margin 2, power of 2


def test_without_a_spread_the_grid_covers_twice_the_senders_range():
    x = torch.linspace(-1, 1, 1000)
    codec = get_codec("coset3")
    body, value = codec.encode_with_value(x)
    for y in (-x, torch.zeros(1000), x.flip(0) * 0.99):  # any receiver inside the same range
        assert torch.equal(codec.decode(body, 1000, side=y), value)


def test_a_receiver_beyond_the_grid_decodes_a_value_wrapped_by_whole_cycles():
    x = torch.zeros(256)
    y = torch.full((256,), 5.0)  # far outside a spread of 0.1
    codec = get_codec("coset3:m2").with_spread(torch.full((2,), 0.1))
    body, value = codec.encode_with_value(x)
    decoded = codec.decode(body, 256, side=y)
    step = 2.0 ** coset.grid_exponents(x, torch.full((2,), 0.1), 3, 2.0)[0].item()
    assert step == 0.125  # 2 × 0.1 over the 2 levels a distance may use, rounded up to a power of two
    cycles = (decoded - value) / (8 * step)
    assert not torch.equal(decoded, value)
    assert torch.equal(cycles, cycles.round()) and float((decoded - y).abs().max()) <= 4 * step


def test_the_bytes_are_the_bits_and_one_exponent_per_block():
    assert get_codec("coset3").nbytes(4096) == 32 + 1536
    assert get_codec("coset4").nbytes(1) == 16 + 16
    assert get_codec("coset3").nbytes(0) == 0
    n = 1 << 20
    assert get_codec("coset3").nbytes(n) * 8 / n == pytest.approx(3 + 8 / 128, abs=1e-3)


def test_names_margins_and_refusals():
    assert get_codec("coset3") == CosetCodec(3) and get_codec("coset3:m2").margin == 2.0
    assert get_codec("coset3:m2").name == "coset3:m2" and get_codec("coset3:m1").name == "coset3"
    assert get_codec("coset4").side_information
    assert not get_codec("int4").side_information
    for bad in ("coset9", "coset2", "coset3:m0", "coset3:mx"):
        with pytest.raises(ValueError):
            get_codec(bad)


def test_all_zero_blocks_and_ties_decode_exactly():
    x = torch.zeros(300)
    x[256:] = torch.tensor([0.5, 1.5, 2.5, -0.5] * 11)  # halfway between the points of a grid of step 1
    codec = get_codec("coset4:m2").with_spread(torch.tensor([0.0, 0.0, 3.0]))  # 2 × 3 / 6 levels: step 1
    body, value = codec.encode_with_value(x)
    assert body[:2] == bytes([0x82, 0x82]) and body[2] == 0  # exponents -126 (all zero) and 0
    assert torch.equal(value[:256], torch.zeros(256))
    assert torch.equal(value[256:260], torch.tensor([0.0, 2.0, 2.0, -0.0]))  # round half to even
    assert torch.equal(codec.decode(body, 300, side=x), value)
    assert torch.equal(codec.decode(body, 300, side=torch.zeros(300)), value)  # within 3 of every value
    again, value2 = codec.encode_with_value(x)
    assert again == body and torch.equal(value, value2)  # deterministic, round half to even


def test_a_spread_measured_too_small_does_not_shrink_the_grid_below_an_eighth_of_the_range():
    x = torch.linspace(-4, 4, 128)
    e = coset.grid_exponents(x, torch.zeros(1), 3, 2.0)
    assert 2.0 ** e.item() == 0.5  # 2 × (4 / 8) / 2 levels: a receiver within half the range still decodes exactly
    body, value = get_codec("coset3:m2").with_spread(torch.zeros(1)).encode_with_value(x)
    assert torch.equal(get_codec("coset3").decode(body, 128, side=x + 0.45), value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_is_refused(bad):
    x = torch.randn(200)
    x[17] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        get_codec("coset3").encode(x)


def test_payloads_no_encoder_writes_are_refused_before_use():
    codec = get_codec("coset3").with_spread(torch.full((3,), 0.1))
    x, y = _close(300, 0.05)
    body = bytearray(codec.encode(x))
    with pytest.raises(PayloadMismatch, match="bytes"):
        codec.decode(bytes(body[:-1]), 300, side=y)
    with pytest.raises(PayloadMismatch, match="bytes"):
        codec.decode(bytes(body), 400, side=torch.zeros(400))
    for where, byte in ((0, 0x81), (1, 0x80)):  # exponents -127 and -128
        forged = bytearray(body)
        forged[where] = byte
        with pytest.raises(PayloadMismatch, match="exponent"):
            codec.decode(bytes(forged), 300, side=y)
    forged = bytearray(body)
    forged[5] = 1  # alignment padding after the three exponents
    with pytest.raises(PayloadMismatch, match="padding"):
        codec.decode(bytes(forged), 300, side=y)
    forged = bytearray(body)
    forged[16 + 112] = 0xFF  # the last code byte's unused high bits (300 · 3 bits = 112.5 bytes)
    with pytest.raises(PayloadMismatch, match="padding"):
        codec.decode(bytes(forged), 300, side=y)
    forged = bytearray(body)
    forged[0] = 127  # a grid of 2**127: the centred residue decodes beyond fp32
    forged[16:19] = b"\x24\x49\x92"
    with pytest.raises(PayloadMismatch, match="beyond fp32"):
        codec.decode(bytes(forged), 300, side=y)
    with pytest.raises(ValueError, match="own"):
        codec.decode(bytes(body), 300)


def test_error_feedback_through_the_code_stays_bounded_over_1000_calls():
    gen = torch.Generator().manual_seed(3)
    codec = get_codec("coset3").with_spread(torch.full((8,), 0.02))
    residual = torch.zeros(1000)
    sent, total = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for _ in range(1000):
        x = torch.randn(1000, generator=gen) * 0.01
        v = x + residual
        _, value = codec.encode_with_value(v)
        residual = v - value
        sent += value.double()
        total += x.double()
        assert float(residual.abs().max()) <= 0.01  # half a grid step (0.02 / 2 levels, rounded up: 1/64)
    assert float((sent - total).abs().max()) <= 0.02  # nothing lost but the last residual


@pytest.mark.gpu
def test_cuda_encodes_and_decodes_the_same_bits_as_the_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x, y = _close(100_000, 0.05, seed=9)
    codec = get_codec("coset3").with_spread(torch.full((coset.blocks(100_000),), 0.05))
    cpu_body, cpu_value = codec.encode_with_value(x)
    gpu_body, gpu_value = codec.encode_device(x.cuda(), with_value=True)
    assert bytes(gpu_body.cpu().numpy()) == cpu_body and torch.equal(gpu_value.cpu(), cpu_value)
    on_gpu = codec.decode(gpu_body, 100_000, "cuda", side=y.cuda()).cpu()
    assert torch.equal(on_gpu, codec.decode(cpu_body, 100_000, side=y))


def test_random_payloads_decode_to_finite_values_or_are_refused():
    gen = torch.Generator().manual_seed(11)
    codec = get_codec("coset3")
    outcomes = {"decoded": 0, "refused": 0}
    for trial in range(300):
        numel = int(torch.randint(1, 700, (1,), generator=gen))
        body = torch.randint(0, 256, (codec.nbytes(numel),), generator=gen, dtype=torch.uint8)
        if trial % 2:  # a plausible body: exponents in range and zero padding, random codes
            exps, ncodes, _ = coset.layout(numel, 3)
            start = -(-exps // 16) * 16
            body[:exps] = torch.randint(-20, 20, (exps,), generator=gen, dtype=torch.int8).view(torch.uint8)
            body[exps:start] = 0
            body[start + ncodes :] = 0
            body[start + ncodes - 1] &= (1 << ((numel * 3) % 8 or 8)) - 1
        side = torch.randn(numel, generator=gen)
        try:
            out = codec.decode(bytes(body.numpy()), numel, side=side)
        except PayloadMismatch:
            outcomes["refused"] += 1
            continue
        assert out.shape == (numel,) and bool(torch.isfinite(out).all())
        outcomes["decoded"] += 1
    assert outcomes["decoded"] >= 100 and outcomes["refused"] >= 100
