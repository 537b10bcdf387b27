"""Speculative vs autoregressive decoding (ours, same run), and transformers `generate` as the peer.

  python bench/bench_spec.py --questions mt_bench --limit 80 --trees chain-3 chain-4   # the shipped head
  python bench/bench_spec.py --head runs/smollm2-clover2 --questions mt_bench --limit 80 \
      --trees clover2-26 chain-4 small-10 --batch-size 1 --max-new-tokens 128 --out artifacts/eval_mt/results.json
  python bench/bench_spec.py --questions mt_bench --limit 80 --batch-sizes 1 2 4 8 16 \
      --trees chosen fit-5-411aab+lookup-4-table lookup-4-table --out artifacts/batch/results.json
  python bench/bench_spec.py --merge-only --batch-sizes 1 2 4 8 16 --out artifacts/batch/results.json

Writes the results JSON to `--out` (benchmark `bench_spec`), and beside it results.md and PNG plots (tau per category,
accepted-length histogram, speed-up vs tree size), and prints the markdown table. tau and the speed-up come with a 95%
bootstrap interval over the prompt batches (`clover_jax.tuning.evaluation.bootstrap_ci`; each batch is timed for
every run back to back, so the interval pairs them): two trees whose intervals overlap widely are not told apart by
one run.

`--batch-sizes B [B ...]`: one evaluation per batch size, each in its own process (`toolkit.run_child`; its results
in `OUT_FOLDER/bB/results.json`), so every speed-up is against the autoregressive loop timed in the same process at
the same batch size; `--out` then gets one row per batch size (benchmark `batch_table`). `chosen` is what a request
that names no tree gets (`clover_jax.tuning.choose`, measured once per batch size: the tree shrinks, or plain
decoding is chosen, as verification gets dearer with the batch). `--merge-only` merges earlier runs' files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import toolkit


def plots(result: dict, out: Path, trees: list[str], bundle):
    import matplotlib  # optional: the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # tau per category
    fig, ax = plt.subplots(figsize=(8, 4))
    cats = sorted({r["category"] for r in result["per_prompt"]["ar"]})
    width = 0.8 / max(len(trees), 1)
    for j, t in enumerate(trees):
        vals = []
        for c in cats:
            taus = [r["tau"] for r in result["per_prompt"][t] if r["category"] == c]
            vals.append(float(np.mean(taus)) if taus else 0.0)
        ax.bar(np.arange(len(cats)) + j * width, vals, width, label=t)
    ax.set_xticks(np.arange(len(cats)) + width * (len(trees) - 1) / 2, cats, rotation=30, ha="right")
    ax.set_ylabel("tau (tokens / base forward)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau_per_category.png", dpi=120)
    plt.close(fig)
    # accepted-length histogram
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in trees:
        h = np.asarray(result["runs"][t]["accept_hist"], float)
        ax.plot(np.arange(len(h)), h / h.sum(), marker="o", label=t)
    ax.set_xlabel("drafts accepted per step")
    ax.set_ylabel("fraction of steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accept_hist.png", dpi=120)
    plt.close(fig)
    # speedup vs tree size (the `chosen` run has no one size: its tree is whatever was chosen)
    sized = [t for t in trees if t != "chosen"]
    if not sized:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in sized:
        n = bundle.tree(t.removesuffix("+dv")).num_nodes
        ax.scatter(n, result["runs"][t]["speedup_vs_ar"], label=t)
        ax.scatter(n, result["runs"][t]["tau"], marker="x", color="gray")
    ax.set_xlabel("tree size (tokens verified per step)")
    ax.set_ylabel("speedup vs our AR (dots), tau (crosses)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_tree_size.png", dpi=120)
    plt.close(fig)


def report_lines(result: dict, args, n_prompts: int) -> list[str]:
    """results.md: the runs' table, the choice made, the peer, greedy mismatches and their audit."""
    lines = [f"{n_prompts} prompts ({args.questions}), batch {args.batch_size}, {args.max_new_tokens} new tokens, "
             f"temperature {args.temperature}; {result['machine']}; {result['date']}", "",
             "| run | tokens/s | tau (95% CI) | speedup vs our AR (95% CI) | speedup / tau | compile s | "
             "accept rate per depth |",
             "|---|---|---|---|---|---|---|"]

    def with_ci(r, key, ci):  # "1.27 (1.24-1.30)": the value and its 95% bootstrap interval over prompt batches
        if r.get(key) is None:
            return "-"
        return f"{r[key]}" + (f" ({r[ci][0]}-{r[ci][1]})" if r.get(ci) else "")

    for name, r in result["runs"].items():
        rates = r.get("accept_rate_per_depth")
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {with_ci(r, 'tau', 'tau_ci95')} | "
                     f"{with_ci(r, 'speedup_vs_ar', 'speedup_ci95')} | "
                     f"{r.get('speedup_over_tau') or '-'} | {r.get('compile_seconds', '-')} | "
                     f"{', '.join(f'{x:.2f}' for x in rates) if rates else '-'} |")
    chosen = result["runs"].get("chosen", {}).get("choice")
    if chosen:
        lines.append(f"\nchosen: {chosen['head'] or 'no head'}, {chosen['tree']} (predicted "
                     f"{chosen['predicted_speedup']}x plain decoding here)")
    if "transformers" in result["runs"]:
        for t in args.trees:
            ratio = result["runs"][t]["tokens_per_second"] / result["runs"]["transformers"]["tokens_per_second"]
            lines.append(f"\n{t} vs transformers generate: {ratio:.2f}x")
    if result["greedy_mismatches"] is not None:
        lines.append(f"\ngreedy outputs differing from autoregressive: {result['greedy_mismatches']} "
                     f"of {result['greedy_compared']}")
        for t, idx in result["greedy_differing_prompts"].items():
            if idx:
                lines.append(f"- {t}: {len(idx)} prompts differ ({', '.join(map(str, idx[:20]))}"
                             f"{', ...' if len(idx) > 20 else ''})")
        divs = result["divergences"]
        lines.append(f"audit: {len(divs)} divergences, {sum(d['verdict'] == 'near-tie' for d in divs)} near-ties, "
                     f"{result['greedy_unexplained']} unexplained")
        for d in divs[:20]:
            lines.append(f"- {d['tree']} prompt {d['prompt']} position {d['position']}: {d['reference_token']} vs "
                         f"{d['token']}, margin {d['margin']:.3g} ({d['margin_ulps']:.1f} ulps, bound "
                         f"{d['bound']:.3g}): {d['verdict']}")
    for t, r in (result.get("replay") or {}).items():
        lines.append(f"replay {t}: {r['outputs']} outputs, {r['tokens']} tokens, {r['near_ties']} near-ties, "
                     f"{r['violations']} violations")
    return lines


