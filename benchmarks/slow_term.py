"""How well each code carries NoLoCo's pull term, measured on the slow weights of a real run (issue 30).

The pull moves worker i toward its group's mean slow weights: in a pair, by γ·(φ_j − φ_i)/2. Today that term
crosses the link as φ − φ₀ through a plain codec (int4 by default), whose grid spans the whole progress φ − φ₀ of
each group of 128 values, while the pull needs only the partners' difference, which is far smaller. This benchmark
trains one run (``train.py``, the CPU frontier's tiny budget unless told otherwise), keeps the slow weights of every
worker at every ``--every-rounds``-th outer round (its checkpoints), and for every pair of workers at every kept
round reports:

* the premise: per block of 128 values, max |φ − φ₀| ÷ max |φ_i − φ_j| (how much wider the plain codec's range is
  than what the pull needs);
* per code, the error of the pull each partner would apply, rms(pull decoded − pull exact) ÷ rms(pull exact), one
  message each way, before error feedback (which repays it later but cannot make up for an error larger than the
  pull itself), and its bits per value.

Codes:

* ``int4``/``int3``/``int2`` of φ − φ₀: the project's codecs (:func:`noloco.quant.quantize`), bits from the payload;
* ``cosetB`` (B = 2, 3, 4; analytical, not a codec of the package yet): a code of the partners' *difference* that
  uses what each receiver already holds, its own φ (side information, as in Wyner–Ziv coding and lattice-based
  distributed mean estimation). On a grid s shared by the pair (one power-of-two exponent per block of 128:
  8/128 bits per value), each member sends q = round(x / s) mod M, M = 2^B − 1, and each computes the centred
  residue r = (q_j − q_i) mod M ∈ [−(M−1)/2, (M−1)/2]; member i takes s·(q_i + r/2) as the pair's mean and member
  j s·(q_j − r/2). The residues of the two members are exact negatives of each other, so the pulls sum to zero
  whatever happens (the world mean is untouched, as the design requires); they are right when |q_j − q_i| ≤
  (M−1)/2 and otherwise *wrap* (a bounded pull in a wrong direction). The grid trades precision for wraps:
  ``oracle`` sizes it from the pair's true largest difference in the block (no member knows it: the bound of what
  the code can do), ``history ×k`` from k times each member's largest difference to one other worker at the previous
  kept round, the larger proposal of the two (what members can agree on with one byte per block; with kept rounds
  ``--every-rounds`` apart that history is older than a member's own previous pull).

    python -m benchmarks.slow_term                                   # tiny model, NoLoCo-fp32, pull every round
    python -m benchmarks.slow_term -- comm.codec=topk:64/4096+int2   # the frontier's split (φ − φ₀ int4, 1 in 8)
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/slow_term.py`: rerun as a module, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.slow_term", *sys.argv[1:]])

import torch

from benchmarks import common
from benchmarks.frontier import QUIET, TINY
from noloco.quant import dequantize, quantize
from noloco.train import checkpoint

BLOCK = 128
PLAIN = ("int4", "int3", "int2")
COSET_BITS = (2, 3, 4)
HISTORY = (1.0, 2.0)


def blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows of :data:`BLOCK` values (a partial last block left out)."""
    n = x.numel() // BLOCK * BLOCK
    return x[:n].view(-1, BLOCK)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ≥ ``v`` (per element; tiny values get 2^-100)."""
    return torch.exp2(torch.ceil(torch.log2(v.clamp_min(2.0**-100))))


def coset_means(xi: torch.Tensor, xj: torch.Tensor, grid: torch.Tensor, bits: int):
    """Each member's view of the pair's mean under the coset code on ``grid`` (per block), and where it wrapped."""
    modulus = 2**bits - 1
    half = (modulus - 1) // 2
    qi, qj = torch.round(xi / grid), torch.round(xj / grid)
    r = torch.remainder(qj - qi + half, modulus) - half  # the same residue on both members, negated for the other
    return grid * (qi + r / 2), grid * (qj - r / 2), r != qj - qi


def plain_mean(x: torch.Tensor, spec: str) -> tuple[torch.Tensor, float]:
    """``x`` (rows of blocks) through codec ``spec`` and back; bits per value of its payload."""
    flat = x.reshape(-1)
    packed = quantize(flat, spec)
    return dequantize(packed).reshape(x.shape), len(packed.to_bytes()) * 8 / flat.numel()


def train(overrides: list[str], every_rounds: int, run_dir: Path) -> Path:
    """One run of ``train.py`` keeping a checkpoint every ``every_rounds`` outer rounds; returns its folder."""
    from noloco.train.config import load_config

    cfg = load_config([*TINY, *QUIET, *overrides])
    every = int(cfg.outer.every) * every_rounds
    args = [*TINY, *QUIET, *overrides, f"checkpoint.every={every}", "checkpoint.keep=100000",
            f"run.dir={run_dir}", "run.name=slow-term"]  # fmt: skip
    done = subprocess.run([sys.executable, str(common.ROOT / "train.py"), *args], cwd=common.ROOT)
    if done.returncode != 0:
        raise SystemExit(f"error: the run failed (exit {done.returncode})")
    return run_dir / "slow-term"


def initial_weights(folder: Path) -> torch.Tensor:
    """φ₀ of the run in ``folder``: its model built again from its config's ``run.seed`` (a checkpoint stores only
    its digest), as the flat vector of trained parameters the outer algorithm keeps."""
    from omegaconf import OmegaConf
    from torch.nn.utils import parameters_to_vector

    from noloco.train.loop import build_model

    cfg = OmegaConf.load(folder / "config.yaml")
    model = build_model(cfg, int(cfg.data.vocab_size))
    return parameters_to_vector([p for p in model.parameters() if p.requires_grad]).detach().float()


def progress_by_step(folder: Path) -> dict[int, dict[int, torch.Tensor]]:
    """φ − φ₀ of every worker at every kept checkpoint step: ``{step: {rank: tensor}}``."""
    reference = initial_weights(folder)
    digest = checkpoint.digest(reference)
    out: dict[int, dict[int, torch.Tensor]] = {}
    for step_dir in sorted((folder / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1])):
        step = int(step_dir.name.split("_")[1])
        out[step] = {}
        for rank in checkpoint.worker_ranks(step_dir):
            state = checkpoint.load_worker(step_dir, rank, step)["algorithm"]
            stored = state["reference"]
            if isinstance(stored, dict) and stored.get("sha256") != digest:
                raise SystemExit(f"error: φ₀ built from {folder}/config.yaml is not the run's (digest differs)")
            slow = reference if isinstance(state["slow"], dict) else state["slow"].float()  # φ = φ₀ is stored so
            out[step][rank] = slow - (reference if isinstance(stored, dict) else stored.float())
    return out


def pair_scores(xi: torch.Tensor, xj: torch.Tensor, history: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
    """For one pair (rows of blocks of φ − φ₀), per code: ``(pull error ÷ pull, wrapped fraction, bits/value)``;
    ``history``: each member's largest difference per block to another worker at the previous kept round."""
    exact = (xj - xi) / 2  # i's pull (j's is its negative), before γ
    scale = exact.pow(2).mean().sqrt().item()
    out = {}

    def score(name, bits, mi, mj, wrapped=None):
        err = torch.cat([(mi - xi) - exact, (mj - xj) + exact]).pow(2).mean().sqrt().item() / scale
        out[name] = (err, 0.0 if wrapped is None else wrapped.float().mean().item(), bits)

    for spec in PLAIN:
        (mi, bits), (mj, _) = plain_mean(xi, spec), plain_mean(xj, spec)
        score(f"{spec} of φ − φ₀", bits, mi, mj)
    largest = (xi - xj).abs().amax(1, keepdim=True)
    for b in COSET_BITS:
        half = (2**b - 1) // 2
        score(f"coset{b}, oracle grid", b + 8 / BLOCK, *coset_means(xi, xj, pow2_ceil(largest / half), b))
        for k in HISTORY if history is not None else ():
            grid = torch.maximum(pow2_ceil(k * history[0] / half), pow2_ceil(k * history[1] / half))
            score(f"coset{b}, history ×{k:g}", b + 8 / BLOCK, *coset_means(xi, xj, grid[:, None], b))
    return out


