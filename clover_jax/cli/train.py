"""Train a Clover-2 draft head by knowledge distillation from a frozen base model.

  python train.py --config configs/smollm2-135m-clover2.yaml
  python train.py --config configs/smollm2-135m-clover2.yaml --set optim.lr=5e-4 --set train.steps=2000
  python train.py --config configs/smollm2-135m-clover2.yaml --resume          # continue after a stop
  python train.py --config configs/smollm2-135m-clover2.yaml --resume --from-step 1000  # from an earlier step
  python train.py --config configs/smollm2-135m-clover2.yaml --output-dir runs/try2
  python train.py --config configs/llama3-8b-instruct-clover2.yaml --compile-only --topology v5e-16   # fits a slice?

SIGTERM saves a checkpoint at the next step boundary and exits cleanly (0); `--resume` continues from it.
The logic is in `clover_jax.training` (run.py, trainer.py, checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading

from clover_jax import tpu
from clover_jax.cli import add_debug_argument, run_cli
from clover_jax.cli.compile_only import add_topology_arguments, check_topology_arguments, compile_only_process, finish
from clover_jax.io.shapes import plan_base_config
from clover_jax.training import compiled
from clover_jax.training.memory import estimate_training_memory
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
    add_topology_arguments(p, what="the config's training step (its mesh, batch, sequence length, remat)")
    add_debug_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    code = run_cli(_main, argv)
    if code != 0 and argv is None:  # the process's own command line: end it even where a writer thread is stuck
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """Exits now when threads other than daemons are still alive after an error: Orbax's writer threads of a
    checkpoint save that failed (a read-only folder, a full disk) wait for a signal that never comes, and Python's
    exit would wait for them for ever. The error line is printed already; the last good checkpoint is untouched."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(argv=None) -> int:

    args = parse_args(argv)
    sl = check_topology_arguments(args)
    if sl is not None:
        return compile_training(args, sl)
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


def compile_training(args, sl: tpu.Slice) -> int:
    """`--compile-only`: the config's training step compiled for the slice `sl`, beside the memory plan's estimate."""
    compile_only_process()
    cfg = config_from_args(args)
    base_config = plan_base_config(cfg.model.name_or_path)
    mesh = tpu.slice_mesh(sl, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp)
    print(f"{args.config or 'defaults'}: data.batch_size={cfg.data.batch_size} x data.max_length={cfg.data.max_length}, "
          f"train.remat={str(cfg.train.remat).lower()}, optim.grad_accum={cfg.optim.grad_accum}, "
          f"{cfg.model.param_dtype} base", flush=True)
    program = compiled.compile_training_step(cfg, base_config, mesh)
    est = estimate_training_memory(cfg, base_config, mesh, platform="tpu")
    line = (f"the memory plan's estimate: {tpu.fmt(est.total)} per chip ({est.describe()}); compiled "
            f"{program.total / max(est.total, 1):.2f}x of it")
    return finish(sl, [program], mesh, compiled.SETTINGS, [line])


if __name__ == "__main__":
    sys.exit(main())
