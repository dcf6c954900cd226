"""Training algorithms behind one interface, usable inside anyone's training loop.

``NoLoCo`` (arXiv 2506.10911), ``DiLoCo`` (arXiv 2311.08105), ``PeriodicAveraging`` and the ``DDP``
baseline wrap a model, its inner optimizer and a transport. A loop calls two methods::

    loss.backward()
    algo.sync_gradients()                 # DDP: average gradients over all workers; others: no-op
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    algo.step()                           # inner optimizer step; every H steps the outer exchange

The outer algorithms keep the slow weights ``φ`` as one flat fp32 vector. Every ``every`` inner
steps they reduce the pseudo-gradients (and, for NoLoCo, the slow weights) over their group with
:func:`noloco.collectives.allreduce`, apply the pure update rule of :mod:`noloco.optim`, and load
``φ`` back into the model. NoLoCo with β = γ and one codec for both terms exchanges the fast weights
once instead (``β·mean_Δ + γ·(mean_φ − φ_i) = β·(mean_θ − φ_i)``), which halves its bytes.

Compression (docs/design.md §3.2): the pseudo-gradient goes through ``codec`` (default int4) with error
feedback. The slow-weight term goes through ``slow_codec`` as the difference from the initial
weights, which every worker holds (same seed), so the codec sees accumulated training updates, not
raw weights; it has its own error feedback. The fused single exchange (β = γ and one codec for both
terms) sends the fast weights as the difference from the initial weights, θ − φ_0, through that codec
with error feedback: exact for fp32, and for a lossy codec half the bytes of the two-vector exchange
(measured in docs/results/codecs.md). Below 4 bits the fused message is no longer honest (θ − φ_0 grows
over training and is not sparse), so ``slow_every=k`` splits the exchange: Δ every round through ``codec``
(sparse or low-bit, with error feedback), φ − φ_0 through ``slow_codec`` in one round of every k only; the
other rounds apply no pull (:meth:`OuterAlgorithm.slow_round`; docs/design.md §3.2 bounds what that changes);
``slow_stagger`` sends a rotating 1/k slice of φ − φ_0 every round instead and pulls on that slice.

Fragments (``fragments=k``, docs/design.md §3.1): the flat vector is cut into k contiguous slices
(:mod:`noloco.optim.fragments`); an exchange runs every ``every/k`` steps on one slice only, with that
slice's own error feedback, so each carries about 1/k of the bytes.

Faults (docs/reliability.md): a round whose exchange fails — a dead or silent peer
(:class:`~noloco.comm.base.CommTimeout` after ``timeout`` seconds), a malformed or non-finite payload
(:class:`~noloco.collectives.PayloadMismatch`) — is skipped by default: φ, θ and the error-feedback
state stay as they were and training goes on; the next round's pseudo-gradient covers the missed
steps. Every reduction runs with a norm bound (``max_norm_ratio``, default 10): a partner's
contribution more than that many times larger than this worker's own is dropped, counted in
:attr:`OuterAlgorithm.norm_rejections` and logged, never applied. ``NOLOCO_FAULTS`` points
``inner.step``, ``outer.exchange`` and ``outer.send`` (and link drops/delays) fire here
(:mod:`noloco.comm.faults`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch.nn.utils import parameters_to_vector

from noloco.collectives import Codec, NormRejections, ReductionErrorFeedback, allreduce, get_codec
from noloco.comm import faults
from noloco.comm.base import ByteCounter, CommAborted, CommError, Transport
from noloco.gossip import GroupSource, ScheduledGroups
from noloco.optim.base import OuterRule
from noloco.optim.diloco import AveragingRule, DiLoCoRule
from noloco.optim.fragments import Fragment, split_fragments
from noloco.optim.noloco import NoLoCoRule
from noloco.optim.overlap import InFlight, OverlappedRounds, check_overlap_steps, overlap_rule
from noloco.optim.spread import SpreadHistory
from noloco.optim.stagger import SliceFeedback, stagger_index, stagger_slices
from noloco.quant.coset import steps as coset_steps
from noloco.state import StateError, all_finite, check_keys, check_tensor, is_count

logger = logging.getLogger(__name__)

#: Default norm bound of the outer exchange (``comm.max_norm_ratio``): honest NoLoCo contributions are
#: within a factor 1.4 of each other per segment (measured, docs/reliability.md), so 10 never refuses
#: an honest partner and stops any peer sending updates 10x or more larger than this worker's own.
DEFAULT_MAX_NORM_RATIO = 10.0


@dataclass
class OuterRoundInfo:
    """What one outer round did, for logging. ``skipped`` names why the update was not applied."""

    round: int
    group: list[int]
    skipped: str | None = None
    rejected: int = 0  # partners' contributions (or reduced segments) the norm bound refused this round
    fragment: int | None = None  # which fragment the round exchanged (outer.fragments > 1); None: all parameters
    exchange_ms: float | None = None  # outer.overlap: how long the exchange ran on its thread, from its send
    wait_ms: float | None = None  # outer.overlap: how long the training thread waited for it where it landed


SAME_START = ("broadcast", "check", "trust")


@torch.no_grad()
def agree_on_start(params: list[torch.nn.Parameter], transport: Transport, mode: str, timeout: float) -> None:
    """Make every rank of ``transport`` start from the same weights (NoLoCo, DiLoCo and DDP assume it).

    Each rank sends rank 0 a SHA-256 of its weights. ``broadcast`` (the default): ranks whose weights
    differ from rank 0's receive rank 0's and copy them in (a model built from the global RNG in
    each thread, say). ``check``: such a rank raises ``ValueError`` instead. ``trust``: no check. The
    start-up messages are not counted as traffic.
    """
    if mode not in SAME_START:
        raise ValueError(f"same_start={mode!r} is not one of {SAME_START}")
    if mode == "trust" or transport.world_size == 1:
        return
    flat = parameters_to_vector(params).detach().float().cpu().contiguous()
    digest = hashlib.sha256(flat.numpy().tobytes()).digest()
    before = transport.counter.state_dict()
    try:
        if transport.rank != 0:
            transport.send(0, "start/digest", digest)
            verdict = transport.recv(0, "start/verdict", timeout)
            if verdict == b"same":
                return
            if mode == "check":
                raise ValueError(
                    f"rank {transport.rank} starts from other weights than rank 0: build every "
                    "replica from the same seed or state_dict (or pass same_start='broadcast')"
                )
            weights = transport.recv(0, "start/weights", timeout)
            if len(weights) != 4 * flat.numel():
                raise ValueError(f"rank 0's starting weights have {len(weights)} bytes, expected {4 * flat.numel()}")
            copy_flat_into(torch.frombuffer(bytearray(weights), dtype=torch.float32).to(params[0].device), params)
            return
        differ = []
        for rank in range(1, transport.world_size):
            same = transport.recv(rank, "start/digest", timeout) == digest
            transport.send(rank, "start/verdict", b"same" if same else b"differ")
            if not same:
                differ.append(rank)
        if differ and mode == "broadcast":
            payload = flat.numpy().tobytes()
            for rank in differ:
                transport.send(rank, "start/weights", payload)
            logger.warning("ranks %s started from other weights than rank 0; they now start from rank 0's", differ)
    finally:
        transport.counter.load_state_dict(before)


@dataclass
class _RoundResult:
    """An outer round's exchange: what to log, the group means to apply (None: skipped), whether the
    fast weights were non-finite."""

    info: OuterRoundInfo
    means: tuple[torch.Tensor, torch.Tensor | None] | None
    guarded: bool = False


def _in_flight_from(state: dict | None, like: torch.Tensor, split) -> InFlight | None:
    """The exchange in flight of a checkpoint; ``split(round)``: the (slice, fragment) this run's round exchanges."""
    if state is None:
        return None
    part, fragment = split(int(state["round"]))
    stored = state.get("part")
    if (None if stored is None else [int(b) for b in stored]) != (None if part is None else [part.start, part.stop]):
        raise ValueError(f"checkpoint's in-flight exchange is of the slice {stored} of the parameters, this "
                         f"run's round {state['round']} exchanges {part} (was outer.fragments changed?)")  # fmt: skip
    shape = like.shape if part is None else torch.Size([part.stop - part.start])
    for key in ("snapshot", "mean_delta", "mean_slow", "slow", "start"):
        tensor = state.get(key)
        if tensor is not None and (tensor.shape != shape or not torch.isfinite(tensor).all()):
            raise ValueError(f"checkpoint's in-flight exchange has a bad {key}")
    share = state.get("share")
    if (share is None) != (state.get("slow") is None) or not (share is None or 0 < share <= 1):
        raise ValueError("checkpoint's in-flight exchange has a bad share")
    to = lambda t: None if t is None else t.to(like.device, torch.float32).clone()  # noqa: E731
    means = None if state["mean_delta"] is None else (to(state["mean_delta"]), to(state["mean_slow"]))
    result = _RoundResult(OuterRoundInfo(**state["info"], fragment=fragment), means, bool(state["guarded"]))
    rule = state.get("rule", "delayed")  # checkpoints from before the eager and provisional rules: delayed
    return InFlight(int(state["round"]), to(state["snapshot"]), None, result, part, to(state.get("slow")),
                    None if share is None else float(share), str(rule), to(state.get("start")))  # fmt: skip


