"""+hadamard against hostile or extreme payloads: finite after decoding or PayloadError, and a bounded table cache."""

import math

import pytest
import torch

from noloco.quant import ErrorFeedback, Packed, PayloadError, QuantSpec, dequantize, hadamard, quantize
from noloco.quant.hadamard import cache_clear, cache_info, encode_limit, factors, rotate, signs, unrotate
from noloco.quant.intq import max_scale_bits16

F32_MAX = torch.finfo(torch.float32).max
BLOCKS = [2, 16, 128, 256, 512, 4096]


def _bf16_bits(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32)) >> 16


def _fwht64(rows: torch.Tensor) -> torch.Tensor:
    """rows @ H in float64 by the butterfly recursion (no matrix): an independent reference."""
    x = rows.double().clone()
    m, block = x.shape
    h = 1
    while h < block:
        x = x.view(m, block // (2 * h), 2, h)
        x = torch.stack([x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]], 2)
        h *= 2
    return x.reshape(m, block) / math.sqrt(block)


def _wire(p: Packed) -> Packed:
    """What a receiver holds: the payload serialized (valid CRC) and accepted by ``from_bytes``."""
    return Packed.from_bytes(p.to_bytes())


# --- the transform: dense for small blocks, Kronecker factors above, equal to fp32 rounding ---------------------


