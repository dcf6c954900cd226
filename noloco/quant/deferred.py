"""The deferred non-finite check of the Triton quantizing calls on CUDA: the verdict is read when a payload is used.

A checked quantizing call (``quantize``, ``ErrorFeedback.quantize``, ``dequantize_accumulate_requantize``) must
refuse NaN/±Inf input. Its kernel sees non-finite values in the group statistics it computes anyway and marks the
group in the payload itself (bf16 NaN scale, E8M0 255: every decoder rejects it); what is left is to tell the
caller. Reading a device word at the end of every call is a host sync per call, which keeps the GPU idle while
the host prepares the next launch. Here the read is moved to the first *use* of the payload
(:meth:`~noloco.quant.Packed.check`, called by ``to_bytes``, ``to``, ``sections``, the decoders and the
collectives before they send), usually long after the kernel finished, so it costs no wait.

Mechanism, per (thread, device, stream) -- :class:`FlagWord`:

- one int32 device word, zeroed once. Each checked call gets the next *call id* (1, 2, ..., wrapping below 2**31;
  the word is zeroed again at the wrap, once every 2**31 - 1 calls), and its kernel programs that see a non-finite
  group store that id into the word. Calls on one stream run in order, so after call k's kernel the word holds the
  id of the last refused call up to k: call k was refused iff the word equals k's id. Nothing is ever zeroed per
  call.
- after the launch, an asynchronous 4-byte copy of the word into a slot of a ring of pinned host memory, then an
  event recorded on the stream (:class:`FlagRing`): no host sync, nothing for ``torch.cuda.set_sync_debug_mode``
  to report. The call returns a :class:`PendingCheck` (slot, call id) that the payload carries.
- at check time: wait for the slot's event (the kernel is normally done by then), read the slot, compare. A slot
  is reused only after its previous owner's verdict was read into that owner (``FlagRing.submit`` resolves it
  first, through a weak reference, when the owner still needs it), so a reused slot never answers for the wrong
  call. With 256 slots this only waits when more than 256 checked calls of one stream are queued unchecked.

The CPU path (torch reference) and the Triton interpreter check at the call, as they always did: their launches
are synchronous. The ring and its records work with any event object that has ``record(stream)`` and
``synchronize()`` (:class:`HostEvent` for synchronous devices), which is how the tests exercise them on the CPU.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NON_FINITE", "PendingCheck", "FlagRing", "FlagWord", "HostEvent", "RING_SLOTS", "MAX_CALL_ID"]

NON_FINITE = (
    "cannot quantize: input holds non-finite values (NaN or ±Inf) or a group range that would "
    "overflow; refusing to produce a poisoned payload"
)
#: slots of a ring: checked calls of one stream that may be in flight with no wait
RING_SLOTS = 256
#: call ids run 1..MAX_CALL_ID (0 is the zeroed word's value and never an id)
MAX_CALL_ID = 2**31 - 1


class HostEvent:
    """The event of a device whose work is done when the call returns (CPU): recording and waiting are no-ops."""

    __slots__ = ()

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class PendingCheck:
    """The non-finite verdict of one checked launch, read from its ring slot on first need.

    ``bad()`` waits for the launch's event (if the verdict is not known yet), reads the verdict and returns it;
    ``raise_if_bad()`` raises the ``ValueError`` a refused call raises. Callbacks registered with
    :meth:`add_done_callback` run once, with the verdict, when it becomes known (whoever reads it: the payload's
    owner, another thread, or the ring reusing the slot). Pickling or copying a record reads the verdict first.
    """

    __slots__ = ("_ring", "_slot", "call_id", "_bad", "_callbacks", "__weakref__")

    def __init__(self, ring: FlagRing | None, slot: int, call_id: int, bad: bool | None = None) -> None:
        self._ring = ring
        self._slot = slot
        self.call_id = call_id
        self._bad = bad
        self._callbacks: list[Callable[[bool], None]] | None = None

    @classmethod
    def resolved(cls, bad: bool) -> PendingCheck:
        """A record whose verdict is already known."""
        return cls(None, -1, 0, bool(bad))

    def done(self) -> bool:
        """Whether the verdict is known (no wait)."""
        return self._bad is not None

    def bad(self) -> bool:
        """The verdict: True if the launch met a non-finite group. Waits for the launch if needed."""
        ring = self._ring  # None once resolved (the verdict is stored before the ring is dropped)
        if ring is not None:
            with ring.lock:
                callbacks = ring._resolve(self) if self._bad is None else None
            _fire(self, callbacks)
        return self._bad

    def raise_if_bad(self) -> None:
        """Raise ``ValueError`` if the launch met a non-finite group (see :meth:`bad`)."""
        if self.bad():
            raise ValueError(NON_FINITE)

    def add_done_callback(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(bad)`` once the verdict is known (at once if it is)."""
        ring = self._ring
        if ring is not None:
            with ring.lock:
                if self._bad is None:
                    if self._callbacks is None:
                        self._callbacks = []
                    self._callbacks.append(fn)
                    return
        fn(self._bad)

    def __reduce__(self):
        return PendingCheck.resolved, (self.bad(),)

    def __repr__(self) -> str:
        state = "pending" if self._bad is None else ("bad" if self._bad else "clean")
        return f"PendingCheck(call {self.call_id}, {state})"