@dataclass
class OuterState:
    """What a joining worker adopts from a live one: the inner step, the slow weights φ and the outer
    momentum (flat fp32; ``None`` for rules without momentum). AdamW moments are not part of it."""

    step: int
    slow: torch.Tensor
    velocity: torch.Tensor | None = None


def _reduction_name(reduction: str, algorithm: str | None) -> str:
    if algorithm is not None:
        warnings.warn("the algorithm= keyword is deprecated: pass reduction= (the reduction schedule)",
                      DeprecationWarning, stacklevel=4)  # fmt: skip
        return algorithm
    return reduction


def _unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _ef_state(feedback: ReductionErrorFeedback | None) -> dict | None:
    return None if feedback is None else feedback.state_dict()


def _ef_load(feedback: ReductionErrorFeedback | None, state: dict | None) -> None:
    if feedback is not None and state is not None:
        feedback.load_state_dict(state)


@torch.no_grad()
def _read_part(tensors: list[torch.Tensor], part: slice) -> torch.Tensor:
    """The positions ``part`` of the flat fp32 vector of ``tensors`` (a new tensor)."""
    pieces, offset = [], 0
    for tensor in tensors:
        n = tensor.numel()
        lo, hi = max(part.start, offset), min(part.stop, offset + n)
        if lo < hi:
            pieces.append(tensor.detach().reshape(-1)[lo - offset : hi - offset].float())
        offset += n
    return torch.cat(pieces)


@torch.no_grad()
def _write_part(values: torch.Tensor, part: slice, tensors: list[torch.Tensor]) -> None:
    """Copy ``values`` into the positions ``part`` of the flat vector of ``tensors``, in place."""
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        lo, hi = max(part.start, offset), min(part.stop, offset + n)
        if lo < hi:
            tensor.view(-1)[lo - offset : hi - offset].copy_(values[lo - part.start : hi - part.start])
        offset += n


