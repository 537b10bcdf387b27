"""`python -m clover_jax.cli.memory_plan`: what one training step of a config holds per device on a few TPU and GPU
slices, by item, and whether it fits, before renting any of them (`clover_jax.training.memory`).

    python -m clover_jax.cli.memory_plan --config configs/llama3-8b-instruct-clover2.yaml              # every target
    python -m clover_jax.cli.memory_plan --config configs/vicuna-7b-v1.5-clover2.yaml --target v5e-8 --target v4-32
    python -m clover_jax.cli.memory_plan --config configs/x.yaml --set data.batch_size=32 --base /data/my-model
    python -m clover_jax.cli.memory_plan --config configs/llama3-8b-instruct-clover2.yaml --topology v5e-16 \
        --topology v6e-8     # also the step compiled for these TPU slices (clover_jax.tpu), beside the estimate

The config's own mesh, batch, sequence length and loss settings are used on each target's device count. The base
model's shapes come from `--base` or the config's `model.name_or_path` when that is a local folder, GGUF file or
known name, else from the shapes of the models the shipped configs name (`KNOWN_SHAPES`, matched by the last part
of the path or hub id), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from clover_jax import tpu
from clover_jax.cli import add_debug_argument, run_cli
from clover_jax.cli.compile_only import compile_only_process
from clover_jax.decoding.memory import GIB
from clover_jax.io.shapes import KNOWN_SHAPES, plan_base_config  # noqa: F401 (KNOWN_SHAPES: for scripts)
from clover_jax.models.config import LlamaConfig
from clover_jax.parallel import MeshError
from clover_jax.training.compiled import compile_training_step
from clover_jax.training.config import add_config_arguments, config_from_args
from clover_jax.training.memory import SAFETY, estimate_training_memory, suggestions
from clover_jax.validation import InputError

GB_PER_DEVICE = {"v5e": 16, "v4": 32, "H100": 80}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    devices: int  # the JAX devices of the slice
    memory: int  # bytes per device
    platform: str


TARGETS = {t.name: t for t in (
    Target("v5e-8", 8, 16 * GIB, "tpu"),  # 8 chips of 16 GiB HBM
    Target("v4-32", 16, 32 * GIB, "tpu"),  # 16 chips of 32 GiB (32 TensorCores; megacore: one JAX device per chip)
    Target("8xH100", 8, 80 * GIB, "gpu"),  # 8 GPUs of 80 GiB
)}

ITEMS = ("frozen base", "gathered weights", "head", "optimizer", "gradients", "base forward", "head activations",
         "logits", "batch")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def plan_table(cfg, base_config: LlamaConfig, targets: list[Target]) -> tuple[str, list[str]]:
    """(a Markdown table of GiB per device by item and target, notes: meshes that do not fit a target, the
    settings that would fit where it does not)."""
    columns, notes = [], []
    for t in targets:
        try:
            est = estimate_training_memory(cfg, base_config, t.devices, platform=t.platform)
        except MeshError as e:
            notes.append(f"{t.name}: {e}")
            columns.append(None)
            continue
        columns.append(est)
        budget = t.memory * SAFETY
        if est.total > budget:
            fixes = suggestions(cfg, base_config, est, budget, t.platform)
            notes.append(f"{t.name}: {_gib(est.total)} GiB per device does not fit {SAFETY:.0%} of "
                         f"{_gib(t.memory)} GiB; " + ("; ".join(fixes) if fixes else "no single setting fits"))
    head = "| GiB per device | " + " | ".join(t.name for t in targets) + " |"
    rows = [head, "|---|" + "---:|" * len(targets)]

    def row(label, cell):
        rows.append(f"| {label} | " + " | ".join("-" if e is None else cell(t, e) for t, e in zip(targets, columns))
                    + " |")

    row("mesh (data x fsdp x tp)", lambda t, e: f"{e.sizes['data']} x {e.sizes['fsdp']} x {e.sizes['tp']}")
    row("rows per device", lambda t, e: str(e.rows))
    for item in ITEMS:
        row(item, lambda t, e, item=item: _gib(e.items.get(item, 0)))
    row("**total**", lambda t, e: f"**{_gib(e.total)}**")
    row("device memory", lambda t, e: _gib(t.memory))
    row("fits", lambda t, e: "yes" if e.total <= t.memory * SAFETY else "**no**")
    return "\n".join(rows), notes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--target", action="append", choices=sorted(TARGETS), default=None,
                   help="a slice to plan for (repeatable; default: all of them)")
    p.add_argument("--topology", action="append", default=[], metavar="SLICE",
                   help="also compile the step for this TPU slice (repeatable: v5e-16, v6e-8, v5p-8, ...) with the TPU "
                   "compiler on this machine, and show its per-chip memory beside the estimate")
    p.add_argument("--base", default=None, metavar="NAME_OR_PATH",
                   help="read the base model's shapes from here instead of model.name_or_path")
    add_debug_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run_cli(_main, argv)


def _main(argv=None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    base_config = plan_base_config(args.base or cfg.model.name_or_path)
    targets = [TARGETS[name] for name in (args.target or TARGETS)]
    table, notes = plan_table(cfg, base_config, targets)
    print(f"{args.config or 'defaults'}: data.batch_size={cfg.data.batch_size}, data.max_length={cfg.data.max_length}, "
          f"loss.vocab_chunk={cfg.loss.vocab_chunk}, mesh fsdp={cfg.mesh.fsdp} tp={cfg.mesh.tp}, "
          f"train.remat={str(cfg.train.remat).lower()}, {cfg.model.param_dtype} base")
    print(table)
    for note in notes:
        print(f"- {note}")
    if args.topology:
        slices = [tpu.parse_slice(name) for name in args.topology]
        compile_only_process()
        print()
        print(compiled_table(cfg, base_config, slices))
    return 0


def compiled_table(cfg, base_config: LlamaConfig, slices: list[tpu.Slice]) -> str:
    """A Markdown table: per slice, the step compiled by the TPU compiler against the estimate, per chip."""
    rows = ["| per chip | mesh (data x fsdp x tp) | estimate | compiled (arguments + temporaries + outputs) | "
            "compiled / estimate | HBM | fits | compile s |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for sl in slices:
        try:
            mesh = tpu.slice_mesh(sl, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp)
            est = estimate_training_memory(cfg, base_config, mesh, platform="tpu")
            prog = compile_training_step(cfg, base_config, mesh)
        except InputError as e:  # a mesh or batch this slice cannot take: said in its row
            rows.append(f"| {sl.name} | {e} | - | - | - | {tpu.fmt(sl.hbm)} | - | - |")
            continue
        rows.append(f"| {sl.name} | {mesh.shape['data']} x {mesh.shape['fsdp']} x {mesh.shape['tp']} | "
                    f"{tpu.fmt(est.total)} | {tpu.fmt(prog.total)} | {prog.total / max(est.total, 1):.2f} | "
                    f"{tpu.fmt(sl.hbm)} | {'yes' if prog.fits(sl.hbm) else '**no**'} | {prog.seconds:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
