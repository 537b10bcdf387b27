"""Train a draft head by knowledge distillation from a frozen base model: `python train.py --config CONFIG`.
The command line is `clover_jax.cli.train` (also installed as `clover-train`)."""

import sys

from clover_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
