"""Overlapped outer steps: a round's exchange runs in the background while the next round trains.

What a worker does at the end of round r, instead of waiting for round r's group means (docs/design.md
§3.1, "Overlapped outer steps", has the reasons and the measurements). φ: its slow weights, θ: its fast
weights, Δ_r = θ − φ the pseudo-gradient it sends for round r, s_r = φ + Δ_r, R(φ, means) the outer rule's
step (NoLoCo, DiLoCo, averaging) with its momentum.

``provisional``: the eager-update idea of Kale, Douillard and Donchev, "Eager Updates
For Overlapped Communication and Computation in DiLoCo" (arXiv 2502.12996) — this worker's own pseudo-gradient
stands in for the group mean it has not received — taken as a provisional step that the real one replaces
when the means arrive, one round later::

    end of round r:  φ ← R(φ, means_r−1);  θ ← θ + (φ − R̂(φ_r−1, Δ_r−1))     (the step now replaces the provisional one)
                     send s_r;  θ ← R̂(φ, Δ_r)                                  (the provisional step of round r)

R̂(φ, Δ) is the rule's step with mean_Δ = Δ and mean_φ = φ (a group of one: no pull), on copies: φ and the
momentum only ever take real steps, so DiLoCo's φ stays the same on every worker, and R̂ is recomputed bit
for bit at the merge (φ and the momentum of its fragment have not changed since). A failed exchange takes the
provisional step back: θ ← θ + (s_r−1 − R̂), so its progress goes into the next pseudo-gradient.

``coded`` (the default, ``True``) is ``provisional`` with this worker's pseudo-gradient *as its codec sends it*:
R̂(φ, C(Δ_r + e)), C the codec's encode and decode, e the error feedback's residual the exchange adds to Δ_r, so
that the step stands in for the group mean with the very quantity the partners average. With a sparse Δ (top-k) the
provisional step then moves θ where the mean can move φ and leaves it at φ elsewhere, as the blocking round
does, instead of keeping a whole round of unsent progress that the merge takes back a round later. With an
exact codec (fp32) it is ``provisional`` bit for bit. The checkpoint of an exchange in flight keeps its step
(``start``): the residual it was coded with is gone once the exchange has run. The two rules share the merge, so
such a checkpoint resumes under either.

``eager`` implements the eager updates of that paper as written: the outer step of round r is taken at once
and kept, with this worker's own share w = 1/ñ of round r's means (ñ: its group's size), which it knows
exactly, and its partners' shares taken from round r − 1's means, which have just arrived::

    Δ̃_r = w·Δ_r + (mean_Δ,r−1 − w·Δ_r−1)        φ̃_r = w·φ_r + (mean_φ,r−1 − w·φ_r−1)
    send s_r;  φ ← R(φ, Δ̃_r, φ̃_r);  θ ← φ

``delayed`` is Streaming DiLoCo's overlap (Douillard et al., arXiv 2501.18512) with the delay τ = H and a
mixing factor of 1: round r − 1's means are applied at the end of round r, and the progress made meanwhile
is kept on top: ``φ ← R(φ, means_r−1);  θ ← φ + (θ − s_r−1)``, then ``s_r = θ`` is sent.

All apply at a fixed step, not when the bytes arrive, so a run is deterministic and a resumed run exact: by
default at the round boundary (the delay τ is the whole round), and for ``provisional`` and ``delayed`` after
τ = ``overlap_steps`` inner steps if that is set (:meth:`OverlappedRounds.land`; the worker waits there for an
exchange that has not arrived). A checkpoint finishes the exchange in flight first and stores its result
(eager: also what this worker sent against, and the partners' shares not applied yet). With fragments each
rule runs per fragment, one exchange in flight. In a worker of several processes only the leader exchanges;
wherever an exchange is applied it broadcasts φ (and whatever else its processes need to update θ alike) to
the other processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from noloco.state import StateError, all_finite, check_keys, check_tensor, is_int

#: the rules ``overlap=`` (``outer.overlap``) names; ``True`` means :data:`DEFAULT_RULE`
OVERLAP_RULES = ("provisional", "coded", "eager", "delayed")
DEFAULT_RULE = "coded"


def check_overlap_steps(steps: int | None, rule: str | None, period: int) -> int | None:
    """τ, the inner steps after its send at which an exchange lands, as the algorithm uses it: None when it is
    the whole round (the default, ``steps`` None or ``period``, or no overlap), else an integer in [1, period).
    ValueError for anything else, and for τ with the eager rule, whose outer step is taken at the send."""
    if steps is None or rule is None:
        if steps is not None:
            raise ValueError("outer.overlap_steps needs outer.overlap")
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= period:
        raise ValueError(f"outer.overlap_steps must be an integer in [1, {period}] (the inner steps between two "
                         f"exchanges), got {steps!r}")  # fmt: skip
    if rule == "eager" and steps < period:
        raise ValueError(
            "outer.overlap_steps is for the provisional, coded and delayed rules (eager steps at the send)"
        )
    return None if steps == period else steps


def overlap_rule(overlap: bool | str | None) -> str | None:
    """The rule an ``overlap`` setting names: None (no overlap) for False, :data:`DEFAULT_RULE` for True."""
    if overlap is None or overlap is False:
        return None
    if overlap is True:
        return DEFAULT_RULE
    if isinstance(overlap, str) and overlap in OVERLAP_RULES:
        return overlap
    raise ValueError(f"overlap={overlap!r} is not one of false, true, {', '.join(OVERLAP_RULES)}")


def _merge_of(rule: str) -> str:
    """The rule whose merge lands an exchange ``rule`` sent: the provisional and coded rules share theirs (an
    exchange in flight carries the step it started from, or is recomputed as the provisional one), so a checkpoint
    of one resumes under the other (``outer.overlap=true`` named provisional before it named coded)."""
    return "provisional" if rule == "coded" else rule


@dataclass
class InFlight:
    """An overlapped round's exchange: its fragment ``part`` (None: all parameters), the fast weights this worker
    contributed (``snapshot``; its slow weights where they were non-finite: s = φ + Δ), and its future or its
    result. The eager rule keeps the slow weights the contribution was measured against (``slow``) and the share
    w it applied at once (``share``)."""

    round: int
    snapshot: torch.Tensor
    future: object | None = None
    result: object | None = None  # the exchange's _RoundResult once it arrived
    part: slice | None = None
    slow: torch.Tensor | None = None
    share: float | None = None
    rule: str = "delayed"  # the rule that sent it (a checkpoint is refused by a rule of another merge)
    start: torch.Tensor | None = None  # the step L taken at the send (provisional: recomputed after a resume)


def in_flight_state(pending: InFlight | None) -> dict | None:
    """The checkpoint entry of the exchange in flight (its result must have arrived: ``OverlappedRounds.settle``)."""
    if pending is None:
        return None
    result = pending.result
    info = result.info
    means = result.means
    state = {
        "round": pending.round,
        "snapshot": pending.snapshot.clone(),
        "info": {"round": info.round, "group": list(info.group), "skipped": info.skipped, "rejected": info.rejected},
        "mean_delta": None if means is None else means[0].clone(),
        "mean_slow": None if means is None or means[1] is None else means[1].clone(),
        "guarded": result.guarded,
        "rule": pending.rule,
    }
    if pending.part is not None:  # a fragment's exchange: its tensors are of the slice [start, stop) of φ
        state["part"] = [pending.part.start, pending.part.stop]
    if pending.slow is not None:  # the eager rule's: what the contribution was measured against, and its share
        state["slow"], state["share"] = pending.slow.clone(), float(pending.share)
    if pending.rule == "coded" and pending.start is not None:  # its step cannot be recomputed after a resume
        state["start"] = pending.start.clone()
    return state


def _slice_size(part, numel: int, where: str) -> tuple[int]:
    """The size of a stored slice ``[start, stop)`` of φ (a fragment's exchange, outer.fragments)."""
    if not (isinstance(part, list) and len(part) == 2 and all(is_int(b) for b in part)
            and 0 <= part[0] < part[1] <= numel):  # fmt: skip
        raise StateError(f"{where}: not a slice of the {numel} parameters")
    return (part[1] - part[0],)


def check_in_flight_state(pending, numel: int, where: str = "in_flight") -> None:
    """:class:`~noloco.state.StateError` unless ``pending`` is an :func:`in_flight_state` entry for ``numel``
    parameters: its round, the info logged, the tensors of its slice, the eager rule's share."""
    check_keys(pending, where, {"round", "snapshot", "info", "mean_delta", "mean_slow", "guarded"},
               {"part", "slow", "share", "rule", "start"})  # fmt: skip
    if not isinstance(pending.get("rule", "delayed"), str):
        raise StateError(f"{where}/rule: not the name of an overlap rule")
    size = _slice_size(pending["part"], numel, f"{where}/part") if "part" in pending else (numel,)
    check_tensor(pending["snapshot"], f"{where}/snapshot", size)
    for key in ("mean_delta", "mean_slow", "slow", "start"):  # slow and share: the eager rule's; start: coded's
        if pending.get(key) is not None:
            check_tensor(pending[key], f"{where}/{key}", size)
    share = pending.get("share")
    if (share is None) != (pending.get("slow") is None) or not (
        share is None or (isinstance(share, float) and 0 < share <= 1)
    ):
        raise StateError(f"{where}/share: not a share of a group mean (with the slow weights sent)")
    info = pending["info"]
    check_keys(info, f"{where}/info", {"round", "group", "skipped", "rejected"})
    if not (is_int(pending["round"]) and is_int(info["round"]) and isinstance(info["group"], list)
            and all(is_int(g) for g in info["group"]) and is_int(info["rejected"])
            and (info["skipped"] is None or isinstance(info["skipped"], str))
            and isinstance(pending["guarded"], bool)):  # fmt: skip
        raise StateError(f"{where}: not an outer round's exchange")


def check_partners_state(partners, numel: int, where: str = "partners") -> None:
    """:class:`~noloco.state.StateError` unless ``partners`` is :meth:`OverlappedRounds.partners_state`'s list."""
    if not isinstance(partners, list):
        raise StateError(f"{where}: not a list")
    for index, entry in enumerate(partners):
        here = f"{where}/{index}"
        check_keys(entry, here, {"part", "delta", "slow"})
        size = _slice_size(entry["part"], numel, f"{here}/part")
        check_tensor(entry["delta"], f"{here}/delta", size)
        if entry["slow"] is not None:
            check_tensor(entry["slow"], f"{here}/slow", size)


# --- the eager rule's math (pure) ----------------------------------------------------------------------------


def partners_share(means: tuple[torch.Tensor, torch.Tensor | None], share: float, contributed: torch.Tensor,
                   slow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The partners' part of an arrived round's group means: each mean less this worker's own share of it.

    ``means``: (mean_Δ, mean_φ or None) as the exchange returned them; ``contributed``: the fast weights this
    worker sent, ``slow``: the slow weights they were measured against, ``share``: the w it applied at once.
    Returns (mean_Δ − w·(contributed − slow), mean_φ − w·slow). For the fused exchange, whose means are
    (mean_θ − φ_i, φ_i), the sum β·(both) is β·(mean_θ − w·θ_i − (1 − w)·φ_i): again the mean less w of its own.
    """
    mean_delta, mean_slow = means
    delta = mean_delta - share * (contributed - slow)
    return delta, None if mean_slow is None else mean_slow - share * slow


def eager_means(share: float, own_delta: torch.Tensor | None, own_slow: torch.Tensor,
                partners: tuple[torch.Tensor, torch.Tensor | None] | None,
                needs_slow: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The eager rule's stand-ins (Δ̃, φ̃) for a round's group means, for the rule's ``step``.

    Δ̃ = partners' Δ-share + w·own_delta and φ̃ = partners' φ-share + w·own_slow. ``partners`` None (no
    partner's share arrived: the first round, or the last exchange failed) counts the partners as having made
    no progress from this worker's slow weights: Δ̃ = w·own_delta, φ̃ = own_slow (no pull). ``own_delta``
    None: this worker adds no progress of its own (after the last round).
    """
    if partners is None:
        delta = torch.zeros_like(own_slow) if own_delta is None else share * own_delta
        return delta, own_slow.clone() if needs_slow else None
    delta = partners[0].clone() if own_delta is None else partners[0] + share * own_delta
    if not needs_slow:
        return delta, None
    return delta, partners[1] + share * own_slow


# --- the provisional rule's math ------------------------------------------------------------------------------


def provisional_step(rule, slow: torch.Tensor, delta: torch.Tensor, part: slice | None) -> torch.Tensor:
    """φ[part] after one step of ``rule`` as if this worker were its whole group (mean_Δ = ``delta``, mean_φ = φ:
    no pull), computed on copies: ``slow`` (φ[part]) and the rule's momentum are left as they were, so the same
    call later gives the same result bit for bit.

    ``rule.velocity`` (the rule's only state; None before its first step) is swapped for a copy of its ``part``
    while the step runs: the momentum term of the step is the real one.
    """
    full = rule.velocity
    rule.velocity = None if full is None else (full if part is None else full[part]).clone()
    start = slow.clone()
    try:
        rule.step(start, delta, start if rule.needs_slow_mean else None)  # an alias of φ: no pull term
    finally:
        rule.velocity = full
    return start


# --- the overlapped exchange of an outer algorithm -----------------------------------------------------------


class OverlappedRounds:
    """The overlapped exchange of one :class:`~noloco.optim.algorithms.OuterAlgorithm` (``algo``) under ``rule``.

    Holds what overlap adds to the algorithm's state: the exchange in flight (at most one), and for the eager
    rule the partners' shares of arrived exchanges not applied yet (one per fragment; with one fragment a
    share is applied at the exchange it arrives at, so none is held between rounds). The provisional rule
    checkpoints nothing more than the delayed one: its provisional step is kept in memory until the merge, and
    recomputed there after a resume. Runs the exchange on a thread of its own (on CUDA, on a side stream),
    through ``algo.exchange_round``; everything else (the rule, φ, θ, the AdamW state) is touched on the
    caller's thread only, where an exchange is sent or applied.
    """

    def __init__(self, algo, rule: str, by_default: bool = False):
        if rule not in OVERLAP_RULES:
            raise ValueError(f"overlap rule {rule!r} is not one of {OVERLAP_RULES}")
        self.algo, self.rule = algo, rule
        self.by_default = by_default  # the rule is DEFAULT_RULE because overlap=True named no rule (see load)
        self.in_flight: InFlight | None = None
        self.partners: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # by fragment index
        self._last_size: int | None = None  # the size of the last group that arrived (group sources of no schedule)
        self._exchanger = None
        self._side_stream = None  # CUDA: the stream exchanges run on (_exchange_after)

    # --- round boundaries ------------------------------------------------------------------------------------
    @torch.no_grad()
    def round(self, round_index: int):
        """End of round ``round_index``: apply what the rule applies now, and send this round's exchange."""
        if self.rule == "delayed":
            info = self._merge_delayed()
            self._send(round_index)
            return info
        if self.rule in ("provisional", "coded"):
            info = self._merge_provisional()
            taken = self._snapshot(round_index)
            coded = self._coded_delta(*taken) if self.rule == "coded" else None  # before the exchange consumes e
            self._provisional_start(*self._submit(*taken), coded)
            return info
        info = self._arrive()
        self._eager_step(*self._send(round_index))
        return info

    @torch.no_grad()
    def finish(self):
        """After the last inner step: the exchange in flight lands (eager: every partners' share still held is
        applied, the worker adding no progress of its own), so the final weights include it."""
        if self.rule == "eager":
            info = self._arrive()
            self._apply_partners()
        else:
            info = self._merge_delayed() if self.rule == "delayed" else self._merge_provisional()
        if self._exchanger is not None:
            self._exchanger.shutdown(wait=True)
            self._exchanger = None
        return info

    @torch.no_grad()
    def land(self):
        """τ steps after a send (``overlap_steps``): apply the exchange in flight now, waiting for it if needed
        (provisional, coded and delayed rules); the next round boundary then only sends."""
        return self._merge_delayed() if self.rule == "delayed" else self._merge_provisional()

    def settle(self) -> None:
        """Wait for the exchange in flight to arrive (not applied): a checkpoint then stores its result."""
        if self.in_flight is not None and self.in_flight.result is None:
            self.in_flight.result = self.in_flight.future.result()

    # --- the exchange --------------------------------------------------------------------------------------
    def _leads(self) -> bool:
        """Whether this process exchanges: always, except in a worker of several processes (its leader does)."""
        replicas = self.algo.replicas
        return replicas is None or replicas.leader

    def _slow(self, part: slice | None) -> torch.Tensor:
        return self.algo.slow if part is None else self.algo.slow[part]

    def _send(self, round_index: int) -> tuple[InFlight, bool]:
        """Start round ``round_index``'s exchange of θ (of its fragment) in the background; returns it and whether
        θ was non-finite (then φ is contributed: a zero pseudo-gradient, as a blocking round does)."""
        return self._submit(*self._snapshot(round_index))

    def _snapshot(self, round_index: int) -> tuple[int, slice | None, torch.Tensor, bool]:
        """Round ``round_index``, its fragment, θ there (a new tensor: training goes on in the parameters) and
        whether θ is non-finite."""
        part = self.algo.part_of(round_index)
        snapshot = self.algo.read_fast(part)
        return round_index, part, snapshot, not all_finite(snapshot)

    def _submit(self, round_index: int, part: slice | None, snapshot: torch.Tensor,
                guarded: bool) -> tuple[InFlight, bool]:  # fmt: skip
        """:meth:`_send` with θ taken (:meth:`_snapshot`)."""
        algo = self.algo
        slow = self._slow(part)
        pending = InFlight(round_index, slow.clone() if guarded else snapshot, part=part, rule=self.rule)
        if self.rule == "eager":
            pending.slow, pending.share = slow.clone(), 1.0 / self._group_size()
        if self._leads():
            if self._exchanger is None:
                from concurrent.futures import ThreadPoolExecutor

                self._exchanger = ThreadPoolExecutor(1, thread_name_prefix="noloco-exchange")
            caller = torch.cuda.current_stream(snapshot.device) if snapshot.is_cuda else None
            # eager changes φ while the exchange runs: it is measured against φ as sent (the others: φ, unchanged)
            against = pending.slow if self.rule == "eager" else None
            pending.future = self._exchanger.submit(self._exchange_after, caller, round_index, snapshot, against,
                                                    time.perf_counter())  # fmt: skip
        else:
            pending.result = algo.replica_round(round_index)
        self.in_flight = pending
        return pending, guarded

    def _exchange_after(self, caller, round_index: int, snapshot: torch.Tensor, slow: torch.Tensor | None,
                        sent: float):  # fmt: skip
        """``algo.exchange_round`` in the exchange thread, against the slow weights ``slow`` (None: φ); on CUDA
        on a side stream that first waits for the training stream's work up to the snapshot (``caller``), its
        results complete when this returns. Its info's ``exchange_ms`` is the time from ``sent`` (the send's
        ``perf_counter``) until then."""
        if caller is None:
            result = self.algo.exchange_round(round_index, snapshot, slow)
        else:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(caller.device)
            side = self._side_stream
            side.wait_stream(caller)
            with torch.cuda.device(caller.device), torch.cuda.stream(side):
                result = self.algo.exchange_round(round_index, snapshot, slow)
            side.synchronize()
        result.info.exchange_ms = round(1e3 * (time.perf_counter() - sent), 3)
        return result

    def _take(self):
        """The exchange in flight and its result (waiting for it), no longer in flight; (None, None) if none."""
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            return None, None
        waiting = time.perf_counter()
        result = pending.result if pending.result is not None else pending.future.result()
        if pending.future is not None:  # this process exchanged: how long the exchange kept training waiting
            result.info.wait_ms = round(1e3 * (time.perf_counter() - waiting), 3)
        if result.means is not None:
            for mean in result.means:  # made on the exchange's side stream, read on this one: keep them until read
                if isinstance(mean, torch.Tensor) and mean.is_cuda:
                    mean.record_stream(torch.cuda.current_stream(mean.device))
        return pending, result

    def _relay(self, part: slice | None, applied: bool, guarded: bool, extra: tuple = ()) -> tuple[bool, bool]:
        """In a worker of several processes: the leader's (applied, guarded), if applied its φ (of ``part``), and
        the tensors ``extra`` into every process of the worker (it returns the leader's flags; the other
        processes pass tensors of the right shape to be filled). Alone: the flags as they are."""
        replicas = self.algo.replicas
        if replicas is None:
            return applied, guarded
        flags = torch.tensor([float(applied), float(guarded)])
        replicas.broadcast(flags)
        applied, guarded = bool(flags[0]), bool(flags[1])
        if applied:
            replicas.broadcast(self._slow(part))
        for tensor in extra:
            replicas.broadcast(tensor)
        return applied, guarded

    # --- the delayed rule -----------------------------------------------------------------------------------
    def _merge_delayed(self):
        """Apply the exchange in flight, if any: φ ← rule(φ, means); θ ← φ + (θ − snapshot) (θ ← φ if θ was
        non-finite); a failed exchange leaves φ and θ as they are."""
        pending, result = self._take()
        if pending is None:
            return None
        algo, part = self.algo, pending.part
        applied = result.means is not None
        if applied and self._leads():
            algo.rule.step(algo.slow, *result.means, part)
        applied, guarded = self._relay(part, applied, result.guarded)
        if guarded:
            algo.inner_opt.state.clear()  # moments may hold NaN/Inf too
        if applied:
            slow = self._slow(part)
            algo.write_fast(slow if guarded else slow + (algo.read_fast(part) - pending.snapshot), part)
        return result.info

    # --- the provisional rule --------------------------------------------------------------------------------
    def _coded_delta(self, round_index: int, part: slice | None, snapshot: torch.Tensor,
                     guarded: bool) -> torch.Tensor | None:  # fmt: skip
        """The coded rule's pseudo-gradient of the round whose θ is ``snapshot``: Δ as this worker's codec sends it
        (:meth:`~noloco.optim.algorithms.OuterAlgorithm.coded_pseudo_gradient`); None where that is Δ itself or
        not this process's to take (an exact codec, θ non-finite, a worker's non-leading process)."""
        if guarded or not self._leads() or self.algo.codec.exact:
            return None
        return self.algo.coded_pseudo_gradient(snapshot, part)

    def _provisional_start(self, sent: InFlight, guarded: bool, coded: torch.Tensor | None = None) -> None:
        """θ ← the provisional step of the round just sent: φ[part] stepped by the rule with this worker's own
        pseudo-gradient (``coded``: as sent, the coded rule's) as its group's mean (φ and the momentum unchanged:
        :func:`provisional_step`)."""
        algo, part = self.algo, sent.part
        slow = self._slow(part)
        if self._leads():
            delta = sent.snapshot - slow if coded is None else coded  # None where θ was non-finite
            start = provisional_step(algo.rule, slow, delta, part)
            sent.start = start  # the merge needs it again: kept rather than recomputed (bit for bit the same)
        else:
            start = torch.empty_like(slow)
        _, guarded = self._relay(part, False, guarded, (start,))
        if guarded:  # θ was non-finite: φ was contributed (a zero pseudo-gradient); the moments may hold NaN/Inf too
            algo.inner_opt.state.clear()
        algo.write_fast(start, part)

    def _merge_provisional(self):
        """Apply the exchange in flight, if any: φ ← rule(φ, means), and θ ← θ + (φ − start), start being the
        provisional step it took at the send (kept from the send; after a resume recomputed, bit for bit, since φ
        and the momentum of its fragment have not changed since). A failed exchange leaves φ as it is and takes
        the provisional step back: θ ← θ + (s − start), s = φ + Δ what it sent, so the next pseudo-gradient covers
        the missed round, as for a blocking round."""
        pending, result = self._take()
        if pending is None:
            return None
        algo, part = self.algo, pending.part
        applied = result.means is not None
        slow = self._slow(part)
        if self._leads():
            start = pending.start  # None after a resume: recomputed (φ and the momentum are as they were)
            if start is None:
                start = provisional_step(algo.rule, slow, pending.snapshot - slow, part)
            if applied:
                algo.rule.step(algo.slow, *result.means, part)
            correction = (slow if applied else pending.snapshot) - start
        else:
            correction = torch.empty_like(slow)
        self._relay(part, applied, False, (correction,))
        algo.write_fast(algo.read_fast(part) + correction, part)
        return result.info

    # --- the eager rule --------------------------------------------------------------------------------------
    def _fragment(self, part: slice | None) -> int:
        return 0 if part is None else self.algo.fragments.index(part)

    def _parts(self) -> list[slice | None]:
        fragments = self.algo.fragments
        return [None] if len(fragments) == 1 else list(fragments)

    def _group_size(self) -> int:
        """ñ: the group's size when a schedule fixes it (a fixed world), else that of the last group that arrived
        (before any: the source's ``group_size``, or 2)."""
        schedule = getattr(self.algo.group_source, "schedule", None)
        if schedule is not None:
            return schedule.group_size
        return self._last_size or getattr(self.algo.group_source, "group_size", None) or 2

    def _arrive(self):
        """Wait for the exchange in flight and keep its partners' share (the leader; a failed one: none)."""
        pending, result = self._take()
        if pending is None:
            return None
        if self._leads():
            fragment = self._fragment(pending.part)
            if result.means is None:
                self.partners.pop(fragment, None)
            else:
                self.partners[fragment] = partners_share(result.means, pending.share, pending.snapshot, pending.slow)
                self._last_size = len(result.info.group) or None
        return result.info

    def _eager_step(self, sent: InFlight, guarded: bool) -> None:
        """The outer step of the round just sent: φ ← rule(φ, Δ̃, φ̃) on its fragment, then θ ← φ there."""
        algo, part = self.algo, sent.part
        if self._leads():
            shares = self.partners.pop(self._fragment(part), None)
            delta, slow = eager_means(sent.share, sent.snapshot - sent.slow, sent.slow, shares,
                                      algo.rule.needs_slow_mean)  # fmt: skip
            algo.rule.step(algo.slow, delta, slow, part)
        _, guarded = self._relay(part, True, guarded)
        if guarded:  # θ was non-finite: φ was contributed; the moments may hold NaN/Inf too
            algo.inner_opt.state.clear()
        algo.write_fast(self._slow(part), part)

    def _apply_partners(self) -> None:
        """After the last round: each fragment's partners' share still held is applied as an outer step that adds
        no progress of this worker's own; the progress θ − φ since the fragment's last exchange stays on top."""
        algo = self.algo
        for part in self._parts():
            shares = self.partners.pop(self._fragment(part), None) if self._leads() else None
            progress = algo.read_fast(part) - self._slow(part)
            if shares is not None:
                own = self._slow(part).clone()
                delta, slow = eager_means(1.0 / self._group_size(), None, own, shares, algo.rule.needs_slow_mean)
                algo.rule.step(algo.slow, delta, slow, part)
            applied, _ = self._relay(part, shares is not None, False)
            if applied:
                algo.write_fast(self._slow(part) + progress, part)

    # --- checkpoint ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What overlap adds to the algorithm's state: ``in_flight`` (the exchange in flight, waited for first:
        :meth:`settle`; None if none) and, while the eager rule holds any, ``partners`` (their shares)."""
        self.settle()
        state = {"in_flight": in_flight_state(self.in_flight)}
        partners = self.partners_state()
        if partners is not None:  # the eager overlap's partners' shares not applied yet (several fragments)
            state["partners"] = partners
        return state

    @staticmethod
    def check_state(state: dict, numel: int, where: str = "algorithm") -> None:
        """:class:`~noloco.state.StateError` unless the ``in_flight`` and ``partners`` entries of ``state`` (an
        algorithm's state; absent or None: none) are :meth:`state_dict`'s for ``numel`` parameters."""
        if state.get("in_flight") is not None:  # an overlapped round's exchange, finished before the save
            check_in_flight_state(state["in_flight"], numel, f"{where}/in_flight")
        if state.get("partners") is not None:  # the eager overlap's partners' shares not applied yet
            check_partners_state(state["partners"], numel, f"{where}/partners")

    def partners_state(self) -> list[dict] | None:
        """The partners' shares held (eager, several fragments), each with its slice of φ; None when none."""
        if not self.partners:
            return None
        parts = self._parts()
        entries = []
        for fragment, (delta, slow) in sorted(self.partners.items()):
            part = parts[fragment] or slice(0, self.algo.slow.numel())
            entries.append({"part": [part.start, part.stop], "delta": delta.clone(),
                            "slow": None if slow is None else slow.clone()})  # fmt: skip
        return entries

    def load(self, pending: InFlight | None, partners: list[dict] | None) -> None:
        """Adopt a checkpoint's exchange in flight and partners' shares, checked against this run's rule and split."""
        if pending is not None and (_merge_of(pending.rule) != _merge_of(self.rule)
                                    or (pending.slow is None) == (self.rule == "eager")):  # fmt: skip
            raise ValueError(f"checkpoint's in-flight exchange is of the {pending.rule} overlap rule, this run's is "
                             f"{self.rule} (was outer.overlap changed?)")  # fmt: skip
        if pending is not None and self.by_default and pending.rule != self.rule:
            # overlap=True named provisional before it named coded: a run saved then goes on as it was trained, so
            # that it ends where it would have without the interruption
            self.rule = self.algo.overlap = pending.rule
        loaded = {}
        parts, like = self._parts(), self.algo.slow
        for entry in partners or []:
            start, stop = (int(b) for b in entry["part"])
            part = slice(start, stop)
            whole = parts == [None] and (start, stop) == (0, like.numel())
            if self.rule != "eager" or not (whole or part in parts):
                raise ValueError(f"checkpoint holds a partners' share of the slice [{start}, {stop}), which is not "
                                 f"a fragment of this run's eager overlap (was outer.overlap or outer.fragments "
                                 f"changed?)")  # fmt: skip
            tensors = []
            for key in ("delta", "slow"):
                tensor = entry[key]
                if tensor is not None and (tensor.shape != (stop - start,) or not torch.isfinite(tensor).all()):
                    raise ValueError(f"checkpoint's partners' share has a bad {key}")
                tensors.append(None if tensor is None else tensor.to(like.device, torch.float32).clone())
            loaded[0 if whole else parts.index(part)] = (tensors[0], tensors[1])
        self.in_flight, self.partners = pending, loaded