@torch.no_grad()
def copy_flat_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of the 1-D ``flat`` into ``tensors`` in place (no storage sharing).

    One multi-tensor copy where torch has it (on a GPU a few kernels instead of one memcpy per tensor).
    """
    total = sum(t.numel() for t in tensors)
    if total != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, tensors hold {total}")
    pieces = [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    if hasattr(torch, "_foreach_copy_") and all(t.device == flat.device for t in tensors):
        torch._foreach_copy_(tensors, pieces)
        return
    for tensor, piece in zip(tensors, pieces):
        tensor.copy_(piece)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Below 4 bits per value NoLoCo splits its exchange by default (``outer.slow_every`` and ``comm.slow_codec`` null;
#: docs/design.md §3.2): Δ through the codec every round, φ − φ_0 through :data:`SPLIT_SLOW_CODEC` one round in
#: :data:`SPLIT_EVERY`, the frontier's measured points. A fused θ − φ_0 below 4 bits loses the progress itself (top-k
#: of it trained worse than the unigram baseline on the CPU frontier's budget: 5.28 against 5.24; split: 4.41).
SPLIT_EVERY = 8
SPLIT_SLOW_CODEC = "int4"


def below_four_bits(codec: str | Codec) -> bool:
    """Whether ``codec`` sends fewer than 4 bits per value (int3, int2, sign, top-k, ...): measured on its message
    for 2^16 values, headers and scales included (int4 with its group scales is 4.19)."""
    codec = get_codec(codec)
    numel = 1 << 16
    return not codec.exact and codec.nbytes(numel) * 8 < 4 * numel


def slow_term_settings(codec: str | Codec, slow_codec: str | Codec | None, slow_every: int | None):
    """NoLoCo's slow-weight term for the given keys, null ones resolved: ``(slow_codec, slow_every)``.

    ``slow_every`` null: 1 (the fused exchange), or :data:`SPLIT_EVERY` for a codec below 4 bits;
    ``slow_codec`` null: the codec itself, or :data:`SPLIT_SLOW_CODEC` for a codec below 4 bits (φ − φ_0 is dense
    and grows over training: a 2-bit grid or a top-k of it drops the partners' difference the pull needs).
    Explicit values are kept as they are."""
    low = below_four_bits(codec)
    every = (SPLIT_EVERY if low else 1) if slow_every is None else slow_every
    return (SPLIT_SLOW_CODEC if low else codec) if slow_codec is None else slow_codec, every


def _resolved_every(settings: Mapping):
    """``slow_every`` of ``settings``, null resolved by the codec given with it (unknown codecs: as 1)."""
    every = settings.get("slow_every", 1)
    if every is None:
        try:
            every = slow_term_settings(settings.get("codec", "int4"), None, None)[1]
        except ValueError:  # an unknown codec: the reduction settings' check names it
            every = 1
    return every


def _setting_problem(keyword: str, value, settings: Mapping) -> str | None:
    """What is wrong with one setting of an algorithm (``settings``: the others given with it), or None."""
    if keyword in ("timeout", "group_timeout") and not (value is None and keyword == "group_timeout"):
        return None if _number(value) and value > 0 else f"must be > 0 seconds, got {value!r}"
    if keyword == "error_feedback_decay":
        return None if _number(value) and 0 < value <= 1 else f"must be in (0, 1], got {value!r}"
    if keyword == "every":
        return None if _count(value) and value >= 1 else f"must be an integer >= 1, got {value!r}"
    if keyword == "fragments":
        every = settings.get("every", value)
        if not (_count(value) and value >= 1):
            return f"must be an integer >= 1, got {value!r}"
        if _count(every) and every % value:
            return f"={value} does not divide outer.every={every}"
    if keyword == "slow_every":
        if not (value is None or (_count(value) and value >= 1)):
            return f"must be an integer >= 1, got {value!r}"
        # eager moves φ before the partners' share lands, so a round without the slow term would pull φ back
        # toward the φ it sent (its only stand-in for the partners' φ); delayed and provisional leave φ alone
        if _resolved_every(settings) > 1 and settings.get("overlap") == "eager":
            if value is None:
                return (
                    f"null is {SPLIT_EVERY} for comm.codec={settings.get('codec')} (below 4 bits), which does "
                    "not run with outer.overlap=eager: set outer.slow_every=1 or use provisional or delayed"
                )
            return "> 1 does not run with outer.overlap=eager (use provisional or delayed)"
    if keyword == "slow_stagger" and (not isinstance(value, bool) or (value and _resolved_every(settings) == 1)):
        return f"={value!r} must be true or false, and true needs outer.slow_every > 1"
    if keyword == "momentum" and value is not None and not (_number(value) and 0 <= value < 1):
        return f"must be in [0, 1), got {value!r}"
    if keyword == "lr" and not (_number(value) and value > 0):
        return f"must be > 0, got {value!r}"
    if keyword == "pull" and not (_number(value) and value >= 0):
        return f"must be >= 0, got {value!r}"
    if keyword == "max_norm_ratio" and value is not None and not (_number(value) and value > 1):
        return f"must be a number > 1 (null disables the norm bound), got {value!r}"
    return None


class Algorithm:
    """Base class: holds the model, inner optimizer and transport; counts inner steps.

    Its settings have one home each: the constructor's keyword and its default, :attr:`SETTINGS` (the config
    key each is read from, ``noloco/train/defaults.yaml`` holding the same defaults: a test compares them), and
    :meth:`check_settings` (the one validation, run by the constructor and by the config before a run starts).
    """

    name = "base"
    #: config key → constructor keyword: what a run's config sets (:meth:`settings_from`)
    SETTINGS: ClassVar[dict[str, str]] = {
        "comm.codec": "codec",
        "comm.recv_timeout": "timeout",
        "comm.error_feedback": "error_feedback",
        "comm.error_feedback_decay": "error_feedback_decay",
        "comm.reduction": "reduction",
    }

    def __init__(
        self,
        model: torch.nn.Module,
        inner_opt: torch.optim.Optimizer,
        transport: Transport | None,
        codec: str | Codec = "int4",
        timeout: float = 120.0,
        error_feedback: bool = True,
        reduction: str = "two_phase",
        algorithm: str | None = None,
        same_start: str = "broadcast",
        error_feedback_decay: float = 1.0,
    ):
        self.check_settings({"timeout": timeout, "error_feedback_decay": error_feedback_decay})
        self.model, self.inner_opt, self.transport = model, inner_opt, transport
        self.params = _unique_params(model)
        self.codec: Codec = get_codec(codec)  # parsed once; equal specs compare equal
        self.timeout, self.reduction = float(timeout), _reduction_name(reduction, algorithm)
        # error feedback only means something for a lossy codec; decay β: each call sends x + β·e (docs/quant.md)
        self.error_feedback_decay = float(error_feedback_decay)
        self.feedback = self._new_feedback() if error_feedback and not self.codec.exact else None
        self.inner_step = 0
        self.last_round: OuterRoundInfo | None = None
        self._nonfinite_host = 0  # gradients or fast weights found non-finite and neutralised
        self._nonfinite_on_device: torch.Tensor | None = None  # the same count, still on the GPU (read lazily)
        self.norm_rejections = NormRejections()  # partners' contributions a norm bound refused (none for DDP)
        if transport is not None:
            agree_on_start(self.params, transport, same_start, self.timeout)

    @classmethod
    def settings_from(cls, config: Mapping) -> dict:
        """The constructor keywords a run's ``config`` (nested mappings: ``config["comm"]["codec"]``) sets, by
        :attr:`SETTINGS`; null passes None (the constructor's meaning of it), a missing key leaves the default."""
        out = {}
        for key, keyword in cls.SETTINGS.items():
            section, name = key.split(".")
            if section in config and name in config[section]:
                out[keyword] = config[section][name]
        return out

    @classmethod
    def check_settings(cls, settings: Mapping) -> None:
        """ValueError, naming the config key, for a setting out of range (keywords absent from ``settings`` are
        not checked). The one check of each: the constructor runs it, and so does the config before a run."""
        keys = {keyword: key for key, keyword in cls.SETTINGS.items()}
        for keyword, value in settings.items():
            problem = _setting_problem(keyword, value, settings)
            if problem is not None:
                gap = "" if problem.startswith("=") else " "  # "outer.fragments=3 does not divide ..."
                raise ValueError(f"{keys.get(keyword, keyword)}{gap}{problem}")

    def _new_feedback(self) -> ReductionErrorFeedback:
        """A fresh error-feedback state of this algorithm's decay (ValueError unless in (0, 1])."""
        return ReductionErrorFeedback(self.error_feedback_decay)

    @property
    def nonfinite_events(self) -> int:
        """Steps whose gradients (or fast weights) were non-finite and neutralised (reading it waits for the GPU)."""
        on_device = 0 if self._nonfinite_on_device is None else int(self._nonfinite_on_device.item())
        return self._nonfinite_host + on_device

    @nonfinite_events.setter
    def nonfinite_events(self, value: int) -> None:
        self._nonfinite_host, self._nonfinite_on_device = int(value), None

    def sync_gradients(self) -> None:
        """Called after ``backward()``; averages gradients where the algorithm does so."""

    def step(self) -> OuterRoundInfo | None:
        """Inner optimizer step, then whatever the algorithm does after it. Returns outer-round info.

        Non-finite gradients are dropped (no inner update this step), so one bad batch cannot
        poison the weights or the optimizer moments. Fault point ``inner.step`` fires first.
        """
        faults.fire("inner.step", self.inner_step + 1, getattr(self.transport, "rank", None))
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and grads[0].is_cuda and self.inner_opt.defaults.get("fused"):
            # on the device, no host sync: the fused optimizer skips the step itself when found_inf is set
            found_inf = (~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())).float()
            self._nonfinite_on_device = (
                found_inf if self._nonfinite_on_device is None else (self._nonfinite_on_device + found_inf)
            )
            self.inner_opt.found_inf, self.inner_opt.grad_scale = found_inf, None
        elif grads and not all(all_finite(g) for g in grads):  # one sum each: 11x faster than isfinite on a CPU
            self.nonfinite_events += 1
            self.inner_opt.zero_grad(set_to_none=True)
        self.inner_opt.step()
        self.inner_opt.zero_grad(set_to_none=True)
        self.inner_step += 1
        self.last_round = self._after_inner_step()
        return self.last_round

    def _after_inner_step(self) -> OuterRoundInfo | None:
        return None

    def finish(self) -> OuterRoundInfo | None:
        """Called once after the last inner step; applies anything still pending (overlapped exchange)."""
        return None

    @property
    def counter(self) -> ByteCounter:
        """Bytes this worker has sent and received for the algorithm's exchanges."""
        return self.transport.counter

    def slow_weights(self) -> torch.Tensor:
        """The weights workers agree on (the slow weights for outer algorithms), flat fp32."""
        return parameters_to_vector(self.params).detach().float().clone()

    @contextlib.contextmanager
    def slow_in_model(self):
        """Inside the block the model's trained parameters hold :meth:`slow_weights` (to evaluate them); after
        it, what they held before, bit for bit. Here they are the same: the model is left as it is."""
        yield

    def state_dict(self) -> dict:
        return {"inner_step": self.inner_step, "feedback": _ef_state(self.feedback)}

    @classmethod
    def check_state(cls, state, numel: int, where: str = "algorithm") -> None:
        """:class:`~noloco.state.StateError` unless ``state`` is this algorithm's :meth:`state_dict` for a model of
        ``numel`` trained parameters: the inner step and the error feedback's residuals."""
        check_keys(state, where, {"inner_step", "feedback"})
        cls._check_common(state, numel, where)

    @staticmethod
    def _check_common(state: dict, numel: int, where: str) -> None:
        if not is_count(state["inner_step"]):
            raise StateError(f"{where}/inner_step: {state['inner_step']!r}, not a step count")
        for key in ("feedback", "slow_feedback"):
            if state.get(key) is not None:
                ReductionErrorFeedback.check_state(state[key], numel, f"{where}/{key}")

    def load_state_dict(self, state: dict) -> None:
        self.inner_step = int(state["inner_step"])
        _ef_load(self.feedback, state.get("feedback"))


