"""Error feedback (DESIGN §3.3): errors injected by quantization now are paid back later.

For each buffer (named by a key) keep an fp32 residual e. ``quantize(x)`` sends ``Q(x + e)`` and sets
``e <- x + e - deq(Q(x + e))``, so the sum of what was sent tracks the sum of the inputs and the error
stays bounded instead of accumulating (Seide et al. 2014; Karimireddy et al., arXiv 1901.09847).
On CUDA, int and MXFP4/8 specs without rotation use the fused Triton kernel (one pass: read x and e,
write codes, scales and the new e). If quantization fails (NaN/Inf input), the residual is left as it
was. Residuals live on the device of the tensors they track.
"""

from __future__ import annotations

import torch

from . import hadamard, intq, ops
from .base import Packed, QuantSpec


class ErrorFeedback:
    """Per-buffer fp32 residuals for one quantization spec.

    Example::

        ef = ErrorFeedback("int4")
        packed = ef.quantize(pseudo_grad, key="layer0.weight")   # send packed.to_bytes()
    """

    def __init__(self, spec: QuantSpec | str, *, backend: str | None = None) -> None:
        self.spec = QuantSpec.parse(spec)
        self.backend = backend
        self.residuals: dict[object, torch.Tensor] = {}

    def residual(self, key: object = None) -> torch.Tensor | None:
        """The current residual (flat fp32, x.numel()) of ``key``, or None if never used."""
        return self.residuals.get(key)

    def reset(self, key: object = None, *, all_keys: bool = False) -> None:
        """Forget the residual of ``key`` (or of every key)."""
        if all_keys:
            self.residuals.clear()
        else:
            self.residuals.pop(key, None)

    def quantize(self, x: torch.Tensor, key: object = None, *,
                 generator: torch.Generator | None = None) -> Packed:
        """Return ``Q(x + e_key)`` and update ``e_key`` (created as zeros on first use).

        Args:
            x: float tensor of any shape; not modified.
            key: names the buffer; one residual per key. Its numel must stay the same across calls.

        Raises:
            ValueError: NaN/Inf in x (residual unchanged), or x's size differs from the residual's.
        """
        spec = self.spec
        flat = x.detach().reshape(-1)
        e = self.residuals.get(key)
        if e is None:
            e = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        elif e.numel() != flat.numel() or e.device != flat.device:
            raise ValueError(f"error-feedback buffer {key!r} holds {e.numel()} values on {e.device}, "
                             f"got {flat.numel()} on {flat.device}")
        be = ops.pick_backend(self.backend, flat.device, spec)
        if be == "triton" and not spec.hadamard:
            ops._check_input(x)
            v = flat if flat.dtype != torch.float64 else flat.float()
            sections, new_e = ops._triton().quantize(v.contiguous(), spec, generator, residual=e)
            packed = Packed(spec, tuple(x.shape), x.dtype, **sections)
        else:
            v = flat.float() + e
            intq.check_finite(v)
            rv = hadamard.rotate(v, spec) if spec.hadamard else v
            sections = ops.quantize_flat(rv, spec, be, generator)
            packed = Packed(spec, tuple(x.shape), x.dtype, **sections)
            deq = ops.dequantize_flat(packed, be)
            if spec.hadamard:
                deq = hadamard.unrotate(deq, spec, flat.numel())
            new_e = v - deq
        self.residuals[key] = new_e
        return packed

    def state_dict(self) -> dict:
        return {"spec": str(self.spec), "residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        self.spec = QuantSpec.parse(state["spec"])
        self.residuals = dict(state["residuals"])
