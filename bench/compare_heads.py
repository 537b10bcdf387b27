"""Draft heads side by side: tau, acceptance per depth, tokens/s and speed-up over our autoregressive loop (measured
in the same evaluation), greedy mismatches, and each head's training cost, on the same prompts and trees.

  python bench/compare_heads.py clover2 eagle medusa --runs runs --prefix compare-   # runs/compare-<head>
  python bench/compare_heads.py runs/a runs/b path/to/exported --trees chain-4 clover2-26 --limit 24
  python bench/compare_heads.py runs/a smollm2-135m-instruct-eagle@default --trees chain-4 --ar-once

A head is a training run folder, an exported folder or a registered head name. Every head runs the `--trees` its
type can draft (ReDrafter drafts beam policies only) plus its default tree (a shipped head's own, else its type's;
not with --no-default-tree); HEAD@TREE runs TREE alone on that head (HEAD@default: its default tree). A head
trained on a draft vocabulary drafts from it. Each head is opened once (`open_head_or_run`): its module, fitted
trees, draft vocabulary and n-gram table go to the evaluation as they are. `scripts/compare_heads.sh` trains the
heads on an equal budget and calls this; `bench/head_types.py` condenses its outputs into one results table.
Writes the results JSON to `--out` (benchmark `compare_heads`; compare.md and compare.png beside it) and prints the
markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import toolkit


def training_cost(run: Path) -> dict:
    """What a run folder says about its training: steps, wall time, tokens/s, tokens seen, held-out accuracy."""
    out = {}
    summary = run / "train_summary.jsonl"  # written by scripts/compare_heads.sh from train.py's output
    if summary.is_file():
        for line in summary.read_text().splitlines():
            try:
                out.update(json.loads(line))
            except json.JSONDecodeError:
                continue
    if out.get("train_time_s") and out.get("tokens_per_s"):
        out["tokens_seen"] = int(out["train_time_s"] * out["tokens_per_s"])
    return out


def unsupported(head_type, tree: str, ngram_table=None, known=None) -> str | None:
    """Why a head of this type cannot draft `tree` (merged `...+lookup-K[-table]` names included), or None."""
    from clover_jax.decoding.tree import get_tree
    from clover_jax.heads.registry import drafter_for
    from clover_jax.validation import InputError

    try:
        drafter_for(head_type.module_cls, get_tree(tree, known), None, ngram_table)
    except InputError as e:
        return str(e)
    return None


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="run folders, exported folders or registered names (see --prefix)")
    ap.add_argument("--runs", default=None, help="with --prefix: a bare head-type name X means RUNS/PREFIX+X")
    ap.add_argument("--prefix", default="")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--trees", nargs="+", default=["chain-4", "clover2-26"])
    ap.add_argument("--no-default-tree", action="store_true",
                    help="run only --trees (not also each head type's default tree; a head that can draft none of "
                         "them runs its default tree alone)")
    ap.add_argument("--ar-once", action="store_true",
                    help="time our autoregressive loop once, in the first head's evaluation, and compare every head "
                         "with that run (not again beside each head)")
    ap.add_argument("--questions", default="mt_bench")
    ap.add_argument("--categories", nargs="+", help="only these categories of --questions")
    ap.add_argument("--limit", type=int, default=24, help="prompts (spread over the categories); 0 = all")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ngram-table", help="n-gram table for trees named ...-table, for every head (python -m "
                    "clover_jax.decoding.ngram; a head folder with one); default: each head's own")
    toolkit.add_out_argument(ap, default="artifacts/compare_heads/compare.json",
                             what="the results JSON (compare.md and compare.png beside it)")
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)

    import jax
    from flax import nnx

    from clover_jax.decoding.ngram import load_ngram_table
    from clover_jax.heads import registry
    from clover_jax.io.loader import load_model
    from clover_jax.training.loading import open_head_or_run
    from clover_jax.tuning.evaluation import DV, evaluate

    loaded = load_model(args.model)
    prompts, cats = toolkit.load_questions(args.questions, args.limit or None, args.categories)
    shared = load_ngram_table(args.ngram_table) if args.ngram_table else None  # every head's, else each its own
    out = Path(args.out)
    rows, result = [], toolkit.results(
        __file__, argv, benchmark="compare_heads", title=f"Draft heads side by side: {args.questions}, "
        f"{len(prompts)} prompts", settings=f"{args.model}, batch {args.batch_size}, {args.max_new_tokens} new "
        "tokens, greedy", heads={}, prompts=len(prompts), args=vars(args))
    reference = None  # with --ar-once: the first head's autoregressive run
    for arg in args.heads:
        spec, _, own = arg.partition("@")  # HEAD@TREE: this head runs TREE alone ("default": its default tree)
        where = Path(args.runs) / f"{args.prefix}{spec}" if args.runs and spec in registry.names() else spec
        bundle = open_head_or_run(str(where), loaded.model)
        ht = registry.of_head(bundle.module)
        default = bundle.default_tree  # a shipped head's own default, else its type's
        asked = [default if own == "default" else own] if own else list(args.trees)
        table = lambda: shared or bundle.ngram_table  # noqa: E731 - read where a table tree needs it
        why = {t: unsupported(ht, t, table() if t.endswith("-table") else None, bundle.trees) for t in asked}
        trees = [t for t in asked if why[t] is None]
        for t in asked:
            if why[t] is not None:
                print(f"{spec}: skipping {t}: {why[t]}")
        only_asked = args.no_default_tree or own  # no default tree added, unless none of the asked trees fits
        if default not in trees and (not trees or not only_asked):
            trees.append(default)
        names = [t + DV if bundle.draft_vocab is not None else t for t in trees]
        t0 = time.time()
        res = evaluate(loaded, bundle, prompts, trees=names, batch_size=args.batch_size,
                       max_new_tokens=args.max_new_tokens, categories=cats, progress=False, ngram_table=shared,
                       reference=reference, keep_reference=args.ar_once)
        if args.ar_once:
            reference = res.pop("reference")
        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(bundle.module, nnx.Param)))
        cost = training_cost(Path(where)) if Path(where).is_dir() else {}
        entry = {"type": ht.name, "source": str(where), "params": params, "training": cost,
                 "greedy_mismatches": res["greedy_mismatches"], "greedy_compared": res["greedy_compared"],
                 "ar": res["runs"]["ar"], "trees": {t: res["runs"][n] for t, n in zip(trees, names)},
                 "wall_seconds": round(time.time() - t0, 1)}
        result["heads"][spec] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")  # after every head: a crash loses one head
        for t in trees:
            r = entry["trees"][t]
            rates = r.get("accept_rate_per_depth") or []
            rows.append(f"| {spec} ({ht.name}) | {t} | {r['tau']} | {', '.join(f'{x:.2f}' for x in rates)} | "
                        f"{r['tokens_per_second']:.1f} | {r['speedup_vs_ar']} | "
                        f"{res['greedy_mismatches']}/{res['greedy_compared']} | {params / 1e6:.1f}M | "
                        f"{cost.get('final_step', '-')} | {cost.get('tokens_seen', '-')} | "
                        f"{round(cost['train_time_s'] / 60, 1) if cost.get('train_time_s') else '-'} | "
                        f"{_first_acc(cost)} |")
        print(rows[-1], flush=True)
    lines = [f"{len(prompts)} prompts ({args.questions}), batch {args.batch_size}, {args.max_new_tokens} new tokens, "
             f"greedy; {result['machine']}; {result['date']}", "",
             "| head | tree | tau | accept rate per depth | tokens/s | speedup vs our AR | greedy mismatches | params | "
             "train steps | tokens seen | train min | held-out acc (depth 1) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"] + rows
    lines += ratio_lines(result)
    (out.parent / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    plot(result, out.parent / "compare.png")


def _first_acc(cost: dict) -> str:
    """The run's last held-out accuracy of its first draft depth, rounded (or '-')."""
    acc = cost.get("eval_acc")
    return f"{acc[0]:.3f}" if isinstance(acc, list) and acc else "-"