class DDP(Algorithm):
    """Baseline: all-reduce (mean) of the gradients over all workers after every backward."""

    name = "ddp"

    def sync_gradients(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = parameters_to_vector(grads)
        if not torch.isfinite(flat).all():  # contribute nothing rather than spread NaN/Inf
            self.nonfinite_events += 1
            flat = torch.zeros_like(flat)
        mean = allreduce(
            flat,
            self.transport,
            codec=self.codec,
            reduction=self.reduction,
            op="mean",
            timeout=self.timeout,
            tag=f"ddp/s{self.inner_step + 1}",
            error_feedback=self.feedback,
        )
        for p, g in zip(self.params, grads):
            if p.grad is None:
                p.grad = g
        copy_flat_into(mean, [p.grad for p in self.params])


class OuterAlgorithm(Algorithm):
    """Inner steps locally; every ``every`` steps an outer step over the group ``group_source`` forms.

    ``skip_failed_rounds`` (default True): when the group cannot be formed or the exchange fails (a
    dead, silent or misbehaving member, in an open swarm or a fixed world), leave φ, θ and the
    error-feedback state as they are and go on training; the next round's pseudo-gradient then covers
    the missed steps. A deliberate shutdown of the transport (:class:`~noloco.comm.base.CommAborted`:
    another in-process worker crashed) is always raised. When false, every failure is raised.

    ``fragments`` (default 1): cut the parameters into that many contiguous fragments
    (:func:`noloco.optim.fragments.split_fragments`) and exchange fragment j alone at the steps ≡ j·every/k
    (mod every), each with its own error-feedback state; ``every`` must be a multiple of it. Every
    exchange then carries about 1/k of the bytes (Streaming DiLoCo's fragments, docs/design.md §3.1).
    Rounds are numbered by exchange (every ``every/k`` steps), and NoLoCo draws a group for each.

    ``overlap`` (default False): each exchange runs in the background while the next round trains, and the rule
    it names says what is applied at each round boundary: ``"coded"`` (also True), ``"provisional"``, ``"eager"``
    or ``"delayed"`` (:mod:`noloco.optim.overlap`, docs/design.md §3.1). In a worker of several processes the
    leader relays what it applied to the others. ``overlap_steps`` (τ; default None: the whole round,
    ``every / fragments`` steps): the provisional, coded and delayed rules apply an exchange τ inner steps after it
    was sent, waiting for it there if it has not arrived: a smaller τ hides less of the exchange and delays
    its means less.

    ``slow_every`` (k; NoLoCo): the slow-weight term φ − φ_0 crosses the link in one cycle of rounds of
    every k (:meth:`slow_round`); in the others the round reduces Δ alone and the rule applies no pull. With k > 1
    the exchange is never fused, so Δ alone can take a sparse or low-bit ``codec``. None (the default) and a None
    ``slow_codec`` are chosen by the codec (:func:`slow_term_settings`): k = 1 and the same codec (fused) at 4 bits
    and above, k = 8 and int4 for the slow term below. ``slow_stagger`` (k > 1 only):
    instead, every round sends slice (r ÷ fragments) mod k of the term (:mod:`noloco.optim.stagger`) and pulls on
    that slice alone, so every round's message is the same size and every parameter is still pulled once per k.

    ``max_norm_ratio``: the norm bound every reduction of the outer step runs with (None: none); what
    it refuses is counted in :attr:`norm_rejections` (kept in the checkpoint) and in the round's
    :class:`OuterRoundInfo`. "Own" means, per segment: for the pseudo-gradient, this worker's own
    (its progress φ − φ_0 when the non-finite guard zeroed it); for the slow-weight term φ − φ_0,
    √(‖φ − φ_0‖² + ‖Δ‖²), since a worker whose rounds were all skipped still has φ = φ_0 while its
    partners legitimately moved by about one pseudo-gradient; for the fused θ − φ_0, its own.
    """

    SETTINGS: ClassVar[dict[str, str]] = {
        **Algorithm.SETTINGS,
        "outer.every": "every",
        "comm.slow_codec": "slow_codec",
        "comm.max_norm_ratio": "max_norm_ratio",
        "comm.group_timeout": "group_timeout",
        "outer.overlap": "overlap",
        "outer.overlap_steps": "overlap_steps",
        "outer.fragments": "fragments",
        "outer.offload": "offload",
    }

    def __init__(
        self,
        model: torch.nn.Module,
        inner_opt: torch.optim.Optimizer,
        group_source: GroupSource,
        rule: OuterRule,
        every: int,
        codec: str | Codec = "int4",
        timeout: float = 120.0,
        skip_failed_rounds: bool = True,
        slow_codec: str | Codec | None = None,
        error_feedback: bool = True,
        reduction: str = "two_phase",
        max_norm_ratio: float | None = DEFAULT_MAX_NORM_RATIO,
        group_timeout: float | None = None,
        algorithm: str | None = None,
        same_start: str = "broadcast",
        overlap: bool | str = False,
        fragments: int = 1,
        offload: bool = False,
        overlap_steps: int | None = None,
        slow_every: int | None = None,
        error_feedback_decay: float = 1.0,
        slow_stagger: bool = False,
    ):
        if rule.needs_slow_mean:  # null slow_codec and slow_every: by the codec (slow_term_settings)
            slow_codec, slow_every = slow_term_settings(codec, slow_codec, slow_every)
        slow_every = 1 if slow_every is None else slow_every
        self.check_settings({"every": every, "fragments": fragments, "slow_every": slow_every, "overlap": overlap,
                             "slow_stagger": slow_stagger, "group_timeout": group_timeout,
                             "max_norm_ratio": max_norm_ratio})  # fmt: skip
        super().__init__(
            model,
            inner_opt,
            getattr(group_source, "transport", None),
            codec=codec,
            timeout=timeout,
            error_feedback=error_feedback,
            reduction=_reduction_name(reduction, algorithm),
            same_start=same_start,
            error_feedback_decay=error_feedback_decay,
        )
        # seconds a round may spend forming its group (an open swarm's matchmaking); default: timeout
        self.group_timeout = self.timeout if group_timeout is None else float(group_timeout)
        self.rule, self.every, self.group_source = rule, int(every), group_source
        self.skip_failed_rounds = bool(skip_failed_rounds)
        self._replicas = None  # a worker of several processes: its relay (set_replicas)
        self.slow = parameters_to_vector(self.params).detach().float().clone()
        # The slow-weight term travels as φ − reference; every worker starts from the same weights.
        self.slow_codec: Codec = self.codec if slow_codec is None else get_codec(slow_codec)
        self.reference = self.slow.clone()
        self.slow_feedback = self._new_feedback() if error_feedback and not self.slow_codec.exact else None
        self.slow_spread = self._spread_history()
        # the slow-weight term crosses the link every `slow_every`-th cycle of rounds only (docs/design.md §3.2)
        self.slow_every = slow_every
        # staggered: 1/k of the term every round, a rotating slice of each fragment (noloco.optim.stagger)
        self.slow_stagger = slow_stagger
        # fragments: slices of the flat vector, one exchanged every `period` steps in turn, each with its own
        # error feedback (one fragment: the whole vector, today's feedback objects, part None everywhere)
        self.fragments = split_fragments([tuple(p.shape) for p in self.params], fragments)
        self.period = self.every // fragments  # inner steps between two exchanges
        self.fragment_states = [Fragment(self.fragments[0], self.feedback, self.slow_feedback)]
        self._stagger = [stagger_slices(p.stop - p.start, slow_every) for p in self.fragments] if slow_stagger else []
        if fragments > 1:
            fresh = lambda feedback: None if feedback is None else self._new_feedback()  # noqa: E731
            self.fragment_states = [Fragment(part, fresh(self.feedback), fresh(self.slow_feedback))
                                    for part in self.fragments]  # fmt: skip
        self.max_norm_ratio = None if max_norm_ratio is None else float(max_norm_ratio)
        # overlap: round r's exchange runs in the background during round r + 1, under the rule it names
        # (noloco.optim.overlap.OVERLAP_RULES; True: DEFAULT_RULE, see OverlappedRounds.load); False: None
        self.overlap = overlap_rule(overlap)
        self._overlapped = None if self.overlap is None else OverlappedRounds(self, self.overlap, overlap is True)
        # inner steps an exchange may take: it lands (is waited for and applied) that many steps after it was sent
        self.overlap_steps = check_overlap_steps(overlap_steps, self.overlap, self.period)
        # offload: between outer steps the outer state lives in pinned host memory (a no-op on the CPU)
        self.offload = bool(offload) and self.slow.is_cuda
        if self.offload and self._overlapped is not None:
            raise ValueError("outer.offload does not run with outer.overlap (the exchange in flight needs the state)")
        if self.offload:
            self._move_outer_state(torch.device("cpu"))

    def _spread_history(self) -> SpreadHistory | None:
        """A coset-coded slow term's grids: how far partners' φ − φ_0 were, block by block, when last exchanged
        (None for any other codec). A coset ``comm.codec`` is refused: it decodes against the receiver's own
        values, and only the slow-weight term has partners' copies close to this worker's."""
        if self.codec.side_information:
            raise ValueError(f"comm.codec={self.codec.name}: a coset code decodes against the receiver's own values, "
                             "so it carries only the slow-weight term (comm.slow_codec), whose partners' copies are "
                             "close to this worker's")  # fmt: skip
        if not (self.slow_codec.side_information and self.rule.needs_slow_mean):
            return None
        return SpreadHistory(self.slow.numel(), self.slow.device)

    @property
    def counter(self) -> ByteCounter:
        return self.group_source.counter

    @property
    def replicas(self):
        """The relay among the processes of this worker (None: a worker of one process); see :meth:`set_replicas`."""
        return self._replicas

    def set_replicas(self, replicas) -> None:
        """Make this algorithm one process of a worker of several processes (``inner.processes``). ``replicas``
        has ``leader`` (whether this process exchanges) and ``broadcast(tensor)`` (the leader's values into every
        process's ``tensor``, in place); only the leader exchanges, and φ (and whatever an overlap rule applies)
        reaches the others by broadcast, so they stay bit-identical. Call it before the first step."""
        if self.inner_step:
            raise ValueError("set_replicas: the algorithm has already stepped")
        self._replicas = replicas

    def _after_inner_step(self) -> OuterRoundInfo | None:
        phase = self.inner_step % self.period
        if self._overlapped is not None and phase == self.overlap_steps:  # (never when it is a whole round)
            return self._overlapped.land()
        if phase:
            return None
        if self._overlapped is not None:
            return self._overlapped.round(self.inner_step // self.period - 1)
        return self.outer_step(self.inner_step // self.period - 1)

    # --- fragments (outer.fragments; docs/design.md §3.1, "Streamed fragments") ------------------------------
    def fragment_of(self, round_index: int) -> int:
        """The fragment round ``round_index`` exchanges: the one whose steps ≡ j·every/k (mod every) it ends."""
        return (round_index + 1) % len(self.fragments)

    def part_of(self, round_index: int) -> slice | None:
        """The slice of the flat vector round ``round_index`` exchanges; None: all of it (one fragment)."""
        return None if len(self.fragments) == 1 else self.fragments[self.fragment_of(round_index)]

    def _split_of(self, round_index: int) -> tuple[slice | None, int | None]:
        """The slice and the fragment index of round ``round_index`` (None, None: one fragment)."""
        part = self.part_of(round_index)
        return part, None if part is None else self.fragment_of(round_index)

    def read_fast(self, part: slice | None) -> torch.Tensor:
        """This worker's fast weights θ (of ``part``), flat fp32, a new tensor."""
        if part is None:
            return parameters_to_vector(self.params).detach().float()
        return _read_part(self.params, part)

    def write_fast(self, values: torch.Tensor, part: slice | None) -> None:
        """θ ← ``values`` (on ``part`` only; the other fragments' fast weights train on untouched)."""
        if part is None:
            copy_flat_into(values, self.params)
        else:
            _write_part(values, part, self.params)

    # --- overlapped exchange (outer.overlap; docs/design.md §3.1, "Overlapped outer steps") -----------------
    def finish(self) -> OuterRoundInfo | None:
        """At the end of training: apply the exchange still in flight, so the final weights include it."""
        return None if self._overlapped is None else self._overlapped.finish()

    def replica_round(self, round_index: int) -> _RoundResult:
        """What a process of a worker that is not its leader has of an overlapped round: no exchange, no means (the
        leader's φ arrives by broadcast)."""
        return _RoundResult(OuterRoundInfo(round_index, [], fragment=self._split_of(round_index)[1]), None)

    @torch.no_grad()
    def outer_step(self, round_index: int) -> OuterRoundInfo:
        """Exchange with this round's group and apply the outer rule; loads φ into the model.

        In a worker made of several processes (``self.replicas``), only the leader exchanges; it
        then broadcasts φ to the other processes of its worker, so they stay bit-identical.
        """
        if self.offload:  # the state comes to the GPU for the step and goes back to pinned host memory after it
            self._move_outer_state(self.params[0].device)
            try:
                return self._replicated_outer_step(round_index)
            finally:
                self._move_outer_state(torch.device("cpu"))
        return self._replicated_outer_step(round_index)

    def _replicated_outer_step(self, round_index: int) -> OuterRoundInfo:
        if self.replicas is None:
            return self._outer_step(round_index)
        info = self._outer_step(round_index) if self.replicas.leader else OuterRoundInfo(round_index, [])
        self.replicas.broadcast(self.slow)
        part = self.part_of(round_index)
        self.write_fast(self.slow if part is None else self.slow[part], part)
        return info

    # --- outer.offload ---------------------------------------------------------------------------------------
    def _outer_tensors(self):
        """(holder, attribute) of every tensor of the outer state: φ, φ_0, the momentum, the residuals."""
        yield self, "slow"
        yield self, "reference"
        yield self.rule, "velocity"
        if self.slow_spread is not None:
            yield self.slow_spread, "blocks"
        for fragment in self.fragment_states:
            for feedback in fragment.feedbacks:
                if feedback is not None:
                    yield feedback, "contribution"
                    yield feedback, "result"

    @torch.no_grad()
    def _move_outer_state(self, device: torch.device) -> None:
        """Move the outer state to ``device``: the GPU (asynchronous copies), or pinned host memory (waits)."""
        for holder, name in self._outer_tensors():
            tensor = getattr(holder, name, None)
            if tensor is None or (tensor.device == device and (device.type != "cpu" or tensor.is_pinned())):
                continue
            if device.type == "cpu":
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=tensor.is_cuda)
                tensor = host
            else:
                tensor = tensor.to(device, non_blocking=True)
            setattr(holder, name, tensor)
        if device.type == "cpu":  # the copies must have landed before the host reads them (a checkpoint)
            torch.cuda.current_stream(self.params[0].device).synchronize()

    def _outer_step(self, round_index: int) -> OuterRoundInfo:
        part = self.part_of(round_index)
        result = self.exchange_round(round_index, self.read_fast(part))
        if result.guarded:
            self.inner_opt.state.clear()  # moments may hold NaN/Inf too
        if result.means is not None:
            self.rule.step(self.slow, *result.means, part)
            self.write_fast(self.slow if part is None else self.slow[part], part)
        return result.info

    def exchange_round(self, round_index: int, fast: torch.Tensor, slow: torch.Tensor | None = None) -> _RoundResult:
        """Form the round's group and reduce ``fast`` (this worker's fast weights of the round's fragment, flat
        fp32) over it, measured against ``slow`` (its slow weights of that fragment; None: φ as it is now).

        Changes nothing but the exchange's own state (error feedback, counters), so it can run in the
        background while training goes on (``overlap``; the eager rule changes φ meanwhile, so it passes the
        φ it sent against); the caller applies the means.
        """
        rank = getattr(self.transport, "rank", None)
        link = faults.fire("outer.exchange", self.inner_step, rank)
        part, fragment = self._split_of(round_index)
        if slow is None:
            slow = self.slow if part is None else self.slow[part]
        guarded = not all_finite(fast)
        if guarded:  # contribute a zero pseudo-gradient; partners are not poisoned, this worker restarts from φ
            self.nonfinite_events += 1
            fast = slow.clone()
        group = self.group_source.form(round_index, self.group_timeout)
        if group is None:
            if not self.skip_failed_rounds:
                raise CommError(f"round {round_index}: no group could be formed")
            info = OuterRoundInfo(round=round_index, group=[], skipped=self.group_source.why_none(round_index),
                                  fragment=fragment)  # fmt: skip
            return _RoundResult(info, None, guarded)
        rejected_before = self.norm_rejections.total

        def exchange(formed) -> tuple[torch.Tensor, torch.Tensor | None]:
            transport = faults.exchange_transport(formed.transport, link, self.inner_step, rank)
            return self._exchange(formed if transport is formed.transport else replace(formed, transport=transport),
                                  fast, guarded, part, slow)  # fmt: skip

        members = group.peer_ids or group.members
        try:
            try:
                means = exchange(group)
            except CommAborted:
                raise
            except (CommError, ValueError) as exc:
                # a member failed: the source may regroup those that delivered (an open swarm) for one more try
                retry = self.group_source.retry(group, exc) if self.skip_failed_rounds else None
                if retry is None:
                    raise
                try:
                    means, members = exchange(retry), retry.peer_ids or retry.members
                finally:
                    self.group_source.release(retry)
        except CommAborted:
            raise
        except (CommError, ValueError) as exc:
            if not self.skip_failed_rounds:
                raise
            info = OuterRoundInfo(round_index, group.members, skipped=f"{type(exc).__name__}: {exc}",
                                  rejected=self.norm_rejections.total - rejected_before, fragment=fragment)  # fmt: skip
            return _RoundResult(info, None, guarded)
        finally:
            self.group_source.release(group)
        info = OuterRoundInfo(round=round_index, group=members, rejected=self.norm_rejections.total - rejected_before,
                              fragment=fragment)  # fmt: skip
        return _RoundResult(info, means, guarded)

    def coded_pseudo_gradient(self, fast: torch.Tensor, part: slice | None = None) -> torch.Tensor:
        """This worker's pseudo-gradient of ``part`` as its exchange would send it now: C(θ − φ + e), or with a
        fused exchange C(θ − φ₀ + e) − (φ − φ₀) (``fast``: θ of ``part``, finite; e: the fragment's
        error-feedback residual, read and left as it is). What the overlap's coded rule steps with (§3.1); it
        must be called before the exchange that consumes e."""
        fragment = 0 if part is None else self.fragments.index(part)
        feedback = self.fragment_states[fragment].feedback
        slow = self.slow if part is None else self.slow[part]
        reference = (self.reference if part is None else self.reference[part]) if self._fused_exchange() else slow
        sent = fast - reference
        if feedback is not None:
            sent += feedback.residuals_for(sent.numel(), sent.device)[0]
        _, value = self.codec.encode_message(sent, with_value=True)
        return value.add_(reference).sub_(slow)

    def _exchange(self, group, fast: torch.Tensor, guarded: bool, part: slice | None = None,
                  slow: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Group means of the pseudo-gradient and (if the rule needs it) the slow weights, of ``part``.

        ``fast``: what this worker contributes (its fast weights; its slow weights when they went
        non-finite, ``guarded``), of the fragment ``part`` of the flat vector (None: all of it); ``slow``: its
        slow weights there (None: φ's). Each fragment reduces with its own error-feedback state.
        """
        tag = f"outer/r{group.round}"
        fragment = 0 if part is None else self.fragments.index(part)
        feedback, slow_feedback = self.fragment_states[fragment].feedbacks
        if slow is None:
            slow = self.slow if part is None else self.slow[part]
        reference = self.reference if part is None else self.reference[part]

        def reduce(x: torch.Tensor, what: str, codec: Codec, feedback, reference=None) -> torch.Tensor:
            return allreduce(
                x,
                group.transport,
                group.members,
                codec=codec,
                reduction=self.reduction,
                op="mean",
                timeout=self.timeout,
                tag=f"{tag}/{what}",
                error_feedback=feedback,
                max_norm_ratio=self.max_norm_ratio,
                norm_rejections=self.norm_rejections,
                norm_reference=reference,
            )

        if self._fused_exchange():  # θ − φ_0 like the slow term: the codec and the norm bound see training updates
            # mean_Δ = mean_θ − φ and mean_φ = φ itself (the rule skips the pull term for an alias of φ)
            return reduce(fast - reference, "fast", self.codec, feedback).add_(reference).sub_(slow), slow
        # Scales of the norm bound (see the class docstring): the pseudo-gradient is bounded by this worker's
        # own; the slow-weight term φ − φ_0 by the hypotenuse of its own and the pseudo-gradient's, because a
        # worker that skipped its rounds legitimately has φ = φ_0 while its partners moved by about one Δ.
        delta = fast - slow
        progress = slow - reference
        mean_delta = reduce(delta, "delta", self.codec, feedback, progress if guarded else None)
        if not self.rule.needs_slow_mean:
            return mean_delta, None
        base = 0 if part is None else part.start

        def reduce_slow(x: torch.Tensor, piece: slice, feedback, scale) -> torch.Tensor:
            """The group mean of the slow term's ``piece`` (of this fragment); a coset code's grids from history."""
            where = slice(base + piece.start, base + piece.stop)
            if self.slow_spread is None:
                return reduce(x, "slow", self.slow_codec, feedback, scale)
            codec = self.slow_codec.with_spread(self.slow_spread.spread_for(where, x))
            mean = reduce(x, "slow", codec, feedback, scale)
            step = coset_steps(codec.exponents(x), x.numel())  # the grids of x itself: close to those sent
            self.slow_spread.update(where, x, mean, len(group.members), step)
            return mean

        if self.slow_stagger:  # the round's slice of φ − φ_0; φ itself elsewhere, whose pull term is exactly zero
            piece = self._stagger[fragment][stagger_index(group.round, len(self.fragments), self.slow_every)]
            scale = torch.hypot(progress[piece], delta[piece]) if self.max_norm_ratio is not None else None
            sliced = None if slow_feedback is None else SliceFeedback(slow_feedback, piece, progress.numel())
            mean_slow = slow.clone()
            mean_slow[piece] = reference[piece] + reduce_slow(progress[piece], piece, sliced, scale)
            return mean_delta, mean_slow
        if not self.slow_round(group.round):
            return mean_delta, slow  # φ itself: no pull this round (the rule skips the pull term for an alias of φ)
        scale = torch.hypot(progress, delta) if self.max_norm_ratio is not None else None
        return mean_delta, reference + reduce_slow(progress, slice(0, progress.numel()), slow_feedback, scale)

    def _fused_exchange(self) -> bool:
        """One exchange of θ instead of Δ and φ: exact only for rules with β = γ and lossless codecs."""
        return False

    def slow_round(self, round_index: int) -> bool:
        """Whether round ``round_index`` exchanges the slow-weight term (``slow_every``, docs/design.md §3.2).

        Rounds go in cycles of one exchange per fragment; the last cycle of every ``slow_every`` carries the term,
        so every fragment gets it once per ``slow_every · every`` inner steps, and the first pull comes after the
        replicas have had rounds to drift apart (at round 0 they are still equal). Every member of a group draws
        the same answer from the round's index.
        """
        return (round_index // len(self.fragments)) % self.slow_every == self.slow_every - 1

    def slow_weights(self) -> torch.Tensor:
        return self.slow.clone()

    @contextlib.contextmanager
    def slow_in_model(self):
        """Inside the block the model's trained parameters hold φ; after it, θ again, bit for bit (one model-size
        copy of θ meanwhile). An overlapped run's θ at a round boundary is the provisional step (§3.1), a model
        nobody agreed on; φ is where the real steps have brought it."""
        with torch.no_grad():
            fast = self.read_fast(None)
            copy_flat_into(self.slow, self.params)
            try:
                yield
            finally:
                copy_flat_into(fast, self.params)

    def save_state(self) -> OuterState:
        """The state a joining worker adopts (:meth:`load_state`): step, φ and the outer momentum, copied."""
        velocity = self.rule.velocity
        return OuterState(self.inner_step, self.slow.clone(), None if velocity is None else velocity.clone())

    @torch.no_grad()
    def load_state(self, state: OuterState) -> None:
        """Adopt a live worker's :class:`OuterState`: φ, momentum and step, and φ into the model's weights.

        Everything is checked before anything changes (shapes, finite values), so a refused state
        leaves this algorithm as it was. Error-feedback residuals and AdamW moments stay this
        worker's own (fresh for a new worker).
        """
        if state.slow.shape != self.slow.shape:
            raise ValueError(f"joined state has {state.slow.numel()} weights, this model has {self.slow.numel()}")
        if state.velocity is not None and state.velocity.shape != self.slow.shape:
            raise ValueError("joined state's momentum does not match its slow weights")
        tensors = [state.slow] if state.velocity is None else [state.slow, state.velocity]
        if not all(all_finite(t) for t in tensors):
            raise ValueError("joined state holds non-finite values")
        if state.step < 0 or state.step % self.period:
            raise ValueError(
                f"joined state is at step {state.step}, not on an outer-round boundary "
                f"(every={self.every}, fragments={len(self.fragments)}: a multiple of {self.period})"
            )
        self.inner_step = int(state.step)
        self.slow = state.slow.to(self.slow.device, torch.float32).clone()
        if "velocity" in self.rule.state_dict():
            self.rule.velocity = None if state.velocity is None else state.velocity.to(self.slow).clone()
        if self.offload:
            self._move_outer_state(torch.device("cpu"))
        copy_flat_into(self.slow, self.params)

    @property
    def can_skip(self) -> bool:
        """Whether :meth:`skip_to` may move this algorithm ahead: not with ``outer.overlap``, whose rounds land
        a fixed number of steps after they start."""
        return self._overlapped is None

    def skip_to(self, step: int) -> None:
        """Go on as if inner step ``step`` (at or ahead of this one) were the last one taken, without taking the
        steps between: a resumed swarm peer behind its swarm joins the swarm's round (docs/swarm.md, *Restarting a
        peer*). The fast weights keep what they trained since the last round, so the round's pseudo-gradient holds
        the steps this worker did take; the rounds of its own that the skip passes over do not happen. ValueError
        (nothing changed) for a step behind this one, or with ``outer.overlap``."""
        if not self.can_skip:
            raise ValueError("skip_to: not with outer.overlap (a round in flight lands a fixed number of steps on)")
        if int(step) < self.inner_step:
            raise ValueError(f"skip_to: step {step} is behind this worker's step {self.inner_step}")
        self.inner_step = int(step)

    def state_dict(self) -> dict:
        # an exchange in flight is finished first; its result is part of the state
        overlapped = {"in_flight": None} if self._overlapped is None else self._overlapped.state_dict()
        state = {
            "inner_step": self.inner_step,
            "slow": self.slow.clone(),
            "rule": self.rule.state_dict(),
            "nonfinite_events": self.nonfinite_events,
            "reference": self.reference.clone(),
            "feedback": Fragment.joined_state(self.fragment_states, "feedback"),
            "slow_feedback": Fragment.joined_state(self.fragment_states, "slow_feedback"),
            "norm_rejections": self.norm_rejections.state_dict(),
            **overlapped,
        }
        if self.slow_spread is not None:
            state["slow_spread"] = self.slow_spread.state_dict()
        return state

    @classmethod
    def check_state(cls, state, numel: int, where: str = "algorithm", rebuilt: tuple[str, ...] = ()) -> None:
        """:class:`~noloco.state.StateError` unless ``state`` is an outer algorithm's :meth:`state_dict` for
        ``numel`` trained parameters: φ, φ₀, the rule's momentum, the residuals (each fragment's side by side),
        the counts, and an overlapped round's exchange and partners' shares. ``rebuilt``: entries (``slow``,
        ``reference``) the caller stores otherwise and checks itself."""
        check_keys(state, where, {"inner_step", "slow", "rule", "reference", "feedback"},
                   {"slow_feedback", "nonfinite_events", "norm_rejections", "in_flight", "partners",
                    "slow_spread"})  # fmt: skip
        cls._check_common(state, numel, where)
        if "slow_spread" in state:
            SpreadHistory.check_state(state["slow_spread"], numel, f"{where}/slow_spread")
        for key in ("slow", "reference"):
            if key not in rebuilt:
                check_tensor(state[key], f"{where}/{key}", (numel,))
        OuterRule.check_state(state["rule"], numel, f"{where}/rule")
        if not is_count(state.get("nonfinite_events", 0)):
            raise StateError(f"{where}/nonfinite_events: not a count")
        NormRejections.check_state(state.get("norm_rejections", {}), f"{where}/norm_rejections")
        OverlappedRounds.check_state(state, numel, where)

    def load_state_dict(self, state: dict) -> None:
        self.inner_step = int(state["inner_step"])
        if state["slow"].shape != self.slow.shape:
            raise ValueError(
                f"checkpoint slow weights have shape {tuple(state['slow'].shape)}, model needs {tuple(self.slow.shape)}"
            )
        device = self.slow.device  # checkpoints are device-agnostic: their tensors go where this worker runs
        self.slow = state["slow"].to(device, torch.float32).clone()
        self.rule.load_state_dict(state["rule"])
        if self.rule.velocity is not None:
            self.rule.velocity = self.rule.velocity.to(device)
        self.nonfinite_events = int(state.get("nonfinite_events", 0))
        if "reference" in state:
            self.reference = state["reference"].to(device, torch.float32).clone()
        Fragment.load_joined(self.fragment_states, "feedback", state.get("feedback"))
        Fragment.load_joined(self.fragment_states, "slow_feedback", state.get("slow_feedback"))
        if "norm_rejections" in state:
            self.norm_rejections.load_state_dict(state["norm_rejections"])
        if self.slow_spread is not None and state.get("slow_spread") is not None:  # older checkpoints: unknown
            self.slow_spread.load_state_dict(state["slow_spread"])
        if self.offload:
            self._move_outer_state(torch.device("cpu"))
        pending, partners = _in_flight_from(state.get("in_flight"), self.slow, self._split_of), state.get("partners")
        if self._overlapped is not None:
            self._overlapped.load(pending, partners)
        elif pending is not None or partners is not None:
            raise ValueError("checkpoint holds an overlapped exchange, this run does not overlap (outer.overlap)")


def _group_source(peers: Transport | GroupSource, group_size: int | None, seed: int) -> GroupSource:
    """``peers`` as a group source: itself, or a fixed world's transport's seeded schedule of groups."""
    if isinstance(peers, GroupSource):
        return peers
    size = None if group_size is None else min(group_size, peers.world_size)
    return ScheduledGroups(peers, size, seed)


class NoLoCo(OuterAlgorithm):
    """NoLoCo: outer momentum with a pull toward the mean of a random subgroup (docs/design.md §3.1).

    ``peers`` is either a fixed world's :class:`~noloco.comm.Transport` (groups drawn from a seeded schedule of
    ``group_size``) or a :class:`~noloco.gossip.GroupSource` (e.g. swarm matchmaking). ``exchange``
    takes the keyword arguments of :class:`OuterAlgorithm` that shape the exchange: ``codec``,
    ``slow_codec``, ``error_feedback``, ``reduction``, ``timeout``, ``group_timeout``,
    ``skip_failed_rounds``, ``max_norm_ratio``, ``overlap``, ``overlap_steps``, ``fragments``, ``slow_every``,
    ``slow_stagger``.
    """

    name = "noloco"
    #: μ where ``momentum`` is None (outer.momentum: null): the best measured on every budget so far (docs/design.md
    #: §3.1); the paper's μ, which was the default until 2026-12-05, is PAPER_MOMENTUM
    DEFAULT_MOMENTUM: ClassVar[float] = 0.1
    PAPER_MOMENTUM: ClassVar[float] = 0.5  # arXiv 2506.10911
    SETTINGS: ClassVar[dict[str, str]] = {
        **OuterAlgorithm.SETTINGS,
        "outer.slow_every": "slow_every",
        "outer.slow_stagger": "slow_stagger",
        "outer.lr": "lr",
        "outer.pull": "pull",
        "outer.momentum": "momentum",
        "outer.group_size": "group_size",
        "run.seed": "seed",
    }

    def __init__(
        self,
        model: torch.nn.Module,
        inner_opt: torch.optim.Optimizer,
        peers: Transport | GroupSource,
        every: int = 20,
        lr: float = 0.7,
        pull: float = 0.7,
        momentum: float | None = None,
        group_size: int = 2,
        seed: int = 0,
        **exchange,
    ):
        self.check_settings({"lr": lr, "pull": pull, "momentum": momentum})
        momentum = self.DEFAULT_MOMENTUM if momentum is None else momentum
        group_source = _group_source(peers, group_size, seed)
        super().__init__(model, inner_opt, group_source, NoLoCoRule(lr, pull, momentum), every, **exchange)

    def _fused_exchange(self) -> bool:  # Codec equality: int4 == int4:g128
        return self.rule.lr == self.rule.pull and self.codec == self.slow_codec and self.slow_every == 1


class DiLoCo(OuterAlgorithm):
    """DiLoCo: global average of pseudo-gradients, outer SGD with Nesterov momentum."""

    name = "diloco"
    #: μ where ``momentum`` is None: the best measured (docs/design.md §3.1); the paper's is PAPER_MOMENTUM
    DEFAULT_MOMENTUM: ClassVar[float] = 0.3
    PAPER_MOMENTUM: ClassVar[float] = 0.9  # arXiv 2311.08105
    SETTINGS: ClassVar[dict[str, str]] = {
        **OuterAlgorithm.SETTINGS,
        "outer.lr": "lr",
        "outer.momentum": "momentum",
        "outer.nesterov": "nesterov",
    }

    def __init__(
        self,
        model: torch.nn.Module,
        inner_opt: torch.optim.Optimizer,
        peers: Transport | GroupSource,
        every: int = 20,
        lr: float = 0.7,
        momentum: float | None = None,
        nesterov: bool = True,
        **exchange,
    ):
        self.check_settings({"lr": lr, "momentum": momentum})
        momentum = self.DEFAULT_MOMENTUM if momentum is None else momentum
        group_source = _group_source(peers, None, 0)
        super().__init__(model, inner_opt, group_source, DiLoCoRule(lr, momentum, nesterov), every, **exchange)


class PeriodicAveraging(OuterAlgorithm):
    """Every ``every`` steps, all workers replace their weights with the world mean."""

    name = "avg"

    def __init__(
        self,
        model: torch.nn.Module,
        inner_opt: torch.optim.Optimizer,
        peers: Transport | GroupSource,
        every: int = 20,
        **exchange,
    ):
        super().__init__(model, inner_opt, _group_source(peers, None, 0), AveragingRule(), every, **exchange)


#: ``outer.algo`` → the class that runs it (the one list of algorithm names)
ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (NoLoCo, DiLoCo, PeriodicAveraging, DDP)}
