"""The deferred non-finite check (noloco/quant/deferred.py): on CUDA a checked quantizing call returns without a host
read and its payload raises when first used.

On the CPU the machinery itself is tested: the ring and its records with stand-in events and an asynchronous copy
model (a copy lands only when its event is waited for), and the whole public API with deferral switched on for CPU
tensors (``_DEFER_DEVICES``), which runs the same host code as CUDA with :class:`HostEvent` instead of CUDA events.
The ``gpu`` tests run it on CUDA, including a check that a clean call makes no host sync.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading

import pytest
import torch

from noloco.quant import (
    ErrorFeedback,
    Packed,
    PayloadError,
    dequantize,
    dequantize_accumulate,
    dequantize_accumulate_requantize,
    quantize,
)
from noloco.quant import triton_kernels as tk
from noloco.quant.deferred import MAX_CALL_ID, NON_FINITE, FlagRing, FlagWord, HostEvent, PendingCheck

from .helpers import awkward

SPECS = ["int4", "int8", "int4:naive", "int8:sym", "mxfp4", "mxfp8"]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.sections(), b.sections()))


def _nan_at(n: int, where: int, seed: int = 0) -> torch.Tensor:
    x = awkward("gauss", n, seed=seed)
    x[where] = float("nan")
    return x


# ------------------------------------------------------------------------------ the ring, with stand-ins


class _Stream:
    """A device stream model: queued copies land only when an event recorded after them is waited for."""

    def __init__(self):
        self.ops: list = []
        self.done = 0
        self.waits = 0

    def wait(self, upto: int) -> None:
        self.waits += 1
        while self.done < upto:
            self.ops[self.done]()
            self.done += 1


class _Event:
    def __init__(self, stream: _Stream):
        self.stream, self.mark = stream, 0

    def record(self, stream=None):
        self.mark = len(self.stream.ops)

    def synchronize(self):
        self.stream.wait(self.mark)


class _AsyncRing(FlagRing):
    """A ring whose copies are queued on a modelled stream (the word's value is taken when queued, as the stream
    would read it right after the launch)."""

    def __init__(self, size: int, stream: _Stream):
        super().__init__(size, lambda: _Event(stream))
        self.model = stream

    def copy(self, i, word):
        value = word.clone()
        self.model.ops.append(lambda: self.slots[i].copy_(value))


def _launch(flag: FlagWord, bad: bool) -> int:
    """What a checked kernel does to the word: store its call id if it meets a non-finite group."""
    call_id = flag.next_id()
    if bad:
        flag.word.fill_(call_id)
    return call_id


def test_verdicts_are_per_call_without_zeroing_the_word():
    flag = FlagWord(torch.device("cpu"), lambda: FlagRing(8, HostEvent))
    pattern = [False, True, False, False, True, True, False]
    records = []
    for bad in pattern:
        records.append(flag.defer(_launch(flag, bad)))
    assert [r.bad() for r in reversed(records)] == pattern[::-1]
    assert int(flag.word) == records[5].call_id  # last refused call's id; never zeroed


def test_a_verdict_is_read_only_after_its_event_and_slot_reuse_resolves_the_old_owner_first():
    stream = _Stream()
    flag = FlagWord(torch.device("cpu"), lambda: _AsyncRing(2, stream))
    first = flag.defer(_launch(flag, bad=True))
    second = flag.defer(_launch(flag, bad=False))
    assert not first.done() and not second.done() and stream.waits == 0  # nothing read at the calls
    third = flag.defer(_launch(flag, bad=False))  # reuses slot 0: `first` is resolved before its slot is rewritten
    assert first.done() and first.bad() and stream.waits == 1
    fourth = flag.defer(_launch(flag, bad=True))  # reuses slot 1
    assert second.done() and not second.bad()
    assert fourth.bad() and not third.bad()


def test_slot_reuse_does_not_wait_for_a_dropped_owner():
    stream = _Stream()
    flag = FlagWord(torch.device("cpu"), lambda: _AsyncRing(1, stream))
    flag.defer(_launch(flag, bad=True))  # nobody keeps the record
    kept = flag.defer(_launch(flag, bad=False))
    assert stream.waits == 0
    assert not kept.bad() and stream.waits == 1


def test_call_ids_wrap_below_2_31_and_a_stale_id_in_the_word_cannot_match():
    flag = FlagWord(torch.device("cpu"), lambda: FlagRing(4, HostEvent))
    flag.word.fill_(1)  # call 1 was refused, 2**31 - 2 calls ago
    flag.last_id = MAX_CALL_ID
    call_id = _launch(flag, bad=False)
    assert call_id == 1 and not flag.is_set(call_id) and not flag.defer(call_id).bad()
    assert _launch(flag, bad=True) == 2 and flag.is_set(2)


def test_callbacks_run_once_with_the_verdict_whoever_reads_it():
    stream = _Stream()
    flag = FlagWord(torch.device("cpu"), lambda: _AsyncRing(1, stream))
    seen = []
    first = flag.defer(_launch(flag, bad=True))
    first.add_done_callback(seen.append)
    flag.defer(_launch(flag, bad=False))  # slot reuse reads `first`
    assert seen == [True]
    first.bad()
    assert seen == [True]
    first.add_done_callback(seen.append)  # already known: called at once
    assert seen == [True, True]


def test_a_record_read_from_another_thread_gets_its_own_verdict():
    flag = FlagWord(torch.device("cpu"), lambda: FlagRing(2, HostEvent))
    records = [flag.defer(_launch(flag, bad=i % 3 == 0)) for i in range(6)]
    out = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, records[i].bad())) for i in range(4, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {4: False, 5: False}
    assert records[3].bad() and not records[4].bad()


def test_pickling_a_record_reads_its_verdict():
    flag = FlagWord(torch.device("cpu"), lambda: FlagRing(2, HostEvent))
    record = flag.defer(_launch(flag, bad=True))
    copy = pickle.loads(pickle.dumps(record))
    assert record.done() and copy.done() and copy.bad()
    assert not PendingCheck.resolved(False).bad()


# ------------------------------------------------------------------ the public API, deferral forced on CPU


@pytest.fixture
def deferred(monkeypatch):
    """Checked Triton calls on CPU tensors defer their verdict as on CUDA; fresh flag words, a 4-slot ring."""
    monkeypatch.setattr(tk, "_DEFER_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(tk, "RING_SLOTS", 4)
    monkeypatch.setattr(tk, "_TLS", threading.local())
    return tk


@pytest.mark.parametrize("spec", SPECS)
def test_a_non_finite_input_raises_at_first_use_not_at_the_call(deferred, spec):
    x = _nan_at(1000, 130)
    p = quantize(x, spec, backend="triton")  # no raise: the verdict is pending
    assert isinstance(p._pending, PendingCheck)
    for use in (
        p.check,
        p.to_bytes,
        lambda: p.to("cpu"),
        p.sections,
        lambda: dequantize(p),
        lambda: dequantize(p, backend="torch"),
        lambda: dequantize_accumulate(torch.zeros(1000), [p]),
        lambda: dequantize_accumulate_requantize(None, [p], spec),
    ):
        with pytest.raises(ValueError, match="non-finite") as err:
            use()
        assert str(err.value) == NON_FINITE  # the message a refused call always had
    acc = torch.ones(1000)
    with pytest.raises(ValueError):
        dequantize_accumulate(acc, [quantize(torch.randn(1000), spec, backend="triton"), p], backend="triton")
    assert torch.equal(acc, torch.ones(1000))  # checked before anything was added


@pytest.mark.parametrize("spec", SPECS)
def test_clean_payloads_made_around_bad_ones_are_not_flagged_and_equal_the_reference(deferred, spec):
    pattern = [True, False, False, True, True, False, True, False, False, False]  # more calls than ring slots
    xs = [_nan_at(777, 5 * i, seed=i) if bad else awkward("student", 777, seed=i) for i, bad in enumerate(pattern)]
    ps = [quantize(x, spec, backend="triton") for x in xs]
    for x, p, bad in reversed(list(zip(xs, ps, pattern))):  # checked in reverse order, after slots were reused
        if bad:
            with pytest.raises(ValueError, match="non-finite"):
                p.check()
            with pytest.raises(ValueError, match="non-finite"):
                p.check()  # a bad verdict stays
        else:
            p.check()
            assert p._pending is None
            assert _same(p, quantize(x, spec, backend="torch"))
            assert Packed.from_bytes(p.to_bytes()).to_bytes() == p.to_bytes()


def test_the_pending_check_is_not_part_of_equality_repr_or_the_wire(deferred):
    field = {f.name: f for f in dataclasses.fields(Packed)}["_pending"]
    assert not field.compare and not field.repr and not field.init
    x = awkward("gauss", 500, seed=1)
    p = quantize(x, "int4", backend="triton")
    assert "_pending" not in repr(p) and "PendingCheck" not in repr(p)
    assert p.to_bytes() == quantize(x, "int4", backend="torch").to_bytes()
    bad = quantize(_nan_at(500, 7), "int4", backend="triton")
    with pytest.raises(ValueError, match="non-finite"):
        pickle.loads(pickle.dumps(bad)).check()  # pickling reads the verdict; the copy keeps it


def test_unchecked_calls_and_undeferred_paths_carry_nothing(deferred):
    x = _nan_at(600, 3)
    assert quantize(x, "int4", backend="triton", check_finite=False)._pending is None
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, "int4+hadamard", backend="triton")  # rotated specs check at the call, as the torch path
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, "int4", backend="torch")


@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8"])
def test_requantize_defers_its_own_verdict(deferred, spec):
    ps = [quantize(awkward("gauss", 1000, seed=i), spec, backend="triton") for i in range(2)]
    acc = awkward("student", 1000, seed=3)
    good = dequantize_accumulate_requantize(acc, ps, spec, backend="triton")
    bad = dequantize_accumulate_requantize(_nan_at(1000, 999), ps, spec, backend="triton")
    assert _same(good, dequantize_accumulate_requantize(acc, ps, spec, backend="torch"))
    with pytest.raises(ValueError, match="non-finite"):
        bad.to_bytes()
    marked = dequantize_accumulate_requantize(_nan_at(1000, 999), ps, spec, backend="triton", check_finite=False)
    assert marked._pending is None
    with pytest.raises(PayloadError):
        Packed.from_bytes(marked.to_bytes())


@pytest.mark.parametrize("spec", ["int8", "int4:naive", "mxfp4", "mxfp8"])
def test_error_feedback_never_keeps_the_residual_of_a_refused_call(deferred, spec):
    ef, ref = ErrorFeedback(spec, backend="triton"), ErrorFeedback(spec, backend="torch")
    xs = [awkward("gauss", 1001, seed=i) for i in range(4)]
    ef.quantize(xs[0], key="w")
    ref.quantize(xs[0], key="w")
    before = ef.residual("w").clone()
    p = ef.quantize(_nan_at(1001, 500), key="w")  # refused, but nothing raised yet
    with pytest.raises(ValueError, match="non-finite"):
        p.check()
    assert torch.equal(ef._residuals["w"], before)  # put back as soon as the verdict was read
    # not checked at all: the next call of the key reads the verdict first and starts from the old residual
    ef.quantize(_nan_at(1001, 0), key="w")
    for x in xs[1:]:
        assert _same(ef.quantize(x, key="w"), ref.quantize(x, key="w"))
    assert torch.equal(ef.residual("w"), ref.residual("w"))
    # a refused first call of a key leaves no residual; the accessors read pending verdicts
    ef.quantize(_nan_at(1001, 1000), key="new")
    assert ef.residual("new") is None
    ef.quantize(_nan_at(1001, 1), key="other")
    assert "other" not in ef.residuals and "other" not in ef.state_dict()["residuals"]
    assert all(torch.isfinite(r).all() for r in ef.residuals.values())
    assert not ef._unverified


def test_error_feedback_commits_a_clean_call_and_releases_the_previous_residual_at_check(deferred):
    ef = ErrorFeedback("int4", backend="triton")
    ef.quantize(awkward("gauss", 300, seed=1))
    p = ef.quantize(awkward("gauss", 300, seed=2))
    assert None in ef._unverified
    p.check()
    assert not ef._unverified
    ef.reset()
    ef.quantize(_nan_at(300, 2))  # the verdict is left unread
    ef.reset(all_keys=True)
    assert ef.residual() is None and not ef._unverified


# ------------------------------------------------------------------------------------------------------- GPU


def _cuda_nan(n: int, where: int) -> torch.Tensor:
    x = torch.randn(n, device="cuda")
    x[where] = float("nan")
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8"])
def test_gpu_checked_quantize_of_nan_raises_at_first_use(spec):
    n = (1 << 20) + 3
    p = quantize(_cuda_nan(n, 12345), spec)  # returns: no host read
    assert isinstance(p._pending, PendingCheck)
    for use in (p.check, p.to_bytes, lambda: dequantize(p), lambda: p.to("cpu")):
        with pytest.raises(ValueError, match="non-finite"):
            use()
    q = dequantize_accumulate_requantize(_cuda_nan(n, 7), [quantize(torch.randn(n, device="cuda"), spec)], spec)
    with pytest.raises(ValueError, match="non-finite"):
        q.check()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "mxfp8"])
def test_gpu_interleaved_bad_and_clean_calls_get_their_own_verdicts(spec, monkeypatch):
    monkeypatch.setattr(tk, "RING_SLOTS", 3)
    monkeypatch.setattr(tk, "_TLS", threading.local())
    n = 1 << 20
    pattern = [i % 3 == 1 or i % 7 == 0 for i in range(20)]
    xs = [_cuda_nan(n, 1000 * i) if bad else torch.randn(n, device="cuda") for i, bad in enumerate(pattern)]
    ps = [quantize(x, spec) for x in xs]
    for x, p, bad in reversed(list(zip(xs, ps, pattern))):
        if bad:
            with pytest.raises(ValueError, match="non-finite"):
                p.check()
        else:
            assert _same(p, quantize(x, spec, backend="torch"))
    side = torch.cuda.Stream()  # another stream: its own word and ring
    with torch.cuda.stream(side):
        a, b = quantize(xs[1], spec), quantize(xs[2], spec)
    with pytest.raises(ValueError, match="non-finite"):
        a.check()
    b.check()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8"])
def test_gpu_error_feedback_never_keeps_a_non_finite_residual(spec):
    n = (1 << 20) + 1
    ef = ErrorFeedback(spec)
    ef.quantize(torch.randn(n, device="cuda"), key="g").check()
    before = ef.residual("g").clone()
    p = ef.quantize(_cuda_nan(n, 4321), key="g")
    with pytest.raises(ValueError, match="non-finite"):
        p.to_bytes()
    assert torch.equal(ef.residual("g"), before)
    ef.quantize(_cuda_nan(n, 99), key="g")  # never checked
    ef.quantize(torch.randn(n, device="cuda"), key="g").check()
    assert bool(torch.isfinite(ef.residual("g")).all())


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8"])
def test_gpu_a_clean_checked_call_makes_no_host_sync(spec):
    n = 1 << 20
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    acc = torch.randn(n, device="cuda")
    ef = ErrorFeedback(spec)
    p0 = quantize(x, spec)  # warm-up: plans, compiled kernels, flag word, ring, events
    dequantize_accumulate_requantize(acc, [p0], spec).check()
    ef.quantize(x, key="warm").check()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ps = [quantize(x, spec) for _ in range(5)]
        ps.append(dequantize_accumulate_requantize(acc, [p0], spec))
        ps.append(ef.quantize(x, key="fresh"))
        with pytest.raises(RuntimeError):
            acc.sum().item()  # the mode does catch a host read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for p in ps:
        p.check()
