"""Fuzz of what a reduction decodes from a peer: the message header, the codecs, and a whole allreduce.

- ``protocol``: ``Exchange.recv`` (``Header.unpack`` + the field-by-field check) returns a body only for
  a header identical to the one expected; anything else raises ``PayloadMismatch`` (``RemoteFailure``
  for an error marker) or ``CommTimeout`` (a marker saying the peer timed out).
- ``codec``: the decode path of allreduce (``Codec.decode`` then ``Exchange.check_finite``) returns a
  1-D float32 tensor of exactly the expected numel with finite values, or raises ``PayloadMismatch``.
- ``allreduce``: one member of a real reduction over the in-process fabric sends one mutated message;
  every honest member either returns a finite result of the right shape or raises ``PayloadMismatch``
  / ``CommError`` quickly, and its input tensor and error-feedback residuals are untouched when it fails.
"""

from __future__ import annotations

import struct
import zlib

import torch
from hypothesis import given
from hypothesis import strategies as st

from noloco.collectives import (
    Fp32Codec,
    NormRejections,
    PayloadMismatch,
    QuantCodec,
    ReductionErrorFeedback,
    allreduce,
    segment_bounds,
)
from noloco.collectives.protocol import HEADER_BYTES, CallInfo, Exchange
from noloco.comm import LocalFabric
from noloco.comm.base import CommError, CommTimeout, Transport

from .fuzzing import fuzz_settings, mutate, plan_mutation, record

# ----------------------------------------------------------------------------------------- protocol header

INFO = CallInfo("two_phase", "mean", torch.float32, (0, 3, 5), 0, 1000, "int4|int4", "outer/r7/delta")
# (offset, size) of every header field after the magic (see noloco.collectives.protocol)
HEADER_FIELDS = [(2, 1, "little"), (3, 1, "little"), (4, 1, "little"), (5, 1, "little"), (6, 1, "little"),
                 (7, 1, "little"), (8, 2, "little"), (10, 2, "little"), (12, 2, "little"), (14, 2, "little"),
                 (16, 8, "little"), (24, 4, "little"), (28, 4, "little")]  # fmt: skip


class Replay(Transport):
    """Hands out one given payload to every ``recv``; sends nothing (a stub peer)."""

    def __init__(self, payload: bytes):
        self.payload, self.rank, self.world_size = payload, 0, 6

    def send(self, dst, tag, payload):
        raise AssertionError("the receiver must not send while checking a header")

    def recv(self, src, tag, timeout):
        return self.payload


def test_mutated_message_headers_are_accepted_only_when_identical_to_the_expected_one():
    expected = INFO.header(phase=0, sender=1, segment=0).pack()
    valid = expected + b"body bytes"

    @fuzz_settings(1500)
    @given(data=st.data())
    def run(data):
        _, payload = mutate(data, valid, boundaries=[2, 3, 4, 8, 16, 24, 28, HEADER_BYTES], fields=HEADER_FIELDS)
        ex = Exchange(Replay(payload), INFO, timeout=1.0)
        try:
            body = ex.recv(1, 0, 0)
        except (PayloadMismatch, CommTimeout) as exc:
            assert str(exc)  # a reason the operator can read
            record("collectives message header", False)
            return
        record("collectives message header", True)
        assert payload[:HEADER_BYTES] == expected and body == payload[HEADER_BYTES:]

    run()


# ----------------------------------------------------------------------------------------- codecs

CODEC_SPECS = [
    "fp32",
    "int4",
    "int8",
    "int4:g64",
    "mxfp4",
    "mxfp6",
    "mxfp8",
    "bf16",
    "fp16",
    "int4+hadamard",
    "int2",
    "int3",
    "sign",
    "topk:8/64+int2",
    "topk:8/64+dct+int3",
]
NUMEL = 301


