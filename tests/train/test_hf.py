"""Hugging Face adapters (noloco/models/hf.py, noloco/data/): a transformers model trains like noloco's LLaMA, datasets
corpora give what the files give, user tokenizers set the vocabulary, streams resume exactly. Offline:
every model, dataset and tokenizer is built here."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from noloco.data.corpus import corpus_options, load_documents, prepare_corpus  # noqa: E402
from noloco.data.documents import DataError, split_documents  # noqa: E402
from noloco.data.sampler import BatchSampler  # noqa: E402
from noloco.data.stream import StreamingCorpus, text_digest  # noqa: E402
from noloco.data.tokenizer import EOT, load_tokenizer  # noqa: E402
from noloco.models.hf import HFCausalLM, ModelError  # noqa: E402
from noloco.train.backends.local import launch  # noqa: E402
from noloco.train.cli import main  # noqa: E402
from noloco.train.config import ConfigError, load_config  # noqa: E402
from noloco.train.loop import build_model  # noqa: E402
from noloco.train.metrics import read_metrics  # noqa: E402
from noloco.train.run import load_corpus  # noqa: E402

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls sing of rivers stones and "
    "kings who ruled the northern hills in winter"
).split()


def tiny_llama(folder: Path, vocab_size: int, weights: bool = False, **overrides) -> Path:
    """A transformers LlamaConfig folder: hidden 32, 2 layers (and its random weights, ``weights=True``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        **overrides,
    )
    if weights:
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + "." for _ in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({field: text, "id": len(text)}) + "\n")
    return path


def write_parquet(path: Path, texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts, "n": [len(t) for t in texts]}), path)
    return path


def bpe_tokenizer_file(path: Path, texts: list[str], vocab_size: int = 300, eot: str = EOT) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eot], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return path


def _losses(run_dir: Path) -> dict:
    return {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(run_dir)}


def _evals(run_dir: Path, worker: int = 0) -> list[float]:
    return [r["eval_loss"] for r in read_metrics(run_dir) if r["worker"] == worker and "eval_loss" in r]


# ------------------------------------------------------------------------------------------ model


@pytest.fixture
def llama_folder(tiny_config, tmp_path):
    """A LlamaConfig folder whose vocabulary is the tiny run's tokenizer's."""
    cfg = tiny_config()
    corpus = prepare_corpus(
        cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir
    )
    return tiny_llama(tmp_path / "llama", corpus.vocab_size)


def test_a_transformers_llama_trains_with_noloco_and_lowers_the_held_out_loss(tiny_config, tmp_path, llama_folder):
    cfg = tiny_config(
        "model.source=hf",
        f"model.hf_path={llama_folder}",
        "workers=2",
        "steps=30",
        "outer.every=10",
        "inner.lr=1e-2",
        "log.tensorboard=false",
        "run.name=hf",
    )
    vocab = corpus_vocab(cfg)
    model = build_model(cfg, vocab)
    assert isinstance(model, HFCausalLM) and model.cfg.vocab_size == vocab
    named = dict(model.named_parameters(remove_duplicate=False))
    assert named["hf.lm_head.weight"] is named["hf.model.embed_tokens.weight"]  # tied: one parameter
    assert len(list(model.parameters())) == len(named) - 1
    summary = launch(cfg, quiet=True)
    assert summary["params"] == model.num_parameters()
    evals = _evals(tmp_path / "hf")
    assert evals[-1] < evals[0] - 0.5, evals
    assert summary["bytes_sent_per_worker"] > 0  # the outer exchange ran over the HF model's parameters


def corpus_vocab(cfg) -> int:
    return prepare_corpus(
        cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir
    ).vocab_size


def test_a_transformers_model_resumes_exactly(tiny_config, tmp_path, llama_folder):
    common = (
        "model.source=hf",
        f"model.hf_path={llama_folder}",
        "workers=2",
        "steps=12",
        "outer.every=4",
        "checkpoint.every=6",
        "log.tensorboard=false",
        "log.plot=false",
    )
    launch(tiny_config(*common, "run.name=full"), quiet=True)
    launch(tiny_config(*common, "run.name=killed"), quiet=True, stop_after=6)
    killed = tmp_path / "killed"
    assert main([f"resume={killed}/checkpoints/latest", "log.progress=false"]) == 0
    assert _losses(tmp_path / "full") == _losses(killed)


