"""Hugging Face adapters: a ``transformers`` causal LM as a noloco model, ``datasets`` corpora (tokenized
into the cache, or streamed) and your own tokenizer. See docs/your-model-and-data.md.

Model (``model.source=hf model.hf_path=DIR``): any ``AutoModelForCausalLM`` of a local folder with a
``config.json``: built from the config (``from_config``, initialised from ``run.seed``) or, when the
folder holds weights, loaded with them (``from_pretrained``, ``model.hf_weights``). :class:`HFCausalLM`
wraps it so that ``forward(tokens, targets)`` returns ``(logits, loss)`` like noloco's LLaMA; the outer
algorithms, codecs and backends see only ``model.parameters()`` (a tied embedding is one parameter).
Weights are fp32 (the master weights; ``precision=bf16`` autocasts); nothing is ever downloaded.

Data (``data.source=hf``): ``datasets.load_dataset(data.hf_path, data.hf_name, data_files=data.hf_files,
split=data.hf_split)``, the text in ``data.text_field``. Local files are read shard by shard, one shard
a file, and a row is named ``<file>#<row>`` as ``data.source=files`` names it, so the same ``.jsonl`` or
``.parquet`` files give the same split, tokens and batches either way. ``data.streaming=true``
(:class:`StreamingCorpus`): nothing is tokenized ahead; the first ``data.stream_sample`` documents of the
stream are read at start-up and split by document as usual (held-out split; the BPE tokenizer is
trained on the rest); then each worker streams its own shard of the dataset
(``datasets.distributed.split_dataset_by_node``, by rank) through a :class:`StreamSampler`, skipping the
held-out documents, and packs the tokens into consecutive windows. Its position is
``StreamSampler.state_dict()``: a checkpoint that stores it resumes the stream exactly.

Tokenizer (``data.tokenizer``): a ``tokenizers`` JSON file or a transformers tokenizer folder
(:func:`load_tokenizer`); its vocabulary sets the model's embedding size; documents are separated by
its end-of-text token and encoded without the special tokens its post-processor would add.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from noloco.train import data as D
from noloco.train.config import ConfigError
from noloco.train.data import EOT, DataError, Document, TokenizedCorpus

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|end|>")
STREAM_FORMAT = 1
_BUILD = threading.Lock()  # transformers initialises from the global RNG: one model at a time, seeded


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _transformers(what: str):
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{what} needs transformers: pip install 'noloco[hf]'") from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("data.source=hf needs datasets: pip install 'noloco[hf]'") from None
    datasets.utils.logging.disable_progress_bar()
    return datasets


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
    """The local folder of ``model.hf_path``; ConfigError unless it holds a ``config.json``."""
    if not path:
        raise ConfigError("model.source=hf needs model.hf_path (a local folder with a transformers config.json)")
    folder = Path(os.path.expanduser(str(path)))
    if not folder.is_dir():
        raise ConfigError(f"model.hf_path={path!r}: no such folder (a local transformers model folder)")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.hf_path={path!r}: no config.json in it (write one with config.save_pretrained(DIR))")
    return folder


def has_weights(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in WEIGHT_FILES)


def loads_weights(model_cfg, folder: Path) -> bool:
    """Whether ``model.hf_weights`` (auto | true | false) loads the folder's weights."""
    mode = model_cfg.get("hf_weights", "auto")
    if mode == "auto":
        return has_weights(folder)
    if mode is True and not has_weights(folder):
        raise ConfigError(f"model.hf_weights=true but {folder} holds no weights ({', '.join(WEIGHT_FILES[::2])})")
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
    [1, 2^31); ConfigError naming the key if one is not. Nothing is built."""
    sizes = {}
    for name, keys in _SIZE_KEYS.items():
        value = _config_value(config, *keys)
        if value is None:
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**31):
            raise ConfigError(f"model.hf_path={where!r}: config.json has {keys[0]}={value!r}, not an integer in "
                              "[1, 2^31)")  # fmt: skip
        sizes[name] = value
    h = sizes.get("hidden", 1)
    inner = sizes.get("inner", 4 * h)
    return (2 * sizes.get("vocab", 1) * h + sizes.get("layers", 1) * (4 * h * h + 3 * h * inner)
            + sizes.get("positions", 0) * h)  # fmt: skip


def check_weight_shapes(auto, config, folder: Path) -> None:
    """ConfigError naming the first tensor of the folder's safetensors weights whose shape is not the one
    ``config.json`` gives it (read from the files' headers and a model built on the ``meta`` device: nothing is
    loaded). Pickled ``.bin`` weights are left to transformers' own check."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            (["model.safetensors"] if (folder / "model.safetensors").is_file() else [])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{index}: not a weights index ({_first_line(exc)})") from None
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
            raise ConfigError(f"{path}: not a safetensors file ({_first_line(exc)})") from None
        for key, shape in stored.items():
            expected = shapes.get(key)
            if expected is not None and expected != shape:
                raise ConfigError(f"{path}: {key} has shape {shape}, {folder}/config.json makes it {expected} "
                                  "(the weights are not this config's model)")  # fmt: skip


