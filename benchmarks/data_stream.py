"""The streaming data path (``data.streaming=true``) against the cached token files, on the same text (issue 16).

The text is the bundled Shakespeare written as four gzipped JSON-lines shards (as docs/your-model-and-data.md
does). Two measurements:

1. **the data path alone**: batches of the default shape (8 × 128 tokens) drawn by one worker of four, in this
   process, with ``--threads`` torch threads: ``BatchSampler`` over the memory-mapped token files of
   ``data.source=hf`` (tokenized ahead) against ``StreamSampler`` of ``data.streaming=true``, and the stream's
   parts timed apart: reading its rows through ``datasets`` (gzip, JSON, Arrow, Python iteration), the
   held-out check (a BLAKE2 digest of each document) and tokenizing (``tokenizers``, Rust);
2. **real runs**: ``python train.py`` with the default config (4 workers on the local backend, the default
   model) for ``--steps`` steps, once on each path; tokens/s from their ``summary.json``.

The stream is not the bottleneck when one worker's stream makes batches much faster than a worker trains
(the run's tokens/s divided by its workers).

    python -m benchmarks.data_stream [--steps 30] [--batches 500] [--out DIR]   # DIR: runs/benchmarks/data_stream/
    python -m benchmarks.data_stream --out docs/results               # the committed docs/results/data_stream.*
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/data_stream.py`: rerun as `python -m benchmarks.data_stream`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.data_stream", *sys.argv[1:]])

import torch

from benchmarks import common

NAME = "data_stream"
WORKERS = 4  # the default run's


def write_shards(folder: Path, shards: int = 4) -> list[Path]:
    """The bundled Shakespeare as ``shards`` gzipped jsonl files, document ``i`` in shard ``i % shards``."""
    import datasets
    from datasets import Dataset

    from noloco.data.corpus import load_documents

    datasets.disable_progress_bars()
    folder.mkdir(parents=True, exist_ok=True)
    docs = load_documents("shakespeare")
    paths = []
    for i in range(shards):
        path = folder / f"part{i}.jsonl.gz"
        Dataset.from_dict({"text": [d.text for d in docs[i::shards]]}).to_json(str(path), compression="gzip")
        paths.append(path)
    return paths


def overrides(folder: Path, cache: Path, streaming: bool) -> list[str]:
    return ["data.source=hf", "data.hf_path=json", f"data.hf_files={folder}/*.jsonl.gz", "data.text_field=text",
            f"data.streaming={str(streaming).lower()}", f"data.cache_dir={cache}"]  # fmt: skip


def _rate(tokens: int, seconds: float) -> float:
    return tokens / max(seconds, 1e-9)


def data_path(folder: Path, cache: Path, batches: int) -> dict:
    """Tokens/s of one worker's batches on each path, and the stream's parts timed apart."""
    from noloco.data.hf import check_text_field, dataset_rows, open_dataset
    from noloco.data.sampler import BatchSampler
    from noloco.data.stream import text_digest
    from noloco.train.config import load_config
    from noloco.train.run import load_corpus

    out: dict = {}
    cfg = load_config(overrides(folder, cache, streaming=False))
    seq, batch, seed = cfg.data.seq_len, cfg.data.batch_size, cfg.run.seed
    tokens = batches * batch * seq
    corpus = load_corpus(cfg)
    sampler = BatchSampler(corpus.train, seq, batch, seed)
    started = time.perf_counter()
    for step in range(1, batches + 1):
        sampler.batch(1, step)
    out["token_files_tokens_per_second"] = _rate(tokens, time.perf_counter() - started)

    cfg = load_config(overrides(folder, cache, streaming=True))
    stream_corpus = load_corpus(cfg)
    started = time.perf_counter()
    stream = stream_corpus.sampler(1, WORKERS, seq, batch)
    stream.batch(1, 1)
    out["stream_first_batch_seconds"] = time.perf_counter() - started  # opening the stream, its first document
    started = time.perf_counter()
    for step in range(2, batches + 2):
        stream.batch(1, step)
    seconds = time.perf_counter() - started
    out["stream_tokens_per_second"] = _rate(tokens, seconds)
    out["stream_epochs"] = stream.epoch + 1

    # the stream's parts, over one pass of worker 1's shard
    from datasets.distributed import split_dataset_by_node

    opts = stream.opts
    ds, _ = open_dataset({**opts, "streaming": True}, streaming=True)
    name = check_text_field(ds, opts)
    shard = split_dataset_by_node(ds.select_columns([name]), rank=1, world_size=WORKERS)
    started = time.perf_counter()
    texts = [text for _, text in dataset_rows(shard, name, "bench")]
    read = time.perf_counter() - started
    started = time.perf_counter()
    for text in texts:
        text_digest(text)
    digest = time.perf_counter() - started
    started = time.perf_counter()
    shard_tokens = sum(stream._encode(text).size for text in texts)
    encode = time.perf_counter() - started
    out["shard"] = {"documents": len(texts), "characters": sum(map(len, texts)), "tokens": shard_tokens}
    out["parts_tokens_per_second"] = {
        "read rows (datasets: gzip, JSON, Arrow, Python)": _rate(shard_tokens, read),
        "held-out check (BLAKE2 of each document)": _rate(shard_tokens, digest),
        "tokenize (tokenizers)": _rate(shard_tokens, encode),
    }
    return out


def real_run(folder: Path, cache: Path, streaming: bool, steps: int, run_dir: Path) -> dict:
    """One default run (4 local workers) of ``steps`` steps on one path; its summary's numbers."""
    name = "stream" if streaming else "token-files"
    args = [sys.executable, str(common.ROOT / "train.py"), *overrides(folder, cache, streaming), f"steps={steps}",
            f"run.dir={run_dir}", f"run.name={name}", "log.progress=false", "log.plot=false", "log.tensorboard=false",
            "checkpoint.every=0"]  # fmt: skip
    started, load = time.perf_counter(), os.getloadavg()[0]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=common.ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / name / "summary.json").read_text())
    from noloco.train.metrics import read_metrics

    rates = sorted(r["tokens_per_second"] for r in read_metrics(run_dir / name) if r["step"] >= 2 and
                   "tokens_per_second" in r)  # fmt: skip
    return {"tokens_per_second": summary["tokens_per_second"], "wall_seconds": summary["wall_seconds"],
            "worker_step_tokens_per_second": rates[len(rates) // 2],  # the median step of any worker
            "process_seconds": time.perf_counter() - started, "final_eval_loss": summary["final_eval_loss"],
            "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],  # 1-minute load, before and after
            "steps": summary["steps"], "workers": summary["workers"]}  # fmt: skip


def report(results: dict, steps: int, batches: int, threads: int, machine: str, command: str) -> list[str]:
    alone, runs = results["data_path"], results["runs"]
    per_worker = {k: v["worker_step_tokens_per_second"] for k, v in runs.items()}
    headroom = alone["stream_tokens_per_second"] / per_worker["stream"]
    tokens_per_batch = 8 * 128
    lines = [
        "# The streaming data path against the cached token files",
        "",
        f"`{command}` on {machine}.",
        "",
        "The same text on both paths: the bundled Shakespeare as four gzipped JSON-lines shards,",
        "`data.source=hf data.hf_path=json` tokenized ahead into the token files (memory-mapped) or streamed",
        "(`data.streaming=true`).",
        "",
        f"## The data path alone (one worker of {WORKERS}, {batches} batches of 8 × 128 tokens, {threads} torch "
        "thread(s))",
        "",
        "| path | tokens/s |",
        "|---|---:|",
        f"| token files (`BatchSampler`: random windows of a memory map) | "
        f"{alone['token_files_tokens_per_second']:,.0f} |",
        f"| stream (`StreamSampler`: read, check, tokenize, pack) | {alone['stream_tokens_per_second']:,.0f} |",
        "",
        f"Opening the stream and its first batch: {alone['stream_first_batch_seconds']:.2f} s. The stream's parts, "
        f"timed apart over one pass of the shard ({alone['shard']['documents']} documents, "
        f"{alone['shard']['characters'] / 1e6:.2f} M characters, {alone['shard']['tokens']:,} tokens):",
        "",
        "| part | tokens/s |",
        "|---|---:|",
        *[f"| {part} | {rate:,.0f} |" for part, rate in alone["parts_tokens_per_second"].items()],
        "",
        f"## Real runs (`python train.py`, the default config: {WORKERS} workers, local backend, {steps} steps)",
        "",
        "| path | run tokens/s (summary.json) | one worker's step, tokens/s (median) | wall s | held-out loss | "
        "load average (before, after) |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {name} | {r['tokens_per_second']:,.0f} | {per_worker[name]:,.0f} | {r['wall_seconds']:.1f} | "
            f"{r['final_eval_loss']:.4f} | {r['load_average'][0]:.1f}, {r['load_average'][1]:.1f} |"
            for name, r in runs.items()
        ],
        "",
        "`summary.json`'s tokens/s counts the whole wall time (start-up and evaluations included); the median step "
        "is one worker's training rate (`tokens_per_second` of `metrics.jsonl`).",
        "",
        f"One worker's stream makes batches {headroom:,.0f}× as fast as a worker of the streamed run trains "
        f"({alone['stream_tokens_per_second']:,.0f} against {per_worker['stream']:,.0f} tokens/s): drawing a batch "
        f"takes {1e3 * tokens_per_batch / alone['stream_tokens_per_second']:.1f} ms of a "
        f"{tokens_per_batch / per_worker['stream']:.2f} s step. Of the stream's parts the slowest is "
        f"{min(alone['parts_tokens_per_second'], key=alone['parts_tokens_per_second'].get)}. The two runs' rates "
        "differ by more than that: they share the machine's cores with whatever else runs (the load average), "
        "and their held-out losses differ because the stream trains on consecutive windows, the token files on "
        "random ones.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="steps of each real run (default 30)")
    parser.add_argument(
        "--batches",
        type=int,
        default=500,
        help="batches timed on each path alone (default 500: a pass over the stream's shard)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing the paths alone")
    common.add_out(parser, NAME)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="noloco-data-stream-") as tmp:
        tmp = Path(tmp)
        folder, cache = tmp / "data", tmp / "cache"
        write_shards(folder)
        results = {"data_path": data_path(folder, cache, args.batches), "runs": {}}
        for streaming in (False, True):
            name = "stream" if streaming else "token-files"
            results["runs"][name] = real_run(folder, cache, streaming, args.steps, tmp / "runs")
    machine, command = common.machine(), common.command(NAME, argv)
    results.update(steps=args.steps, batches=args.batches, threads=args.threads, workers=WORKERS)
    lines = report(results, args.steps, args.batches, args.threads, machine, command)
    md, js = common.write_report(args.out, NAME, lines, results, command=command, machine=machine)
    print("\n".join(lines))
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
