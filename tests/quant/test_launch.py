"""The host side of the Triton path: cached launch plans, direct launches of compiled kernels, one allocation per
payload, the persistent non-finite flag and ``check_finite`` (the deferred check: test_deferred.py).

Under ``TRITON_INTERPRET=1`` Triton's launcher returns no compiled kernel, so the direct-launch path is exercised
here with a stand-in CompiledKernel whose ``run`` executes the interpreted kernel with exactly the arguments the
direct path passes (grid, then runtime arguments, then constexprs in signature order). If the direct path passed
anything in the wrong order or reused a stale plan, the codes would differ from the torch reference.
"""

from __future__ import annotations

import threading

import pytest
import torch

from noloco.quant import (
    ErrorFeedback,
    Packed,
    PayloadError,
    QuantSpec,
    dequantize,
    dequantize_accumulate,
    dequantize_accumulate_requantize,
    quantize,
)
from noloco.quant import triton_kernels as tk
from noloco.quant.ops import parse_spec

from .helpers import awkward


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.sections(), b.sections()))


# ------------------------------------------------------------------------------------------- plan cache


def test_plans_never_reuse_launch_parameters_across_spec_numel_dtype():
    tk.clear_plans()
    cases = [
        (spec, n, dt)
        for spec in ["int4", "int4:g64", "int8", "mxfp4", "mxfp8", "int4:naive"]
        for n in [129, 130, 4099]
        for dt in [torch.float32, torch.bfloat16]
    ]
    for rnd in range(2):  # the second round hits the cache for every case, interleaved
        for spec, n, dt in cases:
            x = awkward("student", n, seed=n + rnd).to(dt)
            assert _same(quantize(x, spec, backend="triton"), quantize(x, spec, backend="torch")), (spec, n, dt)
    keys = {k for k in tk._PLANS if k[0] == "q"}
    assert len(keys) == len(cases)


def test_a_changed_launch_configuration_builds_a_new_plan(monkeypatch):
    x = awkward("gauss", 5000, seed=3)
    want = quantize(x, "int4", backend="torch")
    assert _same(quantize(x, "int4", backend="triton"), want)
    before = {k for k in tk._PLANS if k[0] == "q"}
    monkeypatch.setitem(tk.CONFIG, tk.quantize_config_key(QuantSpec.parse("int4"), False, x.dtype), (1024, 8))
    assert _same(quantize(x, "int4", backend="triton"), want)
    new = {k for k in tk._PLANS if k[0] == "q"} - before
    assert any(k[-1] == (1024, 8) for k in new)


def test_fp32_input_gets_its_own_launch_configuration_where_one_is_tuned(monkeypatch):
    int4, int8 = QuantSpec.parse("int4"), QuantSpec.parse("int8")
    assert tk.quantize_config_key(int4, False, torch.bfloat16) == "quantize/paired"
    assert tk.quantize_config_key(int4, False, torch.float32) == "quantize/paired:fp32"
    assert tk.quantize_config_key(int8, False, torch.float32) == "quantize/flat"  # no :fp32 entry: the shared one
    assert tk.quantize_config_key(int4, True, torch.float32) == "quantize_ef/paired"
    monkeypatch.delitem(tk.CONFIG, "quantize/paired:fp32")
    assert tk.quantize_config_key(int4, False, torch.float32) == "quantize/paired"


def test_parsed_specs_are_cached_and_equal_to_a_fresh_parse():
    a = parse_spec("int4:g64")
    assert a is parse_spec("int4:g64") and a == parse_spec(str(a))
    with pytest.raises(ValueError):
        parse_spec("int5")