def build_hf_model(cfg, vocab_size: int) -> HFCausalLM:
    """The ``model.source=hf`` model of ``cfg`` for a tokenizer of ``vocab_size`` tokens, in fp32.

    Built from ``config.json`` (its ``vocab_size`` set to the tokenizer's; initialised from ``run.seed``),
    or loaded with the folder's weights (whose embedding must have a row for every token). Under
    ``torch.device("meta")`` (a checkpoint's shapes only) nothing is read but the config.
    """
    transformers = _transformers("model.source=hf")
    folder = model_folder(cfg.model.hf_path)
    weights = loads_weights(cfg.model, folder)
    size = (folder / "config.json").stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"model.hf_path={cfg.model.hf_path!r}: its config.json is {size:,} bytes, not a model config "
                          f"(at most {MAX_CONFIG_BYTES:,})")  # fmt: skip
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ...
        reason = _first_line(exc)
        raise ConfigError(f"model.hf_path={cfg.model.hf_path!r}: cannot read its config.json ({reason})") from None
    if not weights:
        config.vocab_size = vocab_size
    config.use_cache = False
    limit = _config_value(config, "max_position_embeddings", "n_positions")
    if isinstance(limit, int) and cfg.data.seq_len > limit:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings={limit}")
    from noloco.train.device import check_model_memory
    from noloco.train.loop import workers_per_process

    check_model_memory(cfg, config_parameters(config, cfg.model.hf_path), copies=workers_per_process(cfg),
                       what=f"model of {folder}/config.json")  # fmt: skip
    meta = torch.get_default_device().type == "meta"
    auto = transformers.AutoModelForCausalLM
    if weights and not meta:
        check_weight_shapes(auto, config, folder)
    verbosity = transformers.logging.get_verbosity()
    try:
        with _BUILD, torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(cfg.run.seed))
            transformers.logging.set_verbosity_error()  # its load report is not our one line
            if weights and not meta:
                model = auto.from_pretrained(folder, config=config, dtype=torch.float32, local_files_only=True)
            else:
                model = auto.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a pickled .bin (UnpicklingError), shapes that disagree, bad values
        raise ConfigError(f"model.hf_path={cfg.model.hf_path!r}: not a causal LM transformers can build or load "
                          f"({type(exc).__name__}: {_first_line(exc)})") from None  # fmt: skip
    finally:
        transformers.logging.set_verbosity(verbosity)
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < vocab_size:
        raise ConfigError(f"model.hf_path={cfg.model.hf_path!r}: its embedding has {rows} rows, the tokenizer has "
                          f"{vocab_size} tokens (use the model's own tokenizer: data.tokenizer={folder})")  # fmt: skip
    model.train()
    return HFCausalLM(model, vocab_size)


# ----------------------------------------------------------------------------------- tokenizer


