"""Train a Clover-2 draft head by knowledge distillation from a frozen base model.

  python train.py --config configs/smollm2-135m-clover2.yaml
  python train.py --config configs/smollm2-135m-clover2.yaml --set optim.lr=5e-4 --set train.steps=2000
  python train.py --config configs/smollm2-135m-clover2.yaml --resume          # continue after a stop
  python train.py --config configs/smollm2-135m-clover2.yaml --output-dir runs/try2

SIGTERM saves a checkpoint at the next step boundary and exits cleanly (0); `--resume` continues from it.
The logic is in `clover_jax.training` (run.py, trainer.py, checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def parse_args(argv=None):
    from clover_jax.config import add_config_arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of the run")
    p.add_argument("--output-dir", default=None, help="run directory (overrides train.output_dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from clover_jax.config import ConfigError, config_from_args
    from clover_jax.parallel import MeshError
    from clover_jax.training.checkpoint import CheckpointError
    from clover_jax.training.data import DataError

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.output_dir:
            args.overrides = list(args.overrides) + [f"train.output_dir={args.output_dir}"]
        cfg = config_from_args(args)
        from clover_jax.training.run import run_experiment

        summary = run_experiment(cfg, resume=args.resume, progress=not args.quiet)
    except (ConfigError, CheckpointError, DataError, MeshError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keys = ("start_step", "final_step", "stopped_early", "train_time_s", "tokens_per_s", "checkpoint_step", "run_dir")
    print(json.dumps({k: summary.get(k) for k in keys}))
    if summary.get("last_eval"):
        ev = summary["last_eval"]
        print(json.dumps({"eval_loss": ev["loss"], "eval_acc": ev["acc"], "eval_chain_acc": ev["chain_acc"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
