"""A DDP communication hook that all-reduces gradient buckets through the quantized two-phase reduction.

Implements the quantized inner-gradient reduction of docs/design.md §3.5: inside a worker made of several
processes/GPUs, PyTorch DDP hands each gradient bucket to the hook, which reduces it with
:func:`noloco.collectives.allreduce` (``two_phase``, int8 by default, fp32 accumulation at the owner,
optional error feedback) over a :class:`~noloco.comm.torchdist.TorchDistTransport`, and returns the
mean. Every process receives bit-identical gradients, so replicas stay in lockstep.

Usage (on every process, after ``dist.init_process_group``)::

    ddp = DistributedDataParallel(model)
    state = QuantizedHookState.from_process_group(codec="int8", error_feedback=True)
    ddp.register_comm_hook(state, quantized_allreduce_hook)

Two paths, same results (bit for bit, on the same gradients):

- **bytes** (``state.transport`` set; gloo/CPU, what ``train.py`` uses): every bucket goes through
  :func:`~noloco.collectives.allreduce` over the transport, with checked message headers.
- **device** (``state.on_device``; chosen by :meth:`QuantizedHookState.from_process_group` when the
  group's backend is NCCL): every bucket goes through
  :func:`~noloco.collectives.device.allreduce_device` on ``state.process_group``: the packed sections
  move as tensors by NCCL collectives, nothing is staged through host memory, no wire headers.

The hook runs synchronously (the reduction finishes inside the hook and an already-completed future
is returned), so it does not overlap communication with the rest of backward; it is a bytes saver
for slow links, not a latency hider. Failures (a dead peer, a mismatch) raise inside ``backward``.
Bytes sent by this process are counted by ``state.counter`` (the transport's counter on the bytes path).
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from noloco.collectives.base import allreduce
from noloco.collectives.device import allreduce_device
from noloco.collectives.residuals import ReductionErrorFeedback
from noloco.comm.base import ByteCounter, Transport


@dataclass
class QuantizedHookState:
    """State of :func:`quantized_allreduce_hook`; one per DDP model, kept for the whole run.

    Attributes:
        transport: the transport the buckets travel over (one rank per DDP process); None for the
            device path.
        codec: wire format (``"int8"`` by default; any codec :func:`allreduce` accepts).
        error_feedback: keep one :class:`ReductionErrorFeedback` per bucket index.
        reduction: reduction reduction (``"two_phase"``; the only one on the device path).
        timeout: seconds to wait for a peer's message (bytes path; on the device path the process
            group's own timeout applies).
        min_compress_numel: passed to :func:`allreduce` / :func:`allreduce_device` (None: the default).
        process_group: the group the device path reduces over (None: the default group).
        on_device: reduce with :func:`allreduce_device` instead of over ``transport`` (always when
            ``transport`` is None).
        device_counter: bytes moved by the device path.
    """

    transport: Transport | None = None
    codec: str = "int8"
    error_feedback: bool = False
    reduction: str = "two_phase"
    timeout: float = 120.0
    min_compress_numel: int | None = None
    calls: dict[int, int] = field(default_factory=dict)
    feedback: dict[int, ReductionErrorFeedback] = field(default_factory=dict)
    process_group: Any = None
    on_device: bool = False
    device_counter: ByteCounter = field(default_factory=ByteCounter)

    def __post_init__(self) -> None:
        if self.transport is None:
            self.on_device = True
        if self.on_device and self.reduction != "two_phase":
            raise ValueError(f"the device path runs two_phase only, got reduction={self.reduction!r}")

    @property
    def counter(self) -> ByteCounter:
        """Bytes this process has sent and received for the hook (on whichever path it uses)."""
        return self.device_counter if self.on_device else self.transport.counter

    @classmethod
    def from_process_group(
        cls, process_group: Any = None, *, on_device: bool | None = None, **kwargs: Any
    ) -> "QuantizedHookState":
        """Build the state for DDP over ``process_group`` (None: the default group).

        With an NCCL group (or ``on_device=True``) buckets are reduced by :func:`allreduce_device`
        directly on ``process_group``, with DDP's own collectives, in the order DDP issues them. Otherwise
        a fresh gloo group with the same ranks carries a :class:`~noloco.comm.torchdist.TorchDistTransport`
        (its always-posted receives must not share a group with DDP's collectives); creating it is a
        collective call: every process must call this, in the same order.
        """
        from noloco.comm.torchdist import TorchDistTransport

        nccl = torch.cuda.is_available() and "nccl" in str(dist.get_backend(process_group)).lower()
        if nccl if on_device is None else on_device:
            return cls(None, process_group=process_group, on_device=True, **kwargs)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        return cls(TorchDistTransport(dist.new_group(ranks=ranks, backend="gloo")), **kwargs)

    def state_dict(self) -> dict:
        return {"calls": dict(self.calls), "feedback": {k: v.state_dict() for k, v in self.feedback.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.calls = {int(k): int(v) for k, v in state["calls"].items()}
        self.feedback = {}
        for key, value in state["feedback"].items():
            self.feedback[int(key)] = ReductionErrorFeedback()
            self.feedback[int(key)].load_state_dict(value)


def quantized_allreduce_hook(state: QuantizedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mean of ``bucket``'s gradients over all processes, via quantized two-phase.

    Args:
        state: :class:`QuantizedHookState` (its per-bucket call counts name the messages, so every
            process must run the same buckets in the same order, as DDP guarantees; on the device path
            the same order is what keeps the collectives matched).
        bucket: ``torch.distributed.GradBucket``; its buffer is read, not modified.

    Returns:
        A completed future holding the averaged flat gradients (the bucket buffer's dtype and device).
    """
    buffer = bucket.buffer()
    index = int(bucket.index())
    count = state.calls.get(index, 0)
    state.calls[index] = count + 1
    ef = None
    if state.error_feedback:
        ef = state.feedback.setdefault(index, ReductionErrorFeedback())
        if ef.numel not in (None, buffer.numel()):
            ef.reset()  # DDP rebuilt its buckets (after the first iteration): start a fresh residual
    if state.on_device:
        mean = allreduce_device(
            buffer,
            state.process_group,
            codec=state.codec,
            op="mean",
            error_feedback=ef,
            min_compress_numel=state.min_compress_numel,
            counter=state.device_counter,
        )
    else:
        mean = allreduce(
            buffer,
            state.transport,
            codec=state.codec,
            reduction=state.reduction,
            op="mean",
            timeout=state.timeout,
            tag=f"ddp/b{index}/c{count}",
            error_feedback=ef,
            min_compress_numel=state.min_compress_numel,
        )
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(mean.to(dtype=buffer.dtype, device=buffer.device))
    return future
