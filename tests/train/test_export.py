"""``python -m noloco.export`` and ``python -m noloco.sample``: a run becomes a transformers folder that
``from_pretrained`` loads and that computes noloco's logits; sampling gives the same text from either."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from noloco import export, sample  # noqa: E402
from noloco.train import checkpoint  # noqa: E402
from noloco.train.backends.local import launch  # noqa: E402

TOL = 1e-4  # max abs logit difference, fp32


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_cache, smoke_overrides):
    """A tiny NoLoCo run of 2 workers whose slow weights differ between the workers."""
    from noloco.train.config import load_config

    root = tmp_path_factory.mktemp("export-run")
    cfg = load_config(
        [
            *smoke_overrides,
            f"data.cache_dir={data_cache}",
            f"run.dir={root}",
            "run.name=r",
            "workers=4",
            "steps=12",
            "outer.every=4",
            "log.tensorboard=false",
            "log.plot=false",
        ]
    )
    launch(cfg, quiet=True)
    return root / "r"


def test_an_exported_run_loads_with_from_pretrained_and_matches_noloco(trained_run, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    for flags, name in ((["--mean"], "mean"), (["--worker", "1"], "w1")):
        assert export.main([str(trained_run), "--out", str(tmp_path / name), *flags]) == 0
        model, cfg, *_ = export.load_run_model(trained_run, worker=1, mean=name == "mean")
        llama = LlamaForCausalLM.from_pretrained(tmp_path / name).eval()
        x = _tokens(model.cfg.vocab_size)
        with torch.no_grad():
            assert (model(x)[0] - llama(x).logits).abs().max().item() <= TOL
    info = json.loads((tmp_path / "mean" / "noloco_export.json").read_text())
    assert info["step"] == 12 and info["weights"] == "the mean of workers [0, 1, 2, 3]"
    # the mean is the mean of the workers' slow weights in the checkpoint
    folder, _, step = export.find_checkpoint(trained_run)
    slow = [checkpoint.load_worker(folder, r, step)["algorithm"]["slow"] for r in range(4)]
    assert not torch.equal(slow[0], slow[1])
    mean, *_ = export.load_run_model(trained_run, mean=True)
    flat = torch.cat([p.detach().reshape(-1) for p in mean.parameters()])
    assert torch.allclose(flat, torch.stack(slow).double().mean(0).float(), atol=1e-7)
    # the tokenizer travels with it and encodes as the run's
    run_tok = export.run_tokenizer(cfg, trained_run)
    tok = AutoTokenizer.from_pretrained(tmp_path / "mean")
    text = "To be, or not to be: that is the question."
    assert tok(text).input_ids == run_tok.tokenizer.encode(text).ids
    assert tok.eos_token == "<|endoftext|>" and len(tok) == model.cfg.vocab_size


def test_greedy_samples_are_the_same_from_the_run_and_its_export(trained_run, tmp_path, capsys):
    assert export.main([str(trained_run), "--out", str(tmp_path / "x")]) == 0
    capsys.readouterr()
    args = ["--prompt", "To be, or not", "--tokens", "12"]
    assert sample.main([str(trained_run), *args]) == 0
    from_run = capsys.readouterr().out
    assert sample.main([str(tmp_path / "x"), *args]) == 0
    from_export = capsys.readouterr().out
    assert from_run == from_export and from_run.startswith("To be, or not")
    assert sample.main([str(trained_run), *args, "--temperature", "0.9", "--top-k", "20", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("To be, or not")


def test_a_transformers_run_exports_with_save_pretrained(tiny_config, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from noloco.data.corpus import prepare_corpus

    cfg = tiny_config()
    vocab = prepare_corpus(
        cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir
    ).vocab_size
    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=vocab,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path / "llama")
    launch(
        tiny_config(
            "model.source=hf",
            f"model.hf_path={tmp_path / 'llama'}",
            "workers=2",
            "steps=6",
            "outer.every=3",
            "log.tensorboard=false",
            "log.plot=false",
            "run.name=hf",
        ),
        quiet=True,
    )
    assert export.main([str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 0
    model, *_ = export.load_run_model(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = _tokens(vocab)
    with torch.no_grad():
        assert (model(x)[0] - loaded(x).logits).abs().max().item() <= TOL


def test_export_and_sample_refuse_bad_input_with_one_line(trained_run, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    assert export.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: no such run or checkpoint"
    assert export.main([str(trained_run), "--out", str(tmp_path / "o"), "--worker", "9"]) == 2
    assert "no worker 9" in capsys.readouterr().err
    other = Tokenizer(models.BPE(vocab={"a": 0, "<|endoftext|>": 1}, merges=[]))
    other.save(str(tmp_path / "small.json"))
    assert (
        export.main([str(trained_run), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "small.json")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 2 tokens, the checkpoint's model a vocabulary of" in err[0]
    assert sample.main([str(trained_run), "--tokenizer", str(tmp_path / "small.json")]) == 2
    assert "has 2 tokens" in capsys.readouterr().err
    assert not (tmp_path / "o" / "model.safetensors").exists()