def _codec_sample(name: str):
    codec = Fp32Codec() if name == "fp32" else QuantCodec(name)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(len(name)))
    payload = codec.encode(x)
    if isinstance(codec, Fp32Codec):
        return codec, payload, [4 * k for k in (1, NUMEL // 2, NUMEL - 1)], [(4 * k, 4, "little") for k in (0, 7)], None
    slen = len(codec.name)
    boundaries = [8, 8 + slen, 16 + slen, 24 + slen, len(payload) - 4]
    fields = [(5, 1, "little"), (6, 1, "little"), (8 + slen, 8, "little"), (16 + slen, 8, "little"),
              (24 + slen, 2, "little")]  # fmt: skip
    return codec, payload, boundaries, fields, lambda b: b[:-4] + struct.pack("<I", zlib.crc32(b[:-4]))


CODEC_SAMPLES = {name: _codec_sample(name) for name in CODEC_SPECS}


def test_mutated_codec_payloads_decode_to_the_expected_numel_or_raise_payload_mismatch():
    @fuzz_settings(1500)
    @given(name=st.sampled_from(CODEC_SPECS), data=st.data())
    def run(name, data):
        codec, payload, boundaries, fields, reseal = CODEC_SAMPLES[name]
        _, mutated = mutate(data, payload, boundaries, fields, reseal)
        ex = Exchange(Replay(b""), INFO, timeout=1.0)
        try:
            value = codec.decode(mutated, NUMEL)
            ex.check_finite(value, 1, 0)  # what two-phase and ring do with every decoded payload
        except PayloadMismatch:
            record("collectives codec decode", False)
            return
        record("collectives codec decode", True)
        assert value.shape == (NUMEL,) and value.dtype == torch.float32 and bool(torch.isfinite(value).all())

    run()


# ----------------------------------------------------------------------------------------- whole allreduce

WORLD = 3
ALLREDUCE_CODECS = ["fp32", "int4", "int8", "mxfp4"]


class Malicious(Transport):
    """Sends its ``target``-th message mutated by ``corrupt``; everything else as an honest member would."""

    def __init__(self, inner: Transport, target: int, corrupt):
        self.inner, self.target, self.corrupt = inner, target, corrupt
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter
        self.sent = 0

    def send(self, dst, tag, payload):
        if self.sent == self.target:
            payload = self.corrupt(bytes(payload))
        self.sent += 1
        self.inner.send(dst, tag, payload)

    def recv(self, src, tag, timeout):
        return self.inner.recv(src, tag, timeout)


def _inputs(seed: int, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(WORLD)]


def _reseal_body(payload: bytes) -> bytes:
    """Recompute the CRC-32 that ends a quantized body (after the 32-byte message header)."""
    body = payload[HEADER_BYTES:-4]
    return payload[:HEADER_BYTES] + body + struct.pack("<I", zlib.crc32(body))


# message header fields, then (quantized bodies) the packed dtype/ndim bytes and the first dim
BODY_FIELDS = HEADER_FIELDS + [(HEADER_BYTES + 5, 1, "little"), (HEADER_BYTES + 6, 1, "little"),
                               (HEADER_BYTES + 12, 8, "little")]  # fmt: skip


def test_a_member_sending_mutated_bytes_never_corrupts_an_honest_member():
    @fuzz_settings(400)
    @given(
        codec=st.sampled_from(ALLREDUCE_CODECS),
        reduction=st.sampled_from(["two_phase", "ring", "naive_ring"]),
        feedback=st.booleans(),
        bound=st.sampled_from([None, 10.0]),
        attacker=st.integers(0, WORLD - 1),
        target=st.integers(0, 3),
        data=st.data(),
    )
    def run(codec, reduction, feedback, bound, attacker, target, data):
        numel = 96
        xs = _inputs(target, numel)
        originals = [x.clone() for x in xs]
        # drawn here (hypothesis is not thread-safe), applied in the attacker's thread to its target-th message
        _, corrupt = plan_mutation(data, BODY_FIELDS, [2, 16, HEADER_BYTES, HEADER_BYTES + 8],
                                   None if codec == "fp32" else _reseal_body)  # fmt: skip
        efs = [ReductionErrorFeedback() if feedback else None for _ in range(WORLD)]
        if feedback:  # residuals from an earlier call, so "untouched" means something
            for ef in efs:
                ef.commit(torch.randn(numel) * 0.01, torch.randn(numel) * 0.01)
        before = [None if ef is None else ef.state_dict() for ef in efs]
        rejections = [NormRejections() for _ in range(WORLD)]

        def member(t: Transport):
            transport = Malicious(t, target, corrupt) if t.rank == attacker else t
            try:
                return allreduce(xs[t.rank], transport, codec=codec, reduction=reduction, timeout=3600.0,
                                 min_compress_numel=0, error_feedback=efs[t.rank], max_norm_ratio=bound,
                                 norm_rejections=rejections[t.rank], tag="fuzz")  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - inspected below
                return exc

        # a member that waited for a peer's timeout (an hour) would hit the fabric's: no timing is compared
        results = LocalFabric(WORLD).run(member, timeout=300)
        accepted = True
        for rank in range(WORLD):
            if rank == attacker:
                continue
            result = results[rank]
            assert torch.equal(xs[rank], originals[rank]), "an input tensor was modified"
            if isinstance(result, Exception):
                accepted = False
                assert isinstance(result, (PayloadMismatch, CommError)), repr(result)
                if efs[rank] is not None:
                    state = efs[rank].state_dict()
                    assert torch.equal(state["contribution"], before[rank]["contribution"])
                    assert torch.equal(state["result"], before[rank]["result"])
            else:
                assert result.shape == (numel,) and bool(torch.isfinite(result).all())
                if bound is not None:  # nothing beyond the bound reached it, whatever the attacker sent
                    own = xs[rank] + (0 if efs[rank] is None else before[rank]["contribution"])
                    for start, end in segment_bounds(numel, WORLD):
                        limit = bound * float(own[start:end].norm()) * 1.05 + 0.1
                        assert float(result[start:end].norm()) <= limit
        record("collectives allreduce (honest members)", accepted)

    run()
