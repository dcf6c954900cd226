"""Quality of the noloco.quant formats: relative L2 error ||deq(Q(x)) - x|| / ||x|| (issue 3).

Zero-aware vs naive vs symmetric int4/int8 at g = 64/128/256, with and without the randomized Hadamard
rotation, plus MXFP4/6/8, on Gaussian and heavy-tailed (Student-t, 3 dof) data and on tensors of a
small transformer built inline (torch.nn.TransformerEncoderLayer, 2 layers, d = 256) briefly trained
on a synthetic next-token task: its weights, its last gradient and its pseudo-gradient (weights after
H = 30 AdamW steps minus weights before, as in the NoLoCo/DiLoCo outer step). CPU, torch reference.

    python -m benchmarks.quantizers [--n 1048576] [--out DIR]     # DIR: runs/benchmarks/quantizers/
    python -m benchmarks.quantizers --out docs/results           # the committed docs/results/quantizers.*
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/quantizers.py`: rerun as `python -m benchmarks.quantizers`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.quantizers", *sys.argv[1:]])

import torch

from benchmarks import common
from noloco.quant import QuantSpec, dequantize, quantize


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights, last gradient and pseudo-gradient of a briefly trained tiny transformer LM."""
    torch.manual_seed(seed)
    vocab, d, seq, batch = 512, 256, 64, 16
    emb = torch.nn.Embedding(vocab, d)
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True), num_layers=2
    )
    head = torch.nn.Linear(d, vocab)
    params = [*emb.parameters(), *enc.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=6e-4)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)
    start = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    for _ in range(30):  # synthetic language: next token = (3 * token + 1) mod vocab, with noise
        tok = torch.randint(0, vocab, (batch, 1))
        seqs = [tok]
        for _ in range(seq):
            nxt = (3 * seqs[-1] + 1) % vocab
            noise = torch.rand(batch, 1) < 0.1
            seqs.append(torch.where(noise, torch.randint(0, vocab, (batch, 1)), nxt))
        data = torch.cat(seqs, 1)
        logits = head(enc(emb(data[:, :-1]), mask=mask, is_causal=True))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in params])
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    return {"model weights": weights, "model gradient": grads, "model pseudo-gradient": weights - start}


def datasets(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"gaussian": torch.randn(n, generator=g), "student-t(3)": torch.distributions.StudentT(3.0).sample((n,))}
    out.update(model_tensors())
    return out


def specs() -> list[str]:
    out = []
    for bits in (4, 8):
        for g in (64, 128, 256):
            for mode in ("zero", "naive", "sym"):
                base = f"int{bits}" + ("" if g == 128 else f":g{g}") + ("" if mode == "zero" else f":{mode}")
                out += [base, base + "+hadamard"]
    for mx in ("mxfp4", "mxfp6", "mxfp8"):
        out += [mx, mx + "+hadamard"]
    return out


def rel_l2(y: torch.Tensor, x: torch.Tensor) -> float:
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quantizers", description=__doc__.split("\n")[0])
    common.add_out(ap, "quantizers")
    ap.add_argument("--n", type=int, default=1 << 20, help="elements of the synthetic tensors")
    args = ap.parse_args()
    t0 = time.time()
    data = datasets(args.n)
    names = list(data)
    rows = []
    for s in specs():
        spec = QuantSpec.parse(s)
        errs = {name: rel_l2(dequantize(quantize(x, spec)), x) for name, x in data.items()}
        rows.append({"spec": s, "bits_per_element": spec.bits_per_element(), **errs})
        print(f"{s:28} {spec.bits_per_element():5.2f} " + " ".join(f"{errs[n]:.5f}" for n in names))
    sizes = {name: x.numel() for name, x in data.items()}
    cmd, machine = common.command("quantizers"), common.machine()
    lines = [
        "# Quantizer quality: relative L2 error ||deq(Q(x)) - x|| / ||x||",
        "",
        f"Command: `{cmd}` (CPU, torch reference, {time.time() - t0:.0f} s).  ",
        f"Machine: {machine}.  ",
        "Data: " + ", ".join(f"{k} ({v} values)" for k, v in sizes.items()) + ". Model tensors come from a "
        "2-layer d=256 TransformerEncoder LM trained 30 AdamW steps (lr 6e-4) on a synthetic next-token "
        "task; pseudo-gradient = weights after - weights before those steps.  ",
        "Bits/elt: payload bits per element (no header). Lower error is better; best per column and "
        "bit-width in **bold**.",
        "",
        "| spec | bits/elt | " + " | ".join(names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    best = {}
    for fam in ("int4", "int8", "mxfp"):
        fam_rows = [r for r in rows if r["spec"].startswith(fam)]
        best[fam] = {n: min(r[n] for r in fam_rows) for n in names}
    for r in rows:
        fam = "mxfp" if r["spec"].startswith("mxfp") else r["spec"][:4]
        cells = [f"**{r[n]:.4f}**" if r[n] == best[fam][n] else f"{r[n]:.4f}" for n in names]
        lines.append(f"| {r['spec']} | {r['bits_per_element']:.2f} | " + " | ".join(cells) + " |")
    md, _ = common.write_report(args.out, "quantizers", lines, {"sizes": sizes, "rows": rows}, command=cmd,
                                machine=machine)  # fmt: skip
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