@pytest.mark.slow
def test_the_torch_backend_trains_a_transformers_model_as_the_local_backend_does(tiny_config, tmp_path, llama_folder):
    from noloco.train.backends.distributed import launch as launch_torch

    common = (
        "model.source=hf",
        f"model.hf_path={llama_folder}",
        "workers=2",
        "steps=6",
        "outer.every=3",
        "threads=1",
        "log.tensorboard=false",
        "log.plot=false",
    )
    a = launch(tiny_config(*common, "run.name=local"), quiet=True)
    b = launch_torch(tiny_config(*common, "backend=torch", "run.name=torch"), quiet=True)
    assert _losses(tmp_path / "local") == _losses(tmp_path / "torch")
    assert a["final_eval_loss_per_worker"] == b["final_eval_loss_per_worker"]


def test_pretrained_weights_are_loaded_and_continued(tiny_config, tmp_path):
    from transformers import AutoModelForCausalLM

    vocab = corpus_vocab(tiny_config())
    folder = tiny_llama(tmp_path / "pre", vocab, weights=True)
    cfg = tiny_config("model.source=hf", f"model.hf_path={folder}")
    model = build_model(cfg, vocab)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.hf.parameters(), reference.parameters()))
    fresh = build_model(tiny_config("model.source=hf", f"model.hf_path={folder}", "model.hf_weights=false"), vocab)
    assert not torch.equal(fresh.hf.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    with pytest.raises(ModelError, match="embedding has"):  # a tokenizer larger than the pretrained embedding
        build_model(cfg, vocab + 1)


def test_the_same_seed_builds_the_same_transformers_model(tiny_config, llama_folder):
    cfg = tiny_config("model.source=hf", f"model.hf_path={llama_folder}")
    a, b = build_model(cfg, 300), build_model(cfg, 300)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model(tiny_config("model.source=hf", f"model.hf_path={llama_folder}", "run.seed=1"), 300)
    assert not torch.equal(a.hf.model.embed_tokens.weight, c.hf.model.embed_tokens.weight)
    assert a.hf.model.embed_tokens.weight.shape == (300, 32)  # the embedding follows the tokenizer


def test_a_model_folder_without_config_json_is_one_line_at_start_up(tiny_overrides, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([*tiny_overrides, "model.source=hf", f"model.hf_path={tmp_path / 'empty'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: model.hf_path='{tmp_path / 'empty'}': no config.json in it "
        "(write one with config.save_pretrained(DIR))"
    ]
    assert main([*tiny_overrides, "model.source=hf"]) == 2
    assert "needs model.hf_path" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- data


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_hf_files_give_the_same_first_batches_as_data_source_files(tmp_path, kind):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        texts = documents(6, seed=i)
        if kind == "jsonl":
            write_jsonl(folder / f"part{i}.jsonl", texts)
        else:
            write_parquet(folder / f"part{i}.parquet", texts)
    pattern = str(folder / f"*.{kind}")
    common = ["data.vocab_size=400", "data.eval_fraction=0.2"]
    files = load_config([*common, "data.source=files", f"data.path={pattern}", f"data.cache_dir={tmp_path}/a"])
    builder = "json" if kind == "jsonl" else "parquet"
    hf = load_config(
        [
            *common,
            "data.source=hf",
            f"data.hf_path={builder}",
            f"data.hf_files={pattern}",
            f"data.cache_dir={tmp_path}/b",
        ]
    )
    corpora = [load_corpus(c) for c in (files, hf)]
    a, b = corpora
    assert a.tokenizer_path != b.tokenizer_path  # built independently, each in its own cache
    assert a.tokenizer().to_str() == b.tokenizer().to_str()
    assert (a.train_documents, a.val_documents) == (b.train_documents, b.val_documents) == (19, 5)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    for step in (1, 2, 3):
        for worker in (0, 1):
            xa, ya = BatchSampler(a.train, 32, 4, seed=0).batch(worker, step)
            xb, yb = BatchSampler(b.train, 32, 4, seed=0).batch(worker, step)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_hf_reads_compressed_json_lines_and_another_text_field(tmp_path):
    write_jsonl(tmp_path / "a.jsonl.gz", documents(8), field="body")
    cfg = load_config(
        [
            "data.source=hf",
            "data.hf_path=json",
            f"data.hf_files={tmp_path}/*.jsonl.gz",
            "data.text_field=body",
            "data.vocab_size=300",
            f"data.cache_dir={tmp_path}/c",
        ]
    )
    corpus = prepare_corpus(cfg.data.source, cfg.data.path, 300, 0.2, cfg.data.cache_dir, **corpus_options(cfg.data))
    assert corpus.train_documents + corpus.val_documents == 8
    assert corpus.tokenizer().decode(corpus.val.tolist()).replace(EOT, "").strip()


def test_a_dataset_without_the_text_field_is_one_line(tiny_overrides, tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", documents(4), field="content")
    args = [*tiny_overrides, "data.source=hf", "data.hf_path=json", f"data.hf_files={tmp_path}/a.jsonl"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: data.hf_path='json': no 'text' field (fields: content, id); set data.text_field"
    with pytest.raises(ConfigError, match="matches no file"):
        load_config(["data.source=hf", "data.hf_path=json", f"data.hf_files={tmp_path}/none*.jsonl"])
    with pytest.raises(DataError, match="cannot load the dataset"):  # a hub name, offline
        prepare_corpus("hf", None, 300, 0.1, tmp_path / "c", hf={"path": "nobody/no-such-dataset"})


# -------------------------------------------------------------------------------------- tokenizer


def test_a_tokenizer_file_sets_the_vocabulary_and_the_embedding(tiny_config, tmp_path, llama_folder):
    texts = documents(30)
    path = bpe_tokenizer_file(tmp_path / "tok.json", texts, vocab_size=333)
    write_jsonl(tmp_path / "a.jsonl", texts)
    cfg = tiny_config("data.source=files", f"data.path={tmp_path}/a.jsonl", f"data.tokenizer={path}")
    corpus = load_corpus(cfg)
    user = load_tokenizer(path)
    assert corpus.vocab_size == user.vocab_size == 333 != cfg.data.vocab_size
    assert build_model(cfg, corpus.vocab_size).embed.weight.shape[0] == 333
    hf_cfg = tiny_config("model.source=hf", f"model.hf_path={llama_folder}", f"data.tokenizer={path}")
    assert build_model(hf_cfg, corpus.vocab_size).embed.weight.shape[0] == 333
    train_docs, _ = split_documents(load_documents("files", f"{tmp_path}/a.jsonl"), cfg.data.eval_fraction)
    expected = [i for d in train_docs for i in [*user.tokenizer.encode(d.text).ids, user.eot_id]]
    assert corpus.train.tolist() == expected  # each document, then the tokenizer's end-of-text


def test_a_transformers_tokenizer_folder_adds_no_special_tokens_inside_documents(tmp_path):
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    texts = documents(10)
    tok = Tokenizer.from_file(str(bpe_tokenizer_file(tmp_path / "t.json", texts, 320, eot="</s>")))
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path / "tf")
    assert tok.encode("the fox").ids[0] == bos  # its post-processor adds a BOS ...
    write_jsonl(tmp_path / "a.jsonl", texts)
    corpus = prepare_corpus(
        "files", str(tmp_path / "a.jsonl"), 300, 0.2, tmp_path / "c", tokenizer=str(tmp_path / "tf")
    )
    assert corpus.vocab_size == 321
    assert bos not in set(corpus.train.tolist())  # ... which the corpus does not take
    assert int((corpus.train == tok.token_to_id("</s>")).sum()) == corpus.train_documents


def test_a_tokenizer_that_does_not_match_the_checkpoint_is_refused(tiny_config, tiny_overrides, tmp_path, capsys):
    path = bpe_tokenizer_file(tmp_path / "tok.json", documents(40), vocab_size=300)
    launch(
        tiny_config(
            "steps=4", "outer.every=2", "checkpoint.every=2", "run.name=r", "log.tensorboard=false", "log.plot=false"
        ),
        quiet=True,
        stop_after=2,
    )
    assert main([f"resume={tmp_path}/r/checkpoints/latest", f"data.tokenizer={path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "vocabulary" in err[0], err
    with pytest.raises(DataError, match="no end-of-text token"):
        load_tokenizer(bpe_tokenizer_file(tmp_path / "odd.json", documents(5), 300, eot="[END]"))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(DataError, match="not a tokenizers JSON file"):
        load_tokenizer(tmp_path / "junk.json")


# -------------------------------------------------------------------------------------- streaming


@pytest.fixture
def stream_files(tmp_path):
    folder = tmp_path / "stream"
    folder.mkdir()
    for i in range(4):
        write_jsonl(folder / f"shard{i}.jsonl", documents(25, seed=10 + i))
    return folder


def _stream_corpus(stream_files, tmp_path, sample=30) -> StreamingCorpus:
    cfg = load_config(
        [
            "data.source=hf",
            "data.hf_path=json",
            f"data.hf_files={stream_files}/*.jsonl",
            "data.streaming=true",
            f"data.stream_sample={sample}",
            "data.vocab_size=300",
            f"data.cache_dir={tmp_path}/cache",
        ]
    )
    corpus = load_corpus(cfg)
    assert isinstance(corpus, StreamingCorpus)
    return corpus


def test_a_stream_resumes_exactly_where_its_position_was_saved(stream_files, tmp_path):
    corpus = _stream_corpus(stream_files, tmp_path)
    sampler = corpus.sampler(1, 2, 16, 4)
    for step in range(1, 6):
        sampler.batch(1, step)
    state = json.loads(json.dumps(sampler.state_dict()))  # JSON-able, as a checkpoint stores it
    expected = [sampler.batch(1, step) for step in range(6, 300)]  # past the end of the shard: a second epoch
    assert sampler.epoch >= 1
    resumed = corpus.sampler(1, 2, 16, 4)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (resumed.batch(1, step) for step in range(6, 300))):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ValueError, match="worker 1 of 2"):
        corpus.sampler(0, 2, 16, 4).load_state_dict(state)


def test_stream_workers_read_their_own_shards_and_skip_the_held_out_documents(stream_files, tmp_path):
    corpus = _stream_corpus(stream_files, tmp_path, sample=100)  # the whole stream: every document's split known
    tok = corpus.tokenizer()
    rows = [json.loads(line) for f in sorted(stream_files.glob("*.jsonl")) for line in f.read_text().splitlines()]
    held = {row["text"] for row in rows if text_digest(row["text"]) in corpus.held_out}
    assert held and corpus.val_documents == len(held)
    texts = []
    for rank in (0, 1):
        sampler = corpus.sampler(rank, 2, 31, 2)
        ids = torch.cat([sampler.batch(rank, s)[0].flatten() for s in range(1, 30)]).tolist()
        texts.append(tok.decode(ids))
        assert sampler.epoch == 0
    assert texts[0][:200] != texts[1][:200]
    for text in held:
        assert all(text[:120] not in t for t in texts)  # no held-out document is trained on


def test_streaming_trains_on_the_local_backend(stream_files, tiny_config, tmp_path):
    cfg = tiny_config(
        "data.source=hf",
        "data.hf_path=json",
        f"data.hf_files={stream_files}/*.jsonl",
        "data.streaming=true",
        "data.stream_sample=40",
        "data.vocab_size=300",
        "workers=2",
        "steps=20",
        "outer.every=5",
        "log.tensorboard=false",
        "run.name=s",
    )
    summary = launch(cfg, quiet=True)
    evals = _evals(tmp_path / "s")
    assert evals[-1] < evals[0], evals
    assert summary["workers"] == 2
