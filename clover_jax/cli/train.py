"""Train a Clover-2 draft head by knowledge distillation from a frozen base model.

  python train.py --config configs/smollm2-135m-clover2.yaml
  python train.py --config configs/smollm2-135m-clover2.yaml --set optim.lr=5e-4 --set train.steps=2000
  python train.py --config configs/smollm2-135m-clover2.yaml --resume          # continue after a stop
  python train.py --config configs/smollm2-135m-clover2.yaml --resume --from-step 1000  # from an earlier step
  python train.py --config configs/smollm2-135m-clover2.yaml --output-dir runs/try2

SIGTERM saves a checkpoint at the next step boundary and exits cleanly (0); `--resume` continues from it.
The logic is in `clover_jax.training` (run.py, trainer.py, checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from clover_jax.cli import add_debug_argument, run_cli
from clover_jax.training.config import add_config_arguments, config_from_args
from clover_jax.generation.replies import make_generate_fn
from clover_jax.training.run import run_experiment
from clover_jax.validation import InputError, check_int


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of the run")
    p.add_argument("--from-step", type=int, default=None, metavar="N",
                   help="with --resume: continue from the checkpoint of step N instead of the latest (e.g. when the "
                   "latest is corrupt); later checkpoints are moved aside to <run>/discarded_checkpoints, not deleted")
    p.add_argument("--output-dir", default=None, help="run directory (overrides train.output_dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_debug_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run_cli(_main, argv)


def _main(argv=None) -> int:

    args = parse_args(argv)
    if args.from_step is not None:
        check_int("--from-step", args.from_step, minimum=0)
        if not args.resume:
            raise InputError(f"--from-step {args.from_step} needs --resume (it picks the checkpoint to resume from)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.output_dir:
        args.overrides = list(args.overrides) + [f"train.output_dir={args.output_dir}"]
    cfg = config_from_args(args)
    summary = run_experiment(cfg, resume=args.resume, progress=not args.quiet, from_step=args.from_step,
                             make_generate_fn=make_generate_fn)  # self-distillation generates with `generate`
    keys = ("start_step", "final_step", "stopped_early", "train_time_s", "tokens_per_s", "checkpoint_step", "run_dir")
    print(json.dumps({k: summary.get(k) for k in keys}))
    if summary.get("last_eval"):
        ev = summary["last_eval"]
        print(json.dumps({"eval_loss": ev["loss"], "eval_acc": ev["acc"], "eval_chain_acc": ev["chain_acc"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
