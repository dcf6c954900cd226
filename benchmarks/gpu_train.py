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
from noloco.data.sampler import BatchSampler
from noloco.train.config import load_config
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


def noloco_run(preset: str, workers: int, compiled: bool, steps: int, every: int, run_dir: Path,
               offload: bool = False) -> dict:  # fmt: skip
    """``train.py`` itself: NoLoCo int4, ``workers`` threads on the GPU; steady-state rate from metrics.jsonl."""
    from noloco.train.backends.local import launch

    name = f"noloco-{preset}-k{workers}-{'c' if compiled else 'e'}{'-offload' if offload else ''}"
    cfg = _cfg(preset, [f"workers={workers}", f"steps={steps}", f"outer.every={every}", f"eval.every={steps}",
                        "eval.batches=2", f"compile={str(compiled).lower()}", f"run.name={name}",
                        f"outer.offload={str(offload).lower()}"], run_dir)  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    summary = launch(cfg, quiet=True)
    shutil.rmtree(Path(summary["run_dir"]) / "checkpoints", ignore_errors=True)  # 32 B/param/worker: disks fill
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rate, outer = steady_rate(records, steps, cfg.data.batch_size * cfg.data.seq_len)
    model = build_model(cfg, summary_vocab(cfg))
    label = f"noloco K={workers} ({'compiled' if compiled else 'eager'}{', outer.offload' if offload else ''})"
    row = _row(label, model, cfg, rate,
               sum(outer) / len(outer) if outer else None, torch.cuda.max_memory_allocated(), workers)  # fmt: skip
    row["final_eval_loss"] = summary["final_eval_loss"]
    row["bytes_sent_per_worker"] = summary["bytes_sent_per_worker"]
    return row


