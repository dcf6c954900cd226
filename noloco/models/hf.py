"""A ``transformers`` causal LM as a noloco model (``model.source=hf``). See docs/your-model-and-data.md.

Any ``AutoModelForCausalLM`` of a local folder with a ``config.json``: built from the config (``from_config``,
initialised from ``run.seed``) or, when the folder holds weights, loaded with them (``from_pretrained``,
``model.hf_weights``). :class:`HFCausalLM` wraps it so that ``forward(tokens, targets)`` returns ``(logits, loss)``
like noloco's LLaMA (:mod:`noloco.models.llama`); the outer algorithms, codecs and backends see only
``model.parameters()`` (a tied embedding is one parameter). Weights are fp32 (the master weights; ``precision=bf16``
autocasts); nothing is ever downloaded. A folder's sizes are read and bounded before anything of that size is built
(:func:`config_parameters`, the caller's ``check_memory``), and its safetensors shapes checked against its config.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip
_BUILD = threading.Lock()  # transformers initialises from the global RNG: one model at a time, seeded


class ModelError(ValueError):
    """A model that cannot be built or loaded as configured; the message is one line for the user."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def transformers_module(what: str):
    """The ``transformers`` package (progress bars off); ModelError naming ``what`` needs it when it is missing."""
    try:
        import transformers
    except ImportError:
        raise ModelError(f"{what} needs transformers: pip install 'noloco[hf]'") from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


# --------------------------------------------------------------------------------------- model


@dataclass
class HFModelConfig:
    """What noloco reads of a model's shape (``model.cfg`` of noloco's LLaMA has the same names)."""

    vocab_size: int  # the tokenizer's vocabulary (a pretrained embedding may have more rows)
    dim: int
    n_layers: int
    n_heads: int
    max_seq_len: int | None
    embedding_rows: int


def _config_value(config, *names, default=None):
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in names:
        value = getattr(text, name, None)
        if value is not None:
            return value
    return default


class HFCausalLM(nn.Module):
    """A transformers causal LM with noloco's model interface: ``forward(tokens, targets) -> (logits, loss)``.

    The loss is the mean cross-entropy of ``logits`` against ``targets`` (already shifted by the data,
    as for noloco's LLaMA), computed in fp32. ``self.hf`` is the transformers model (``save_pretrained``).
    """

    def __init__(self, model: nn.Module, vocab_size: int):
        super().__init__()
        self.hf = model
        config = model.config
        rows = model.get_input_embeddings().weight.shape[0]
        self.cfg = HFModelConfig(
            vocab_size=vocab_size,
            dim=int(_config_value(config, "hidden_size", "n_embd", "d_model", default=0)),
            n_layers=int(_config_value(config, "num_hidden_layers", "n_layer", "num_layers", default=0)),
            n_heads=int(_config_value(config, "num_attention_heads", "n_head", default=0)),
            max_seq_len=_config_value(config, "max_position_embeddings", "n_positions"),
            embedding_rows=int(rows),
        )

    @property
    def embed(self) -> nn.Module:  # a property, not a submodule: the embedding is registered once, under hf
        return self.hf.get_input_embeddings()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.hf(input_ids=tokens, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def model_folder(path) -> Path:
    """The local folder of ``model.hf_path``; ModelError unless it holds a ``config.json``."""
    if not path:
        raise ModelError("model.source=hf needs model.hf_path (a local folder with a transformers config.json)")
    folder = Path(os.path.expanduser(str(path)))
    if not folder.is_dir():
        raise ModelError(f"model.hf_path={path!r}: no such folder (a local transformers model folder)")
    if not (folder / "config.json").is_file():
        raise ModelError(f"model.hf_path={path!r}: no config.json in it (write one with config.save_pretrained(DIR))")
    return folder


def has_weights(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in WEIGHT_FILES)


def loads_weights(mode, folder: Path) -> bool:
    """Whether ``model.hf_weights`` ``mode`` (auto | true | false) loads the folder's weights."""
    if mode == "auto":
        return has_weights(folder)
    if mode is True and not has_weights(folder):
        raise ModelError(f"model.hf_weights=true but {folder} holds no weights ({', '.join(WEIGHT_FILES[::2])})")
    return bool(mode)


#: the largest config.json read (real ones are a few KB)
MAX_CONFIG_BYTES = 1 << 20
_SIZE_KEYS = {"vocab": ("vocab_size",), "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
              "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
              "inner": ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim"),
              "positions": ("max_position_embeddings", "n_positions", "max_seq_len")}  # fmt: skip


def config_parameters(config, where) -> int:
    """An upper estimate of a transformers config's parameter count from its sizes (embeddings in and out, per layer
    attention 4·h² and a gated MLP 3·h·inner, position embeddings), each size checked to be an integer in
    [1, 2^31); ModelError naming the key if one is not. Nothing is built."""
    sizes = {}
    for name, keys in _SIZE_KEYS.items():
        value = _config_value(config, *keys)
        if value is None:
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**31):
            raise ModelError(f"model.hf_path={where!r}: config.json has {keys[0]}={value!r}, not an integer in "
                             "[1, 2^31)")  # fmt: skip
        sizes[name] = value
    h = sizes.get("hidden", 1)
    inner = sizes.get("inner", 4 * h)
    return (2 * sizes.get("vocab", 1) * h + sizes.get("layers", 1) * (4 * h * h + 3 * h * inner)
            + sizes.get("positions", 0) * h)  # fmt: skip