def one_batch_size(args, argv) -> int:
    import jax.numpy as jnp

    from clover_jax import pretrained
    from clover_jax.io.loader import load_model
    from clover_jax.training.loading import open_head_or_run
    from clover_jax.tuning.evaluation import DV, evaluate

    out = Path(args.out)
    mesh = None
    if args.mesh:
        from clover_jax.parallel import parse_mesh

        mesh = parse_mesh(args.mesh)
    loaded = load_model(args.model, mesh=mesh, dtype=getattr(jnp, args.dtype))
    chosen_head = args.head  # the `chosen` run's head: None, what a request with no head gets
    args.head = args.head or pretrained.default_head(args.model)
    if args.head is None:
        raise SystemExit(f"--head: {args.model} has no shipped head; pass one")
    bundle = open_head_or_run(args.head, loaded.model)  # read once: module, fitted trees, vocabulary, table
    prompts, cats = toolkit.load_questions(args.questions, args.limit or None, args.category)
    t0 = time.time()
    draft_vocab = None
    if args.draft_vocab:
        from clover_jax.heads.draft_vocab import load_draft_vocab

        draft_vocab = load_draft_vocab(args.draft_vocab)
    ngram_table = None
    if args.ngram_table:
        from clover_jax.decoding.ngram import load_ngram_table

        ngram_table = load_ngram_table(args.ngram_table)
    auto = None
    if "auto" in args.trees:  # the calibrated choice for this head on this hardware (calibrates if none is saved)
        from clover_jax.generation.calibration import AR
        from clover_jax.tuning.calibrate import resolve_auto

        auto, _ = resolve_auto(loaded, bundle.module, args.head, batch_size=args.batch_size, mesh=mesh,
                               draft_vocab=bundle.draft_vocab if draft_vocab is None else draft_vocab,
                               ngram_table=ngram_table or bundle.ngram_table)
        print(f"tree auto -> {auto}" + (" (autoregressive decoding: the 'ar' row is auto's)" if auto == AR else ""))
        args.trees = [t for t in args.trees if t != "auto"] + ([auto] if auto != AR and auto not in args.trees else [])
    if bundle.draft_vocab is not None:  # a head trained on a draft vocabulary drafts from it in every run
        args.trees = [t if t.endswith(DV) or t == "chosen" else t + DV for t in args.trees]
        print(f"the head was trained on a {len(bundle.draft_vocab)}-token draft vocabulary: every tree drafts from it "
              "(+dv)")
    result = evaluate(loaded, bundle, prompts, trees=args.trees, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, categories=cats,
                      draft_vocab=draft_vocab, mesh=mesh, layers=args.layers, ngram_table=ngram_table,
                      replay=args.replay, chosen_head=bundle if chosen_head else None,
                      prompt_bucket=args.prompt_bucket, warmup_threads=args.warmup_threads)
    result["wall_seconds"] = round(time.time() - t0, 1)
    result["auto"] = auto
    result["args"] = vars(args)
    if args.peer and args.temperature == 0.0:
        from clover_jax.io.prompts import encode_prompts

        eos = loaded.config.eos_token_ids[0]
        peer, _ = toolkit.transformers_generate(toolkit.transformers_model(args.model), eos,
                                                encode_prompts(loaded.tokenizer, prompts), args.batch_size,
                                                args.max_new_tokens, eos)
        result["runs"]["transformers"] = {"tokens_per_second": round(peer["tok_per_s"], 2), "tokens": peer["tokens"],
                                          "seconds": round(peer["seconds"], 2)}
    result = toolkit.results(
        __file__, argv, benchmark="bench_spec", questions=f"{args.questions} {len(prompts)}",
        title=f"Speculative decoding against our autoregressive loop: {args.questions}, {len(prompts)} prompts",
        settings=f"{args.model}, head {args.head}, batch {args.batch_size}, {args.max_new_tokens} new tokens, "
                 f"temperature {args.temperature}, {args.dtype}", **result)
    toolkit.write_results(out, result)
    lines = report_lines(result, args, len(prompts))
    (out.parent / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plots(result, out.parent, args.trees, bundle)
    return 0


# -------------------------------------------------------------------------------------------- by batch size
def batch_row(batch: int, result: dict) -> dict:
    runs = result["runs"]
    out = {"batch_size": batch, "ar_tokens_per_second": runs["ar"]["tokens_per_second"],
           "greedy_compared": result.get("greedy_compared"), "greedy_mismatches": result.get("greedy_mismatches"),
           "runs": {}}
    for name, r in runs.items():
        if name in ("ar", "transformers"):
            continue
        out["runs"][name.removesuffix("+dv")] = {k: r.get(k) for k in (
            "tau", "speedup_vs_ar", "speedup_ci95", "tokens_per_second", "choice")}
    return out


def by_batch_size(args, argv) -> int:
    """One evaluation per batch size, each in its own process, merged into one row per batch size."""
    out = Path(args.out)
    rows = []
    for b in args.batch_sizes:
        sub = out.parent / f"b{b}" / "results.json"
        if not args.merge_only:
            child_argv = strip_batch_options(argv) + ["--batch-size", str(b), "--out", str(sub)]
            print("+ python bench/bench_spec.py", " ".join(child_argv), flush=True)
            toolkit.run_child(__file__, {"argv": child_argv}, echo=True)
        if not sub.is_file():
            raise SystemExit(f"{sub}: no results (run without --merge-only)")
        rows.append(batch_row(b, json.loads(sub.read_text())))
    first = json.loads((out.parent / f"b{args.batch_sizes[0]}" / "results.json").read_text())
    result = toolkit.results(
        __file__, argv, benchmark="batch_table", title=f"Speculative decoding by batch size: {args.questions}",
        settings=f"{args.model}, {args.max_new_tokens} new tokens, one process per batch size",
        questions=args.questions, limit=args.limit, max_new_tokens=args.max_new_tokens, trees=list(args.trees),
        rows=rows)
    result["machine"], result["date"] = first.get("machine", result["machine"]), first.get("date", result["date"])
    toolkit.write_results(out, result)
    names = list(rows[0]["runs"])
    print("| batch | AR tokens/s | " + " | ".join(f"{n}: tau, vs AR" for n in names) + " | differing |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        cells = [f"{r['runs'][n]['tau']}, {r['runs'][n]['speedup_vs_ar']}x" for n in names]
        print(f"| {r['batch_size']} | {r['ar_tokens_per_second']} | " + " | ".join(cells) +
              f" | {r['greedy_mismatches']} of {r['greedy_compared']} |")
    return 0


def strip_batch_options(argv) -> list[str]:
    """The command line less the options of the sweep (`--batch-sizes ...`, `--merge-only`, `--out ...`)."""
    out, skip = [], False
    for a in (sys.argv[1:] if argv is None else list(argv)):
        if a in ("--batch-sizes", "--out"):
            skip = True
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        if a != "--merge-only":
            out.append(a)
    return out


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default=None,
                    help="registered head name, training run dir or exported folder (default: the model's first "
                    "shipped head; the `chosen` run then drafts with what a request with no head gets: a saved "
                    "choice, else the default head's tree or plain decoding)")
    ap.add_argument("--questions", default="mt_bench", help="mt_bench | spec_bench | sharegpt_heldout | path to question.jsonl")
    ap.add_argument("--category")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--trees", nargs="+", default=["chosen"],  # "auto": the calibrated tree (clover_jax.tuning.calibrate)
                    help="tree names; a name ending in +dv (chain-3+dv) also uses --draft-vocab; `chosen`: what a "
                    "request that names no tree runs (the head and tree chosen for this machine, or plain decoding)")
    ap.add_argument("--draft-vocab", help="draft vocabulary JSON (python -m clover_jax.cli.draft_vocab)")
    ap.add_argument("--ngram-table", help="n-gram table for trees named ...-table (python -m "
                    "clover_jax.decoding.ngram); default: the one shipped beside the head")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--batch-sizes", type=int, nargs="+", help="one evaluation per batch size, each in its own "
                    "process, merged into one row per batch size (benchmark batch_table)")
    ap.add_argument("--merge-only", action="store_true", help="with --batch-sizes: merge the earlier runs' files")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--peer", action="store_true", help="also time transformers + torch generate (greedy)")
    ap.add_argument("--replay", action="store_true", help="certify every greedy speculative output on its own: a "
                    "float32 replay of the base model checks each emitted token is its argmax, up to a near-tie "
                    "(clover_jax.tuning.audit)")
    ap.add_argument("--prompt-bucket", type=int, default=None, help="pad every prompt to this many tokens: one "
                    "compiled program per run for the whole question set (default: each prompt's own bucket)")
    ap.add_argument("--warmup-threads", type=int, default=1, help="compile every run's programs before the first "
                    "timed call, this many at a time (1: each on first use)")
    toolkit.add_out_argument(ap, default="artifacts/eval/results.json",
                             what="the results JSON (results.md and the plots beside it)")
    ap.add_argument("--mesh", default=None, help="decode on a device mesh, e.g. 'tp=8' or 'data=2,tp=4'")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype of the model")
    ap.add_argument("--layers", default="auto", choices=["auto", "unrolled", "scan"],
                    help="how both decoding loops run the layers (clover_jax.decoding.autoregressive.decode_layers)")
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)
    return by_batch_size(args, argv) if args.batch_sizes else one_batch_size(args, argv)


def main(argv=None) -> int:
    """Runs the benchmark; bad input is one `error: ...` line and exit status 2 (`clover_jax.cli`)."""
    from clover_jax.cli import run_cli

    if toolkit.serve_child(argv, lambda spec: {"status": main(spec["argv"])}):
        return 0
    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
