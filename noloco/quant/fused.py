"""Fused ops for reductions (docs/design.md §3.4): dequantize-accumulate and dequantize-accumulate-requantize.

- :func:`dequantize_accumulate` adds k decoded payloads into one fp32 accumulator in place
  (the owner's step of a two-phase reduce-scatter).
- :func:`dequantize_accumulate_requantize` computes ``Q(acc + sum_i deq(p_i))`` in one pass: one hop of
  a multi-hop (ring/tree) reduction, forwarding a partial sum without materialising it in fp32.

Both follow the fixed summation order ``((acc + deq(p_1)) + deq(p_2)) + ...`` in fp32 on every
backend. The Triton path (CUDA, or forced) handles runs of up to 4 inputs that share one spec per
launch; inputs of other specs, rotated specs and MXFP6 go through the torch reference. Both first check
their inputs (:meth:`Packed.check`: a payload whose deferred non-finite check fails raises here), and the
fused requantize on CUDA defers its own output's check like ``quantize``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import hadamard, ops
from .base import Packed, QuantSpec


def _check_inputs(numel: int, inputs: Sequence[Packed]) -> None:
    for p in inputs:
        if p.numel != numel:
            raise ValueError(f"input holds {p.numel} elements, accumulator {numel}")
    for p in inputs:
        p.check()


def dequantize_accumulate(acc: torch.Tensor, inputs: Sequence[Packed], *, backend: str | None = None) -> torch.Tensor:
    """``acc += deq(inputs[0]) + deq(inputs[1]) + ...`` in place (left to right, fp32).

    Args:
        acc: fp32 tensor (any shape, contiguous) whose numel equals every input's numel; mutated.
        inputs: Packed tensors on acc's device.
        backend: "torch", "triton" or None (auto).

    Returns:
        ``acc``.

    Raises:
        ValueError: an input's pending non-finite check fails (:meth:`Packed.check`); ``acc`` is untouched then.
    """
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError("the accumulator must be a contiguous float32 tensor")
    _check_inputs(acc.numel(), inputs)
    flat = acc.view(-1)
    device = acc.device
    spec = inputs[0].spec if inputs else None
    if (
        0 < len(inputs) <= 4
        and not spec.hadamard
        and all(p.spec == spec for p in inputs)
        and ops.fused_kernels(spec)
        and ops.pick_backend(_soft(backend, spec), device, spec) == "triton"
    ):  # the hot path: one launch
        ops._triton().dequantize_accumulate(flat, list(inputs), accumulate=True)
        return acc
    i = 0
    while i < len(inputs):
        spec = inputs[i].spec
        be = ops.pick_backend(_soft(backend, spec), device, spec)
        if be == "triton" and not spec.hadamard and ops.fused_kernels(spec):
            j = i
            while j < len(inputs) and j - i < 4 and inputs[j].spec == spec:
                j += 1
            ops._triton().dequantize_accumulate(flat, list(inputs[i:j]), accumulate=True)
            i = j
        else:
            flat += ops.dequantize(inputs[i], backend=be).view(-1)
            i += 1
    return acc


def dequantize_accumulate_requantize(
    acc: torch.Tensor | None,
    inputs: Sequence[Packed],
    spec: QuantSpec | str,
    *,
    generator: torch.Generator | None = None,
    backend: str | None = None,
    check_finite: bool = True,
) -> Packed:
    """``Q_spec(acc + deq(inputs[0]) + ...)``: one hop of a multi-hop reduction.

    Args:
        acc: this hop's own fp32 contribution (not modified), or None for a pure re-encode of the sum.
        inputs: at least one Packed (the incoming partial sums), all of the same numel and device.
        spec: the format of the outgoing partial sum.
        check_finite: as in :func:`noloco.quant.quantize` (default True: a non-finite sum raises ``ValueError``,
            on CUDA's fused kernel when the returned payload is first used).

    Returns:
        The outgoing Packed, with the shape/dtype of ``acc`` (or of ``inputs[0]``).

    Raises:
        ValueError: an input's pending non-finite check fails, or the sum is not finite (see ``check_finite``).
    """
    spec = ops.parse_spec(spec)
    if not inputs:
        raise ValueError("dequantize_accumulate_requantize needs at least one input")
    ref = inputs[0]
    numel = ref.numel
    if acc is not None and acc.numel() != numel:
        raise ValueError(f"accumulator holds {acc.numel()} elements, inputs {numel}")
    _check_inputs(numel, inputs)
    shape = tuple(acc.shape) if acc is not None else ref.shape
    dtype = acc.dtype if acc is not None else ref.dtype
    device = acc.device if acc is not None else ref.device
    be = ops.pick_backend(_soft(backend, spec), device, spec)
    in_spec = ref.spec
    fusable = (
        be == "triton"
        and not spec.hadamard
        and not in_spec.hadamard
        and len(inputs) <= 4
        and all(p.spec == in_spec for p in inputs)
        and ops.fused_kernels(in_spec)
        and ops.fused_kernels(spec)
        and in_spec.group == spec.group
    )
    if fusable:
        a = None if acc is None else ops._kernel_input(acc).float()  # no copy for a contiguous fp32 acc
        sections, pending = ops._triton().dequantize_accumulate_requantize(
            a, list(inputs), numel, spec, generator, check=check_finite, defer=True
        )
        packed = Packed(spec, shape, dtype, **sections)
        packed._pending = pending
        return packed
    total = (
        torch.zeros(numel, dtype=torch.float32, device=device)
        if acc is None
        else acc.detach().reshape(-1).float().clone()
    )
    for p in inputs:
        total += ops.dequantize(p, backend=_soft(backend, p.spec)).view(-1)
    out_be = ops.pick_backend(_soft(backend, spec), device, spec)
    if spec.hadamard:
        ops.intq.check_finite(total)
        total = hadamard.rotate(total, spec)
    return Packed(spec, shape, dtype, **ops.quantize_flat(total, spec, out_be, generator, check_finite))


def _soft(backend: str | None, spec: QuantSpec) -> str | None:
    """A forced "triton" falls back to "torch" for formats without a kernel (MXFP6, float)."""
    if backend == "triton" and (spec.kind == "float" or not ops._has_kernel(spec)):
        return "torch"
    return backend