def _fire(record: PendingCheck, callbacks: list[Callable[[bool], None]] | None) -> None:
    """Run a resolved record's callbacks (outside the ring's lock)."""
    for fn in callbacks or ():
        fn(record._bad)


class FlagRing:
    """Slots of host memory that receive a device flag word after each checked launch, one owner per slot.

    Args:
        size: number of slots (checked calls that may be in flight without a wait).
        make_event: creates the event of a slot (``torch.cuda.Event`` on CUDA, :class:`HostEvent` on CPU); one
            per slot, created on first use and reused.
        stream: what ``event.record`` is given (the CUDA stream the launches run on; None on CPU).
        pin_memory: allocate the slots in pinned host memory (needed for an asynchronous device-to-host copy).

    Thread safety: :meth:`submit` and the resolution of a record hold ``lock``, so a record read from another
    thread never sees its slot reused under it.
    """

    def __init__(self, size: int, make_event: Callable[[], Any], stream: Any = None, pin_memory: bool = False) -> None:
        if size < 1:
            raise ValueError(f"a flag ring needs at least one slot, got {size}")
        self.size = size
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin_memory)
        self.slots = list(self.host.split(1))  # (1,) views, made once: the copy's destination
        self.values = self.host.numpy()  # the host's view for reading a verdict without a torch op
        self.make_event = make_event
        self.events: list[Any] = [None] * size
        self.owners: list[weakref.ref | None] = [None] * size
        self.stream = stream
        self.next = 0
        self.lock = threading.Lock()

    def submit(self, word: torch.Tensor, call_id: int) -> PendingCheck:
        """Queue the copy of ``word`` (after the launch of call ``call_id`` on the ring's stream) into the next
        slot, record the slot's event and return the record that reads it. Resolves the slot's previous owner
        first if it is still alive and unresolved (a wait for that older launch)."""
        with self.lock:
            i = self.next
            self.next = i + 1 if i + 1 < self.size else 0
            callbacks, old = None, self.owners[i]
            owner = None if old is None else old()
            if owner is not None and owner._bad is None:
                callbacks = self._resolve(owner)
            self.copy(i, word)
            event = self.events[i]
            if event is None:
                event = self.events[i] = self.make_event()
            event.record(self.stream)
            record = PendingCheck(self, i, call_id)
            self.owners[i] = weakref.ref(record)
        if callbacks:
            _fire(owner, callbacks)
        return record

    def copy(self, i: int, word: torch.Tensor) -> None:
        """Queue the copy of the flag word into slot ``i`` (asynchronous for a pinned slot and a device word)."""
        self.slots[i].copy_(word, non_blocking=True)

    def _resolve(self, record: PendingCheck) -> list[Callable[[bool], None]] | None:
        """Wait for ``record``'s event and store its verdict (``lock`` held); returns its callbacks to run."""
        i = record._slot
        self.events[i].synchronize()
        record._bad = int(self.values[i]) == record.call_id
        record._ring = None
        callbacks, record._callbacks = record._callbacks, None
        return callbacks


class FlagWord:
    """The non-finite flag word of one (thread, device, stream) and the call ids written into it.

    Args:
        device: where the word lives (the kernels' device).
        make_ring: builds the :class:`FlagRing` of deferred checks on first need (None: deferral unsupported).
    """

    __slots__ = ("word", "last_id", "ring", "make_ring")

    def __init__(self, device: torch.device, make_ring: Callable[[], FlagRing] | None = None) -> None:
        self.word = torch.zeros(1, dtype=torch.int32, device=device)
        self.last_id = 0
        self.ring: FlagRing | None = None
        self.make_ring = make_ring

    def next_id(self) -> int:
        """The id of the next checked call (1..MAX_CALL_ID); at the wrap the word is zeroed (stream-ordered) so
        that an id stored 2**31 - 1 calls ago cannot match a new call."""
        i = self.last_id + 1
        if i > MAX_CALL_ID:
            self.word.zero_()
            i = 1
        self.last_id = i
        return i

    def is_set(self, call_id: int) -> bool:
        """Whether call ``call_id`` met a non-finite group, read now (a device read: a sync on CUDA)."""
        return int(self.word.item()) == call_id

    def defer(self, call_id: int) -> PendingCheck:
        """The record that reads call ``call_id``'s verdict later (see the module docstring)."""
        ring = self.ring
        if ring is None:
            ring = self.ring = self.make_ring()
        return ring.submit(self.word, call_id)