@pytest.mark.parametrize("block", [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
def test_rotation_matches_a_float64_reference_to_fp32_rounding(block):
    spec = QuantSpec.parse(f"int4+hadamard:b{block}:s9")
    rows = 32
    x = torch.randn(block * rows - 1, generator=torch.Generator().manual_seed(block))  # a padded tail
    d = signs(spec, torch.device("cpu"))
    padded = torch.zeros(block * rows)
    padded[: x.numel()] = x
    ref = _fwht64(padded.view(-1, block) * d).view(-1)
    y = rotate(x, spec)
    top = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= 1e-6 * top  # ~17 fp32 ulps of the largest value
    back = unrotate(y, spec, x.numel())
    assert back.shape == x.shape and (back.double() - x.double()).abs().max().item() <= 1e-6 * x.abs().max().item()
    if block <= hadamard.DENSE_MAX:  # the dense path is the computation of earlier versions, bit for bit
        h, _ = factors(spec, torch.device("cpu"))
        assert torch.equal(y, ((padded.view(-1, block) * d) @ h).view(-1))
        assert torch.allclose(h.double(), _fwht64(torch.eye(block)), atol=1e-7)


def test_no_table_grows_with_the_square_of_the_block():
    cache_clear()
    x = torch.randn(4096 * 3, generator=torch.Generator().manual_seed(0))
    dequantize(_wire(quantize(x, "int4+hadamard:b4096:s3")))
    biggest = max(t.numel() * t.element_size() for t in hadamard._cache._items.values())
    assert biggest <= 64 * 64 * 4 and cache_info()["bytes"] <= 3 * 64 * 64 * 4  # H_64, H_64 and d: no 64 MiB H


# --- the cache is bounded, whatever seeds and blocks the peers send ---------------------------------------------


def test_decoding_payloads_with_many_distinct_seeds_keeps_the_cache_within_its_bound():
    # What a hostile peer does: the same valid payload again and again, each time with another seed in the header.
    cache_clear()
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    honest = {b: quantize(x, f"int8+hadamard:b{b}") for b in BLOCKS}
    peak = 0
    for seed in range(1, 71):  # 50 seeds fit in the 64 entries; 70 also exercise the eviction
        block = BLOCKS[seed % len(BLOCKS)]
        base = honest[block]
        forged = Packed(
            QuantSpec.parse(f"int8+hadamard:b{block}:s{seed}"),
            base.shape,
            base.dtype,
            codes=base.codes,
            scales=base.scales,
            zero_points=base.zero_points,
        )
        y = dequantize(_wire(forged))
        assert y.shape == x.shape and torch.isfinite(y).all()
        info = cache_info()
        assert info["entries"] <= hadamard.CACHE_MAX_ENTRIES and info["bytes"] <= hadamard.CACHE_MAX_BYTES
        peak = max(peak, info["bytes"])
        if seed == 50:
            assert info["entries"] <= 50 + 2 * len(BLOCKS)  # one d per seed, one H (or two factors) per block
    assert cache_info()["entries"] == hadamard.CACHE_MAX_ENTRIES  # full, and not beyond
    assert peak <= 2 << 20  # the old caches held one 64 MiB H per b4096 seed


def test_an_evicted_table_is_rebuilt_identically():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    spec = "int4+hadamard:b512:s77"
    payload = quantize(x, spec).to_bytes()
    first = dequantize(Packed.from_bytes(payload))
    cache_clear()
    assert cache_info()["entries"] == 0
    for seed in range(hadamard.CACHE_MAX_ENTRIES + 5):  # push everything out
        rotate(x, QuantSpec.parse(f"int4+hadamard:b16:s{seed + 1000}"))
    assert torch.equal(dequantize(Packed.from_bytes(payload)), first)
    assert quantize(x, spec).to_bytes() == payload


# --- finite after dequantize, or PayloadError --------------------------------------------------------------------


@pytest.mark.parametrize("block", [128, 4096])
def test_forged_int4_payload_whose_inverse_rotation_overflows_is_refused(block):
    # every value of the block is c = 15 * s with s * 15 well inside fp32 (so from_bytes accepts it), but the inverse
    # rotation sums the block coherently: x_0 = c * sqrt(B) > fp32 max.
    spec = QuantSpec.parse(f"int4+hadamard:b{block}" if block != 128 else "int4+hadamard")
    s = 2.0 * F32_MAX / (15 * math.sqrt(block))
    bits = _bf16_bits(s)
    assert bits <= max_scale_bits16(15)
    groups = block // 128
    p = Packed(
        spec,
        (block,),
        torch.float32,
        codes=torch.full((block // 2,), 0xFF, dtype=torch.uint8),
        scales=torch.full((groups,), bits, dtype=torch.int16),
        zero_points=torch.zeros(groups, dtype=torch.uint8),
    )
    received = _wire(p)  # every value is in range: the wire accepts it
    with pytest.raises(PayloadError, match="non-finite values after the inverse rotation"):
        dequantize(received)


@pytest.mark.parametrize("spec", ["mxfp4+hadamard", "bf16+hadamard", "fp32+hadamard"])
def test_other_forged_payloads_whose_inverse_rotation_overflows_are_refused(spec):
    block = 128
    parsed = QuantSpec.parse(spec)
    if parsed.kind == "mx":  # E2M1 code 0b0111 = 6.0, both nibbles; X = 122: every value 6 * 2**122 = 3.2e37
        p = Packed(
            parsed,
            (block,),
            torch.float32,
            codes=torch.full((block // 2,), 0x77, dtype=torch.uint8),
            scales=torch.full((block // 32,), 127 + 122, dtype=torch.uint8),
        )
    else:  # a cast payload: every value 3.2e37, finite in bf16 / fp32
        vals = torch.full((block,), 3.2e37).to(torch.bfloat16 if parsed.name == "bf16" else torch.float32)
        p = Packed(parsed, (block,), torch.float32, codes=vals.view(torch.uint8).clone())
    with pytest.raises(PayloadError, match="non-finite"):
        dequantize(_wire(p))


def test_forged_scales_decode_finite_or_raise_payload_error_never_inf():
    """A sweep over accepted scale patterns (up to the largest the wire allows) and code patterns."""
    gen = torch.Generator().manual_seed(3)
    spec = QuantSpec.parse("int4+hadamard")
    base = quantize(torch.randn(256, generator=gen), spec)
    outcomes = {"finite": 0, "refused": 0}
    top = max_scale_bits16(15)
    for bits in list(range(top - 0x300, top + 1, 0x40)) + [top]:
        for pattern in ("max", "random"):
            codes = (
                torch.full_like(base.codes, 0xFF)
                if pattern == "max"
                else torch.randint(0, 256, base.codes.shape, generator=gen, dtype=torch.uint8)
            )
            p = Packed(
                spec,
                base.shape,
                base.dtype,
                codes=codes,
                scales=torch.full_like(base.scales, bits),
                zero_points=torch.zeros_like(base.zero_points),
            )
            received = _wire(p)
            try:
                y = dequantize(received)
            except PayloadError:
                outcomes["refused"] += 1
                continue
            assert torch.isfinite(y).all()
            outcomes["finite"] += 1
    assert outcomes["finite"] and outcomes["refused"]  # the sweep crosses the overflow edge


SPECS_AT_THE_LIMIT = [
    "int4",
    "int4:sym",
    "int4:naive",
    "int4:stochastic",
    "int8",
    "int8:sym",
    "int8:naive",
    "mxfp4",
    "mxfp4:ceil",
    "mxfp6",
    "mxfp8",
    "mxfp8:ceil",
    "bf16",
    "fp32",
]


@pytest.mark.parametrize("block", [16, 128, 4096])
@pytest.mark.parametrize("base", SPECS_AT_THE_LIMIT)
def test_honest_payloads_just_inside_the_encoder_limit_decode_finite(base, block):
    spec = QuantSpec.parse(f"{base}+hadamard:b{block}:s5")
    d = signs(spec, torch.device("cpu"))
    limit = encode_limit(block)
    spike = torch.zeros(block)
    spike[3] = 1.0  # rotates to a flat block: the inverse sums it coherently
    flat = d * (1 - 2 * (torch.arange(block) % 2)).float()  # d * sqrt(B) * row 1 of H: rotates to a single spike
    gauss = torch.randn(2 * block, generator=torch.Generator().manual_seed(block))
    for x in (spike, flat, gauss):
        x = x * (0.999 * limit / rotate(x, spec).abs().max().item())
        p = quantize(x, spec, generator=torch.Generator().manual_seed(0))
        y = dequantize(_wire(p))
        assert torch.isfinite(y).all()
        assert (y.double() - x.double()).norm() <= 0.5 * x.double().norm()


@pytest.mark.parametrize("spec", ["mxfp4+hadamard", "int4:sym+hadamard", "int8+hadamard", "bf16+hadamard:b4096"])
def test_encoders_refuse_inputs_whose_payload_could_decode_to_inf(spec):
    # A single huge value: the old encoder wrote an mxfp4/int4:sym payload that decoded to inf (rounding up in the
    # rotated domain, summed back by the inverse).
    x = torch.zeros(300)
    x[7] = 3.2e38
    with pytest.raises(ValueError, match="could decode to ±Inf"):
        quantize(x, spec)
    with pytest.raises(ValueError, match="could decode to ±Inf"):
        ErrorFeedback(spec).quantize(x, "w")
    x[7] = 0.9 * encode_limit(QuantSpec.parse(spec).hadamard_block)  # a spike rotates to |x| / sqrt(B): accepted
    assert torch.isfinite(dequantize(_wire(quantize(x, spec)))).all()
