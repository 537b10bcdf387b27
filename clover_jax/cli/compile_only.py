"""`--compile-only --topology SLICE` of the command lines: compile for a TPU slice on this machine and say whether each
program fits a chip (`clover_jax.tpu`).

    python train.py --config configs/llama3-8b-instruct-clover2.yaml --compile-only --topology v5e-16
    python infer.py --model configs/llama3-8b-instruct-clover2.yaml --mode speculative --tree clover2-26 \\
        --compile-only --topology v6e-8 --batch-size 8

Each prints, per program and per chip, the arguments, temporaries, outputs and their total against the chip's HBM,
and the compile seconds. A program that does not fit ends the command with `error: ...` naming what to change and
exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import jax
from jax._src import xla_bridge

from clover_jax import tpu
from clover_jax.validation import InputError


def add_topology_arguments(parser: argparse.ArgumentParser, *, what: str) -> argparse.ArgumentParser:
    parser.add_argument("--compile-only", action="store_true",
                        help=f"compile {what} for the TPU slice --topology names, on this machine (no TPU, no weights: "
                        "the real TPU compiler), print per-chip memory against the chip's HBM and exit (status 2 when "
                        "a program does not fit)")
    parser.add_argument("--topology", default=None, metavar="SLICE",
                        help="with --compile-only: v5e-8, v5e-16, v6e-8, v4-8, v5p-8, ... (v4/v5p sizes count "
                        "TensorCores), a libtpu topology (v5e:4x4), or N slices (2xv5e-16)")
    return parser


def check_topology_arguments(args) -> tpu.Slice | None:
    """The slice of `--compile-only --topology` (None without `--compile-only`); an error for one without the
    other."""
    if args.topology and not args.compile_only:
        raise InputError(f"--topology {args.topology}: compiles only with --compile-only")
    if not args.compile_only:
        return None
    if not args.topology:
        raise InputError("--compile-only: give the TPU slice to compile for, e.g. --topology v5e-8")
    return tpu.parse_slice(args.topology)


def compile_only_process() -> None:
    """This process compiles only: JAX runs on the CPU (a machine with libtpu installed as a package would
    otherwise start it as a backend, and warn where there is no TPU); the TPU devices are compile-only ones."""
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def finish(sl: tpu.Slice, programs: Sequence[tpu.CompiledProgram], mesh, settings: str,
           lines: Sequence[str] = ()) -> int:
    """Prints the report (and `lines` after it); a program that does not fit is an `InsufficientMemoryError`."""
    print(tpu.report(sl, programs, mesh))
    for line in lines:
        print(line)
    sys.stdout.flush()
    tpu.check_fits(sl, programs, settings)
    print(f"fits: every program fits one {sl.generation.name} chip")
    return 0


__all__ = ["add_topology_arguments", "check_topology_arguments", "compile_only_process", "finish"]
