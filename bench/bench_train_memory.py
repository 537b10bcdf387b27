"""Training memory: the estimate and the compiled step's check (`clover_jax.training.memory`) against the peak
resident memory of real runs.

Each point is a real run of `run_experiment` in a child process: `configs/smollm2-135m-clover2.yaml` with the point's
`--set` overrides, `--steps` optimizer steps on synthetic rows of exactly `data.max_length` tokens (every row full,
the longest bucket), through the data path of `train.py` from the tokenized data set on (a `TokenizedDataset`, the
`BucketedBatcher`, the base features with `train.cache_features`), and its peak resident memory: `ru_maxrss` of the
child (`os.wait4`). The run's own check before step 1 says what it predicts (`compiled_peak`: the process's resident
memory then, plus what XLA's buffers of the compiled step add, `CompiledTrainingMemory.peak`). A second child
compiles the same training step without running it and reads XLA's buffer assignment (`Compiled.memory_analysis()`:
arguments + outputs + temporaries) and what the check would predict there. A point whose estimate passes
`--limit-gib` (or whose compiled check's prediction does) is not run (its compiled buffers only); a run that passes
the limit anyway is stopped there (its peak then reads ">= limit"). One child at a time.

  python bench/bench_train_memory.py --limit-gib 14 --out results/2026-12-05-cpu-train-memory.json   # every point
  python bench/bench_train_memory.py --points smollm2 --lengths 256 1024 --out /tmp/m.json
  python bench/bench_train_memory.py --reestimate results/2026-12-05-cpu-train-memory.json   # after a formula change
                                                    # (and the compiled check's prediction from its recorded parts)
  python scripts/render_results.py                                  # the table in docs/training.md

All the points take about an hour and a half on 2 cores (the longest rows most of it); the limit keeps a run below what
the host has, and a run waits until the host has its estimate free (others may share it).

Bases: `smollm2` is SmolLM2-135M-Instruct (30 layers, D=576, 9 heads, context 8,192); `random` a random 2-layer
Llama with SmolLM2's vocabulary (D=64, 4 heads) and a 16,384-token context, so 9,000-token rows train for real.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2-135m-clover2.yaml"
GIB = 1024 ** 3
WHOLE_VOCAB = ["loss.vocab_positions_per_row=0", "loss.draft_vocab=false", "train.cache_features=false"]

# name: (base, [(batch, length, extra overrides), ...], what the overrides mean)
POINTS = {
    "smollm2": ("smollm2", [(1, t, ["loss.vocab_chunk=64"]) for t in (256, 1024, 2048, 4096, 6144, 8192)],
                "the shipped config (cached base features, 64 packed positions, 8,192-token draft vocabulary)"),
    "smollm2-online": ("smollm2", [(1, t, ["loss.vocab_chunk=64", "train.cache_features=false"])
                                   for t in (256, 2048, 4096, 8192)],
                       "the shipped config with the base run in every step (train.cache_features=false)"),
    "random": ("random", [(1, t, ["loss.vocab_chunk=64", "train.cache_features=false"])
                          for t in (256, 1024, 2048, 4096, 6144, 9000)],
               "the shipped config on the random base, run in every step"),
    "short": ("random", [(4, 128, WHOLE_VOCAB), (16, 128, WHOLE_VOCAB),
                         (32, 128, WHOLE_VOCAB + ["loss.vocab_chunk=32"])],
              "the whole vocabulary in the cross-entropy, base run in every step"),
    "long-whole-vocab": ("random", [(1, t, WHOLE_VOCAB + ["loss.vocab_chunk=0", "head.num_heads=3"])
                                    for t in (512, 1024, 2048, 3072, 4096)],
                         "three heads, the whole vocabulary at every position of long rows (no chunking)"),
    "smollm2-short": ("smollm2", [(8, 128, WHOLE_VOCAB), (16, 256, WHOLE_VOCAB + ["loss.vocab_chunk=64"])],
                      "the whole vocabulary in the cross-entropy, base run in every step"),
    "tiny": ("random", [(1, 64, WHOLE_VOCAB)], "a quick check that the script runs (not a point of the table)"),
}


def random_base_config():
    from clover_jax.models.config import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384)


def point_config(base: str, batch: int, length: int, extra: list[str], steps: int, out_dir: str):
    from clover_jax.training.config import load_config

    return load_config(str(CONFIG), [
        f"data.batch_size={batch}", f"data.max_length={length}", "mesh.data=1", f"train.steps={steps}",
        "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=0", "checkpoint.save_every=1000",
        f"train.output_dir={out_dir}", "train.check_memory=false",
        *(["model.name_or_path=random"] if base == "random" else []), *extra])


# ------------------------------------------------------------------------------------------------- child
def _pipeline(cfg, base, vocab_file: Path):
    """(batcher, draft vocabulary ids or None): synthetic full-length rows through the training data path."""
    import numpy as np

    from clover_jax.heads.draft_vocab import save_draft_vocab
    from clover_jax.training.batching import BucketedBatcher
    from clover_jax.training.dataset import Example, TokenizedDataset
    from clover_jax.training.features import attach_features

    t, rows = cfg.data.max_length, cfg.data.batch_size * cfg.train.steps
    rng = np.random.default_rng(0)
    examples = []
    for i in range(rows):
        tokens = rng.integers(0, base.config.vocab_size, t).astype(np.int32)
        mask = (np.arange(t) >= min(16, t // 4)).astype(np.int32)  # a short prompt, then the trained reply
        examples.append(Example(f"row{i}", tokens, mask))
    dataset = TokenizedDataset(examples, pad_id=0, max_length=t)
    batcher = BucketedBatcher(dataset, cfg.data.batch_size, cfg.data.bucket_boundaries, seed=0, shuffle=False)
    if cfg.train.cache_features:
        attach_features(batcher, base, progress=False)
    ids = None
    if cfg.loss.draft_vocab:  # the draft vocabulary's size as the config says (synthetic rows may hold fewer ids)
        ids = np.arange(cfg.train.draft_vocab_size, dtype=np.int32)
        save_draft_vocab(vocab_file, ids, source="bench_train_memory")
    return batcher, ids


def _load(base_name: str, cfg, mesh):
    if base_name == "random":
        from clover_jax.models.llama import init_llama

        return init_llama(random_base_config(), seed=0)
    from clover_jax.training.run import load_base

    return load_base(cfg, mesh)


def child(spec: dict) -> dict:
    """One point in this process: `spec["mode"]` "run" (train, report the estimate) or "compile" (XLA's buffers)."""
    with tempfile.TemporaryDirectory(prefix="bench_train_memory_") as tmp:
        return _child(spec, Path(tmp))


def _child(spec: dict, tmp: Path) -> dict:
    import jax
    import numpy as np

    from clover_jax import parallel
    from clover_jax.training import memory

    cfg = point_config(spec["base"], spec["batch"], spec["length"], spec["extra"], spec["steps"], str(tmp / "run"))
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    loaded = _load(spec["base"], cfg, mesh)
    base = loaded.model if hasattr(loaded, "model") else loaded
    vocab_file = tmp / "draft_vocab.json"
    est = memory.estimate_training_memory(cfg, base.config, mesh)
    out = {"estimate": est.total, "items": est.items}
    if spec["mode"] == "run":
        from clover_jax.training.run import run_experiment

        batcher, ids = _pipeline(cfg, base, vocab_file)
        if ids is not None:
            cfg = cfg.replace(f"train.draft_vocab_from={vocab_file}")
        t0 = time.perf_counter()
        summary = run_experiment(cfg, progress=False, mesh=mesh, loaded=loaded, batcher=batcher, eval_batches=[])
        out.update(steps=summary["final_step"], seconds=round(time.perf_counter() - t0, 1), compiled=summary["memory"])
        return out
    from clover_jax.training.features import feature_program, feature_rows
    from clover_jax.training.trainer import Trainer

    batcher, ids = _pipeline(cfg.replace("train.cache_features=false"), base, vocab_file)
    trainer = Trainer(cfg, base, mesh=mesh, vocab_ids=ids)
    mem = memory.compiled_training_memory(cfg, base.config, mesh, *trainer.compile_step())
    out["compiled"] = mem.as_dict()
    out["xla"] = {"arguments": mem.arguments, "outputs": mem.outputs, "aliased": mem.aliased,
                  "temporaries": mem.temporaries}
    out["xla_step"] = mem.step
    if cfg.train.cache_features:  # the base's pass over the data before training: its own program
        rows, t = feature_rows(cfg.data.max_length), cfg.data.max_length
        forward, state = feature_program(base)
        tokens = jax.ShapeDtypeStruct((rows, t), np.int32)
        m = forward.lower(state, tokens, tokens.update(dtype=np.bool_)).compile().memory_analysis()
        out["xla_features"] = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    return out


# ------------------------------------------------------------------------------------------------ parent
def _available() -> int:
    """MemAvailable of /proc/meminfo, bytes (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def wait_for_memory(need: float, patience: float) -> bool:
    """Waits up to `patience` seconds until the host has `need` bytes available (others share it)."""
    t0 = time.monotonic()
    while _available() < need:
        if time.monotonic() - t0 > patience:
            return False
        time.sleep(10)
    return True


def run_child(spec: dict, limit: int, timeout: float) -> tuple[dict | None, int, str]:
    """(the child's report or None, its peak resident bytes, "" or why it stopped): one point in a new process."""
    import toolkit  # the bench scripts' shared module (not needed by the functions the tests import alone)

    child_run = toolkit.run_child(__file__, spec, env={"CLOVER_JAX_COMPILE_CACHE": "off"}, limit_bytes=limit,
                                  timeout=timeout, check=False)
    return child_run.report, child_run.peak_bytes, child_run.stopped


def base_config(base: str):
    """The base's `LlamaConfig` (shapes only: nothing loaded)."""
    if base == "random":
        return random_base_config()
    from clover_jax.io.loader import base_config_of

    return base_config_of("smollm2-135m-instruct")


def reestimate(path: Path) -> None:
    """Rewrites the estimate of every row of a results file with the estimate as the code computes it now."""
    from clover_jax.training import memory

    result = json.loads(path.read_text())
    for row in result["rows"]:
        cfg = point_config(row["base"], row["batch"], row["length"], row["settings"], result["steps"], "unused")
        est = memory.estimate_training_memory(cfg, base_config(row["base"]), 1)
        row["estimate"], row["items"] = est.total, est.items
        m = row.get("measured")
        row["error"] = (est.total - m) / m if m and not row.get("note") else None
        c = row.get("compiled")
        if c and c.pop("host", 0):  # the compiled check's prediction from its recorded parts, as the code adds them
            fields = {k: v for k, v in c.items() if k not in ("step", "added", "peak")}
            c.update(memory.CompiledTrainingMemory(**fields).as_dict())
            row["compiled_peak"] = c["peak"]
            row["compiled_error"] = (c["peak"] - m) / m if m and not row.get("note") else None
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"rewrote the estimates of {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="+", default=[p for p in POINTS if p != "tiny"], choices=list(POINTS))
    ap.add_argument("--lengths", nargs="+", type=int, help="only these data.max_length values")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    ap.add_argument("--limit-gib", type=float, default=16.0,
                    help="no run whose estimate passes this; a run that does is stopped there")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per child")
    ap.add_argument("--no-compile", action="store_true", help="skip XLA's buffer assignment of each step")
    ap.add_argument("--out", help="write the results JSON here (as results/*.json: scripts/render_results.py)")
    ap.add_argument("--reestimate", metavar="RESULTS_JSON",
                    help="only recompute the estimates of a results file with the code as it is (measurements kept)")
    import toolkit  # the bench scripts' shared module (not needed by the functions the tests import alone)

    if toolkit.serve_child(argv, child):
        return 0
    args = ap.parse_args(argv)
    if args.reestimate:
        reestimate(Path(args.reestimate))
        return 0
    limit = int(args.limit_gib * GIB)
    rows = []
    for name in args.points:
        base, cases, what = POINTS[name]
        for batch, length, extra in cases:
            if args.lengths and length not in args.lengths:
                continue
            spec = {"base": base, "batch": batch, "length": length, "extra": extra, "steps": args.steps}
            row = {"points": name, "base": base, "batch": batch, "length": length, "settings": extra, "what": what}
            if not args.no_compile:
                compiled, _, why = run_child({**spec, "mode": "compile"}, limit, args.timeout)
                if compiled is None:
                    raise SystemExit(f"{name} {batch}x{length}: compiling the step {why}")
                row.update(estimate=compiled["estimate"], items=compiled["items"], xla_step=compiled["xla_step"],
                           xla=compiled["xla"], xla_features=compiled.get("xla_features"),
                           compiled_peak=compiled["compiled"]["peak"], compiled=compiled["compiled"])
            expected = max(row.get("estimate", 0), row.get("compiled_peak", 0))
            if expected > limit:
                row["measured"], row["note"] = None, (f"not run: the compiled check's prediction passes the "
                                                      f"{args.limit_gib:.0f} GiB limit")
            elif not wait_for_memory(1.15 * expected, args.timeout):
                row["measured"], row["note"] = None, "not run: the host did not have the memory free"
            else:
                report, peak, why = run_child({**spec, "mode": "run"}, limit, args.timeout)
                row["measured"] = peak
                if report:
                    row.update(estimate=report["estimate"], items=report["items"], seconds=report["seconds"],
                               compiled_peak=report["compiled"]["peak"], compiled=report["compiled"])
                if why:
                    row["note"] = why
            m, e, c = row.get("measured"), row.get("estimate"), row.get("compiled_peak")
            row["error"] = (e - m) / m if m and e and not row.get("note") else None
            row["compiled_error"] = (c - m) / m if m and c and not row.get("note") else None
            rows.append(row)
            print(f"{name:15s} batch {batch:2d} x {length:5d}: estimate {e / GIB:6.2f} GiB"
                  + (f", XLA step {row['xla_step'] / GIB:6.2f} GiB" if row.get("xla_step") else "")
                  + (f", measured {m / GIB:6.2f} GiB" if m else "")
                  + (f" ({row['error']:+.0%})" if row["error"] is not None else "")
                  + (f", compiled check {c / GIB:6.2f} GiB" if c else "")
                  + (f" ({row['compiled_error']:+.0%})" if row["compiled_error"] is not None else "")
                  + (f"  [{row['note']}]" if row.get("note") else ""), flush=True)
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="train_memory", title="Training memory: the estimate against the peak resident "
        "memory", machine=toolkit.machine(f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB"),
        settings=f"{args.steps} optimizer steps per point, runs above {args.limit_gib:.0f} GiB not started",
        steps=args.steps, limit_gib=args.limit_gib, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
