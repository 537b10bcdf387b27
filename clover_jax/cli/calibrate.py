"""`python -m clover_jax.cli.calibrate`: calibrates `tree="auto"` for a head on this hardware
(`clover_jax.tuning.calibrate`) and prints the table of what it measured; with `--quick`, measures again the choice
a request with no tree gets, comparing every shipped head's default tree, the head-less chains and plain decoding
(`clover_jax.tuning.choose`; a request alone compares its default tree with plain decoding).

    python -m clover_jax.cli.calibrate --model smollm2-135m-instruct --head smollm2-135m-instruct-clover2
    python -m clover_jax.cli.calibrate --quick --model smollm2-135m-instruct            # every shipped head, the chains, AR
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from clover_jax import pretrained
from clover_jax.cli import add_debug_argument, run_cli
from clover_jax.decoding.tree import get_tree
from clover_jax.generation.calibration import AR
from clover_jax.heads.bundle import open_head
from clover_jax.heads.draft_vocab import head_draft_vocab
from clover_jax.heads.folder import fitted_trees
from clover_jax.io.loader import load_model
from clover_jax.io.prompts import read_prompts
from clover_jax.parallel import parse_mesh
from clover_jax.training.checkpoint import load_head_from_run
from clover_jax.training.loading import load_head
from clover_jax.tuning.calibrate import DYNAMIC_CANDIDATES, STATIC_CANDIDATES, resolve_auto
from clover_jax.tuning.choose import choose
from clover_jax.validation import InputError, check_int


# ------------------------------------------------------------------------------------------------ CLI
def main(argv=None) -> int:
    return run_cli(_main, argv)


def _main(argv=None) -> int:

    ap = argparse.ArgumentParser(prog="python -m clover_jax.cli.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default=None, help="registered name or folder (default: the model's first shipped "
                    "head; with --quick, all of them)")
    ap.add_argument("--quick", action="store_true", help="measure again what a request with no tree gets, comparing "
                    "every shipped head's tree, the head-less chains and plain decoding, and print it (how long it takes: "
                    "docs/trees.md)")
    ap.add_argument("--prompts-file", help="questions to calibrate on (default: 8 Spec-Bench questions outside "
                    "MT-Bench: translation, QA, math)")
    ap.add_argument("--limit", type=int, default=8, help="the first N questions of --prompts-file")
    ap.add_argument("--candidates", nargs="+", help=f"trees to try (default: {' '.join(STATIC_CANDIDATES)} "
                    f"{' '.join(DYNAMIC_CANDIDATES)}, those the head supports)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--mesh", default=None, help="calibrate sharded decoding, e.g. 'tp=8'")
    ap.add_argument("--no-fit", action="store_true", help="measure the candidates only: no probe tree and no trees "
                    "fitted to the head's per-rank acceptance")
    add_debug_argument(ap)
    args = ap.parse_args(argv)
    check_int("--batch-size", args.batch_size, minimum=1)  # before the model loads
    check_int("--limit", args.limit, minimum=1)
    check_int("--max-new-tokens", args.max_new_tokens, minimum=1)
    mesh = None
    if args.mesh:
        mesh = parse_mesh(args.mesh)
    loaded = load_model(args.model, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32, mesh=mesh)
    if args.quick:
        return _quick(loaded, args, mesh)
    args.head = args.head or pretrained.default_head(args.model)
    if args.head is None:
        raise InputError(f"--head: {args.model} has no shipped head; pass one")
    head = load_head(args.head, loaded.model)
    prompts = read_prompts(args.prompts_file, limit=args.limit) if args.prompts_file else None
    best, entry = resolve_auto(loaded, head, args.head, batch_size=args.batch_size, mesh=mesh, recalibrate=True,
                               draft_vocab=head_draft_vocab(args.head), prompts=prompts,
                               candidates=args.candidates, max_new_tokens=args.max_new_tokens, progress=True,
                               fit=not args.no_fit)
    print(f"\n{entry['prompts']} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens; "
          f"autoregressive {entry['ar_tokens_per_second']:.1f} tokens/s; {entry['greedy_mismatches']} greedy "
          "mismatches\n")
    print("| tree | nodes | tau | speedup vs AR | tokens/s | final round: speedup | fitted: predicted tau / speedup |")
    print("|---|---|---|---|---|---|---|")
    fitted_here = fitted_trees({"entries": {"this": entry}})  # names this calibration fitted (fit-N-<hash>, probe-...)
    for tree, r in sorted(entry["candidates"].items(), key=lambda kv: -kv[1]["speedup"]):
        fitted = f"{r['predicted_tau']:.3f} / {r['predicted_speedup']:.3f}" if r.get("fitted") else ""
        final = r["final_speedup"] if "final_speedup" in r else (r["speedup"] if r.get("fitted") or r.get("lookup")
                                                                  else "")
        print(f"| {tree} | {get_tree(tree, fitted_here).num_nodes} | {r['tau']:.3f} | {r['speedup']:.3f} | "
              f"{r['tokens_per_second']:.1f} | {final} | {fitted} |")
    if entry.get("rank_acceptance"):
        print("\nacceptance per depth (rows) and child rank (columns), pooled over the static trees (the fit uses "
              "them smoothed: trees.fit.smooth_acceptance):")
        for d, row in enumerate(entry["rank_acceptance"]):
            print(f"  depth {d + 1}: " + " ".join(f"{x:.3f}" for x in row))
        for name, t in entry.get("trees", {}).items():
            print(f"  {name}: {t['choices']}")
    print(f"\nauto -> {best}" + (" (no tree beats autoregressive decoding here)" if best == AR else ""))
    return 0


def _quick(loaded, args, mesh) -> int:
    head = open_head(args.head, loaded.model, run_loader=load_head_from_run) if args.head else None
    choice = choose(loaded, head, batch_size=args.batch_size, mesh=mesh, refresh=True, model_source=args.model)
    entry = choice.entry
    print(f"\n{entry['new_tokens']} new tokens, batch {entry['batch_size']}, measured in {entry['seconds']} s\n")
    print("| head | tree | measured speed-up | tau measured | iteration cost (decode iterations) | tokens per "
          "iteration at this batch (source) | predicted |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(entry["candidates"].values(), key=lambda r: -r["predicted_speedup"]):
        print(f"| {r['head'] or '-'} | {r['tree']} | {r.get('measured_speedup', '-')} | {r.get('tau_measured', '-')} "
              f"| {r['step_cost']} "
              f"| {r['tau_batch']} ({r['tau_source']}) | {r['predicted_speedup']} |")
    print(f"\n{choice.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
