"""Tokenizers: the offline byte-level BPE noloco trains on a corpus's training documents, or the user's own
(``data.tokenizer``: a ``tokenizers`` JSON file or a transformers tokenizer folder).

A user tokenizer's vocabulary sets the model's embedding size; documents are separated by its end-of-text token
and encoded without the special tokens its post-processor would add. Its size is bounded (``data.max_vocab_size``)
before the file is parsed (:func:`count_entries`). See docs/your-model-and-data.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from noloco.data.documents import DataError, Document, first_line, text_chunks

EOT = "<|endoftext|>"
MAX_VOCAB = 1 << 20
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|end|>")


def _transformers(what: str):
    try:
        import transformers
    except ImportError:
        raise DataError(f"{what} needs transformers: pip install 'noloco[hf]'") from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


def train_bpe_tokenizer(train_docs: list[Document], vocab_size: int):
    """The byte-level BPE (``tokenizers``) trained on ``train_docs`` in bounded pieces, with the EOT token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((piece for d in train_docs for piece in text_chunks(d.text)), trainer=trainer)
    return tokenizer


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


def train_bpe(train_docs: list[Document], vocab_size: int):
    """The byte-level BPE of :func:`train_bpe_tokenizer`, as a :class:`UserTokenizer`."""
    tokenizer = train_bpe_tokenizer(train_docs, vocab_size)
    return UserTokenizer(tokenizer, tokenizer.token_to_id(EOT), "bpe")


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


def load_tokenizer(spec, max_vocab: int = MAX_VOCAB) -> UserTokenizer:
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
                raise DataError(f"data.tokenizer={spec}: not a tokenizer folder ({first_line(exc)})") from None
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
            raise DataError(f"data.tokenizer={spec}: not a tokenizers JSON file ({first_line(exc)})") from None
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
