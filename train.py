"""Train a small LLaMA with NoLoCo (or DiLoCo / DDP / periodic averaging): see ``noloco.train.cli``."""

import sys

from noloco.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
