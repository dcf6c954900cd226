"""A corpus ready to train on: its documents loaded, split, tokenized into the token cache (or streamed).

:func:`prepare_corpus` is the one way in: ``load_documents`` (a bundled corpus, the user's files or a ``datasets``
dataset), the held-out split by document, the tokenizer (the byte-level BPE trained on the training split, or
``data.tokenizer``), the token files in the cache folder (reused when the inputs match) and, with
``data.streaming``, a :class:`~noloco.data.stream.StreamingCorpus`.

How much text the bundled corpora give (train / held-out tokens at eval_fraction 0.1, measured
with tokenizers 0.23; "reached" is the vocabulary the BPE trainer reached)::

    source            documents  characters  vocab 2048             vocab 32000
    shakespeare       38 + 4     5.06 M      1,701,352 / 159,145    1,261,680 / 121,643
    kjv               59 + 7     4.29 M      1,097,647 / 146,891    910,002 / 123,094 (reached 19,947)
    shakespeare+kjv   97 + 11    9.35 M      2,852,495 / 356,698    2,159,133 / 273,497

``data.vocab_size`` may be anything in (256, 2**20]; the BPE trainer stops early when the corpus has no pair left
to merge, and ``TokenizedCorpus.vocab_size`` is the size it reached (the model's embedding follows it): the bundled
corpora run out at 46,357 (shakespeare), 19,947 (kjv) and 54,070 (both), so their token files are always ``uint16``.

That is a few million tokens: plenty for the small presets, but a 125M model wants billions (about
20 tokens a parameter), a thousand times the bundled text. For a larger corpus set
``data.source=files data.path=...`` to a file, folder or glob of ``.txt``/``.md``/``.jsonl``/
``.parquet`` files, e.g. ``data.path='~/corpora/fineweb/*.parquet' data.vocab_size=32000``. The first
run tokenizes it into the cache (holding the documents in memory as text meanwhile, one to four
bytes a character); later runs memory-map the token files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from noloco.data.documents import (
    DataError,
    Document,
    file_documents,
    kjv_documents,
    shakespeare_documents,
    split_documents,
)
from noloco.data.hf import hf_documents
from noloco.data.stream import StreamingCorpus, text_digest
from noloco.data.tokenizer import MAX_VOCAB, UserTokenizer, load_tokenizer, train_bpe
from noloco.data.tokens import (
    FORMAT_VERSION,
    TokenizedCorpus,
    atomic_save,
    cache_key,
    load_token_cache,
    split_meta,
    token_dtype,
    write_tokens,
)


def load_documents(source: str, path: str | None = None, hf: dict | None = None) -> list[Document]:
    """The documents of a data source: a bundled corpus, ``data.path`` (``source=files``) or a ``datasets`` dataset
    (``source=hf``, :mod:`noloco.data.hf`); ``hf``: the ``data.hf_*`` options of :func:`corpus_options`."""
    sources = {"shakespeare": shakespeare_documents, "kjv": kjv_documents}
    if source == "files":
        return file_documents(path or "", (hf or {}).get("text_field") or "text")
    if source == "hf":
        return hf_documents(hf or {})
    if source == "shakespeare+kjv":
        return shakespeare_documents() + kjv_documents()
    if source not in sources:
        raise DataError(f"unknown data.source {source!r}; use shakespeare, kjv, shakespeare+kjv, files or hf")
    return sources[source]()


def corpus_options(data) -> dict:
    """The keyword arguments of :func:`prepare_corpus` for the ``data`` config section beyond its five
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
    return {"tokenizer": data.get("tokenizer"), "hf": hf, "max_vocab": data.get("max_vocab_size") or MAX_VOCAB}


def _corpus(folder: Path) -> TokenizedCorpus:
    corpus = load_token_cache(folder)
    if corpus is None:
        raise DataError(f"the token cache in {folder} could not be read back after writing it")
    return corpus


def build_corpus(
    docs: list[Document],
    folder: Path,
    eval_fraction: float,
    tokenizer: UserTokenizer | None,
    vocab_size: int,
    meta: dict,
) -> TokenizedCorpus:
    """Split ``docs``, tokenize them with ``tokenizer`` (None: train the BPE on the training split) into
    ``folder`` (unless it holds them already): ``train.bin``, ``val.bin``, ``tokenizer.json`` and ``meta.json``."""
    cached = load_token_cache(folder) if (folder / "meta.json").exists() else None
    if cached is not None:
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = split_documents(docs, eval_fraction)
    user = tokenizer or train_bpe(train_docs, vocab_size)
    reached = user.vocab_size
    dtype = token_dtype(reached)
    encoder = user.encoder()
    train_tokens = write_tokens(folder / "train.bin", encoder, train_docs, user.eot_id, dtype)
    val_tokens = write_tokens(folder / "val.bin", encoder, val_docs, user.eot_id, dtype)
    atomic_save(folder / "tokenizer.json", lambda tmp: user.tokenizer.save(tmp))
    meta = {
        "format": FORMAT_VERSION,
        **meta,
        "tokenizer": user.source,
        "eot_id": user.eot_id,
        **split_meta(reached, vocab_size, dtype, train_docs, val_docs, train_tokens, val_tokens),
        "held_out_digests": [text_digest(d.text) for d in val_docs],
    }
    atomic_save(folder / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1)))
    return _corpus(folder)


def prepare_corpus(
    source: str = "shakespeare",
    path: str | None = None,
    vocab_size: int = 4096,
    eval_fraction: float = 0.1,
    cache_dir: str | os.PathLike = "~/.cache/noloco",
    *,
    tokenizer: str | None = None,
    hf: dict | None = None,
    max_vocab: int = MAX_VOCAB,
) -> TokenizedCorpus:
    """Load, split, tokenize (training the BPE unless ``tokenizer`` is given) and cache, reusing the cache folder
    when the inputs match; a :class:`~noloco.data.stream.StreamingCorpus` for a streamed ``data.source=hf``.

    ``tokenizer``: ``data.tokenizer`` (at most ``max_vocab`` tokens: ``data.max_vocab_size``); ``hf``: the
    ``data.hf_*`` options (``data.source=hf``; the text field for ``files``): :func:`corpus_options` gives all
    three from ``cfg.data``. DataError (one line) when the settings or the data are not usable."""
    if not 0 < eval_fraction < 1:
        raise DataError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
    user = load_tokenizer(tokenizer, max_vocab) if tokenizer else None
    if user is None and not 256 < vocab_size <= MAX_VOCAB:
        raise DataError(f"data.vocab_size must be in (256, {MAX_VOCAB}], got {vocab_size}")
    streaming = bool(hf and hf.get("streaming"))
    docs = load_documents(source, path, hf)
    key = cache_key(docs, 0 if user else vocab_size, eval_fraction)
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
