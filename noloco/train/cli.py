"""Command line of ``train.py``: ``python train.py [--config FILE ...] [key=value ...]``.

Examples::

    python train.py                                         # the default run (4 workers, NoLoCo)
    python train.py outer.algo=diloco workers=8 outer.every=50
    python train.py --config configs/experiments/diloco.yaml
    python train.py resume=runs/<run>/checkpoints/latest    # continue exactly where it stopped
"""

from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

from noloco.train import backends, checkpoint
from noloco.train.config import ConfigError, load_config
from noloco.train.data import DataError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", action="append", default=[], help="YAML file merged over the defaults")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (omegaconf dotlist)")
    args = parser.parse_args(argv)

    try:
        cfg = load_config(args.overrides, args.config)
        resume_from, run_dir, resume_step = None, None, 0
        if cfg.resume:
            resume_from, run_dir, resume_step = checkpoint.resolve(cfg.resume)
            # The checkpoint's own config, with this command line's overrides on top.
            others = [o for o in args.overrides if not o.startswith("resume=")]
            cfg = load_config(others, [str(resume_from / "config.yaml"), *args.config])
            cfg.resume = str(resume_from)
            if resume_step >= cfg.steps:
                raise ConfigError(
                    f"resume: checkpoint is at step {resume_step}, run has steps={cfg.steps}; raise steps= to continue"
                )
        if args.print_config:
            print(OmegaConf.to_yaml(cfg))
            return 0
        # local: threads of this process; torch: a process per worker; hivemind: one swarm peer (docs/swarm.md)
        backends.launch(cfg, run_dir=run_dir, resume_from=resume_from, resume_step=resume_step)
    except (ConfigError, DataError, checkpoint.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
