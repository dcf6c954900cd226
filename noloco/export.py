"""Export a run's model as a transformers folder: ``python -m noloco.export runs/<run> --out exported/``.

The weights are the slow weights φ of one worker (``--worker``, default 0) or their mean over the
workers (``--mean``) in the run's latest complete checkpoint (or the checkpoint folder given); a DDP
run has no slow weights and exports its model weights. noloco's own LLaMA becomes a
``LlamaForCausalLM`` (config.json + model.safetensors, :mod:`noloco.models.convert`) that computes the
same logits. A ``model.source=hf`` model is written with its own ``save_pretrained``, through the
:class:`~noloco.models.hf.HFCausalLM` that wraps it. The tokenizer goes beside it (``tokenizer.json``,
``tokenizer_config.json``), so ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` load the pair.

Which tokenizer: ``--tokenizer``, else ``<run>/tokenizer.json`` if the run has one, else the run's
``data.tokenizer``, else the run's data cache (the corpus is looked up again; its tokens are cached).
Its vocabulary must be the checkpoint's. Exit status 0, or 2 with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from noloco.data.documents import DataError
from noloco.data.tokenizer import load_tokenizer
from noloco.data.tokens import corpus_tokenizer
from noloco.models.convert import save_llama
from noloco.models.hf import HFCausalLM, ModelError, transformers_module
from noloco.models.llama import LLaMA
from noloco.train import checkpoint
from noloco.train.config import ConfigError, default_config


class ExportError(ValueError):
    """What cannot be exported; one line for the user."""


ERRORS = (ExportError, ConfigError, DataError, ModelError, checkpoint.CheckpointError)


# ------------------------------------------------------------------------------- reading a run


def find_checkpoint(path) -> tuple[Path, Path, int]:
    """(checkpoint folder, run folder, step) of a run folder (its latest checkpoint) or a checkpoint path."""
    given = Path(path).expanduser()
    if not given.exists() and not given.is_symlink():
        raise ExportError(f"{path}: no such run or checkpoint")
    return checkpoint.resolve(given, key=None)


def run_config(folder: Path) -> DictConfig:
    """The checkpoint's config over the defaults (not validated: the run's data need not be here)."""
    saved = folder / "config.yaml"
    if not saved.is_file():
        raise checkpoint.CheckpointError(f"{saved}: missing: the checkpoint is damaged")
    try:
        loaded = OmegaConf.load(saved)
    except Exception as exc:  # noqa: BLE001 - yaml errors of every kind
        raise checkpoint.CheckpointError(f"{saved}: cannot parse: {str(exc).splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise checkpoint.CheckpointError(f"{saved}: not a mapping of config keys")
    try:
        return OmegaConf.merge(default_config(), loaded)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise checkpoint.CheckpointError(f"{saved}: '{key}': {str(exc).splitlines()[0]}") from None


def build(cfg: DictConfig, vocab: int) -> torch.nn.Module:
    """One model of the run (its size checked against ``model.max_memory_gb`` for one model, not every worker's)."""
    from noloco.train.loop import build_model

    one = cfg.copy()
    one.workers = 1
    return build_model(one, vocab)


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]  # the order of the algorithms' flat vectors


def worker_weights(folder: Path, step: int, rank: int, model: torch.nn.Module, initial) -> torch.Tensor:
    """Worker ``rank``'s slow weights (a DDP run: its model weights) as one flat fp32 vector in
    ``model.parameters()`` order; ``model`` is one the run built (its buffers are loaded on the way);
    ``initial()``: the seed's initial weights (flat), for a checkpoint that stores φ = φ₀ as a marker."""
    from torch.nn.utils import parameters_to_vector

    state = checkpoint.load_worker(folder, rank, step)
    algo, weights = state.get("algorithm") or {}, state.get("model")
    if isinstance(weights, dict) and checkpoint.REBUILT in weights:
        model.load_state_dict(weights.get("buffers") or {}, strict=False)
    elif isinstance(weights, dict):
        try:
            model.load_state_dict(weights)
        except RuntimeError as exc:
            reason = str(exc)[:200]
            raise checkpoint.CheckpointError(f"{folder}/worker_{rank}: not this run's model ({reason})") from None
    slow = algo.get("slow")
    if isinstance(slow, dict):  # φ = φ₀ (no outer step has changed it): the stored or the seed's initial weights
        reference = algo.get("reference")
        slow = reference if isinstance(reference, torch.Tensor) else initial()
    if slow is None:  # DDP: the model weights
        if not isinstance(weights, dict) or checkpoint.REBUILT in weights:
            raise checkpoint.CheckpointError(f"{folder}/worker_{rank}: holds neither slow nor model weights")
        slow = parameters_to_vector(_trainable(model)).detach().float()
    expected = sum(p.numel() for p in _trainable(model))
    if not isinstance(slow, torch.Tensor) or slow.numel() != expected:
        raise checkpoint.CheckpointError(f"{folder}/worker_{rank}: its slow weights are not {expected} numbers")
    return slow.float()


