import numpy as np
import pytest
import torch

from noloco.data.corpus import load_documents, prepare_corpus
from noloco.data.documents import DataError, Document, split_documents
from noloco.data.sampler import BatchSampler, eval_batches


def test_default_corpus_is_real_shakespeare():
    docs = load_documents("shakespeare")
    assert len(docs) == 42
    assert sum(len(d.text) for d in docs) > 4_000_000
    assert any("HAMLET" in d.text for d in docs)


def test_split_is_by_document_and_deterministic():
    docs = [Document(f"doc{i}", f"text {i} " * 50) for i in range(40)]
    train, held = split_documents(docs, 0.1)
    assert len(held) == 4 and len(train) == 36
    assert not {d.name for d in train} & {d.name for d in held}
    assert split_documents(list(reversed(docs)), 0.1)[1][0].name in {d.name for d in held}


def test_user_text_files_work_and_cache_is_reused(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.txt").write_text(f"The quick brown fox {i} jumps over the lazy dog. " * 200)
    first = prepare_corpus("files", str(folder), vocab_size=300, eval_fraction=0.2, cache_dir=tmp_path / "c")
    second = prepare_corpus("files", str(folder), vocab_size=300, eval_fraction=0.2, cache_dir=tmp_path / "c")
    assert first.train_documents == 4 and first.val_documents == 1
    assert np.array_equal(first.train, second.train)
    text = first.tokenizer().decode(first.val[:12].tolist())
    assert "quick brown fox" in text


def test_missing_files_fail_clearly(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        prepare_corpus("files", str(tmp_path / "nothing*.txt"), cache_dir=tmp_path)
    with pytest.raises(DataError, match="unknown data.source"):
        prepare_corpus("wikipedia", cache_dir=tmp_path)


def test_batches_are_a_pure_function_of_worker_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    sampler = BatchSampler(tokens, seq_len=16, batch_size=4, seed=0)
    x, y = sampler.batch(1, 7)
    assert torch.equal(x, sampler.batch(1, 7)[0])
    assert not torch.equal(x, sampler.batch(2, 7)[0])
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_eval_batches_are_fixed():
    tokens = np.arange(5_000, dtype=np.uint16)
    a, b = eval_batches(tokens, 16, 4, 3), eval_batches(tokens, 16, 4, 3)
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
