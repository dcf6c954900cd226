"""Command line of ``train.py``: ``python train.py [--config FILE ...] [key=value ...]``.

Examples::

    python train.py                                         # the default run (4 workers, NoLoCo)
    python train.py outer.algo=diloco workers=8 outer.every=50
    python train.py --config configs/experiments/diloco.yaml
    python train.py resume=runs/<run>/checkpoints/latest    # continue exactly where it stopped

Exit status: 0 done (also when a streamed dataset ran out and ended the run early, ``data.stream_end=stop``:
``summary.json`` says so under ``stopped``); 2 a bad config, data or checkpoint (one ``error:`` line; a
refused resume leaves the run folder as it was; also a full disk during a checkpoint, which keeps the previous
one); 3 stalled (no worker finished a step within ``run.stall_timeout`` seconds: every thread's stack is in
``<run>/stall-<pid>.txt``, the last complete checkpoint is kept); 130 interrupted (Ctrl-C: every worker stops at
one step and saves it, and the last line says how to resume; a second Ctrl-C quits at once, keeping the last
complete checkpoint). Resuming a run's last checkpoint when its ``summary.json`` is missing (a kill between the
two) writes the summary.

``run.restarts=N``: this process supervises the run in a forked child and forks it again from its last checkpoint
when it dies with another status (a crash, a kill, a stall), at most N times (:mod:`noloco.train.supervise`); its
exit status is the last run's (128 + the signal for a killed one).
"""

from __future__ import annotations

import argparse
import signal
import sys

from omegaconf import DictConfig, OmegaConf

from noloco.data.documents import DataError
from noloco.models.hf import ModelError
from noloco.train import backends, checkpoint, supervise
from noloco.train.config import ConfigError, commented_yaml, kept_behaviour, load_config
from noloco.train.interrupt import INTERRUPT, Interrupted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", action="append", default=[], help="YAML file merged over the defaults")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (with the comments of defaults.yaml) and exit")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="key=value overrides (omegaconf dotlist)")
    args = parser.parse_args(argv)

    return _run(args, [], supervised=False)


def _run(args: argparse.Namespace, extra: list[str], supervised: bool) -> int:
    """The run ``args`` describe, ``extra`` overrides last (a supervisor's ``resume=``); its exit status.
    ``supervised``: this is the forked run of a supervisor (``run.restarts``), not one to supervise."""
    overrides = [o for o in args.overrides if not (extra and o.startswith("resume="))] + extra
    interrupt = INTERRUPT
    interrupt.reset()
    previous = signal.getsignal(signal.SIGINT)
    try:
        cfg = load_config(overrides, args.config)
        resume_from, run_dir, resume_step = None, None, 0
        if cfg.resume:
            resume_from, run_dir, resume_step = checkpoint.resolve(cfg.resume)
            saved = resume_from / "config.yaml"
            if not saved.is_file():
                raise checkpoint.CheckpointError(f"{saved}: missing: the checkpoint is damaged")
            try:
                saved_cfg = OmegaConf.load(saved)
            except Exception as exc:  # noqa: BLE001 - yaml errors of every kind
                raise checkpoint.CheckpointError(f"{saved}: cannot parse: {str(exc).splitlines()[0]}") from None
            if not isinstance(saved_cfg, DictConfig):
                raise checkpoint.CheckpointError(f"{saved}: not a mapping of config keys: the checkpoint is damaged")
            # The checkpoint's own config (as it ran: kept_behaviour), with this command line's overrides on top.
            others = kept_behaviour(saved_cfg) + [o for o in overrides if not o.startswith("resume=")]
            cfg = load_config(others, [str(saved), *args.config])
            cfg.resume = str(resume_from)
            if resume_step == cfg.steps and not (run_dir / "summary.json").exists():  # killed before its summary
                print(f"note: the checkpoint is the run's last step ({resume_step}) and {run_dir}/summary.json is "
                      "missing: writing the summary from it", file=sys.stderr)  # fmt: skip
            elif resume_step >= cfg.steps:
                raise ConfigError(
                    f"resume: checkpoint is at step {resume_step}, run has steps={cfg.steps}; raise steps= to continue"
                )
        if args.print_config:  # the resolved values, each with its comment from defaults.yaml
            print(commented_yaml(cfg), end="")
            return 0
        if cfg.run.restarts and not supervised:  # this process supervises; the run is its forked child
            run = lambda more: _run(args, more, supervised=True)  # noqa: E731
            spec = backends.spec(cfg)
            return supervise.supervise(run, int(cfg.run.restarts), (spec.module, *spec.late_imports))
        interrupt.install(signal.SIGINT)
        # the backend places the workers; the run's lifecycle (noloco.train.run.Run) checks a resume, all or
        # nothing, before config.yaml or metrics change
        backends.launch(cfg, run_dir=run_dir, resume_from=resume_from, resume_step=resume_step)  # Interrupted: Ctrl-C
        if interrupt.requested:  # after the last step: the run is complete
            print("interrupted after the last step: the run is complete", file=sys.stderr)
            return 130
    except Interrupted as exc:
        if not exc.quiet:
            print(exc.line(), file=sys.stderr, flush=True)
        return 130
    except KeyboardInterrupt:
        print("interrupted before training started or after it ended: nothing new to resume", file=sys.stderr)
        return 130
    except backends.WorkersReported as exc:  # each failed worker process printed its own error line
        if exc.others:
            print(f"error: {exc}, after the errors above", file=sys.stderr)
        return exc.code
    except (ConfigError, DataError, ModelError, checkpoint.CheckpointError) as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    finally:
        if signal.getsignal(signal.SIGINT) == interrupt.handler:
            signal.signal(signal.SIGINT, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