def load_run_model(path, worker: int | None = 0, mean: bool = False):
    """(model holding the chosen weights, config, run folder, checkpoint folder, step, which weights) of a run."""
    from torch.nn.utils import parameters_to_vector

    from noloco.optim.algorithms import copy_flat_into

    folder, run_dir, step = find_checkpoint(path)
    cfg = run_config(folder)
    ranks = checkpoint.worker_ranks(folder)
    if not ranks:
        raise checkpoint.CheckpointError(f"{folder} holds no worker state")
    vocab = checkpoint.checkpoint_vocab_size(folder)
    if vocab is None:
        raise checkpoint.CheckpointError(f"{folder}: cannot tell its models' vocabulary")
    model = build(cfg, vocab)
    seed_init = parameters_to_vector(_trainable(model)).detach().float().clone()  # built from run.seed: φ₀
    initial = lambda: seed_init
    if mean:
        total = None
        for rank in ranks:
            flat = worker_weights(folder, step, rank, model, initial).double()
            total = flat if total is None else total + flat
        flat, what = (total / len(ranks)).float(), f"the mean of workers {ranks}"
    else:
        rank = ranks[0] if worker is None else worker
        if rank not in ranks:
            raise ExportError(f"{folder}: no worker {rank} (workers: {ranks})")
        flat, what = worker_weights(folder, step, rank, model, initial), f"worker {rank}"
    copy_flat_into(flat, _trainable(model))
    model.eval()
    return model, cfg, run_dir, folder, step, what


def run_tokenizer(cfg: DictConfig, run_dir: Path, override=None):
    """The tokenizer the run trained with (see the module docstring for where it is looked for)."""
    bound = cfg.data.max_vocab_size
    if override:
        return load_tokenizer(override, bound)
    if (run_dir / "tokenizer.json").is_file():
        return load_tokenizer(run_dir / "tokenizer.json", bound)
    if cfg.data.get("tokenizer"):
        return load_tokenizer(cfg.data.tokenizer, bound)
    from noloco.train.run import load_corpus

    try:
        corpus = load_corpus(cfg)
    except DataError as exc:
        raise ExportError(f"cannot find the run's tokenizer ({exc}); pass --tokenizer") from None
    return corpus_tokenizer(corpus)


def check_vocab(tokenizer, vocab: int) -> None:
    if tokenizer.vocab_size != vocab:
        raise ExportError(f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size} tokens, the checkpoint's "
                          f"model a vocabulary of {vocab}")  # fmt: skip


# ------------------------------------------------------------------------------------- writing


def save_tokenizer(tokenizer, out: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (a transformers tokenizer folder keeps its own files)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = Path(str(tokenizer.source)).expanduser()
    if source.is_dir():
        AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
        return
    eot = tokenizer.tokenizer.id_to_token(tokenizer.eot_id)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, eos_token=eot, bos_token=eot).save_pretrained(out)


def export(path, out, worker: int | None = 0, mean: bool = False, tokenizer=None) -> dict:
    """Write the transformers folder ``out`` for the run or checkpoint ``path``; returns what was written."""
    transformers_module("noloco.export")
    model, cfg, run_dir, folder, step, what = load_run_model(path, worker, mean)
    vocab = model.cfg.vocab_size
    tok = run_tokenizer(cfg, run_dir, tokenizer)
    check_vocab(tok, vocab)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, HFCausalLM):
        model.hf.config.use_cache = True
        model.hf.save_pretrained(out)
    elif isinstance(model, LLaMA):
        save_llama(model, out, tok.eot_id)
    else:
        raise ExportError(f"cannot export a {type(model).__name__}")
    save_tokenizer(tok, out)
    info = {"run": str(run_dir), "checkpoint": str(folder), "step": step, "weights": what, "vocab_size": vocab,
            "model": "hf" if isinstance(model, HFCausalLM) else "noloco-llama"}  # fmt: skip
    (out / "noloco_export.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m noloco.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("run", help="a run folder (its latest checkpoint) or a checkpoint folder")
    parser.add_argument("--out", required=True, help="the transformers folder to write")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--worker", type=int, default=0, help="export this worker's slow weights (default 0)")
    which.add_argument("--mean", action="store_true", help="export the mean of every worker's slow weights")
    parser.add_argument("--tokenizer", help="a tokenizers JSON file or tokenizer folder (default: the run's)")
    args = parser.parse_args(argv)
    try:
        info = export(args.run, args.out, args.worker, args.mean, args.tokenizer)
    except ERRORS as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    print(f"exported {info['weights']} of {info['checkpoint']} (step {info['step']}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
