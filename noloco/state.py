"""The state-owner protocol: what every component with state offers, and the checks they share.

A component that holds state across steps (an outer algorithm, its rule, error feedback, byte counters, the
harness's model, optimizer, schedule, data position and eval history) has three methods, after torchtitan's
checkpointer, which stores whatever *state owners* it is handed and knows nothing of their insides:

- ``state_dict()``: its state as a nested structure of dicts, lists, tensors and plain values;
- ``load_state_dict(state)``: continue from such a state;
- ``check_state(state, ...)``: raise :class:`StateError` (one line, naming the first entry it cannot load) for a
  state this component could not load: its keys, dtypes, shapes, bounds and finiteness, compared with what the
  component expects (the shapes it is built for are passed in where the component has no instance yet). A check
  reads shapes and values only: it allocates nothing in proportion to what the state claims.

This module imports nothing of noloco, so every package may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class StateError(ValueError):
    """A state (from a checkpoint, a peer) that its owner cannot load; the message names the entry."""


def is_int(value) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value) -> bool:
    """A count that fits an int64: an integer in [0, 2^63)."""
    return is_int(value) and 0 <= value < 2**63


def is_number(value) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_keys(node, where: str, required: set, optional: Iterable = ()) -> None:
    """``node`` is a dict holding every key of ``required``, and otherwise only keys of ``optional``."""
    if not isinstance(node, dict):
        raise StateError(f"{where}: a {type(node).__name__}, not a mapping")
    missing, extra = set(required) - set(node), set(node) - set(required) - set(optional)
    if missing:
        raise StateError(f"{where}: missing {sorted(map(str, missing))[:3]}")
    if extra:
        raise StateError(f"{where}: unexpected {sorted(map(str, extra))[:3]}")


def check_tensor(value, where: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    """``value`` is a tensor of ``dtype`` and ``shape`` (finiteness: the checkpoint file's reader checks every
    floating tensor it loads; :func:`check_finite` for states from elsewhere)."""
    if not isinstance(value, torch.Tensor):
        raise StateError(f"{where}: a {type(value).__name__}, not a tensor")
    if value.dtype != dtype:
        raise StateError(f"{where}: dtype {str(value.dtype).removeprefix('torch.')}, "
                         f"expected {str(dtype).removeprefix('torch.')}")  # fmt: skip
    if tuple(value.shape) != tuple(shape):
        raise StateError(f"{where}: shape {tuple(value.shape)}, expected {tuple(shape)}")


def all_finite(value: torch.Tensor) -> bool:
    """Whether ``value`` holds no NaN or Inf (true for a tensor that is not floating point).

    One reduction, no temporary of the tensor's size: a NaN or an Inf makes the sum NaN or infinite, so a finite
    sum settles it; only a sum that is not (one that overflowed, or a tensor that does hold one) is looked at
    element by element."""
    if not value.is_floating_point() or value.numel() == 0:
        return True
    return bool(torch.isfinite(value.sum())) or bool(torch.isfinite(value).all())


def check_finite(value: torch.Tensor, where: str) -> None:
    """``value`` holds no NaN or Inf."""
    if not all_finite(value):
        raise StateError(f"{where}: holds NaN or Inf")
