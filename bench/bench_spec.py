"""Speculative vs autoregressive decoding (ours, same run), and transformers `generate` as the peer.

  python bench/bench_spec.py --questions mt_bench --limit 80 --trees chain-3 chain-4   # the shipped head
  python bench/bench_spec.py --head runs/smollm2-clover2 --questions mt_bench --limit 80 \
      --trees clover2-26 chain-4 small-10 --batch-size 1 --max-new-tokens 128 --out-dir artifacts/eval_mt

Writes results.json, results.md and PNG plots (tau per category, accepted-length histogram, speedup vs tree
size) to --out-dir and prints the markdown table. tau and the speed-up come with a 95% bootstrap interval over the
prompt batches (`clover_jax.tuning.evaluation.bootstrap_ci`; each batch is timed for every run back to back, so the
interval pairs them): two trees whose intervals overlap widely are not told apart by one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_questions(which: str, limit: int | None, category: str | None):
    from clover_jax.io.prompts import questions_path

    path = questions_path(which)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if category:  # one category, or several
        wanted = {category} if isinstance(category, str) else set(category)
        rows = [r for r in rows if r.get("category") in wanted]
    if limit:
        # keep every category represented: take the first `limit / n_categories` of each
        cats = sorted({r.get("category", "all") for r in rows})
        per = max(1, limit // len(cats))
        picked = []
        for c in cats:
            picked += [r for r in rows if r.get("category", "all") == c][:per]
        rows = picked[:limit]
    return [r["turns"][0] for r in rows], [r.get("category", "all") for r in rows]


def plots(result: dict, out: Path, trees: list[str], known=None):
    import matplotlib

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
    from clover_jax.decoding.tree import get_tree

    sized = [t for t in trees if t != "chosen"]
    if not sized:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in sized:
        n = get_tree(t.removesuffix("+dv"), known).num_nodes
        ax.scatter(n, result["runs"][t]["speedup_vs_ar"], label=t)
        ax.scatter(n, result["runs"][t]["tau"], marker="x", color="gray")
    ax.set_xlabel("tree size (tokens verified per step)")
    ax.set_ylabel("speedup vs our AR (dots), tau (crosses)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_tree_size.png", dpi=120)
    plt.close(fig)


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default=None,
                    help="registered head name, training run dir or exported folder (default: the model's first "
                    "shipped head; the `chosen` run then drafts with what a request with no head gets: a saved choice, else the default head's tree or plain decoding)")
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
    ap.add_argument("--out-dir", default="artifacts/eval")
    ap.add_argument("--mesh", default=None, help="decode on a device mesh, e.g. 'tp=8' or 'data=2,tp=4'")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype of the model")
    ap.add_argument("--layers", default="auto", choices=["auto", "unrolled", "scan"],
                    help="how both decoding loops run the layers (clover_jax.decoding.autoregressive.decode_layers)")
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)

    from clover_jax.tuning.evaluation import evaluate
    from clover_jax.training.loading import load_head
    from clover_jax.io.loader import load_model

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mesh = None
    if args.mesh:
        from clover_jax.parallel import parse_mesh

        mesh = parse_mesh(args.mesh)
    import jax.numpy as jnp

    loaded = load_model(args.model, mesh=mesh, dtype=getattr(jnp, args.dtype))
    from clover_jax import pretrained

    chosen_head = args.head  # the `chosen` run's head: None, what a request with no head gets
    args.head = args.head or pretrained.default_head(args.model)
    if args.head is None:
        raise SystemExit(f"--head: {args.model} has no shipped head; pass one")
    head = load_head(args.head, loaded.model)
    from clover_jax.heads.folder import open_folder

    known = open_folder(args.head).trees  # --trees fit-N-<hash>: a tree fitted by the head's calibration
    prompts, cats = load_questions(args.questions, args.limit or None, args.category)
    t0 = time.time()
    from clover_jax.tuning.evaluation import DV
    from clover_jax.heads.draft_vocab import head_draft_vocab, load_draft_vocab

    draft_vocab = load_draft_vocab(args.draft_vocab) if args.draft_vocab else None
    trained_on = head_draft_vocab(args.head)
    from clover_jax.decoding.ngram import resolve_ngram_table

    ngram_table = resolve_ngram_table(args.ngram_table, args.head)
    auto = None
    if "auto" in args.trees:  # the calibrated choice for this head on this hardware (calibrates if none is saved)
        from clover_jax.generation.calibration import AR
        from clover_jax.tuning.calibrate import resolve_auto

        auto, _ = resolve_auto(loaded, head, args.head, batch_size=args.batch_size, mesh=mesh,
                               draft_vocab=trained_on if draft_vocab is None else draft_vocab,
                               ngram_table=ngram_table)
        print(f"tree auto -> {auto}" + (" (autoregressive decoding: the 'ar' row is auto's)" if auto == AR else ""))
        args.trees = [t for t in args.trees if t != "auto"] + ([auto] if auto != AR and auto not in args.trees else [])
    if trained_on is not None:  # a head trained on a draft vocabulary drafts from it in every run
        draft_vocab = trained_on if draft_vocab is None else draft_vocab
        args.trees = [t if t.endswith(DV) or t == "chosen" else t + DV for t in args.trees]
        print(f"the head was trained on a {len(trained_on)}-token draft vocabulary: every tree drafts from it (+dv)")
    result = evaluate(loaded, head, prompts, trees=args.trees, batch_size=args.batch_size, known_trees=known,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, categories=cats,
                      draft_vocab=draft_vocab, mesh=mesh, layers=args.layers, ngram_table=ngram_table,
                      replay=args.replay, chosen_head=chosen_head, prompt_bucket=args.prompt_bucket,
                      warmup_threads=args.warmup_threads)
    result["wall_seconds"] = round(time.time() - t0, 1)
    result["auto"] = auto
    result["args"] = vars(args)
    import jax

    dev = jax.devices()[0]
    result["machine"] = (f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, "
                         f"{dev.platform}: {getattr(dev, 'device_kind', '')}, {args.dtype}")
    result["date"] = time.strftime("%Y-%m-%d")
    if args.peer and args.temperature == 0.0:
        import torch
        import transformers

        from bench_ar import bench_transformers

        from clover_jax.io.prompts import encode_prompts
        from clover_jax.io.loader import resolve_model_path

        torch.set_num_threads(os.cpu_count() or 2)
        path = resolve_model_path(args.model)
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                dtype=torch.float32).eval()
        ids = encode_prompts(loaded.tokenizer, prompts)
        eos = loaded.config.eos_token_ids[0]
        peer, _ = bench_transformers(ref, eos, ids, args.batch_size, args.max_new_tokens, eos)
        result["runs"]["transformers"] = {"tokens_per_second": round(peer["tok_per_s"], 2), "tokens": peer["tokens"],
                                          "seconds": round(peer["seconds"], 2)}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"{len(prompts)} prompts ({args.questions}), batch {args.batch_size}, {args.max_new_tokens} new tokens, "
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
    if result.get("replay"):
        for t, r in result["replay"].items():
            lines.append(f"replay {t}: {r['outputs']} outputs, {r['tokens']} tokens, {r['near_ties']} near-ties, "
                         f"{r['violations']} violations")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plots(result, out, args.trees, known)


def main(argv=None) -> int:
    """Runs the benchmark; bad input is one `error: ...` line and exit status 2 (`clover_jax.cli`)."""
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
