"""Training throughput on one GPU: a plain loop against ``train.py``'s NoLoCo with K workers sharing the GPU.

    python -m benchmarks.gpu_train                                   # 125M: plain loop, K = 1, 4, 8; eager and compiled
    python -m benchmarks.gpu_train --presets 125m,1.3b --out docs/results

Rows (docs/design.md §8; vocab 32k, sequence 1024, batch 16, bf16 autocast with fp32 master weights,
fused AdamW, SDPA, the bundled Shakespeare corpus):

- ``plain``: the model alone in a loop (no noloco): forward, backward, clip, fused AdamW step; the loss
  read every 10 steps, as noloco's loop does;
- ``noloco K=k``: ``train.py`` on the local backend, NoLoCo with an int4 fused exchange every H = 50
  steps, k simulated workers as threads sharing the GPU (evaluation only at the end).

Tokens/s are steady-state: measured after the first 10 steps (compilation, allocator warm-up) and summed
over the workers; MFU counts ``6N + 12·layers·dim·seq`` FLOPs per token (:mod:`noloco.train.device`)
against 790 TFLOP/s (measured dense bf16 on an H200); ``outer ms`` is the mean wall time of an outer step
(encode, exchange over the in-process fabric, decode, update) per worker; peak memory is the process's
peak allocated memory divided by the workers sharing it. Writes ``gpu_train.md`` and ``gpu_train.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from benchmarks import common
from noloco.train.config import load_config
from noloco.train.data import BatchSampler
from noloco.train.device import flops_per_token, peak_tflops
from noloco.train.loop import build_inner_optimizer, build_model
from noloco.train.run import load_corpus

SHAPE = ("data.vocab_size=32000", "data.seq_len=1024", "data.batch_size=16")
WARMUP = 10


def _cfg(preset: str, extra: list[str], run_dir: Path):
    return load_config([f"model.preset={preset}", *SHAPE, "device=cuda", "precision=bf16", "log.tensorboard=false",
                        "log.plot=false", "log.progress=false", f"run.dir={run_dir}", *extra])  # fmt: skip


def plain_loop(preset: str, compiled: bool, steps: int, run_dir: Path) -> dict:
    """The same model, data and optimizer with no noloco in the way."""
    cfg = _cfg(preset, [], run_dir)
    corpus = load_corpus(cfg)
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg, corpus.vocab_size).to(device)
    opt, _ = build_inner_optimizer(cfg, model)
    forward = torch.compile(model) if compiled else model
    sampler = BatchSampler(corpus.train, cfg.data.seq_len, cfg.data.batch_size, cfg.run.seed)
    losses, started = [], None
    for step in range(1, steps + 1):
        if step == WARMUP + 1:
            torch.cuda.synchronize()
            started = time.perf_counter()
        x, y = (t.to(device, non_blocking=True) for t in sampler.batch(0, step))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % 10 == 0:
            torch.stack(losses).tolist()
            losses.clear()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = (steps - WARMUP) * cfg.data.batch_size * cfg.data.seq_len
    return _row(f"plain ({'compiled' if compiled else 'eager'})", model, cfg, tokens / seconds, None,
                torch.cuda.max_memory_allocated(), 1)  # fmt: skip


def noloco_run(preset: str, workers: int, compiled: bool, steps: int, every: int, run_dir: Path) -> dict:
    """``train.py`` itself: NoLoCo int4, ``workers`` threads on the GPU; steady-state rate from metrics.jsonl."""
    from noloco.train.backends.local import launch

    name = f"noloco-{preset}-k{workers}-{'c' if compiled else 'e'}"
    cfg = _cfg(preset, [f"workers={workers}", f"steps={steps}", f"outer.every={every}", f"eval.every={steps}",
                        "eval.batches=2", f"compile={str(compiled).lower()}", f"run.name={name}"], run_dir)  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    summary = launch(cfg, quiet=True)
    shutil.rmtree(Path(summary["run_dir"]) / "checkpoints", ignore_errors=True)  # 32 B/param/worker: disks fill
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    walls = {}
    for r in records:
        if r["step"] in (WARMUP, steps):
            walls.setdefault(r["step"], []).append(r["wall"])
    seconds = max(walls[steps]) - min(walls[WARMUP])
    tokens = workers * (steps - WARMUP) * cfg.data.batch_size * cfg.data.seq_len
    outer = [r["outer_ms"] for r in records if "outer_ms" in r]
    model = build_model(cfg, summary_vocab(cfg))
    row = _row(f"noloco K={workers} ({'compiled' if compiled else 'eager'})", model, cfg, tokens / seconds,
               sum(outer) / len(outer) if outer else None, torch.cuda.max_memory_allocated(), workers)  # fmt: skip
    row["final_eval_loss"] = summary["final_eval_loss"]
    row["bytes_sent_per_worker"] = summary["bytes_sent_per_worker"]
    return row


def summary_vocab(cfg) -> int:
    return load_corpus(cfg).vocab_size


def _row(label: str, model, cfg, rate: float, outer_ms: float | None, peak_bytes: int, workers: int) -> dict:
    params = sum(p.numel() for p in model.parameters())
    flops = flops_per_token(params, model.embed.weight.numel(), model.cfg.n_layers, model.cfg.dim, cfg.data.seq_len)
    peak = peak_tflops(torch.device("cuda"), None) or 790.0
    return {"preset": cfg.model.preset, "label": label, "params": params, "tokens_per_second": rate,
            "mfu": rate * flops / (peak * 1e12), "outer_ms": outer_ms,
            "peak_memory_gb_per_worker": peak_bytes / 2**30 / workers}  # fmt: skip


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | run | tokens/s | MFU | vs plain compiled | outer step ms / worker | peak GiB / worker |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b["tokens_per_second"] for b in rows if b["preset"] == r["preset"]
                     and b["label"] == "plain (compiled)"), None)  # fmt: skip
        ratio = f"{r['tokens_per_second'] / base:.2f}×" if base else "–"
        outer = f"{r['outer_ms']:.1f}" if r["outer_ms"] is not None else "–"
        lines.append(f"| {r['preset']} ({r['params'] / 1e6:.0f}M) | {r['label']} | {r['tokens_per_second']:,.0f} | "
                     f"{100 * r['mfu']:.1f}% | {ratio} | {outer} | {r['peak_memory_gb_per_worker']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="125m", help="comma-separated model presets (1.3b runs K=1 only)")
    parser.add_argument("--workers", default="1,4,8", help="K values for the noloco rows")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--steps", type=int, default=100, help="inner steps per worker of each noloco run")
    parser.add_argument("--plain-steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=50, help="H, inner steps between outer steps")
    common.add_out(parser, "gpu_train")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_train needs a CUDA GPU")
    run_dir = common.out_dir(args.out) / "runs"
    rows = []
    for preset in args.presets.split(","):
        ks = [1] if preset != "125m" else [int(k) for k in args.workers.split(",")]
        for mode in args.modes.split(","):
            compiled = mode == "compiled"
            rows.append(plain_loop(preset, compiled, args.plain_steps, run_dir))
            print("\n".join(table(rows[-1:])[2:]), flush=True)
            for k in ks:
                rows.append(noloco_run(preset, k, compiled, args.steps, args.every, run_dir))
                print("\n".join(table(rows[-1:])[2:]), flush=True)
                torch.cuda.empty_cache()
    machine, command = common.machine(), common.command("gpu_train", argv)
    lines = ["# Training throughput on one GPU", "", f"Machine: {machine}  ", f"Command: `{command}`", "",
             *table(rows)]  # fmt: skip
    print("\n".join(table(rows)))
    common.write_report(args.out, "gpu_train", lines, rows, command=command, machine=machine)


if __name__ == "__main__":
    main()
