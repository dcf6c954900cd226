"""One worker's state owners: what a checkpoint of a worker holds, entry by entry, and who checks each entry.

A checkpoint (:mod:`noloco.train.checkpoint`) stores a dict of state owners and knows nothing of their insides
(the state-owner protocol: :mod:`noloco.state`). The library's owners check their own entries: the outer
algorithm (:meth:`~noloco.optim.OuterAlgorithm.check_state`, with its rule, error feedback, norm rejections and
overlapped exchange), the byte counter (:meth:`~noloco.comm.base.ByteCounter.check_state`). The harness's own
owners are here: the model's weights, the inner optimizer, the LR schedule, the data position and the eval
history, and :class:`WorkerState`, which collects them under the keys a worker's checkpoint has always had
(format ``noloco-checkpoint-2``; format 1 loads too) and checks what joins them (every entry of one step).

What can be rebuilt exactly is stored as a marker instead (``checkpoint.REBUILT``): the outer algorithm's initial
weights φ₀ (rebuilt from ``run.seed``; their SHA-256 is stored and checked), φ while it equals φ₀ (before the
first outer step) and θ when it equals φ (right after an outer step). AdamW moments, φ, momentum and residuals
stay fp32: a resume is bit-exact only with the values the run had.
"""

from __future__ import annotations

import torch

from noloco.comm.base import ByteCounter
from noloco.optim import Algorithm, OuterAlgorithm
from noloco.optim.algorithms import copy_flat_into
from noloco.state import StateError, check_keys, check_tensor, is_int, is_number
from noloco.train.checkpoint import REBUILT, CheckpointError, digest

#: bounds of plain values in a worker's state: ten years of seconds; a held-out loss (cross-entropy: ln of the
#: vocabulary at the start of a run, under 15 for a vocabulary of a million)
MAX_SECONDS = 3.2e8
MAX_LOSS = 1e4


class ModelWeights:
    """The model's ``state_dict``, or, when θ equals φ bit for bit, a marker and the buffers (θ rebuilt from φ).

    ``algo``: the outer algorithm whose φ θ may equal (None: always stored, as for DDP); the model may be on the
    ``meta`` device when the owner only checks."""

    def __init__(self, model: torch.nn.Module, algo: OuterAlgorithm | None = None, outer: bool = False):
        self.model, self.algo, self.outer = model, algo, outer or algo is not None
        self.params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.entries = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self.buffers = set(self.entries) - self.params

    def state_dict(self) -> dict:
        weights = self.model.state_dict()
        if self.algo is not None and _equals_flat(self.algo.params, self.algo.slow):
            return {REBUILT: "slow", "buffers": {k: v for k, v in weights.items() if k not in self.params}}
        return weights

    def check_state(self, state, where: str = "model") -> None:
        if isinstance(state, dict) and REBUILT in state:
            if not self.outer or state.get(REBUILT) != "slow":
                raise StateError(f"{where}: cannot rebuild the weights from {state.get(REBUILT)!r}")
            check_keys(state, where, {REBUILT, "buffers"})
            check_keys(state["buffers"], f"{where}/buffers", self.buffers)
            for name in self.buffers:
                check_tensor(state["buffers"][name], f"{where}/{name}", self.entries[name])
            return
        check_keys(state, where, set(self.entries))
        for name, shape in self.entries.items():
            check_tensor(state[name], f"{where}/{name}", shape)

    def load_state_dict(self, state: dict) -> None:
        """Load the weights; a marker's θ is φ, so the algorithm's state must be loaded first."""
        if REBUILT not in state:
            self.model.load_state_dict(state)
            return
        self.model.load_state_dict(state["buffers"], strict=False)
        copy_flat_into(self.algo.slow, self.algo.params)


