"""One process of a multi-process job (run by `clover_jax.cli.launch`, or alone for the one-process reference).

  python tests/multihost/worker.py train --out DIR [--resume] [--kill-at STEP] [--kill-in-save STEP]
  python tests/multihost/worker.py decode --out DIR

train: the tiny Clover-2 experiment of tests/training (random base, synthetic batches of 8 rows, the cross-entropy
at 4 random trained positions per row) on a mesh over every device of the job (data=-1), checkpoints every 2 steps,
6 steps. Each process feeds its own rows of every
global batch. Process 0 writes `DIR/final.npz` (the head's parameters, gathered) and the run's metrics.jsonl.
`--kill-at S`: process 1 kills itself (SIGKILL) when step S is done, before its checkpoint; `--kill-in-save S`:
right after the asynchronous save of step S started. `--step-delay T`: every process waits T s after each step
(time to signal the job mid-run; the numbers do not change).

decode: greedy autoregressive and speculative decoding (Clover-2 head, chain-3) of a tiny random model, with the
weights and batch on the job's 8-device mesh; process 0 writes the tokens to `DIR/decode.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "training")]

from clover_jax import parallel  # noqa: E402

parallel.maybe_initialize_distributed("auto")  # before anything touches a JAX backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from clover_jax import api  # noqa: E402
from clover_jax.heads.clover2.model import Clover2Config, init_from_base  # noqa: E402
from clover_jax.models.llama import init_llama  # noqa: E402
from clover_jax.training import checkpoint  # noqa: E402
from clover_jax.training.run import run_experiment  # noqa: E402
from training_helpers import TINY, SyntheticBatcher, make_cfg, tiny_base  # noqa: E402


class ProcessRows:
    """This process's rows of every global batch of a batcher (as `BucketedBatcher` cuts them)."""

    def __init__(self, batcher):
        self.batcher = batcher

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batcher)
        per = self.batcher.batch_size // jax.process_count()
        i = jax.process_index()
        return {k: v[i * per: (i + 1) * per] for k, v in batch.items()}

    def state_dict(self):
        return self.batcher.state_dict()

    def load_state_dict(self, state):
        self.batcher.load_state_dict(state)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


_TRAINER = {}  # the run's Trainer, kept by on_step


def train(args) -> None:
    out = Path(args.out)
    cfg = make_cfg("mesh.data=-1", "train.steps=6", "train.log_every=1", "checkpoint.save_every=2",
                   "loss.vocab_positions_per_row=4",  # random subsets of trained positions, drawn per global row
                   "checkpoint.keep=5", f"train.output_dir={out / 'run'}")
    if args.kill_in_save is not None and jax.process_index() == 1:
        save = checkpoint.Checkpointer.save

        def save_then_die(self, step, **kw):
            started = save(self, step, **kw)
            if step == args.kill_in_save and started:
                die()  # the asynchronous save of `step` is under way
            return started

        checkpoint.Checkpointer.save = save_then_die

    def on_step(step, trainer):
        _TRAINER["trainer"] = trainer
        time.sleep(args.step_delay)
        if step == args.kill_at and jax.process_index() == 1:
            die()

    summary = run_experiment(cfg, resume=args.resume, loaded=tiny_base(), batcher=ProcessRows(SyntheticBatcher()),
                             progress=False, on_step=on_step)
    params = {jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
              for p, x in jax.tree_util.tree_flatten_with_path(_TRAINER["trainer"].state.params)[0]}
    if jax.process_index() == 0:
        np.savez(out / "final.npz", **params)
        (out / "summary.json").write_text(json.dumps({"final_step": summary["final_step"],
                                                     "start_step": summary["start_step"],
                                                     "processes": jax.process_count(),
                                                     "devices": jax.device_count()}))


def decode(args) -> None:
    base = init_llama(TINY, seed=1)
    head = init_from_base(base, Clover2Config(), seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, TINY.vocab_size, int(k)).tolist() for k in rng.integers(3, 20, 6)]
    kw = dict(max_new_tokens=24, cache_size=128)
    mesh = None if args.one_device else args.mesh
    runs = {"ar": api.generate(base, prompts, mesh=mesh, **kw)}
    for tree in ("chain-3",):
        runs[tree] = api.generate(base, prompts, mode="speculative", head=head, tree=tree, mesh=mesh, **kw)
    if jax.process_index() == 0:
        (Path(args.out) / "decode.json").write_text(json.dumps(
            {k: {"tokens": r.token_ids, "accept_hist": r.stats.get("accept_hist")} for k, r in runs.items()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["train", "decode"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--kill-in-save", type=int, default=None)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--mesh", default="data=2,tp=4")
    ap.add_argument("--one-device", action="store_true")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (train if args.what == "train" else decode)(args)


if __name__ == "__main__":
    main()