def measure(progress: dict[int, dict[int, torch.Tensor]]) -> dict:
    """Per code, the pull's relative error and wraps over every pair of workers at every kept step."""
    scores: dict[str, list[tuple[float, float, float]]] = {}
    premise: list[float] = []
    previous: dict[int, torch.Tensor] | None = None  # per worker: largest |φ_i − φ_k| per block, previous kept step
    for step in sorted(progress):
        xs = {r: blocks(x) for r, x in progress[step].items()}
        ranks = sorted(xs)
        for a, i in enumerate(ranks):
            for j in ranks[a + 1 :]:
                largest = (xs[i] - xs[j]).abs().amax(1)
                if not largest.any():
                    continue
                ok = largest > 0
                premise += (xs[i].abs().amax(1)[ok] / largest[ok]).tolist()
                history = None if previous is None else (previous[i], previous[j])
                for name, value in pair_scores(xs[i], xs[j], history).items():
                    scores.setdefault(name, []).append(value)
        # a member's knowledge of the spread: its largest difference per block to one other worker (the next rank)
        previous = {r: (xs[r] - xs[ranks[(a + 1) % len(ranks)]]).abs().amax(1) for a, r in enumerate(ranks)}
    rows = []
    for name, values in scores.items():
        e = torch.tensor([v[0] for v in values])
        wrapped = sum(v[1] for v in values) / len(values)
        rows.append({"code": name, "bits_per_value": values[0][2], "pairs": len(values),
                     "error_median": e.median().item(), "error_p10": e.quantile(0.1).item(),
                     "error_p90": e.quantile(0.9).item(), "wraps": wrapped})  # fmt: skip
    p = torch.tensor(premise)
    return {"rows": rows, "range_over_difference": {"median": p.median().item(), "p10": p.quantile(0.1).item(),
                                                    "p90": p.quantile(0.9).item()}}  # fmt: skip