class InnerOptimizer:
    """AdamW's state: per-parameter moments of this model's shapes, and the param groups' settings as the run
    builds them from its config (they do not change on resume; ``fused``/``foreach`` may: a GPU run's checkpoint
    resumes on a CPU)."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt
        self.shapes = [tuple(p.shape) for group in opt.param_groups for p in group["params"]]
        built = opt.state_dict()["param_groups"]
        self.groups = [list(g["params"]) for g in built]
        self.settings = [{k: v for k, v in g.items() if k != "params"} for g in built]

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)

    def check_state(self, state, where: str = "inner_opt") -> None:
        check_keys(state, where, {"state", "param_groups"})
        groups = state["param_groups"]
        if not isinstance(groups, list) or [g.get("params") if isinstance(g, dict) else None
                                            for g in groups] != self.groups:  # fmt: skip
            raise StateError(f"{where}/param_groups: not this model's parameter groups")
        moments = state["state"]
        if not isinstance(moments, dict):
            raise StateError(f"{where}/state: not a mapping")
        for index, entry in moments.items():
            here = f"{where}/state/{index}"
            if not is_int(index) or not 0 <= index < len(self.shapes):
                raise StateError(f"{here}: no such parameter")
            check_keys(entry, here, {"step", "exp_avg", "exp_avg_sq"}, {"max_exp_avg_sq"})
            check_tensor(entry["step"], f"{here}/step", ())
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in entry:
                    check_tensor(entry[key], f"{here}/{key}", self.shapes[index])
        for index, (group, built) in enumerate(zip(groups, self.settings, strict=True)):
            _check_settings(group, built, f"{where}/param_groups/{index}")


def _check_settings(group: dict, built: dict, where: str) -> None:
    """One param group's plain values: the run's settings, and a current learning rate in [0, peak]."""
    check_keys(group, where, set(built) | {"params"})
    for key, expected in built.items():
        value = group[key]
        if key == "lr":
            peak = group["initial_lr"]
            if not (is_number(value) and is_number(peak) and 0 <= value <= peak):
                raise StateError(f"{where}/lr: {value!r} is not a learning rate in [0, {peak!r}]")
        elif key in ("fused", "foreach"):  # device-dependent (a GPU run's checkpoint resumes on CPU)
            if value is not None and not isinstance(value, bool):
                raise StateError(f"{where}/{key}: {value!r}, not true, false or null")
        elif not _same(value, expected):
            hint = " (inner.lr)" if key == "initial_lr" else ""
            raise StateError(f"{where}/{key}: {value!r}, this run builds {expected!r}{hint} from its config "
                             "(the optimizer's settings do not change on resume)")  # fmt: skip


class Schedule:
    """The LR schedule (``LambdaLR``): at the checkpoint's step, its rates those of the optimizer's groups."""

    def __init__(self, schedule: torch.optim.lr_scheduler.LRScheduler):
        self.schedule = schedule
        self.keys = set(schedule.state_dict())

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)

    def check_state(self, state, step: int, groups: list, where: str = "schedule") -> None:
        """``groups``: the optimizer's param groups of the same state (checked first)."""
        if not isinstance(state, dict) or state.get("last_epoch") != step:
            raise StateError(f"{where}: not at step {step}")
        n = len(groups)
        check_keys(state, where, self.keys)
        if state["base_lrs"] != [g["initial_lr"] for g in groups]:
            raise StateError(f"{where}/base_lrs: {str(state['base_lrs'])[:80]}, not the groups' peak rates")
        if not (isinstance(state["_last_lr"], list) and len(state["_last_lr"]) == n
                and all(a == g["lr"] and is_number(a) for a, g in zip(state["_last_lr"], groups))):  # fmt: skip
            raise StateError(f"{where}/_last_lr: {str(state['_last_lr'])[:80]}, not the groups' learning rates")
        if state["lr_lambdas"] != [None] * n:  # a dict here would be set on the schedule's functions
            raise StateError(f"{where}/lr_lambdas: {str(state['lr_lambdas'])[:80]}, expected {[None] * n}")
        count = state["_step_count"]
        if not (is_int(count) and 1 <= count <= step + 1):
            raise StateError(f"{where}/_step_count: {count!r}, not a step count in [1, {step + 1}]")
        for key in self.keys - {"base_lrs", "last_epoch", "_last_lr", "lr_lambdas", "_step_count"}:
            if not isinstance(state[key], bool):
                raise StateError(f"{where}/{key}: {state[key]!r}, not true or false")


