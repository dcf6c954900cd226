"""Error feedback (docs/design.md §3.3): errors injected by quantization now are paid back later.

For each buffer (named by a key) keep an fp32 residual e. ``quantize(x)`` sends ``Q(v)`` with
``v = x + decay·e`` and sets ``e <- v - deq(Q(v))``, so with ``decay = 1`` (default) the sum of what was sent
tracks the sum of the inputs and the error stays bounded instead of accumulating (Seide et al. 2014;
Karimireddy et al., arXiv 1901.09847). For top-k specs the residual holds every value not selected and the
value codec's error on the selected ones. ``decay < 1`` forgets a fraction of the debt each call (SparseLoCo,
arXiv 2508.15706, uses 0.95): what was sent then lags the inputs by ``e_T + (1 - decay)·sum e_t``, the price of a
residual that forgets stale directions (docs/quant.md, "Error feedback").
On CUDA, int and MXFP4/8 specs without rotation use the fused Triton kernel (one pass: read x and e,
write codes, scales and the new e). If quantization fails (NaN/Inf input), the residual is left as it
was. Residuals live on the device of the tensors they track.

On CUDA's fused kernel the non-finite verdict is deferred as for :func:`noloco.quant.quantize` (no host sync per
call; the payload raises when first used, :meth:`Packed.check`). The residual stays safe without a sync: the new
residual is stored at once, the previous one is kept beside it until the verdict is known, and a refused call puts
the previous one back. The verdict is read when the payload is checked (then the previous residual is released at
once) or, at the latest, when the key's residual is next needed -- the next ``quantize`` of that key,
:meth:`residual`, :attr:`residuals`, :meth:`state_dict` -- which waits for that launch if it is still running. So
no API ever sees a residual made from non-finite input; the cost is the previous residual's memory until the
payload is checked, and a wait when one key is quantized twice with no check in between.
"""

from __future__ import annotations

import weakref

import torch

from noloco.state import StateError, check_finite, check_keys, check_tensor

from . import hadamard, intq, ops
from .base import Packed, QuantSpec
from .deferred import PendingCheck


class ErrorFeedback:
    """Per-buffer fp32 residuals for one quantization spec.

    Example::

        ef = ErrorFeedback("int4")
        packed = ef.quantize(pseudo_grad, key="layer0.weight")   # send packed.to_bytes()
    """

    def __init__(self, spec: QuantSpec | str, *, backend: str | None = None, decay: float = 1.0) -> None:
        self.spec = QuantSpec.parse(spec)
        self.backend = backend
        self.decay = check_decay(decay)
        self._residuals: dict[object, torch.Tensor] = {}
        #: key -> (deferred verdict of its last call, the residual before that call or None): calls whose residual
        #: is stored but whose verdict has not been read yet
        self._unverified: dict[object, tuple[PendingCheck, torch.Tensor | None]] = {}

    @property
    def residuals(self) -> dict[object, torch.Tensor]:
        """Key -> residual (flat fp32), every pending verdict read first (may wait for running launches)."""
        for pending, _ in list(self._unverified.values()):
            pending.bad()  # its callback settles the key
        return self._residuals

    @residuals.setter
    def residuals(self, value: dict[object, torch.Tensor]) -> None:
        self._unverified.clear()
        self._residuals = value

    def residual(self, key: object = None) -> torch.Tensor | None:
        """The current residual (flat fp32, x.numel()) of ``key``, or None if never used."""
        self._settle(key)
        return self._residuals.get(key)

    def reset(self, key: object = None, *, all_keys: bool = False) -> None:
        """Forget the residual of ``key`` (or of every key)."""
        if all_keys:
            self._residuals.clear()
            self._unverified.clear()
        else:
            self._residuals.pop(key, None)
            self._unverified.pop(key, None)

    def quantize(self, x: torch.Tensor, key: object = None, *, generator: torch.Generator | None = None) -> Packed:
        """Return ``Q(x + decay·e_key)`` and update ``e_key`` (created as zeros on first use).

        Args:
            x: float tensor of any shape; not modified.
            key: names the buffer; one residual per key. Its numel must stay the same across calls.

        Raises:
            ValueError: NaN/Inf in x (residual unchanged; on CUDA's fused kernel raised by the payload's first use
                instead, the residual restored then at the latest), or x's size differs from the residual's.
        """
        spec = self.spec
        flat = x.detach().reshape(-1)
        self._settle(key)
        e = self._residuals.get(key)
        previous = e
        if e is None:
            e = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        elif e.numel() != flat.numel() or e.device != flat.device:
            raise ValueError(
                f"error-feedback buffer {key!r} holds {e.numel()} values on {e.device}, "
                f"got {flat.numel()} on {flat.device}"
            )
        if self.decay != 1.0 and previous is not None:
            e = e * self.decay
        be = ops.pick_backend(self.backend, flat.device, spec)
        pending = None
        if be == "triton" and not spec.hadamard and ops.fused_kernels(spec):
            ops._check_input(x)
            v = flat if flat.dtype != torch.float64 else flat.float()
            sections, new_e, pending = ops._triton().quantize(v.contiguous(), spec, generator, residual=e, defer=True)
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
        self._residuals[key] = new_e
        if pending is not None:
            packed._pending = pending
            self._unverified[key] = (pending, previous)
            ref = weakref.ref(self)
            pending.add_done_callback(lambda bad: _settled(ref, key, pending, bad))
        return packed

    def _settle(self, key: object) -> None:
        """Read the pending verdict of ``key``'s last call, if any (a refused call's residual is undone)."""
        item = self._unverified.get(key)
        if item is not None:
            item[0].bad()  # runs _settled

    def state_dict(self) -> dict:
        return {"spec": str(self.spec), "residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        self.spec = QuantSpec.parse(state["spec"])
        self.residuals = dict(state["residuals"])

    def check_state(self, state, where: str = "feedback") -> None:
        """:class:`~noloco.state.StateError` unless ``state`` is :meth:`state_dict`'s for this spec: residuals by
        key, each a 1-D fp32 tensor of finite values (their sizes are the caller's buffers')."""
        check_keys(state, where, {"spec", "residuals"})
        if not isinstance(state["spec"], str) or state["spec"] != str(self.spec):
            raise StateError(f"{where}/spec: {str(state['spec'])[:40]!r}, this error feedback's is {str(self.spec)!r}")
        if not isinstance(state["residuals"], dict):
            raise StateError(f"{where}/residuals: not a mapping")
        for key, residual in state["residuals"].items():
            if not isinstance(residual, torch.Tensor) or residual.dim() != 1:
                raise StateError(f"{where}/residuals/{key}: not a 1-D tensor")
            check_tensor(residual, f"{where}/residuals/{key}", tuple(residual.shape))
            check_finite(residual, f"{where}/residuals/{key}")


def check_decay(decay: float) -> float:
    """``decay`` as a float if 0 < decay <= 1, else ``ValueError`` (one line)."""
    value = float(decay)
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise ValueError(f"error-feedback decay must be in (0, 1], got {decay!r}")
    return value


def _settled(ref: weakref.ref, key: object, pending: PendingCheck, bad: bool) -> None:
    """The verdict of ``key``'s call ``pending`` is known: forget the previous residual, or put it back."""
    ef = ref()
    if ef is None:
        return
    item = ef._unverified.get(key)
    if item is None or item[0] is not pending:  # reset, reloaded, or superseded meanwhile
        return
    del ef._unverified[key]
    if bad:
        previous = item[1]
        if previous is None:
            ef._residuals.pop(key, None)
        else:
            ef._residuals[key] = previous
