"""Configuration: the packaged defaults, merged with ``--config`` files and ``key=value`` overrides.

Config errors (an unknown key, a value of the wrong type, a group size that does not divide the
workers, a missing data path) raise :class:`ConfigError` with one clear line before any work starts.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from noloco.collectives import get_codec, known_codecs
from noloco.collectives.settings import check_reduction_settings
from noloco.data.settings import check_data_settings
from noloco.models.settings import check_model_settings
from noloco.optim import ALGORITHMS, NoLoCo
from noloco.optim.overlap import OVERLAP_RULES, check_overlap_steps, overlap_rule
from noloco.swarm.settings import check_peer_settings
from noloco.train.backends import BACKENDS

ALGOS = tuple(ALGORITHMS)
#: ``eval.weights``: which weights a held-out point evaluates (:func:`evaluated_weights`)
EVAL_WEIGHTS = ("auto", "fast", "slow")


class ConfigError(ValueError):
    """A bad configuration; the message is one line meant for the user."""


def default_config() -> DictConfig:
    text = resources.files("noloco.train").joinpath("defaults.yaml").read_text()
    cfg = OmegaConf.create(text)
    OmegaConf.set_struct(cfg, True)
    return cfg


# ------------------------------------------------------------------------ --print-config with comments
_KEY_LINE = re.compile(r"^( *)([A-Za-z_][A-Za-z0-9_]*):(?=\s|$)")
COMMENT_COLUMN = 24  # where defaults.yaml's comments start


def _split_comment(line: str) -> tuple[str, str | None]:
    """``(code, comment)`` of one YAML line: a ``#`` outside quotes, at the start or after a space."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), None