class EvalHistory:
    """The held-out losses so far, ``[(step, loss), ...]`` (a list the worker appends to; loaded in place)."""

    def __init__(self, history: list | None = None):
        self.history = [] if history is None else history

    def state_dict(self) -> list:
        return self.history

    def load_state_dict(self, state: list) -> None:
        self.history[:] = [tuple(h) for h in state]

    @staticmethod
    def check_state(state, step: int, where: str = "eval_history") -> None:
        if not isinstance(state, list) or not all(
            isinstance(h, (list, tuple)) and len(h) == 2 and is_int(h[0]) and 0 <= h[0] <= step
            and is_number(h[1]) and 0 <= h[1] <= MAX_LOSS for h in state
        ):  # fmt: skip
            raise StateError(f"{where}: not a list of (step <= {step}, finite loss in [0, {MAX_LOSS:.0e}])")


class DataPosition:
    """A streamed dataset's position (``data.streaming``: the sampler's own ``state_dict``, which checks its values
    when loaded); None for token files, whose batches are a pure function of (seed, rank, step)."""

    def __init__(self, sampler=None):
        self.sampler = sampler if hasattr(sampler, "state_dict") else None

    def state_dict(self) -> dict | None:
        return None if self.sampler is None else self.sampler.state_dict()

    @staticmethod
    def check_state(state, where: str = "sampler") -> None:
        if not isinstance(state, dict):
            raise StateError(f"{where}: not a stream position")

    def load_state_dict(self, state: dict | None) -> None:
        if (self.sampler is None) != (state is None):
            raise ValueError("the checkpoint and this run disagree on whether the data is streamed "
                             "(data.streaming): the batches would not continue where they stopped")  # fmt: skip
        if state is not None:
            self.sampler.load_state_dict(state)


class AlgorithmState:
    """The algorithm's own state (:meth:`~noloco.optim.OuterAlgorithm.state_dict`), with φ₀ stored as a marker
    and its SHA-256 when it is ``run.seed``'s initial weights, and φ as a marker while it equals φ₀.

    ``algo``: the live algorithm (None: only :meth:`check_state`, against ``cls`` and ``numel``)."""

    def __init__(self, algo: Algorithm | None, cls: type[Algorithm] | None = None, numel: int | None = None):
        self.algo = algo
        self.cls = cls or type(algo)
        self.outer = issubclass(self.cls, OuterAlgorithm)
        self.numel = numel if numel is not None else sum(p.numel() for p in algo.params)
        self.explicit_reference = False  # an older checkpoint's φ₀ that is not the seed's: stored as it is
        self._digest: tuple | None = None  # (φ₀, its version, its SHA-256): hashed once per φ₀

    def state_dict(self) -> dict:
        state = self.algo.state_dict()
        if not self.outer:
            return state
        if not self.explicit_reference:  # φ₀ is this config's seed init
            ref = self.algo.reference
            if self._digest is None or self._digest[0] is not ref or self._digest[1] != ref._version:
                self._digest = (ref, ref._version, digest(ref))
            state["reference"] = {REBUILT: "seed", "sha256": self._digest[2]}
        if torch.equal(self.algo.slow, self.algo.reference):
            state["slow"] = {REBUILT: "reference"}
        return state

    def check_state(self, state, where: str = "algorithm") -> None:
        if not self.outer:
            self.cls.check_state(state, self.numel, where)
            return
        rebuilt = []
        if isinstance(state, dict) and isinstance(state.get("slow"), dict):  # φ = φ₀
            check_keys(state["slow"], f"{where}/slow", {REBUILT})
            if state["slow"][REBUILT] != "reference":
                raise StateError(f"{where}/slow: cannot rebuild the slow weights from it")
            rebuilt.append("slow")
        if isinstance(state, dict) and isinstance(state.get("reference"), dict):
            check_keys(state["reference"], f"{where}/reference", {REBUILT, "sha256"})
            if state["reference"][REBUILT] != "seed" or not isinstance(state["reference"]["sha256"], str):
                raise StateError(f"{where}/reference: cannot rebuild the initial weights from it")
            rebuilt.append("reference")
        self.cls.check_state(state, self.numel, where, rebuilt=tuple(rebuilt))

    def load_state_dict(self, state: dict) -> None:
        """Load, rebuilding φ₀ (``run.seed``'s, as this worker built it: :class:`CheckpointError` if its SHA-256
        differs) and φ where they were markers."""
        state = dict(state)
        reference = state.pop("reference", None)
        if self.outer:
            if isinstance(state.get("slow"), dict):  # φ = φ₀
                seed_init = self.algo.reference if isinstance(reference, dict) else reference
                state["slow"] = seed_init.to(self.algo.reference).clone()
            if isinstance(reference, dict):  # rebuilt: this worker's φ₀ was built from run.seed
                if digest(self.algo.reference) != reference["sha256"]:
                    raise CheckpointError("the initial weights rebuilt from run.seed differ from the checkpoint's "
                                          "(run.seed or the model changed since it was saved)")  # fmt: skip
            elif reference is not None and not torch.equal(reference.to(self.algo.reference), self.algo.reference):
                state["reference"] = reference  # an older checkpoint's φ₀ that is not the seed's
                self.explicit_reference = True
        self.algo.load_state_dict(state)