def steady_rate(records: list[dict], steps: int, tokens_per_step: int) -> tuple[float, list[float]]:
    """Summed tokens/s over the second half of the run, and the outer-step ms of that half.

    The window starts at step ``steps // 2`` (at least :data:`WARMUP`): threads compile their models one
    after another (compilation holds the GIL), and by then every worker has finished compiling and met
    its partners at an outer round, so no worker's window includes another's compilation. Each worker's
    rate is read on its own clock (``wall``) and the rates are summed.
    """
    begin = max(WARMUP, steps // 2)
    walls: dict[int, dict[int, float]] = {}
    for r in records:
        if r["step"] in (begin, steps) and "loss" in r:
            walls.setdefault(r["worker"], {})[r["step"]] = r["wall"]
    rate = sum((steps - begin) * tokens_per_step / (w[steps] - w[begin]) for w in walls.values())
    outer = [r["outer_ms"] for r in records if "outer_ms" in r and begin < r["step"] <= steps]
    return rate, outer


def outer_step_alone(preset: str, repeats: int = 6, device_messages: bool = True) -> dict:
    """NoLoCo's outer step (int4, fused exchange, error feedback, norm bound) of two workers sharing the GPU.

    Each worker holds the preset's parameters on the GPU on a stream of its own (as ``train.py`` does) and
    runs the library's ``NoLoCo``; between outer steps its weights move by a random step (no AdamW, no
    training), and one call of ``outer_step`` is timed: encode, exchange over the in-process fabric, decode,
    update of φ, momentum and the model. ``device_messages``: the fabric hands message bodies over in GPU
    memory (the default for simulated workers), else each goes through pinned host memory as on a byte
    transport. The GPU is idle otherwise; the first call (allocations) is left out.
    """
    import threading

    from noloco.comm import LocalFabric
    from noloco.optim import NoLoCo

    cfg = _cfg(preset, [], Path("/tmp"))
    vocab = summary_vocab(cfg)
    times: dict[int, list[float]] = {}
    spans: dict[int, list[tuple[float, float]]] = {}
    together = threading.Barrier(2)

    def worker(transport) -> None:
        device = torch.device("cuda")
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream), torch.no_grad():
            torch.manual_seed(cfg.run.seed)
            model = build_model(cfg, vocab).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            algo = NoLoCo(model, opt, transport, every=1, codec="int4", max_norm_ratio=10.0)
            gen = torch.Generator(device).manual_seed(transport.rank)
            spent = []
            for r in range(repeats + 1):
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, device=device, generator=gen), alpha=1e-3)
                stream.synchronize()
                together.wait()  # both workers start each round together, as in training
                started = time.perf_counter()
                algo.outer_step(r)
                stream.synchronize()
                ended = time.perf_counter()
                spent.append(1e3 * (ended - started))
                spans.setdefault(r, []).append((started, ended))
            times[transport.rank] = spent[1:]

    LocalFabric(2, device_messages=device_messages).run(worker)
    every = [t for ms in times.values() for t in ms]
    # the GPU's time per worker: both workers' outer steps share it, so a round's span over the two
    rounds = [1e3 * (max(e for _, e in m) - min(b for b, _ in m)) / 2 for r, m in spans.items() if r > 0]
    model = build_model(cfg, vocab)
    where = "GPU memory" if device_messages else "pinned host memory"
    return {
        "preset": preset,
        "label": f"outer step alone, 2 workers, messages in {where}",
        "device_messages": device_messages,
        "params": sum(p.numel() for p in model.parameters()),
        "outer_ms_mean": sum(every) / len(every),
        "outer_ms_min": min(every),
        "outer_ms_max": max(every),
        "gpu_ms_per_worker": sum(rounds) / len(rounds),
    }


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
    lines = [
        "| model | run | tokens/s | MFU | vs plain compiled | outer step ms / worker | peak GiB / worker |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next((b["tokens_per_second"] for b in rows if b["preset"] == r["preset"]
                     and b["label"] == "plain (compiled)"), None)  # fmt: skip
        ratio = f"{r['tokens_per_second'] / base:.2f}×" if base else "–"
        outer = f"{r['outer_ms']:.1f}" if r["outer_ms"] is not None else "–"
        lines.append(
            f"| {r['preset']} ({r['params'] / 1e6:.0f}M) | {r['label']} | {r['tokens_per_second']:,.0f} | "
            f"{100 * r['mfu']:.1f}% | {ratio} | {outer} | {r['peak_memory_gb_per_worker']:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="125m", help="comma-separated model presets (1.3b runs K=1 only)")
    parser.add_argument("--workers", default="1,4,8", help="K values for the noloco rows")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per worker of each noloco run")
    parser.add_argument("--plain-steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=50, help="H, inner steps between outer steps")
    parser.add_argument("--outer-only", action="store_true", help="only time the outer step alone")
    parser.add_argument(
        "--no-outer-alone",
        action="store_true",
        help="leave out the timing of the outer step alone (two workers of the preset on the GPU)",
    )
    parser.add_argument("--no-plain", action="store_true", help="leave out the plain loops (rows of an earlier run)")
    parser.add_argument("--offload", action="store_true", help="add a K=1 row with outer.offload=true per preset")
    parser.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="folder of the training runs (default <out>/runs; their checkpoints are deleted)",
    )
    common.add_out(parser, "gpu_train")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_train needs a CUDA GPU")
    run_dir = args.runs or common.out_dir(args.out) / "runs"
    rows, alone = [], []
    for preset in args.presets.split(","):
        for device_messages in () if args.no_outer_alone else (True, False):
            print(f"{time.strftime('%H:%M:%S')} {preset}: timing the outer step alone", flush=True)
            alone.append(outer_step_alone(preset, device_messages=device_messages))
            a = alone[-1]
            print(
                f"{preset}: {a['label']}: {a['outer_ms_mean']:.1f} ms per call (min {a['outer_ms_min']:.1f}, max "
                f"{a['outer_ms_max']:.1f}); GPU time per worker {a['gpu_ms_per_worker']:.1f} ms",
                flush=True,
            )
        if args.outer_only:
            continue
        ks = [1] if preset != "125m" else [int(k) for k in args.workers.split(",")]
        for mode in args.modes.split(","):
            compiled = mode == "compiled"
            if not args.no_plain:
                print(f"{time.strftime('%H:%M:%S')} {preset}: plain loop ({mode})", flush=True)
                rows.append(plain_loop(preset, compiled, args.plain_steps, run_dir))
                print("\n".join(table(rows[-1:])[2:]), flush=True)
            for k, offload in [(k, False) for k in ks] + ([(1, True)] if args.offload else []):
                print(f"{time.strftime('%H:%M:%S')} {preset}: noloco K={k} ({mode}{', offload' if offload else ''})",
                      flush=True)  # fmt: skip
                rows.append(noloco_run(preset, k, compiled, args.steps, args.every, run_dir, offload))
                print("\n".join(table(rows[-1:])[2:]), flush=True)
                torch.cuda.empty_cache()
    machine, command = common.machine(), common.command("gpu_train", argv)
    outer_lines = [
        "| model | messages in | outer step alone, ms per call (mean) | min | max | GPU ms per worker |",
        "|---|---|---|---|---|---|",
    ]
    outer_lines += [f"| {a['preset']} ({a['params'] / 1e6:.0f}M) | {'GPU' if a['device_messages'] else 'pinned host'} "
                    f"| {a['outer_ms_mean']:.1f} | {a['outer_ms_min']:.1f} | {a['outer_ms_max']:.1f} | "
                    f"{a['gpu_ms_per_worker']:.1f} |" for a in alone]  # fmt: skip
    lines = ["# Training throughput on one GPU", "", f"Machine: {machine}  ", f"Command: `{command}`", "",
             *(table(rows) if rows else []), "", *outer_lines]  # fmt: skip
    print("\n".join(lines[5:]))
    common.write_report(args.out, "gpu_train", lines, rows + alone, command=command, machine=machine)


if __name__ == "__main__":
    main()