def report(result: dict, overrides: list[str], kept: int, cmd: str) -> list[str]:
    p = result["range_over_difference"]
    lines = [
        "# The pull term: what each code carries of the partners' difference",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {common.machine()}  ",
        f"Date: {time.strftime('%Y-%m-%d')}  ",
        f"Run: the CPU frontier's tiny budget ({' '.join(TINY)}){' with ' + ' '.join(overrides) if overrides else ''};"
        f" slow weights of every worker at {kept} kept rounds, every pair of workers at each.",
        "",
        f"Per block of {BLOCK} values, max |φ − φ₀| ÷ max |φ_i − φ_j|: median **{p['median']:.1f}** "
        f"(10%: {p['p10']:.1f}, 90%: {p['p90']:.1f}).",
        "",
        "| code | bits/value | pull error ÷ pull (rms), median | 10% | 90% | wrapped values |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['code']} | {r['bits_per_value']:.3f} | {r['error_median']:.3f} | {r['error_p10']:.3f} | "
                     f"{r['error_p90']:.3f} | {100 * r['wraps']:.2f}% |")  # fmt: skip
    lines += ["", "One message each way, before error feedback; coset codes are analytical (bits: B + 8/128)."]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slow_term", description=__doc__.split("\n")[0])
    parser.add_argument("--every-rounds", type=int, default=2, help="keep the slow weights every N rounds (2)")
    parser.add_argument("--name", default="slow-term", help="report name (slow-term)")
    parser.add_argument("--keep-run", action="store_true", help="keep the run's folder and checkpoints")
    common.add_out(parser, "slow_term")
    args = parser.parse_args(ours)
    if args.every_rounds < 1:
        parser.error("--every-rounds must be >= 1")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = common.ROOT / "runs" / "slow_term" / stamp
    folder = train(overrides, args.every_rounds, run_dir)
    progress = progress_by_step(folder)
    if len(progress) < 2:
        print("error: fewer than two kept rounds; run longer or lower --every-rounds", file=sys.stderr)
        return 2
    result = measure(progress)
    cmd = common.command("slow_term", argv)
    lines = report(result, overrides, len(progress), cmd)
    print("\n".join(lines))
    common.write_report(args.out, args.name, lines, {"overrides": overrides, **result}, command=cmd,
                        machine=common.machine())  # fmt: skip
    if not args.keep_run:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if all(math.isfinite(r["error_median"]) for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