class WorkerState:
    """The state owners of one worker, under the keys of its checkpoint: ``step``, ``vocab_size``, ``model``,
    ``inner_opt``, ``schedule``, ``algorithm``, ``counter``, ``wall_seconds``, ``eval_history`` and, for a
    streamed dataset, ``sampler``. Each owner checks and loads its own entry; this checks what joins them (one
    step, one vocabulary) and the order of loading (θ rebuilt from φ after the algorithm).

    Built from a worker's live objects (:meth:`of_worker`), or from a model, optimizer and schedule on the
    ``meta`` device and the algorithm's class, to check a checkpoint before anything is built (:meth:`for_check`).
    """

    def __init__(self, model: ModelWeights, inner_opt: InnerOptimizer, schedule: Schedule,
                 algorithm: AlgorithmState, vocab_size: int | None, counter: ByteCounter | None = None,
                 history: EvalHistory | None = None, sampler: DataPosition | None = None):  # fmt: skip
        self.model, self.inner_opt, self.schedule, self.algorithm = model, inner_opt, schedule, algorithm
        self.vocab_size, self.counter = vocab_size, counter
        self.history, self.sampler = history or EvalHistory(), sampler or DataPosition()

    @classmethod
    def of_worker(cls, model, opt, schedule, algo: Algorithm, history: list, sampler) -> WorkerState:
        outer = algo if isinstance(algo, OuterAlgorithm) else None
        return cls(ModelWeights(model, outer), InnerOptimizer(opt), Schedule(schedule), AlgorithmState(algo),
                   _vocab_size(model), algo.counter, EvalHistory(history), DataPosition(sampler))  # fmt: skip

    @classmethod
    def for_check(cls, model, opt, schedule, outer: bool) -> WorkerState:
        """Owners that check a state only: ``model``, ``opt`` and ``schedule`` as the run builds them (on the
        ``meta`` device: nothing allocated); ``outer``: an outer algorithm's state, else DDP's."""
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        algorithm = OuterAlgorithm if outer else Algorithm
        return cls(ModelWeights(model, outer=outer), InnerOptimizer(opt), Schedule(schedule),
                   AlgorithmState(None, algorithm, numel), _vocab_size(model))  # fmt: skip

    def state_dict(self, step: int, wall_seconds: float) -> dict:
        state = {"step": step, "vocab_size": self.vocab_size, "model": self.model.state_dict(),
                 "inner_opt": self.inner_opt.state_dict(), "schedule": self.schedule.state_dict(),
                 "algorithm": self.algorithm.state_dict(), "counter": self.counter.state_dict(),
                 "wall_seconds": wall_seconds, "eval_history": self.history.state_dict()}  # fmt: skip
        position = self.sampler.state_dict()
        if position is not None:  # a streamed dataset's position (data.streaming)
            state["sampler"] = position
        return state

    def check(self, state: dict, step: int, where: str = "checkpoint") -> None:
        """:class:`~noloco.train.checkpoint.CheckpointError` (``where: ...``) naming the first entry of ``state``
        this worker cannot load, for a checkpoint of ``step``."""
        try:
            self.check_state(state, step)
        except StateError as exc:
            raise CheckpointError(f"{where}: {exc}") from None

    def check_state(self, state, step: int) -> None:
        check_keys(state, "state", {"step", "model", "inner_opt", "schedule", "algorithm", "counter", "wall_seconds",
                                    "eval_history"}, {"vocab_size", "sampler"})  # fmt: skip
        if "sampler" in state:
            DataPosition.check_state(state["sampler"])
        if state["step"] != step or not is_int(state["step"]):
            raise StateError(f"state is of step {state['step']!r}, the checkpoint of step {step}")
        if "vocab_size" in state and state["vocab_size"] != self.vocab_size:
            raise StateError(f"model has a vocabulary of {state['vocab_size']!r}, this run's has {self.vocab_size}")
        self.model.check_state(state["model"])
        self.inner_opt.check_state(state["inner_opt"])
        self.schedule.check_state(state["schedule"], step, state["inner_opt"]["param_groups"])
        self.algorithm.check_state(state["algorithm"])
        if state["algorithm"]["inner_step"] != step:
            raise StateError(f"algorithm: at inner step {state['algorithm']['inner_step']!r}, the checkpoint is "
                             f"of step {step}")  # fmt: skip
        ByteCounter.check_state(state["counter"])
        wall = state["wall_seconds"]
        if not is_number(wall) or not 0 <= wall <= MAX_SECONDS:
            raise StateError(f"wall_seconds: {wall!r} (not a number of seconds in [0, {MAX_SECONDS:.0e}])")
        EvalHistory.check_state(state["eval_history"], step)

    def load_state_dict(self, state: dict) -> None:
        """Load every owner's entry (a state :meth:`check_state` accepted); the algorithm before the model, whose
        θ may be rebuilt from φ."""
        self.inner_opt.load_state_dict(state["inner_opt"])
        self.schedule.load_state_dict(state["schedule"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.model.load_state_dict(state["model"])
        self.counter.load_state_dict(state["counter"])
        self.sampler.load_state_dict(state.get("sampler"))
        self.history.load_state_dict(state["eval_history"])


def _vocab_size(model) -> int | None:
    return getattr(getattr(model, "cfg", None), "vocab_size", None)


def _same(value, expected) -> bool:
    """``value`` read from a file is ``expected`` (a setting the run builds): same kind, equal."""
    if expected is None or isinstance(expected, bool):
        return value is expected
    if isinstance(expected, (int, float)):
        return is_number(value) and value == expected
    if isinstance(expected, (list, tuple)):
        return (isinstance(value, (list, tuple)) and len(value) == len(expected)
                and all(_same(v, e) for v, e in zip(value, expected)))  # fmt: skip
    return type(value) is type(expected) and value == expected


def _equals_flat(params: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether ``params`` hold exactly the consecutive slices of ``flat`` (θ = φ after an outer step); ``flat``
    may live elsewhere (``outer.offload``: pinned host memory)."""
    offset = 0
    for p in params:
        n = p.numel()
        piece = flat[offset : offset + n].to(p.device, non_blocking=True)
        if p.dtype != flat.dtype or not torch.equal(p.detach().reshape(-1), piece):
            return False
        offset += n
    return offset == flat.numel()
