"""Device messages: simulated workers on a GPU hand message bodies over in GPU memory (noloco.comm.DeviceMessage).

The in-process fabric carries a CUDA body without a host round trip. What is checked: the results are
bit-identical to the same reduction through pinned host memory (``device_messages=False``) and to the CPU
path, the byte counters agree, the sender's and receiver's streams are ordered, and a forged body is refused
on the device exactly as a forged byte payload is on the host.
"""

from __future__ import annotations

import pytest
import torch

from noloco.collectives import ReductionErrorFeedback, allreduce
from noloco.collectives.codec import PayloadMismatch, get_codec
from noloco.collectives.message import device_message, message_gaps, message_layout
from noloco.comm import DeviceMessage, LocalFabric
from noloco.quant import quantize

pytestmark = pytest.mark.gpu

CODECS = ["int4", "int8", "mxfp4", "bf16", "fp32", "int4:naive"]


def _reduce(world: int, xs: list[torch.Tensor], codec: str, device_messages: bool, rounds: int = 3,
            bound: float | None = None) -> tuple[list[torch.Tensor], list[dict]]:  # fmt: skip
    """``rounds`` int4/... all-reduces with error feedback, each worker on a CUDA stream of its own."""
    fabric = LocalFabric(world, device_messages=device_messages)
    states = [ReductionErrorFeedback() for _ in range(world)]

    def worker(t):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x = xs[t.rank].cuda()
            outs = []
            for r in range(rounds):
                outs.append(allreduce(x, t, codec=codec, min_compress_numel=0, error_feedback=states[t.rank],
                                      max_norm_ratio=bound, tag=f"t/{r}"))  # fmt: skip
                x.mul_(0.5)  # the sender changes its input right after the call: receivers must not see it
            stream.synchronize()
            return torch.stack(outs).cpu()

    outs = fabric.run(worker)
    assert fabric.pending() == 0
    return outs, [t.counter.state_dict() for t in fabric.transports]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec", CODECS)
def test_device_messages_give_the_host_paths_results_and_bytes(world, codec):
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randn(300_007, generator=gen) for _ in range(world)]
    on_device, counted = _reduce(world, xs, codec, True, bound=10.0)
    staged, counted_staged = _reduce(world, xs, codec, False, bound=10.0)
    for out in on_device:
        assert torch.equal(out, on_device[0])
        assert torch.equal(out, staged[0])
    assert counted == counted_staged and counted[0]["bytes_sent"] > 0


def test_a_device_message_keeps_its_body_when_the_sender_reuses_memory():
    fabric = LocalFabric(2)
    sent = torch.arange(1 << 20, device="cuda", dtype=torch.int32).view(torch.uint8).clone()
    expected = sent.cpu()  # synchronizes: ``sent`` is complete before the workers' streams read it

    def worker(t):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            if t.rank == 0:
                torch.cuda._sleep(50_000_000)  # the body's copy is still queued when the message leaves
                body = sent.clone()
                t.send(1, "m", DeviceMessage(b"h" * 32, body))
                del body
                junk = [torch.full((1 << 22,), 7, dtype=torch.uint8, device="cuda") for _ in range(8)]
                stream.synchronize()
                return len(junk)
            message = t.recv(0, "m", 30.0)
            got = message.body_on("cuda").cpu()
            return got

    assert torch.equal(fabric.run(worker)[1], expected)
    assert fabric.transports[0].counter.bytes_sent == 32 + expected.numel()


@pytest.mark.parametrize("codec", ["int4", "int8", "mxfp4"])
def test_a_forged_device_body_is_refused_like_a_forged_byte_payload(codec):
    c = get_codec(codec)
    numel = 10_001
    body = device_message(quantize(torch.randn(numel, device="cuda"), c.spec))
    assert torch.equal(c.decode(body, numel, "cuda").cpu(), c.decode(bytes(body.cpu().numpy()), numel, "cpu"))
    with pytest.raises(PayloadMismatch, match="need"):
        c.decode(body[:-16], numel, "cuda")
    gaps = message_gaps(c.spec, numel)
    if gaps:
        bad = body.clone()
        bad[gaps[0][0]] = 1
        with pytest.raises(PayloadMismatch, match="padding"):
            c.decode(bad, numel, "cuda")
    sections = message_layout(c.spec, numel)[0]
    _, dtype, count, offset = next(s for s in sections if s[0] == "scales")
    bad = body.clone()
    bad[offset : offset + count * torch.empty(0, dtype=dtype).element_size()] = 0xFF  # NaN bf16 / E8M0 NaN scales
    with pytest.raises(PayloadMismatch, match="scale"):
        c.decode(bad, numel, "cuda")