@pytest.mark.parametrize("spec", ["int4", "int8", "int4:naive", "int8:sym", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("n", [1, 31, 1000, 4097])
def test_payload_sections_are_aligned_views_of_one_allocation(spec, n):
    p = quantize(awkward("gauss", n, seed=1), spec, backend="triton")
    sections = p.sections()
    storages = {t.untyped_storage().data_ptr() for t in sections}
    assert len(storages) == 1
    assert all(t.data_ptr() % 16 == 0 for t in sections)
    assert [(t.dtype, t.numel()) for t in sections] == [(dt, c) for _, dt, c in p.spec.layout(n)]
    assert _same(Packed.from_bytes(p.to_bytes()), p)


# --------------------------------------------------------------------------------------- direct launches


class _FakeCompiled:
    """Stands in for triton.compiler.CompiledKernel: ``run`` executes the interpreted kernel."""

    calls = 0

    def __init__(self, kernel, num_warps):
        self.kernel, self.num_warps = kernel, num_warps
        self.function, self.packed_metadata = object(), (num_warps, 1, 0)

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        assert (g1, g2, stream, function, metadata) == (1, 1, 0, self.function, self.packed_metadata)
        assert (launch_metadata, enter_hook, exit_hook) == (None, None, None)
        assert len(args) == len(self.kernel.arg_names)  # runtime arguments + every constexpr
        type(self).calls += 1
        self.kernel[(g0,)](*args, num_warps=self.num_warps, enable_fp_fusion=False)


class _Compiling:
    """Wraps an interpreted kernel so that ``kernel[grid](...)`` returns a compiled-kernel stand-in."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.__name__ = kernel.__name__

    def __getitem__(self, grid):
        def launch(*args, num_warps, enable_fp_fusion):
            self.kernel[grid](*args, num_warps=num_warps, enable_fp_fusion=enable_fp_fusion)
            return _FakeCompiled(self.kernel, num_warps)

        return launch


@pytest.fixture
def direct(monkeypatch):
    for name in ("_quantize_kernel", "_dequantize_kernel", "_requantize_kernel"):
        monkeypatch.setattr(tk, name, _Compiling(getattr(tk, name)))
    monkeypatch.setattr(tk, "_CompiledKernel", _FakeCompiled)
    monkeypatch.setattr(tk, "_DIRECT", True)
    monkeypatch.setattr(tk, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(tk, "_hooks_idle", lambda: True)
    tk.clear_plans()
    _FakeCompiled.calls = 0
    yield _FakeCompiled
    tk.clear_plans()


@pytest.mark.parametrize("spec", ["int4", "int8", "int4:sym", "int4:naive", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_launches_give_the_reference_payload(direct, spec, dtype):
    n = 4099
    for seed in range(3):  # first call: Triton's launcher; then direct launches
        x = awkward("student", n, seed=seed).to(dtype)
        assert _same(quantize(x, spec, backend="triton"), quantize(x, spec, backend="torch"))
    assert direct.calls == 2
    ps = [quantize(awkward("gauss", n, seed=s), spec) for s in range(3)]
    for _ in range(2):
        acc_t, acc_r = torch.ones(n), torch.ones(n)
        dequantize_accumulate(acc_t, ps, backend="triton")
        dequantize_accumulate(acc_r, ps, backend="torch")
        assert torch.equal(acc_t, acc_r)
        assert torch.equal(dequantize(ps[0], backend="triton"), dequantize(ps[0], backend="torch"))
        acc = awkward("gauss", n, seed=9)
        assert _same(
            dequantize_accumulate_requantize(acc, ps[:2], spec, backend="triton"),
            dequantize_accumulate_requantize(acc, ps[:2], spec, backend="torch"),
        )
    ef_t, ef_r = ErrorFeedback(spec, backend="triton"), ErrorFeedback(spec, backend="torch")
    for _ in range(3):
        x = awkward("gauss", n, seed=5).to(dtype)
        assert _same(ef_t.quantize(x), ef_r.quantize(x))
    assert torch.equal(ef_t.residual(), ef_r.residual())


def test_direct_launch_is_not_used_for_another_specialization(direct):
    base = awkward("gauss", 1001, seed=2)
    quantize(base[:1000], "int8", backend="triton")  # aligned: compiles and records the kernel
    quantize(base[:1000], "int8", backend="triton")
    assert direct.calls == 1
    x = base[1:]  # 4-byte offset: Triton would specialize differently -> its own launcher
    assert _same(quantize(x, "int8", backend="triton"), quantize(x, "int8", backend="torch"))
    assert direct.calls == 1


def test_stochastic_seeds_give_the_same_codes_on_the_direct_and_the_triton_path(direct, monkeypatch):
    x = awkward("gauss", 2000, seed=4)
    a = [
        quantize(x, "int4:stochastic", generator=torch.Generator().manual_seed(s), backend="triton").codes
        for s in range(20)
    ]
    assert direct.calls > 0  # each seed class (== 1, % 16 == 0, other) has its own compiled kernel
    monkeypatch.setattr(tk, "_DIRECT", False)
    tk.clear_plans()
    b = [
        quantize(x, "int4:stochastic", generator=torch.Generator().manual_seed(s), backend="triton").codes
        for s in range(20)
    ]
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_launcher_that_rejects_the_direct_call_switches_direct_launches_off(direct, monkeypatch):
    def reject(self, *args):
        raise TypeError("launcher takes other arguments")

    monkeypatch.setattr(direct, "run", reject)
    x = awkward("gauss", 3000, seed=6)
    want = quantize(x, "int8", backend="torch")
    with pytest.warns(RuntimeWarning, match="direct Triton launches switched off"):
        for _ in range(3):
            assert _same(quantize(x, "int8", backend="triton"), want)
    assert tk._DIRECT is False
    assert _same(quantize(x, "int8", backend="triton"), want)


def test_sigs_separate_seed_classes():
    assert tk._sig(64, 1) != tk._sig(64, 5) != tk._sig(64, 32)
    assert tk._sig(64, 5) == tk._sig(128, 7)
    assert not tk._sig(4, 5)[0]


# ------------------------------------------------------------------------------------ non-finite checks


@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8"])
def test_a_refused_call_leaves_no_flag_behind(spec):
    x = torch.randn(3000)
    bad = x.clone()
    bad[2999] = float("nan")
    for _ in range(3):
        with pytest.raises(ValueError, match="non-finite"):
            quantize(bad, spec, backend="triton")
        assert _same(quantize(x, spec, backend="triton"), quantize(x, spec, backend="torch"))
        with pytest.raises(ValueError, match="non-finite"):
            dequantize_accumulate_requantize(bad, [quantize(x, spec)], spec, backend="triton")
        dequantize_accumulate_requantize(x, [quantize(x, spec)], spec, backend="triton")


@pytest.mark.parametrize(
    "spec,group,marker", [("int4", 1, 0x7FC0), ("int8:sym", 1, 0x7FC0), ("mxfp4", 4, 255), ("mxfp8", 4, 255)]
)
def test_unchecked_calls_mark_bad_groups_and_never_trip_a_checked_call(spec, group, marker):
    x = torch.randn(1000)
    x[130] = float("inf")
    p = quantize(x, spec, backend="triton", check_finite=False)  # no raise, no host read
    assert int(p.scales[group]) & 0xFFFF == marker
    assert not torch.isfinite(dequantize(p, backend="triton")[130]).item()  # visible locally, never a number
    with pytest.raises(PayloadError):
        Packed.from_bytes(p.to_bytes())  # a marked payload never gets past a receiver
    q = dequantize_accumulate_requantize(
        x, [quantize(torch.randn(1000), spec)], spec, backend="triton", check_finite=False
    )
    assert int(q.scales[group]) & 0xFFFF == marker
    y = torch.randn(1000)
    assert _same(quantize(y, spec, backend="triton"), quantize(y, spec, backend="torch"))  # checked: no raise


def test_flag_words_are_per_thread():
    dev = torch.device("cpu")
    words = []
    t = threading.Thread(target=lambda: words.append(tk._flag_word(dev)))
    t.start()
    t.join()
    mine = tk._flag_word(dev)
    assert mine is tk._flag_word(dev) and words[0] is not mine
    assert tk._scratch(dev) is not mine.word


# ------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["int4", "int8", "mxfp4", "mxfp8", "int4:stochastic"])
def test_gpu_direct_launches_are_used_and_match_the_triton_launcher(spec, monkeypatch):
    n = (1 << 20) + 3
    base = spec.split(":")[0]
    x = torch.randn(n, device="cuda")
    ps = [quantize(torch.randn(n, device="cuda"), base) for _ in range(2)]

    def run_all():
        gen = torch.Generator(device="cuda").manual_seed(3)
        acc = torch.ones(n, device="cuda")
        dequantize_accumulate(acc, ps, backend="triton")
        return [
            quantize(x, spec, generator=gen, backend="triton"),
            quantize(x[1:], base, backend="triton"),  # misaligned: always Triton's launcher
            dequantize_accumulate_requantize(x, ps, base, backend="triton"),
            acc,
        ]

    tk.clear_plans()
    first = run_all()  # Triton's launcher, compiled kernels recorded
    direct = run_all()  # direct launches
    sized_n = [p for k, p in tk._PLANS.items() if (k[3] if k[0] == "r" else k[2]) == n]
    assert tk._DIRECT and len(sized_n) == 3 and all(p.compiled for p in sized_n)
    monkeypatch.setattr(tk, "_DIRECT", False)
    tk.clear_plans()
    launcher = run_all()
    for a, b, c in zip(first, direct, launcher):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and torch.equal(a, c)
        else:
            assert _same(a, b) and _same(a, c)
    if "stochastic" not in spec:
        assert _same(first[0], quantize(x, spec, backend="torch"))


@pytest.mark.gpu
def test_gpu_unchecked_quantize_does_not_sync_and_marks_bad_groups():
    x = torch.randn(1 << 20, device="cuda")
    x[12345] = float("nan")
    p = quantize(x, "int4", check_finite=False)
    assert int(p.scales[12345 // 128]) & 0xFFFF == 0x7FC0
    with pytest.raises(PayloadError):
        Packed.from_bytes(p.to_bytes())
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, "int4").check()  # checked: deferred to the payload's first use on CUDA
    y = torch.randn(1 << 20, device="cuda")
    assert _same(quantize(y, "int4"), quantize(y, "int4", backend="torch"))
