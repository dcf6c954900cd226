"""``python -m noloco.sim consensus|time``: the scale studies (docs/sim.md).

``consensus``: N stacked workers trained in one process, NoLoCo in groups of 2 and 4 against DiLoCo, plus the
pure averaging model (:mod:`noloco.sim.consensus`). ``time``: the WAN time model of sync time and idle
fraction against N, checked against the throttled fleet's measurements (:mod:`noloco.sim.wan`). Each writes
``<name>.md``, ``<name>.json`` and plots into ``--out`` (default ``runs/sim``). Bad arguments: one ``error:``
line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser() -> _Parser:
    parser = _Parser(
        prog="python -m noloco.sim", description="Scale studies: consensus of stacked workers, WAN time model."
    )
    sub = parser.add_subparsers(dest="study", required=True, parser_class=_Parser)
    con = sub.add_parser("consensus", help="N stacked workers: held-out loss and consensus distance against rounds")
    con.add_argument("--workers", type=_ints, default=[8, 32, 128, 512, 1024], help="N values (8,32,128,512,1024)")
    con.add_argument("--methods", nargs="+", default=["noloco-g2", "noloco-g4", "diloco"],
                     help="noloco-g2, noloco-g4, diloco")  # fmt: skip
    con.add_argument("--rounds", type=int, default=20, help="outer rounds (20)")
    con.add_argument("--every", type=int, default=10, help="inner steps H per round (10)")
    con.add_argument("--batch-size", type=int, default=4)
    con.add_argument("--seq-len", type=int, default=32)
    con.add_argument("--dim", type=int, default=32, help="model width (32)")
    con.add_argument("--layers", type=int, default=2, help="model layers (2)")
    con.add_argument("--vocab-size", type=int, default=512)
    con.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    con.add_argument("--eval-batches", type=int, default=8)
    con.add_argument("--relax-rounds", type=int, default=60, help="outer rounds without training after the run (60)")
    con.add_argument("--averaging-workers", type=_ints, default=[8, 16, 64, 256, 1024, 4096],
                     help="N values of the pure averaging model")  # fmt: skip
    con.add_argument("--averaging-trials", type=int, default=10, help="seeds per N of the averaging model (10)")
    con.add_argument("--seed", type=int, default=0)
    con.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    con.add_argument("--chunk", type=int, default=256, help="workers per forward/backward pass (256): bounds memory")
    for p, name in ((con, "consensus"),):
        p.add_argument("--out", type=Path, default=Path("runs/sim"), help="report folder (runs/sim)")
        p.add_argument("--name", default=name, help=f"report file names ({name})")
    from noloco.sim.wan import add_arguments  # noqa: PLC0415 - the time study's own options

    add_arguments(sub.add_parser("time", help="WAN time model: sync time and idle fraction against N"), _ints)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.study == "consensus":
        return _consensus(parser, args)
    from noloco.sim.wan import main as time_main

    return time_main(parser, args)


def _consensus(parser: _Parser, args: argparse.Namespace) -> int:
    import torch

    from noloco.data.documents import DataError
    from noloco.sim.consensus import ConsensusConfig, run_study
    from noloco.sim.report import stamp, write_consensus

    cfg = ConsensusConfig(workers=args.workers, methods=args.methods, rounds=args.rounds, every=args.every,
                          batch_size=args.batch_size, seq_len=args.seq_len, dim=args.dim, n_layers=args.layers,
                          n_heads=2, vocab_size=args.vocab_size, lr=args.lr, eval_batches=args.eval_batches,
                          relax_rounds=args.relax_rounds, seed=args.seed, device=args.device, chunk=args.chunk,
                          averaging_workers=args.averaging_workers, averaging_trials=args.averaging_trials)  # fmt: skip
    try:
        cfg.check()
        if args.dim % 4:
            raise ValueError(f"--dim must be a multiple of 4 (2 heads of even width), got {args.dim}")
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available here")
    except (ValueError, RuntimeError) as exc:  # torch.device raises RuntimeError on a malformed name
        parser.error(str(exc).splitlines()[0])
    try:
        data = run_study(cfg)
    except DataError as exc:
        parser.error(str(exc).splitlines()[0])
    path = write_consensus(stamp(data, args.argv), args.out, args.name)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
