"""The shipped large configs compiled for TPU slices on this machine (`clover_jax.tpu`): does the training step fit
a chip, how close the memory plan's estimate comes to what the TPU compiler says, and what decoding holds per chip.

  python bench/tpu_compile.py --out results/2026-12-05-tpu-compile.json
  python bench/tpu_compile.py --configs configs/llama3-8b-instruct-clover2.yaml --train-slices v5e-16 \\
      --decode-slices v6e-8 --batch-sizes 8 --out /tmp/tpu.json

Training: each config's own mesh, batch, sequence length, remat and loss on each `--train-slices` slice (the base's
shapes from `clover_jax.io.shapes`: nothing downloaded). Decoding: each config's base in bfloat16, its head with its
type's default tree and the autoregressive loop, `--batch-sizes` rows of `--prompt-length` tokens and
`--max-new-tokens`, the weights split over each `--decode-slices` slice (tp = its chips). Compile seconds are this
machine's. Writes one JSON file (`--out`) that scripts/render_results.py renders.

  python bench/tpu_compile.py --steps --out results/2026-12-05-tpu-steps.json

`--steps`: one decoding step as the TPU compiler sees it, Llama-3-8B's shapes in bfloat16 (`--step-model`), per
`--decode-slices` slice and `--batch-sizes` batch: the autoregressive step and the speculative step (draft, verify,
accept, commit) of each head type on the tree its tau was measured on at an equal training budget
(`--tau-from`, bench/head_types.py's file), a 26-token tree and a head-less lookup chain, layers unrolled
(`clover_jax.generation.compiled.compile_steps`): flops, XLA's bytes accessed, the HBM traffic read off the
compiled program (`clover_jax.tpu.hbm_traffic`) against the per-chip floor (weights + KV cache + draft head), and
a predicted speed-up: the measured tau times the autoregressive step's HBM traffic over the speculative step's (a
prediction for a step bound by reading HBM, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: JAX itself runs on the CPU

import toolkit  # noqa: E402
from clover_jax import tpu  # noqa: E402
from clover_jax.generation.compiled import compile_decoding, compile_steps  # noqa: E402
from clover_jax.heads import registry  # noqa: E402
from clover_jax.io.shapes import plan_base_config  # noqa: E402
from clover_jax.training.compiled import compile_training_step  # noqa: E402
from clover_jax.training.config import load_config  # noqa: E402
from clover_jax.training.memory import estimate_training_memory  # noqa: E402
from clover_jax.validation import InputError  # noqa: E402

CONFIGS = ["configs/llama3-8b-instruct-clover2.yaml", "configs/vicuna-7b-v1.5-clover2.yaml",
           "configs/vicuna-7b-v1.5-eagle.yaml", "configs/vicuna-7b-v1.5-medusa.yaml",
           "configs/vicuna-7b-v1.5-redrafter.yaml"]


def machine() -> str:
    return toolkit.machine(f"{tpu.libtpu_requirement()} (libtpu {tpu.find_libtpu()})")


def train_rows(configs, slices) -> list[dict]:
    rows = []
    for path in configs:
        cfg = load_config(path)
        base = plan_base_config(cfg.model.name_or_path)
        for name in slices:
            sl = tpu.parse_slice(name)
            row = {"config": os.path.basename(path), "slice": sl.name, "hbm": sl.hbm}
            try:
                mesh = tpu.slice_mesh(sl, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp)
                row["mesh"] = {a: int(mesh.shape[a]) for a in ("data", "fsdp", "tp")}
                est = estimate_training_memory(cfg, base, mesh, platform="tpu")
                row["estimate"] = est.total
                row["estimate_items"] = est.items
                row["compiled"] = compile_training_step(cfg, base, mesh).as_dict()
            except InputError as e:
                row["error"] = str(e)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "estimate_items"}), flush=True)
    return rows


def decode_rows(configs, slices, batch_sizes, prompt_length, max_new_tokens) -> list[dict]:
    rows, bases_done = [], set()
    for path in configs:
        cfg = load_config(path)
        base = plan_base_config(cfg.model.name_or_path)
        tree = registry.get(cfg.head.type).default_tree
        for name in slices:
            sl = tpu.parse_slice(name)
            mesh = tpu.slice_mesh(sl, data=1, fsdp=1, tp=sl.chips)
            for batch in batch_sizes:
                runs = [("ar", None, None)] if (cfg.model.name_or_path, name, batch) not in bases_done else []
                bases_done.add((cfg.model.name_or_path, name, batch))
                runs.append(("speculative", cfg.head.type, tree))
                for mode, head_type, spec in runs:
                    row = {"config": os.path.basename(path), "base": os.path.basename(cfg.model.name_or_path),
                           "slice": sl.name, "hbm": sl.hbm, "mode": mode, "head": head_type, "tree": spec,
                           "batch": batch, "prompt_length": prompt_length, "max_new_tokens": max_new_tokens}
                    try:
                        prog = compile_decoding(base, mesh, mode=mode, head_type=head_type, head_options=cfg.head,
                                                tree=spec, batch=batch, prompt_length=prompt_length,
                                                max_new_tokens=max_new_tokens, dtype="bfloat16")[0]
                        row["compiled"] = prog.as_dict()
                    except InputError as e:
                        row["error"] = str(e)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def measured_tau(path: str) -> dict[str, dict]:
    """{head type: {"tree", "tau", "set"}} of the equal-budget heads of a bench/head_types.py file (first set)."""
    with open(path) as f:
        d = json.load(f)
    out = {}
    for h in d["heads"].values():
        if h.get("label") or h["type"] in out or h["type"] != h.get("type"):
            continue
        set_name, r = next(iter(h["sets"].items()))
        if "+" in r["tree"] or r["tree"].startswith("fit-"):  # a shipped head's fitted tree: not compiled here
            continue
        out[h["type"]] = {"tree": r["tree"], "tau": r["tau"], "set": set_name, "file": os.path.basename(path)}
    return out


def step_rows(model: str, slices, batch_sizes, cache_size: int, taus: dict, extra_trees) -> list[dict]:
    base = plan_base_config(model)
    rows = []
    for name in slices:
        sl = tpu.parse_slice(name)
        mesh = tpu.slice_mesh(sl, data=1, fsdp=1, tp=sl.chips)
        for batch in batch_sizes:
            plan = [("ar", [])] + [(t, [m["tree"]]) for t, m in taus.items()] + \
                [(t, [tree]) for t, tree in extra_trees]
            ar = None
            for head_type, trees in plan:
                results = compile_steps(base, mesh, head_type=None if head_type in ("ar", "none") else head_type,
                                        trees=trees, batch=batch, cache_size=cache_size)
                for prog, floor in (results if head_type == "ar" else results[1:]):
                    tree = trees[0] if trees else None
                    row = {"slice": sl.name, "batch": batch, "cache_size": cache_size,
                           "head": None if head_type in ("ar", "none") else head_type, "tree": tree,
                           "compiled": prog.as_dict(), "floor": floor,
                           "verified_tokens": int(re.search(r"\((\d+) tokens verified", prog.name).group(1))
                           if tree else 1}
                    if head_type == "ar":
                        ar = row
                    else:
                        row["hbm_vs_ar"] = prog.hbm_bytes / ar["compiled"]["hbm_bytes"]
                        m = taus.get(head_type)
                        if m and m["tree"] == tree:
                            row["tau"] = m["tau"]
                            row["tau_source"] = f"{m['file']}, {m['set']}"
                            row["predicted_speedup"] = m["tau"] / row["hbm_vs_ar"]
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "compiled"} |
                                     {"hbm": prog.hbm_bytes, "seconds": prog.seconds}), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=CONFIGS)
    p.add_argument("--train-slices", nargs="*", default=["v5e-16", "v6e-8", "v5p-8"])
    p.add_argument("--decode-slices", nargs="*", default=["v5e-8", "v6e-8"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", required=True, help="the results JSON to write")
    p.add_argument("--steps", action="store_true", help="one decoding step per head type as the compiler sees it")
    p.add_argument("--step-model", default="meta-llama/Meta-Llama-3-8B-Instruct")
    p.add_argument("--cache-size", type=int, default=1024, help="--steps: KV-cache slots per row")
    p.add_argument("--tau-from", default="results/2026-11-29-cpu-head-types.json")
    p.add_argument("--extra", nargs="*", default=["clover2:clover2-26", "eagle:dynamic-26", "none:lookup-4"],
                   help="--steps: more HEAD:TREE steps (none: head-less)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    header = dict(machine=machine(), machine_short="TPU compiler on a CPU")
    if args.steps:
        extra = [tuple(e.split(":", 1)) for e in args.extra]
        rows = step_rows(args.step_model, args.decode_slices, args.batch_sizes, args.cache_size,
                         measured_tau(args.tau_from), extra)
        out = toolkit.results(
            __file__, argv, benchmark="tpu_steps", title="One decoding step as the TPU compiler sees it: Llama-3-8B, "
            "every head type", source="written by bench/tpu_compile.py --steps", **header,
            settings=(f"{args.step_model}'s shapes, bfloat16, greedy, {args.cache_size} cache slots per row, tp = the "
                      "slice's chips, layers unrolled; random heads of each type's default shapes"),
            seconds=round(time.perf_counter() - t0, 1), steps=rows)
    else:
        train = train_rows(args.configs, args.train_slices)
        decode = decode_rows(args.configs, args.decode_slices, args.batch_sizes, args.prompt_length,
                             args.max_new_tokens)
        out = toolkit.results(
            __file__, argv, benchmark="tpu_compile", title="Compiled for TPU slices on a CPU: the shipped 7B/8B "
            "configs, per-chip memory", source="written by bench/tpu_compile.py", **header,
            settings=(f"training: each config's mesh, batch, sequence length and remat; decoding: bfloat16, batch "
                      f"{'/'.join(map(str, args.batch_sizes))}, prompts of {args.prompt_length} tokens (their "
                      f"bucket), {args.max_new_tokens} new tokens, greedy, tp = the slice's chips, each head type's "
                      "default tree"),
            seconds=round(time.perf_counter() - t0, 1), train=train, decode=decode)
    toolkit.write_results(args.out, out)
    print(f"({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
