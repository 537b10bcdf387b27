"""How many programs each decoding loop compiles over a question set, counted, against the shapes the prompt
lengths predict (`clover_jax.decoding.sizes.loop_shapes`).

  python bench/count_compiles.py --questions mt_bench --limit 80 --trees default chain-3 clover2-26 lookup-4 \
      --max-new-tokens 8
  python bench/count_compiles.py --questions spec_bench --predict-only --max-new-tokens 128 256

Runs `clover_jax.generate` (the default cache sizes: each bucket's rung) on the prompts, `--batch-size` at a time in
order, for autoregressive decoding and each tree (`default`: the head's default tree), counting with
`clover_jax.compile_cache.CompileCounter` what XLA compiles per loop. `--predict-only` compiles nothing: it prints the
distinct (batch, bucket, cache) shapes per loop the prompt lengths need, and how many the cache sizes the plan used
before the cache ladder needed. Run with `CLOVER_JAX_COMPILE_CACHE=off` to count compiles rather than loads from the
persistent cache. One JSON line per loop; `--out PATH` writes the results JSON (one row per loop).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import toolkit


def old_cache(prompt_len: int, max_new_tokens: int, extra: int) -> int:
    """The default cache size before the ladder: the longest prompt's own need, at least its bucket + 1, in
    multiples of 256."""
    from clover_jax.decoding.sizes import bucket_length, round_up

    return round_up(max(prompt_len + max_new_tokens + extra, bucket_length(prompt_len) + 1), 256)


def predicted(lengths: list[int], max_new_tokens: int, nodes: int, batch_size: int) -> dict:
    from clover_jax.decoding.sizes import bucket_length, loop_shapes

    shapes = loop_shapes(lengths, max_new_tokens, nodes, batch_size)
    before = {(len(lengths[i:i + batch_size]), bucket_length(max(lengths[i:i + batch_size])),
               old_cache(max(lengths[i:i + batch_size]), max_new_tokens, nodes))
              for i in range(0, len(lengths), batch_size)}
    return {"shapes": [list(s) for s in shapes], "programs": len(shapes), "programs_before_ladder": len(before)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default=None, help="default: the model's shipped head")
    ap.add_argument("--questions", default="mt_bench", help="mt_bench | spec_bench | sharegpt_heldout | a .jsonl")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--trees", nargs="*", default=["default", "chain-3", "clover2-26", "lookup-4"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[8])
    ap.add_argument("--layers", default="auto", choices=["auto", "unrolled", "scan"])
    ap.add_argument("--predict-only", action="store_true", help="only the shapes the prompt lengths need")
    toolkit.add_out_argument(ap)
    args = ap.parse_args(argv)

    import clover_jax
    from clover_jax import pretrained
    from clover_jax.compile_cache import CompileCounter
    from clover_jax.io.prompts import encode_prompts, read_prompts

    prompts = read_prompts(args.questions, limit=args.limit or None)
    lm = clover_jax.load_model(args.model)
    ids = encode_prompts(lm.tokenizer, prompts)
    lengths = [len(x) for x in ids]
    head = args.head or pretrained.default_head(args.model)
    # each loop's request resolved once, as generate resolves it (the head read, the tree parsed; "default": the
    # head's default tree), then run with what it resolved
    loops = {"ar": (dict(mode="ar"), 0)}
    for tree in args.trees:
        plan = clover_jax.prepare_generate(lm, [ids[0]], max_new_tokens=1, mode="speculative", head=head,
                                           tree=tree, check_free_memory=False)
        kw = dict(mode="speculative", head=plan.head, tree=plan.tree, draft_vocab=plan.draft_vocab,
                  ngram_table=plan.ngram_table)
        label = tree if tree != "default" else f"default ({getattr(plan.tree, 'name', plan.tree)})"
        loops[label] = (kw, plan.drafter.num_nodes)
    rows = []
    for max_new in args.max_new_tokens:
        for loop, (kw, nodes) in loops.items():
            row = {"questions": args.questions, "prompts": len(ids), "batch_size": args.batch_size,
                   "max_new_tokens": max_new, "loop": loop, "tree_nodes": nodes}
            row |= predicted(lengths, max_new, nodes, args.batch_size)
            rows.append(row)
            if args.predict_only:
                print(json.dumps(row), flush=True)
                continue
            name = "autoregressive_loop" if loop == "ar" else "speculative_loop"
            t0 = time.perf_counter()
            with CompileCounter() as count:
                for start in range(0, len(ids), args.batch_size):
                    clover_jax.generate(lm, ids[start:start + args.batch_size], max_new_tokens=max_new,
                                        layers=args.layers, decode_text=False, **kw)
            other = {k: v for k, v in count.compiled.items() if k != name}  # small programs outside the loop
            row |= {"compiled": count.compiled[name], "loaded_from_cache": count.loaded[name],
                    "other_programs": sum(other.values()), "other_names": dict(sorted(other.items())),
                    "seconds": round(time.perf_counter() - t0, 1)}
            print(json.dumps(row), flush=True)
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="count_compiles", title="Programs compiled per decoding loop, against the shapes "
        "predicted", settings=f"{args.model}, {args.questions} ({len(ids)} prompts), batch {args.batch_size}",
        rows=rows))
    bad = [r for r in rows if "compiled" in r and r["compiled"] > r["programs"]]
    for r in bad:
        print(f"{r['loop']}: compiled {r['compiled']} programs, {r['programs']} predicted", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