def key_comments(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """The comments of each key path of a block-style YAML text such as ``defaults.yaml``.

    ``{"outer.every": (above, beside)}``: ``above`` are the comment lines just above the key (a heading of
    what follows), ``beside`` the comment on the key's line and the comment-only lines below it that start
    right of the key's code (they continue it). The file's opening comments belong to no key. Keys inside
    lists and block scalars are not read (defaults.yaml has none).
    """
    comments: dict[str, tuple[list[str], list[str]]] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    pending: list[str] = []  # comment lines waiting for the key below them
    last: tuple[int, list[str]] | None = None  # where the previous key's code ends, and its comment lines
    seen_key = False
    for raw in text.splitlines():
        code, comment = _split_comment(raw)
        if not code.strip():
            if comment is None:  # a blank line ends a comment block
                pending, last = [], None
                continue
            indent = len(raw) - len(raw.lstrip())
            if last is not None and last[1] and indent > last[0]:
                last[1].append(comment)  # continues the comment of the key above
            elif seen_key:
                pending.append(comment)
                last = None
            continue
        match = _KEY_LINE.match(code)
        if match is None:  # a list item or a block scalar's text: not a key of its own
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        path = ".".join(k for _, k in stack)
        beside = [comment] if comment else []
        comments[path] = (pending, beside)
        pending, last, seen_key = [], (len(code), beside), True
    return comments


def commented_yaml(cfg: DictConfig, defaults_text: str | None = None) -> str:
    """``cfg`` as YAML (its values: overrides included) with each key's comment from ``defaults.yaml``.

    Keys that ``defaults.yaml`` does not have are printed without a comment.
    """
    if defaults_text is None:
        defaults_text = resources.files("noloco.train").joinpath("defaults.yaml").read_text()
    comments = key_comments(defaults_text)
    out: list[str] = []
    stack: list[tuple[int, str]] = []
    for line in OmegaConf.to_yaml(cfg).splitlines():
        match = _KEY_LINE.match(line)
        if match is None:
            out.append(line)
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        above, beside = comments.get(".".join(k for _, k in stack), ([], []))
        out += [" " * indent + "# " + text for text in above]
        if not beside:
            out.append(line)
            continue
        column = max(COMMENT_COLUMN, len(line) + 2)
        out.append(line.ljust(column) + "# " + beside[0])
        out += [" " * column + "# " + text for text in beside[1:]]
    return "\n".join(out) + "\n"


def _merge(cfg: DictConfig, other: DictConfig, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, other)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        reason = str(exc).splitlines()[0]
        if "not in struct" in reason or "Key '" in reason and "not" in reason:
            raise ConfigError(f"{origin}: unknown config key '{key}'{_did_you_mean(cfg, key)}") from None
        raise ConfigError(f"{origin}: bad value for '{key}': {reason}") from None


def _keys(node, prefix: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(value, DictConfig):
            out += _keys(value, path + ".")
    return out


def _did_you_mean(cfg: DictConfig, key: str) -> str:
    close = difflib.get_close_matches(key, _keys(cfg), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


_warned: set[str] = set()


def _deprecated(old: str, new: str) -> None:
    if old not in _warned:
        _warned.add(old)
        print(f"warning: {old} is deprecated, use {new}", file=sys.stderr)


def _resolve_deprecated(cfg: DictConfig) -> None:
    """Old key names still work: ``comm.algorithm`` → ``comm.reduction``; ``comm.timeout`` → the three timeouts;
    ``peer.rank`` → ``peer.worker``."""
    comm = cfg.comm
    if cfg.peer.rank is not None:
        _deprecated("peer.rank", "peer.worker")
        cfg.peer.worker, cfg.peer.rank = cfg.peer.rank, None
    if comm.algorithm is not None:
        _deprecated("comm.algorithm", "comm.reduction")
        comm.reduction, comm.algorithm = comm.algorithm, None
    if comm.timeout is not None:
        _deprecated("comm.timeout", "comm.recv_timeout, comm.group_timeout and comm.startup_timeout")
        comm.recv_timeout = comm.group_timeout = comm.startup_timeout = comm.timeout
        comm.timeout = None


def default_momentum(algo: str) -> float:
    """The outer momentum an algorithm defaults to: its class's own (NoLoCo 0.5, DiLoCo 0.9; NoLoCo's for the
    algorithms without momentum, so the saved config reads as before)."""
    return float(getattr(ALGORITHMS[algo], "DEFAULT_MOMENTUM", NoLoCo.DEFAULT_MOMENTUM))


def load_config(overrides: list[str] | None = None, config_files: list[str] | None = None) -> DictConfig:
    """Defaults ← each of ``config_files`` ← ``overrides`` (omegaconf dotlist), then validated."""
    cfg = default_config()
    for path in config_files or []:
        if not Path(path).is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            loaded = OmegaConf.load(path)
        except Exception as exc:  # noqa: BLE001 - yaml errors of every kind
            raise ConfigError(f"--config {path}: cannot parse: {str(exc).splitlines()[0]}") from None
        cfg = _merge(cfg, loaded, path)
    dotlist = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        dotlist.append(item)
    try:
        parsed = OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad override: {str(exc).splitlines()[0]}") from None
    cfg = _merge(cfg, parsed, "command line")
    _resolve_deprecated(cfg)
    validate(cfg)
    return cfg


def kept_behaviour(saved: DictConfig) -> list[str]:
    """Overrides that keep a resumed run doing what it did: the keys added since its ``config.yaml`` was written
    whose default does otherwise (a run's curve keeps evaluating the same weights). The resume's own command line
    goes on top."""
    evaluation = saved.get("eval") or {}
    return [] if "weights" in evaluation else ["eval.weights=fast"]


def evaluated_weights(cfg: DictConfig) -> str:
    """``fast`` (θ) or ``slow`` (φ): what ``eval.weights`` names, ``auto`` being ``slow`` for an overlapped run
    (its θ at a round boundary is a provisional step, docs/design.md §3.1) and ``fast`` otherwise (a blocking
    round's θ after its outer step is φ)."""
    weights = cfg.eval.weights
    if weights == "auto":
        return "slow" if cfg.outer.overlap else "fast"
    return weights


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: DictConfig) -> None:
    """Check values and their relations; resolve defaults that depend on other keys. Each section whose keys a
    component reads is checked by that component (its ``check_*_settings``: the same check it runs itself)."""
    _validate_process(cfg)
    _validate_outer(cfg)
    _validate_comm(cfg.comm)
    _validate_inner(cfg)
    _validate_algorithm(cfg)
    _validate_exchange_schedule(cfg)
    _owner_check(check_data_settings, cfg.data)
    _owner_check(check_model_settings, cfg.model)
    if cfg.eval.every is None:
        cfg.eval.every = cfg.outer.every
    _require(cfg.eval.every >= 1 and cfg.eval.batches >= 1, "eval.every and eval.batches must be >= 1")
    _require(cfg.eval.weights in EVAL_WEIGHTS, f"eval.weights={cfg.eval.weights!r} is not one of "
             f"{', '.join(EVAL_WEIGHTS)}")  # fmt: skip
    _require(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1, "checkpoint.every >= 0 and checkpoint.keep >= 1")
    final = cfg.checkpoint.final
    _require(isinstance(final, bool), f"checkpoint.final must be true or false, got {final!r}")
    _validate_names(cfg)
    stall = cfg.run.stall_timeout
    _require(isinstance(stall, (int, float)) and not isinstance(stall, bool) and 0 <= stall < math.inf,
             f"run.stall_timeout must be a number of seconds >= 0 (0: off), got {stall!r}")  # fmt: skip
    restarts = cfg.run.restarts
    _require(isinstance(restarts, int) and not isinstance(restarts, bool) and restarts >= 0,
             f"run.restarts must be an integer >= 0 (0: off), got {restarts!r}")  # fmt: skip
    _owner_check(check_peer_settings, cfg.peer)


def _owner_check(check, section) -> None:
    """Run an owner's ``check(section)``: its ValueError (naming the key) becomes a ConfigError."""
    try:
        check(section)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _validate_process(cfg: DictConfig) -> None:
    """The run as a whole: backend, workers, steps, device, precision, logging."""
    _require(cfg.backend in BACKENDS, f"backend={cfg.backend!r} is not one of {tuple(BACKENDS)}")
    _require(isinstance(cfg.workers, int) and cfg.workers >= 1, f"workers must be an integer >= 1, got {cfg.workers!r}")
    _require(isinstance(cfg.steps, int) and cfg.steps >= 1, f"steps must be an integer >= 1, got {cfg.steps!r}")
    from noloco.train.device import DeviceError, check_device

    try:
        check_device(str(cfg.device))
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None
    _require(cfg.precision in ("auto", "bf16", "fp32"), f"precision={cfg.precision!r} is not one of auto, bf16, fp32")
    _require(isinstance(cfg.compile, bool), f"compile must be true or false, got {cfg.compile!r}")
    _require(isinstance(cfg.run.overwrite, bool), f"run.overwrite must be true or false, got {cfg.run.overwrite!r}")
    _require(cfg.log.flush_every is None or cfg.log.flush_every >= 1, "log.flush_every must be >= 1 (or null)")
    _validate_wandb(cfg.log.wandb)


def _validate_outer(cfg: DictConfig) -> None:
    """The outer algorithm, its groups (clamped to a single worker's run) and its momentum default."""
    outer = cfg.outer
    _require(outer.algo in ALGOS, f"outer.algo={outer.algo!r} is not one of {ALGOS}")
    if outer.algo == "noloco" and BACKENDS[cfg.backend].fixed_world:  # (an open swarm's groups: whoever is ready)
        if cfg.workers < outer.group_size:  # a single-worker sanity run: its group is itself
            print(f"note: outer.group_size={outer.group_size} clamped to workers={cfg.workers}", file=sys.stderr)
            outer.group_size = cfg.workers
        _require(outer.group_size >= 1, f"outer.group_size must be >= 1 for noloco, got {outer.group_size}")
        _require(
            cfg.workers % outer.group_size == 0,
            f"outer.group_size={outer.group_size} does not divide workers={cfg.workers} "
            "(seeded random groups need equal sizes; e.g. outer.group_size=1 or workers="
            f"{cfg.workers + outer.group_size - cfg.workers % outer.group_size})",
        )
    elif outer.algo == "noloco":
        _require(outer.group_size >= 2, f"outer.group_size must be >= 2 for noloco, got {outer.group_size}")
    if outer.algo != "ddp" and cfg.steps < outer.every:
        print(f"warning: steps={cfg.steps} < outer.every={outer.every}: this run has no outer exchange "
              "(every worker trains alone)", file=sys.stderr)  # fmt: skip
    if outer.momentum is None:
        outer.momentum = default_momentum(outer.algo)


def _validate_algorithm(cfg: DictConfig) -> None:
    """The settings the outer algorithm reads from the config, checked by the algorithm's class itself
    (``check_settings``: the same check its constructor runs)."""
    cls = ALGORITHMS[cfg.outer.algo]
    try:
        cls.check_settings(cls.settings_from(cfg))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _validate_comm(comm) -> None:
    """The ``comm`` section: codecs and reduction (the collectives' check), the run's startup timeout."""
    _owner_check(check_reduction_settings, comm)
    # comm.recv_timeout, group_timeout, error_feedback_decay and max_norm_ratio: the algorithm's own check
    startup = comm.startup_timeout  # (the run's, not the algorithm's: processes meeting)
    _require(isinstance(startup, (int, float)) and not isinstance(startup, bool) and 0 < startup < math.inf,
             f"comm.startup_timeout must be > 0 seconds, got {startup!r}")  # fmt: skip


def _validate_inner(cfg: DictConfig) -> None:
    """The ``inner`` section: learning rates, clipping, processes per worker, their gradient codec."""
    inner = cfg.inner
    _require(inner.lr > 0 and 0 <= inner.min_lr <= inner.lr, "inner.lr must be > 0 and 0 <= inner.min_lr <= inner.lr")
    _require(inner.warmup >= 0 and inner.grad_clip >= 0, "inner.warmup and inner.grad_clip must be >= 0")
    _require(isinstance(inner.processes, int) and inner.processes >= 1, "inner.processes must be an integer >= 1")
    _require(
        inner.processes == 1 or BACKENDS[cfg.backend].processes_per_worker,
        f"inner.processes={inner.processes} needs a backend whose workers may be several processes: "
        f"{', '.join(f'backend={n}' for n, b in BACKENDS.items() if b.processes_per_worker)} (a process per device "
        "of a worker)",
    )
    _require(inner.grad_codec in known_codecs(), f"inner.grad_codec={inner.grad_codec!r} is not a codec")
    _require(not get_codec(inner.grad_codec).side_information,
             f"inner.grad_codec={inner.grad_codec!r}: a coset code carries only NoLoCo's slow-weight term")  # fmt: skip


def _validate_exchange_schedule(cfg: DictConfig) -> None:
    """When the outer exchange runs: overlap, fragments, the slow-weight term's rounds, offload."""
    outer = cfg.outer
    _require(isinstance(outer.overlap, bool) or outer.overlap in OVERLAP_RULES,
             f"outer.overlap={outer.overlap!r} is not one of false, true, {', '.join(OVERLAP_RULES)}")  # fmt: skip
    _require(not (outer.overlap and outer.algo == "ddp"), "outer.overlap is for the outer algorithms, not ddp")
    fragments = outer.fragments  # its range, and slow_every's, are the algorithm's own check (_validate_algorithm)
    _require(fragments == 1 or outer.algo != "ddp", "outer.fragments is for the outer algorithms, not ddp")
    try:
        check_overlap_steps(outer.overlap_steps, overlap_rule(outer.overlap), outer.every // fragments)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _require(isinstance(outer.offload, bool), f"outer.offload must be true or false, got {outer.offload!r}")
    _require(not (outer.offload and outer.overlap), "outer.offload does not run with outer.overlap (the exchange "
             "in flight needs the outer state on the GPU)")  # fmt: skip


def _single_component(value) -> bool:
    """A name that is one path component of its own: not empty, no separator, not ``.`` or ``..``."""
    text = str(value)
    return bool(text) and text not in (".", "..") and "/" not in text and "\\" not in text and "\0" not in text


def _validate_names(cfg: DictConfig) -> None:
    """``run.name``, ``peer.run_id`` and ``peer.name`` become folder names under ``run.dir``: each must be a single
    path component (``../x``, ``a/../../x`` or an absolute path would write outside ``run.dir``)."""
    for key, value in (("run.name", cfg.run.name), ("peer.run_id", cfg.peer.run_id), ("peer.name", cfg.peer.name)):
        if value is None and key != "peer.run_id":
            continue
        _require(_single_component(value), f"{key}={value!r} must be a single folder name (no '/', not '.' or "
                 "'..'): it names a folder under run.dir")  # fmt: skip


def _validate_wandb(wandb) -> None:
    """``log.wandb``: a known mode; with a project set, the wandb package installed (found, not imported)."""
    from importlib.util import find_spec

    from noloco.train.metrics import WANDB_MODES

    _require(wandb.mode in WANDB_MODES, f"log.wandb.mode={wandb.mode!r} is not one of {', '.join(WANDB_MODES)}")
    if wandb.project:
        _require(
            find_spec("wandb") is not None,
            f"log.wandb.project={wandb.project!r} needs wandb, which is not installed: pip install 'noloco[wandb]' "
            "(or drop log.wandb.project)",
        )
