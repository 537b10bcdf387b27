"""Clover-2 training step cost on this machine: which of the step's parts the knobs remove.

Variants of one config, each timed on the same real batches (ShareGPT conversations, SmolLM2 chat
template), compile excluded:
  online      the frozen base runs in every step (the reference setup)
  packed      + cross-entropy at `--positions` trained positions per row (loss.vocab_positions_per_row)
  dv          + cross-entropy over the draft vocabulary of `--draft-vocab` tokens (loss.draft_vocab)
  features    + the base's hidden states computed once, before training (train.cache_features)

  python bench/bench_train.py --config configs/smollm2-135m-clover2.yaml --steps 6 [--out results.json]

`--xla training xla-default` times each variant twice in the same process, with the XLA options the training steps
compile with on a CPU (`clover_jax.training.steps.CPU_COMPILER_OPTIONS`) and with XLA's defaults (its YNNPACK
fusions on). `--set KEY=VALUE` overrides the config (as train.py's); `--out PATH` writes the results JSON.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import toolkit

VARIANTS = {
    "online": dict(positions=False, dv=False, features=False),
    "packed": dict(positions=True, dv=False, features=False),
    "packed+dv": dict(positions=True, dv=True, features=False),
    "packed+dv+features": dict(positions=True, dv=True, features=True),
}


def _main(argv=None):
    import jax

    from clover_jax.training.config import load_config
    from clover_jax.parallel import make_mesh
    from clover_jax.training import data as data_lib
    from clover_jax.training.features import attach_features
    from clover_jax.training.run import draft_vocab_of, load_base
    from clover_jax.training import steps as steps_lib
    from clover_jax.training.trainer import Trainer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2-135m-clover2.yaml")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant (after one compile step)")
    ap.add_argument("--length", type=int, default=384, help="padded sequence length of every batch")
    ap.add_argument("--positions", type=int, default=64, help="packed cross-entropy positions per row")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--xla", nargs="+", default=["training"], choices=["training", "xla-default"],
                    help="the XLA options of the steps: the training's (CPU_COMPILER_OPTIONS) or XLA's defaults")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    toolkit.add_out_argument(ap)
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)

    base_cfg = load_config(args.config).replace(
        *args.set, "data.self_distill=false", f"data.num_conversations={4 * (args.steps + 1) * 3}",
        f"data.max_length={args.length}", f"data.bucket_boundaries=[{args.length}]", "train.eval_every=0",
        "mesh.data=1")
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    loaded = load_base(base_cfg, mesh)
    convs = data_lib.load_conversations(base_cfg.data)
    train, _ = data_lib.build_datasets(base_cfg.data, loaded.tokenizer, convs)
    batcher = data_lib.BucketedBatcher(train, base_cfg.data.batch_size, [args.length], seed=0, shuffle=False)
    t0 = time.perf_counter()
    attach_features(batcher, loaded.model, progress=False)
    feat_s = time.perf_counter() - t0
    batches = [next(batcher) for _ in range(args.steps + 1)]
    ids, _ = draft_vocab_of(batcher.dataset, args.draft_vocab, loaded.config.eos_token_ids)

    rows = []
    training_options = dict(steps_lib.CPU_COMPILER_OPTIONS)
    for name in args.variants:
        for xla in args.xla:
            v = VARIANTS[name]
            cfg = base_cfg.replace(f"loss.vocab_positions_per_row={args.positions if v['positions'] else 0}",
                                   f"loss.draft_vocab={str(v['dv']).lower()}",
                                   f"train.draft_vocab_size={args.draft_vocab}")
            steps_lib.CPU_COMPILER_OPTIONS = training_options if xla == "training" else {}
            trainer = Trainer(cfg, loaded.model, mesh=mesh, vocab_ids=ids if v["dv"] else None)
            strip = (lambda b: b) if v["features"] else (lambda b: {k: x for k, x in b.items() if k != "features"})
            t0 = time.perf_counter()
            jax.block_until_ready(trainer.train_step(strip(batches[0])))
            compile_s = time.perf_counter() - t0
            times = []
            for b in batches[1:]:
                t0 = time.perf_counter()
                jax.block_until_ready(trainer.train_step(strip(b)))
                times.append(time.perf_counter() - t0)
            tokens = float(np.mean([b["valid"].sum() for b in batches[1:]]))
            step = float(np.median(times))
            rows.append({"variant": name, "xla": xla, "step_s": round(step, 3), "tokens_per_step": tokens,
                         "tokens_per_s": round(tokens / step, 1), "compile_s": round(compile_s, 1)})
            del trainer
    steps_lib.CPU_COMPILER_OPTIONS = training_options
    ref = rows[0]["step_s"]
    print(f"\n{toolkit.machine()}, {jax.device_count()} device(s); batch {base_cfg.data.batch_size} x {args.length}, median of {args.steps} steps")
    print(f"base features for {len(train)} examples: {feat_s:.1f} s, computed once "
          f"({float(batcher.dataset.lengths.sum()) / feat_s:.0f} tokens/s)")
    print("| variant | XLA options | step s | real tokens / step | tokens/s | speed vs first | compile s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['xla']} | {r['step_s']} | {r['tokens_per_step']:.0f} | {r['tokens_per_s']} | "
              f"{ref / r['step_s']:.2f}x | {r['compile_s']} |")
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="train_step", title="Training step on this machine: the step's variants and XLA "
        "options", settings=f"batch {base_cfg.data.batch_size} x {args.length} tokens, median of {args.steps} steps",
        rows=rows, feature_seconds=round(feat_s, 1)))


def main(argv=None) -> int:
    """Runs the benchmark; bad input is one `error: ...` line and exit status 2 (`clover_jax.cli`)."""
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
