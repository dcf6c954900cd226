"""The Triton kernels compile for an H100/H200 (sm_90) with the installed Triton, without a GPU.

The interpreter (how CI checks the kernels' results) accepts some programs the compiler rejects, so this compiles a
representative set of kernel variants to SASS offline, in a subprocess where ``TRITON_INTERPRET`` is unset, with
the same constexprs, dtypes and 16-byte alignment hints a 2**28-element launch would use. Skipped when this
Triton has no NVIDIA backend with its bundled ptxas.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from noloco.quant import QuantSpec
from noloco.quant import triton_kernels as tk

N = 1 << 28
SC = {"int": "*i16", "mx": "*u8"}


def compile_plan(kernel, plan, types):
    names = kernel.arg_names
    consts = dict(zip(names[plan.n_runtime:], plan.consts))
    sig = {nm: ("constexpr" if nm in consts else types[nm]) for nm in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names[:plan.n_runtime])
             if nm not in ("seed", "call_id")}
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=plan.num_warps, enable_fp_fusion=False))
    assert ck.asm["cubin"], "no cubin"


def inputs(spec):
    t = {}
    for i in range(4):
        t.update({f"c{i}": "*u8", f"s{i}": SC[spec.kind], f"z{i}": "*u8", f"m{i}": "*i16"})
    return t


def quantize(name, xd, has_res):
    spec = QuantSpec.parse(name)
    paired = spec.bits == 4
    dt = getattr(torch, xd)
    cfg = tk.CONFIG[tk.quantize_config_key(spec, has_res, dt)]
    plan = tk._Plan(tk._quantize_kernel, N, spec.group, cfg, paired,
                    dict(tk._encode_consts(spec), HAS_RES=has_res, XW=tk._XW[dt]), spec)
    x = "*bf16" if xd == "bfloat16" else "*fp32"
    w = ("*i32" if xd == "bfloat16" else "*i64") if paired else x
    r = "*i64" if paired else "*fp32"
    compile_plan(tk._quantize_kernel, plan, dict(
        x_ptr=x, xw_ptr=w, res_ptr="*fp32", resw_ptr=r, res_out_ptr="*fp32", res_outw_ptr=r, codes_ptr="*u8",
        scales_ptr=SC[spec.kind], zp_ptr="*u8", mins_ptr="*i16", flag_ptr="*i32", call_id="i32", n="i32", nw="i32",
        nb="i32", seed="i32"))


def dequantize(name, k, accum):
    spec = QuantSpec.parse(name)
    paired = spec.bits == 4
    cfg = tk.CONFIG["dequantize/paired" if paired else "dequantize/flat"]
    plan = tk._Plan(tk._dequantize_kernel, N, spec.group, cfg, paired,
                    dict(tk._decode_consts(spec), K=k, ACCUM=accum), None)
    compile_plan(tk._dequantize_kernel, plan, dict(
        inputs(spec), out_ptr="*fp32", outw_ptr="*i64" if paired else "*fp32", n="i32", nw="i32", nb="i32"))


def requantize(in_name, name):
    spec, ispec = QuantSpec.parse(name), QuantSpec.parse(in_name)
    paired = spec.bits == 4 or ispec.bits == 4
    cfg = tk.CONFIG["requantize/paired" if paired else "requantize/flat"]
    plan = tk._Plan(tk._requantize_kernel, N, spec.group, cfg, paired,
                    dict(tk._input_consts(ispec), **tk._encode_consts(spec), K=2, HAS_ACC=True, EVEN=True), spec)
    compile_plan(tk._requantize_kernel, plan, dict(
        inputs(ispec), acc_ptr="*fp32", accw_ptr="*i64" if paired else "*fp32", n="i32", nw="i32", nb="i32",
        seed="i32", codes_ptr="*u8", scales_ptr=SC[spec.kind], zp_ptr="*u8", mins_ptr="*i16", flag_ptr="*i32",
        call_id="i32"))


quantize("int4", "bfloat16", False)
quantize("int8:naive", "float32", False)
quantize("int4:stochastic", "float32", True)
quantize("mxfp4:ceil", "bfloat16", False)
quantize("mxfp8", "float32", True)
dequantize("int8:sym", 1, False)
dequantize("mxfp4", 2, True)
requantize("mxfp8", "mxfp8")
requantize("int8", "int4")
print("compiled")
"""


def _ptxas_available() -> bool:
    try:
        import triton

        return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no bundled NVIDIA ptxas")
def test_kernels_compile_for_sm90_with_the_installed_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
