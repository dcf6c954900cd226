"""A DDP communication hook that all-reduces gradient buckets through the quantized two-phase reduction.

Implements the quantized inner-gradient reduction of DESIGN §3.5: inside a worker made of several
processes/GPUs, PyTorch DDP hands each gradient bucket to the hook, which reduces it with
:func:`noloco.collectives.allreduce` (``two_phase``, int8 by default, fp32 accumulation at the owner,
optional error feedback) over a :class:`~noloco.comm.torchdist.TorchDistTransport`, and returns the
mean. Every process receives bit-identical gradients, so replicas stay in lockstep.

Usage (on every process, after ``dist.init_process_group``)::

    ddp = DistributedDataParallel(model)
    state = QuantizedHookState.from_process_group(codec="int8", error_feedback=True)
    ddp.register_comm_hook(state, quantized_allreduce_hook)

The hook runs synchronously (the reduction finishes inside the hook and an already-completed future
is returned), so it does not overlap communication with the rest of backward; it is a bytes saver
for slow links, not a latency hider. Failures (a dead peer, a mismatch) raise inside ``backward``.
Bytes sent by this process are counted by ``state.transport.counter``.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from noloco.collectives.base import allreduce
from noloco.collectives.feedback import ReductionErrorFeedback
from noloco.comm.base import Transport


@dataclass
class QuantizedHookState:
    """State of :func:`quantized_allreduce_hook`; one per DDP model, kept for the whole run.

    Attributes:
        transport: the transport the buckets travel over (one rank per DDP process).
        codec: wire format (``"int8"`` by default; any codec :func:`allreduce` accepts).
        error_feedback: keep one :class:`ReductionErrorFeedback` per bucket index.
        algorithm: reduction algorithm (``"two_phase"``).
        timeout: seconds to wait for a peer's message.
        min_compress_numel: passed to :func:`allreduce` (None: its measured default).
    """

    transport: Transport
    codec: str = "int8"
    error_feedback: bool = False
    algorithm: str = "two_phase"
    timeout: float = 60.0
    min_compress_numel: int | None = None
    calls: dict[int, int] = field(default_factory=dict)
    feedback: dict[int, ReductionErrorFeedback] = field(default_factory=dict)

    @classmethod
    def from_process_group(cls, process_group: Any = None, **kwargs: Any) -> "QuantizedHookState":
        """Build the state over a fresh gloo (CPU) or NCCL (GPU) group with the ranks of ``process_group``.

        A collective call: every process must call it, in the same order.
        """
        from noloco.comm.torchdist import TorchDistTransport

        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        backend = "nccl" if torch.cuda.is_available() and dist.get_backend(process_group) == "nccl" else "gloo"
        return cls(TorchDistTransport(dist.new_group(ranks=ranks, backend=backend)), **kwargs)

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
            process must run the same buckets in the same order, as DDP guarantees).
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
    mean = allreduce(buffer, state.transport, codec=state.codec, algorithm=state.algorithm, op="mean",
                     timeout=state.timeout, tag=f"ddp/b{index}/c{count}", error_feedback=ef,
                     min_compress_numel=state.min_compress_numel)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(mean.to(dtype=buffer.dtype, device=buffer.device))
    return future
