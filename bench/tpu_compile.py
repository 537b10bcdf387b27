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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: JAX itself runs on the CPU

import jax  # noqa: E402

from clover_jax import tpu  # noqa: E402
from clover_jax.generation.compiled import compile_decoding  # noqa: E402
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
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, jax {jax.__version__}, "
            f"{tpu.libtpu_requirement()} (libtpu {tpu.find_libtpu()})")


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=CONFIGS)
    p.add_argument("--train-slices", nargs="*", default=["v5e-16", "v6e-8", "v5p-8"])
    p.add_argument("--decode-slices", nargs="*", default=["v5e-8", "v6e-8"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", required=True, help="the results JSON to write")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    train = train_rows(args.configs, args.train_slices)
    decode = decode_rows(args.configs, args.decode_slices, args.batch_sizes, args.prompt_length,
                         args.max_new_tokens)
    out = {"title": "Compiled for TPU slices on a CPU: the shipped 7B/8B configs, per-chip memory",
           "date": datetime.date.today().isoformat(), "machine": machine(),
           "machine_short": "TPU compiler on a CPU", "benchmark": "tpu_compile",
           "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
           "source": "written by bench/tpu_compile.py",
           "settings": (f"training: each config's mesh, batch, sequence length and remat; decoding: bfloat16, batch "
                        f"{'/'.join(map(str, args.batch_sizes))}, prompts of {args.prompt_length} tokens (their "
                        f"bucket), {args.max_new_tokens} new tokens, greedy, tp = the slice's chips, each head type's "
                        "default tree"),
           "seconds": round(time.perf_counter() - t0, 1), "train": train, "decode": decode}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
