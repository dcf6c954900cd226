"""Sample text from a run or an exported folder: ``python -m noloco.sample runs/<run> --prompt "To be, or not"``.

``PATH`` is a run folder (its latest checkpoint), a checkpoint folder, or a transformers folder
(``python -m noloco.export`` writes one; any causal LM folder with a ``tokenizer.json`` works). From a
run the weights are a worker's slow weights (``--worker``, default 0) or their mean (``--mean``), as
``noloco.export`` would export them. ``--temperature 0`` (the default) is greedy decoding; above 0 it
samples from the softmax at that temperature (``--top-k`` keeps the k likeliest tokens; ``--seed``).
Generation stops after ``--tokens`` tokens or at the end-of-text token. Exit status 0, or 2 with one
``error:`` line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from noloco.data.tokenizer import load_tokenizer
from noloco.export import ERRORS, ExportError, check_vocab, load_run_model, run_tokenizer
from noloco.models.hf import transformers_module


def is_exported(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "checkpoints").is_dir()


def load(path, worker: int = 0, mean: bool = False, tokenizer=None):
    """(logits function of token ids (1, T) -> (1, T, V), tokenizer, context length) of a run or a folder."""
    folder = Path(path).expanduser()
    if is_exported(folder):
        transformers = transformers_module("sampling from a transformers folder")
        try:
            auto = transformers.AutoModelForCausalLM
            model = auto.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise ExportError(f"{path}: not a transformers causal LM folder ({reason})") from None
        tok = load_tokenizer(tokenizer or folder)
        rows = model.get_input_embeddings().weight.shape[0]
        if tok.vocab_size > rows:
            raise ExportError(f"the tokenizer has {tok.vocab_size} tokens, the model's embedding {rows} rows")
        context = getattr(model.config, "max_position_embeddings", None) or 1024
        model.eval()
        return (lambda ids: model(input_ids=ids, use_cache=False).logits), tok, context
    model, cfg, run_dir, _, _, _ = load_run_model(folder, worker, mean)
    tok = run_tokenizer(cfg, run_dir, tokenizer)
    check_vocab(tok, model.cfg.vocab_size)
    context = model.cfg.max_seq_len or cfg.data.seq_len
    return (lambda ids: model(ids)[0]), tok, context


@torch.no_grad()
def generate(logits_of, prompt_ids: list[int], tokens: int, context: int, vocab: int, eot_id: int | None = None,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0) -> list[int]:  # fmt: skip
    """The ids after ``prompt_ids``: greedy (``temperature`` 0) or sampled; stops at ``eot_id``."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.long)
        logits = logits_of(window)[0, -1, :vocab].float()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            if top_k:
                cut = torch.topk(logits, min(top_k, vocab)).values[-1]
                logits = logits.masked_fill(logits < cut, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        if token == eot_id:
            break
        ids.append(token)
        out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m noloco.sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("path", help="a run folder, a checkpoint folder or a transformers folder")
    parser.add_argument("--prompt", default="", help="the text to continue (default: none, start a document)")
    parser.add_argument("--tokens", type=int, default=100, help="most tokens to generate (default 100)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--worker", type=int, default=0, help="from a run: this worker's slow weights (default 0)")
    which.add_argument("--mean", action="store_true", help="from a run: the mean of the workers' slow weights")
    parser.add_argument("--tokenizer", help="a tokenizers JSON file or tokenizer folder (default: the run's)")
    args = parser.parse_args(argv)
    if args.tokens < 0 or args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        parser.error("--tokens and --temperature must be >= 0, --top-k >= 1")
    try:
        logits_of, tok, context = load(args.path, args.worker, args.mean, args.tokenizer)
        prompt = tok.tokenizer.encode(args.prompt, add_special_tokens=False).ids if args.prompt else []
        start = prompt or [tok.eot_id]  # no prompt: what follows the end of a document
        ids = generate(logits_of, start, args.tokens, context, tok.vocab_size, tok.eot_id, args.temperature,
                       args.top_k, args.seed)  # fmt: skip
    except ERRORS as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    print(args.prompt + tok.tokenizer.decode(ids), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