class _WithoutSpecials:
    """Encodes like the tokenizer but without the special tokens its post-processor adds (a BOS per piece)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_batch_fast(self, texts):
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return encode(texts, add_special_tokens=False)

    encode_batch = encode_batch_fast


@dataclass
class UserTokenizer:
    """A ``tokenizers.Tokenizer`` given by ``data.tokenizer``, with the token that ends each document."""

    tokenizer: object
    eot_id: int
    source: str

    @property
    def vocab_size(self) -> int:
        """One past the largest id (the rows the model's embedding needs)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def digest(self) -> str:
        return hashlib.blake2b(self.tokenizer.to_str().encode(), digest_size=8).hexdigest()

    def encoder(self) -> _WithoutSpecials:
        return _WithoutSpecials(self.tokenizer)


def _named_token(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _folder_eos(folder: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            token = _named_token(json.loads((folder / name).read_text()).get("eos_token"))
        except (OSError, ValueError, AttributeError):
            continue
        if token:
            return token
    return None


def count_entries(path: Path, limit: int) -> int:
    """An upper bound on the entries of a tokenizers JSON file, read 16 MiB at a time without parsing it: every
    vocabulary entry (``"token": id``) and every key of an added token holds a ``":``. Stops past ``limit``."""
    count, tail = 0, b""
    with open(path, "rb") as handle:
        while chunk := handle.read(16 << 20):
            count += (tail + chunk[:1]).count(b'":') + chunk.count(b'":')
            tail = chunk[-1:]
            if count > limit:
                break
    return count


def load_tokenizer(spec, max_vocab: int = D.MAX_VOCAB) -> UserTokenizer:
    """``data.tokenizer``: a tokenizers JSON file or a transformers tokenizer folder; DataError (one line) if not,
    or if it holds more than ``max_vocab`` tokens (``data.max_vocab_size``), found before it is parsed."""
    from tokenizers import Tokenizer

    path = Path(os.path.expanduser(str(spec)))
    eos = None
    if path.is_dir():
        eos = _folder_eos(path)
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        else:
            transformers = _transformers("a transformers tokenizer folder")
            try:
                auto = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
            except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
                raise DataError(f"data.tokenizer={spec}: not a tokenizer folder ({_first_line(exc)})") from None
            if not getattr(auto, "is_fast", False):
                raise DataError(f"data.tokenizer={spec}: transformers has no fast (tokenizers) version of it")
            tokenizer, eos = auto.backend_tokenizer, eos or auto.eos_token
    elif not path.is_file():
        raise DataError(f"data.tokenizer={spec}: no such file or folder")
    if path.is_file():
        entries = count_entries(path, 2 * max_vocab + 100_000)  # added tokens: about 8 keys each
        if entries > 2 * max_vocab + 100_000:
            raise DataError(f"data.tokenizer={spec}: holds more than {entries:,} entries, over twice "
                            f"data.max_vocab_size={max_vocab:,} (raise it if this tokenizer is right)")  # fmt: skip
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise DataError(f"data.tokenizer={spec}: not a tokenizers JSON file ({_first_line(exc)})") from None
    size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if size > max_vocab:
        raise DataError(f"data.tokenizer={spec}: a vocabulary of {size:,} tokens, more than data.max_vocab_size="
                        f"{max_vocab:,} (raise it if this tokenizer is right)")  # fmt: skip
    for name in ([eos] if eos else []) + list(EOT_CANDIDATES):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return UserTokenizer(tokenizer, token_id, str(spec))
    raise DataError(f"data.tokenizer={spec}: no end-of-text token (none of {', '.join(EOT_CANDIDATES)}); "
                    "documents are separated by one")  # fmt: skip


def corpus_tokenizer(corpus: TokenizedCorpus) -> UserTokenizer:
    """The tokenizer a corpus was tokenized with, and its end-of-text id."""
    meta = corpus.tokenizer_path.parent / "meta.json"
    tokenizer = corpus.tokenizer()
    try:
        eot = int(json.loads(meta.read_text())["eot_id"])
    except (OSError, ValueError, KeyError, TypeError):
        eot = tokenizer.token_to_id(EOT)
    return UserTokenizer(tokenizer, eot, str(corpus.tokenizer_path))


# ---------------------------------------------------------------------------------------- data


def corpus_options(data) -> dict:
    """The keyword arguments of :func:`noloco.train.data.prepare_corpus` for ``cfg.data`` beyond its five
    positional ones: ``prepare_corpus(source, path, vocab_size, eval_fraction, cache_dir,
    **corpus_options(cfg.data))``."""
    hf = None
    if data.get("source") == "hf":
        files = data.get("hf_files")
        hf = {
            "path": data.get("hf_path"),
            "name": data.get("hf_name"),
            "files": list(files) if files is not None and not isinstance(files, str) else files,
            "split": data.get("hf_split") or "train",
            "text_field": data.get("text_field") or "text",
            "streaming": bool(data.get("streaming", False)),
            "sample": int(data.get("stream_sample") or 10000),
        }
    elif data.get("source") == "files":  # the field of .jsonl records and the column of .parquet files
        hf = {"text_field": data.get("text_field") or "text"}
    return {"tokenizer": data.get("tokenizer"), "hf": hf, "max_vocab": data.get("max_vocab_size") or D.MAX_VOCAB}


def resolve_files(spec) -> list[str]:
    """Local data files of ``data.hf_files`` (a file, folder, glob or list of them), as ``data.source=files``
    orders and names them."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for one in specs:
        root = Path(os.path.expanduser(str(one)))
        if root.is_dir():
            paths = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif root.is_file():
            paths = [root]
        else:
            matches = glob.glob(os.path.expanduser(str(one)), recursive=True)
            paths = sorted(Path(p) for p in matches if Path(p).is_file())
        if not paths:
            raise DataError(f"data.hf_files={one!r} matches no file")
        out += [str(p) for p in paths]
    return out


def _label(opts: dict) -> str:
    return f"data.hf_path={opts.get('path')!r}" + (f" data.hf_name={opts['name']!r}" if opts.get("name") else "")


def open_dataset(opts: dict, streaming: bool):
    """(dataset, local files or None) of the ``data.hf_*`` options; DataError (one line) if it cannot load."""
    datasets = _datasets()
    if not opts.get("path"):
        raise DataError("data.source=hf needs data.hf_path (a builder such as json or parquet with data.hf_files, "
                        "a local dataset folder, or a hub name)")  # fmt: skip
    files = resolve_files(opts["files"]) if opts.get("files") else None
    try:
        ds = datasets.load_dataset(opts["path"], opts.get("name"), data_files=files, split=opts.get("split") or "train",
                                   streaming=streaming)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (missing builder, offline, bad split, ...)
        raise DataError(f"{_label(opts)}: cannot load the dataset ({_first_line(exc)})") from None
    if isinstance(ds, dict):  # no split given and several
        raise DataError(f"{_label(opts)}: pick a split with data.hf_split ({', '.join(ds)})")
    return ds, files


def check_text_field(ds, opts: dict) -> str:
    """The text field; DataError naming the dataset's fields when it has no such field."""
    name = opts.get("text_field") or "text"
    names = list(ds.features) if ds.features is not None else None
    if names is None:  # a stream whose features are unknown until read
        first = next(iter(ds.take(1)), None)
        if first is None:
            raise DataError(f"{_label(opts)}: the dataset has no rows")
        names = list(first)
    if name not in names:
        raise DataError(f"{_label(opts)}: no {name!r} field (fields: {', '.join(map(str, names)) or 'none'}); "
                        "set data.text_field")  # fmt: skip
    return name


def _text(value, where: str, name: str) -> str:
    if value is None:
        raise DataError(f"{where}: {name!r} is null")
    if not isinstance(value, str):
        raise DataError(f"{where}: {name!r} is a {type(value).__name__}, not a string")
    reason = D._control_reason(value[: 4 * D.READ_BYTES]) or ("a NUL character" if "\x00" in value else None)
    if reason is not None:
        raise DataError(f"{where}: {name!r} has {reason}")
    return value


def _rows(ds, name: str, where: str) -> Iterator[tuple[int, str]]:
    """(row, text) of a dataset's text column, read a batch at a time."""
    row = 0
    for batch in ds.select_columns([name]).iter(batch_size=512):
        for value in batch[name]:
            yield row, _text(value, f"{where}: row {row}", name)
            row += 1


def hf_documents(opts: dict) -> list[Document]:
    """``data.source=hf``: the documents of the dataset (for ``data.streaming``: the first ``sample`` ones).

    Local files go shard by shard (a shard is a file) and rows are named ``<file>#<row>``, as
    ``data.source=files`` names the rows of a ``.jsonl`` or ``.parquet`` file.
    """
    if not opts:
        raise DataError("data.source=hf: prepare_corpus got none of the data.hf_* settings (its caller must pass "
                        "**noloco.train.hf.corpus_options(cfg.data))")  # fmt: skip
    streaming = bool(opts.get("streaming"))
    ds, files = open_dataset(opts, streaming=streaming or bool(opts.get("files")))  # local files: read, not copied
    name = check_text_field(ds, opts)
    limit = int(opts.get("sample") or 10000) if streaming else None
    docs: list[Document] = []
    if files and not streaming and getattr(ds, "num_shards", None) == len(files):
        for i, path in enumerate(files):
            shard = ds.shard(num_shards=len(files), index=i)
            docs += [Document(f"{path}#{row}", text) for row, text in _rows(shard, name, path)]
    else:
        label = f"{opts['path']}{'/' + opts['name'] if opts.get('name') else ''}:{opts.get('split') or 'train'}"
        docs = [Document(f"{label}#{row}", text) for row, text in islice(_rows(ds, name, _label(opts)), limit)]
    if not any(doc.text and not doc.text.isspace() for doc in docs):
        raise DataError(f"{_label(opts)}: no text in {name!r}")
    return docs


# -------------------------------------------------------------------- corpora of a user tokenizer


def _corpus(folder: Path) -> TokenizedCorpus:
    corpus = D._load_cached(folder)
    if corpus is None:
        raise DataError(f"the token cache in {folder} could not be read back after writing it")
    return corpus


def train_bpe(train_docs: list[Document], vocab_size: int):
    """The byte-level BPE of :func:`noloco.train.data.prepare_corpus`, as a :class:`UserTokenizer`."""
    tokenizer = D.train_bpe_tokenizer(train_docs, vocab_size)
    return UserTokenizer(tokenizer, tokenizer.token_to_id(EOT), "bpe")


def build_corpus(
    docs: list[Document],
    folder: Path,
    eval_fraction: float,
    tokenizer: UserTokenizer | None,
    vocab_size: int,
    meta: dict,
) -> TokenizedCorpus:
    """Split ``docs``, tokenize them with ``tokenizer`` (None: train the BPE on the training split) into
    ``folder`` (unless it holds them already), as :func:`noloco.train.data.prepare_corpus` does."""
    cached = D._load_cached(folder) if (folder / "meta.json").exists() else None
    if cached is not None:
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = D.split_documents(docs, eval_fraction)
    user = tokenizer or train_bpe(train_docs, vocab_size)
    reached = user.vocab_size
    dtype = D.token_dtype(reached)
    encoder = user.encoder()
    train_tokens = D._write_tokens(folder / "train.bin", encoder, train_docs, user.eot_id, dtype)
    val_tokens = D._write_tokens(folder / "val.bin", encoder, val_docs, user.eot_id, dtype)
    D._atomic_save(folder / "tokenizer.json", lambda tmp: user.tokenizer.save(tmp))
    meta = {
        "format": D.FORMAT_VERSION,
        **meta,
        "tokenizer": user.source,
        "eot_id": user.eot_id,
        **D.split_meta(reached, vocab_size, dtype, train_docs, val_docs, train_tokens, val_tokens),
        "held_out_digests": [text_digest(d.text) for d in val_docs],
    }
    D._atomic_save(folder / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1)))
    return _corpus(folder)


def prepare_corpus(
    source: str,
    path: str | None,
    vocab_size: int,
    eval_fraction: float,
    cache_dir,
    tokenizer: str | None = None,
    hf: dict | None = None,
    max_vocab: int = D.MAX_VOCAB,
) -> TokenizedCorpus:
    """:func:`noloco.train.data.prepare_corpus` with a user tokenizer (``data.tokenizer``) or a streamed
    ``data.source=hf`` (a :class:`StreamingCorpus`); the same split, tokenization and cache otherwise."""
    if not 0 < eval_fraction < 1:
        raise DataError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
    user = load_tokenizer(tokenizer, max_vocab) if tokenizer else None
    if user is None and not 256 < vocab_size <= D.MAX_VOCAB:
        raise DataError(f"data.vocab_size must be in (256, {D.MAX_VOCAB}], got {vocab_size}")
    streaming = bool(hf and hf.get("streaming"))
    docs = D.load_documents(source, path, hf)
    key = D._cache_key(docs, 0 if user else vocab_size, eval_fraction)
    key += f"-tok{user.digest}" if user else ""
    kind = "stream" if streaming else "data"
    folder = Path(os.path.expanduser(str(cache_dir))) / kind / key
    meta = {"source": source, "path": path}
    if hf:
        meta["hf"] = hf
    corpus = build_corpus(docs, folder, eval_fraction, user, vocab_size, meta)
    if not streaming:
        return corpus
    info = json.loads((folder / "meta.json").read_text())
    return StreamingCorpus(
        train=corpus.train,
        val=corpus.val,
        vocab_size=corpus.vocab_size,
        tokenizer_path=corpus.tokenizer_path,
        train_documents=corpus.train_documents,
        val_documents=corpus.val_documents,
        stream=dict(hf),
        eot_id=int(info["eot_id"]),
        held_out=frozenset(info["held_out_digests"]),
    )


def text_digest(text: str) -> str:
    return hashlib.blake2b(D._utf8(text), digest_size=16).hexdigest()


# ------------------------------------------------------------------------------------ streaming


@dataclass
class StreamingCorpus(TokenizedCorpus):
    """A ``data.streaming`` corpus: ``train``/``val`` are the tokens of the start-up sample (the held-out
    split evaluates; the training part only gives the unigram baseline); workers stream through
    :meth:`sampler`."""

    stream: dict = field(default_factory=dict)
    eot_id: int = 0
    held_out: frozenset = frozenset()

    def sampler(self, rank: int, world: int, seq_len: int, batch_size: int) -> StreamSampler:
        return StreamSampler(self.stream, rank, world, seq_len, batch_size, self.tokenizer_path, self.eot_id,
                             self.held_out)  # fmt: skip

    def check_shards(self, ranks, world: int) -> None:
        """DataError naming the first of ``ranks`` whose shard (``rank % world``, as :class:`StreamSampler` cuts
        it) holds no training document: it could neither train nor start over. Opens the stream once and reads
        each shard up to its first training document (at start-up, before the run folder exists)."""
        from datasets.distributed import split_dataset_by_node

        opts = {**self.stream, "streaming": True}
        ds, _ = open_dataset(opts, streaming=True)
        name = check_text_field(ds, opts)
        ds = ds.select_columns([name])
        for rank in ranks:
            shard = split_dataset_by_node(ds, rank=rank % world, world_size=world)
            where = f"{_label(opts)} (worker {rank}'s shard)"
            if not any(text_digest(_text(row[name], where, name)) not in self.held_out for row in shard):
                raise DataError(f"{_label(opts)}: worker {rank}'s shard (of {world}) holds no training documents "
                                "(an empty file, fewer rows than shards, or all of it held out): use fewer workers "
                                "or more data")  # fmt: skip


class StreamSampler:
    """Batches of one worker from its shard of a streamed dataset: consecutive windows of ``seq_len + 1``
    tokens of its documents (each followed by the end-of-text token), held-out documents skipped.

    Worker ``rank`` reads shard ``rank % world``. ``batch(worker, step)`` returns the next ``batch_size``
    windows (the arguments only check that it is this worker's). The position, :meth:`state_dict`
    (JSON-able: the epoch, the dataset's own ``state_dict()`` before the current document, and how many
    of its tokens were used), restores with :meth:`load_state_dict` to continue exactly: the same batches
    as if the run had not stopped. At the end of its shard a worker starts it again (the next epoch);
    ``ends`` lists the steps whose batch crossed an end, and :meth:`report` goes into ``summary.json``.
    """

    def __init__(self, opts: dict, rank: int, world: int, seq_len: int, batch_size: int, tokenizer_path,
                 eot_id: int, held_out: frozenset = frozenset()):  # fmt: skip
        from tokenizers import Tokenizer

        self.opts, self.rank, self.world = dict(opts), int(rank), int(world)
        self.shard = self.rank % self.world  # a swarm peer's rank may be any number
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.tokenizer, self.eot_id, self.held_out = Tokenizer.from_file(str(tokenizer_path)), int(eot_id), held_out
        self.epoch = 0
        self.position: dict | None = None  # the dataset's state before the current document (None: its start)
        self.offset = 0  # tokens of the current document already used
        self.ends: list[int] = []  # the steps whose batch reached the end of the shard (and started it again)
        self._step = 0
        self._dataset = None
        self._iterator: Iterator | None = None
        self._tokens = np.zeros(0, dtype=np.int64)  # the current document's tokens

    # --- the stream

    def _open(self):
        from datasets.distributed import split_dataset_by_node

        ds, _ = open_dataset({**self.opts, "streaming": True}, streaming=True)
        name = check_text_field(ds, self.opts)
        ds = split_dataset_by_node(ds.select_columns([name]), rank=self.shard, world_size=self.world)
        ds.set_epoch(self.epoch)
        return ds, name

    def _restart(self, state: dict | None) -> None:
        self._dataset, self._name = self._open()
        if state is not None:
            self._dataset.load_state_dict(state)
        self._iterator = iter(self._dataset)

    def _encode(self, text: str) -> np.ndarray:
        pieces = list(D.text_chunks(text))
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encode(pieces, add_special_tokens=False)]
        return np.concatenate([*ids, np.asarray([self.eot_id], dtype=np.int64)])

    def _next_document(self) -> None:
        """Make the next training document of the shard current (offset 0), wrapping to the next epoch."""
        empty_epoch = True
        while True:
            if self._iterator is None:
                self._restart(self.position)
            state = self._dataset.state_dict()
            example = next(self._iterator, None)
            if example is None:
                if empty_epoch and self.position is None:
                    raise DataError(f"{_label(self.opts)}: worker {self.rank}'s shard (of {self.world}) holds no "
                                    "training documents")  # fmt: skip
                self.epoch, self.position, self._iterator, empty_epoch = self.epoch + 1, None, None, True
                self.ends.append(self._step)
                continue
            text = _text(example[self._name], f"{_label(self.opts)} (worker {self.rank}'s shard)", self._name)
            if text_digest(text) in self.held_out:
                continue
            self.position, self.offset, self._tokens = state, 0, self._encode(text)
            return

    # --- batches

    def batch(self, worker: int, step: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        if worker != self.rank:
            raise ValueError(f"this stream sampler is worker {self.rank}'s, not worker {worker}'s")
        self._step = int(step)
        need = self.batch_size * (self.seq_len + 1)
        parts, have = [], 0
        if self._iterator is None and self.position is not None:  # resumed: read the current document again
            self._restart(self.position)
            self._iterator_document()
        while have < need:
            if self.offset >= self._tokens.size:
                self._next_document()
            take = min(need - have, self._tokens.size - self.offset)
            parts.append(self._tokens[self.offset : self.offset + take])
            self.offset += take
            have += take
        windows = torch.from_numpy(np.concatenate(parts)).view(self.batch_size, self.seq_len + 1)
        windows = D._to_device(windows, device)
        return windows[:, :-1], windows[:, 1:]

    def _iterator_document(self) -> None:
        """After a restore: the current document is the first the restored dataset yields."""
        offset = self.offset
        example = next(self._iterator)
        self._tokens = self._encode(_text(example[self._name], _label(self.opts), self._name))
        self.offset = offset

    # --- position

    def state_dict(self) -> dict:
        """Where the stream is (JSON-able, for a checkpoint)."""
        return {"version": STREAM_FORMAT, "rank": self.rank, "world": self.world, "epoch": self.epoch,
                "position": self.position, "offset": self.offset, "ends": list(self.ends)}  # fmt: skip

    def report(self) -> dict:
        """What ``summary.json`` says of this worker's stream: its shard, passes begun, the steps it ended at."""
        return {"shard": self.shard, "shards": self.world, "epoch": self.epoch, "ends": list(self.ends)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STREAM_FORMAT or state.get("world") != self.world or state.get("rank") != self.rank:
            raise ValueError(
                f"stream position of worker {state.get('rank')} of {state.get('world')} "
                f"(format {state.get('version')}); this is worker {self.rank} of {self.world}"
            )
        self.epoch, self.position, self.offset = int(state["epoch"]), state["position"], int(state["offset"])
        self.ends = [int(s) for s in state.get("ends", [])]  # (absent from checkpoints written before it was kept)
        self._iterator, self._dataset, self._tokens = None, None, np.zeros(0, dtype=np.int64)