def check_weight_shapes(auto, config, folder: Path) -> None:
    """ModelError naming the first tensor of the folder's safetensors weights whose shape is not the one
    ``config.json`` gives it (read from the files' headers and a model built on the ``meta`` device: nothing is
    loaded). Pickled ``.bin`` weights are left to transformers' own check."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    try:
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else (["model.safetensors"] if (folder / "model.safetensors").is_file() else [])
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"{index}: not a weights index ({_first_line(exc)})") from None
    if not files:
        return
    with _BUILD, torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in auto.from_config(config).state_dict().items()}
    for name in files:
        path = folder / str(name)
        try:
            with safe_open(str(path), framework="pt") as blob:
                stored = {key: tuple(blob.get_slice(key).get_shape()) for key in blob.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelError(f"{path}: not a safetensors file ({_first_line(exc)})") from None
        for key, shape in stored.items():
            expected = shapes.get(key)
            if expected is not None and expected != shape:
                raise ModelError(f"{path}: {key} has shape {shape}, {folder}/config.json makes it {expected} "
                                 "(the weights are not this config's model)")  # fmt: skip


def build_hf_model(path, vocab_size: int, *, hf_weights="auto", seq_len: int, seed: int,
                   check_memory: Callable[[int, str], None] | None = None) -> HFCausalLM:  # fmt: skip
    """The causal LM of the folder ``path`` (``model.hf_path``) for a tokenizer of ``vocab_size`` tokens, in fp32.

    Built from ``config.json`` (its ``vocab_size`` set to the tokenizer's; initialised from ``seed``,
    ``run.seed``), or loaded with the folder's weights (``hf_weights``: ``model.hf_weights``, auto | true | false;
    their embedding must have a row for every token). ``seq_len`` (``data.seq_len``) must fit its positions.
    ``check_memory(parameters, what)`` raises when a model of about ``parameters`` parameters does not fit, before
    anything of that size is built. Under ``torch.device("meta")`` (a checkpoint's shapes only) nothing is read but
    the config. ModelError (one line) when the folder is not such a model.
    """
    transformers = transformers_module("model.source=hf")
    folder = model_folder(path)
    weights = loads_weights(hf_weights, folder)
    size = (folder / "config.json").stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ModelError(f"model.hf_path={path!r}: its config.json is {size:,} bytes, not a model config "
                         f"(at most {MAX_CONFIG_BYTES:,})")  # fmt: skip
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ...
        reason = _first_line(exc)
        raise ModelError(f"model.hf_path={path!r}: cannot read its config.json ({reason})") from None
    if not weights:
        config.vocab_size = vocab_size
    config.use_cache = False
    limit = _config_value(config, "max_position_embeddings", "n_positions")
    if isinstance(limit, int) and seq_len > limit:
        raise ModelError(f"data.seq_len={seq_len} exceeds the model's max_position_embeddings={limit}")
    if check_memory is not None:
        check_memory(config_parameters(config, path), f"model of {folder}/config.json")
    meta = torch.get_default_device().type == "meta"
    auto = transformers.AutoModelForCausalLM
    if weights and not meta:
        check_weight_shapes(auto, config, folder)
    verbosity = transformers.logging.get_verbosity()
    try:
        with _BUILD, torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            transformers.logging.set_verbosity_error()  # its load report is not our one line
            if weights and not meta:
                model = auto.from_pretrained(folder, config=config, dtype=torch.float32, local_files_only=True)
            else:
                model = auto.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a pickled .bin (UnpicklingError), shapes that disagree, bad values
        raise ModelError(f"model.hf_path={path!r}: not a causal LM transformers can build or load "
                         f"({type(exc).__name__}: {_first_line(exc)})") from None  # fmt: skip
    finally:
        transformers.logging.set_verbosity(verbosity)
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < vocab_size:
        raise ModelError(f"model.hf_path={path!r}: its embedding has {rows} rows, the tokenizer has "
                         f"{vocab_size} tokens (use the model's own tokenizer: data.tokenizer={folder})")  # fmt: skip
    model.train()
    return HFCausalLM(model, vocab_size)