def ratio_lines(result: dict) -> list[str]:
    """The papers' comparisons where both heads ran the same tree: tau of Clover-2 over EAGLE-1 and over Medusa."""
    by_type = {}
    for entry in result["heads"].values():
        by_type.setdefault(entry["type"], entry)
    out = []
    for other in ("eagle", "medusa", "clover1", "redrafter"):
        if "clover2" not in by_type or other not in by_type:
            continue
        for tree, r in by_type["clover2"]["trees"].items():
            o = by_type[other]["trees"].get(tree)
            if o and o.get("tau") and r.get("tau"):
                out.append(f"- Clover-2 / {other} tau on {tree}: {r['tau'] / o['tau']:.3f}")
    return [""] + out if out else []


def plot(result: dict, path: Path) -> None:
    import matplotlib  # optional: the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(result["heads"])
    trees = sorted({t for e in result["heads"].values() for t in e["trees"]})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(heads), 1)
    for j, h in enumerate(heads):
        vals = [result["heads"][h]["trees"].get(t, {}).get("tau") or 0.0 for t in trees]
        ax.bar(np.arange(len(trees)) + j * width, vals, width, label=h)
    ax.set_xticks(np.arange(len(trees)) + width * (len(heads) - 1) / 2, trees)
    ax.set_ylabel("tau (tokens per base forward)")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
