"""What prompt length and cache size cost: prefill seconds and decode ms per step, ours vs transformers.

  python bench/bench_context.py                          # 4 Spec-Bench prompts (40 to 1,187 tokens), + transformers
  python bench/bench_context.py --no-peer --cache-sizes 256 1024 2304
  python bench/bench_context.py --head smollm2-135m-instruct-clover2 --tree chain-3   # + speculative columns

Table 1: for prompts of growing length (the shortest QA, extraction, RAG and summarisation prompts of the
Spec-Bench sample that `bench_spec.py --questions spec_bench --limit 104` runs), greedy autoregressive decoding with
our jitted loop (prompt padded to its length bucket, the cache `bench_spec.py` would allocate) and with transformers
`generate` on the same weights: the time of a 1-token generation (prefill + one step) and the decode cost per token
(the difference to a `--max-new-tokens` run over the extra tokens). Table 2: our decode ms per step for the shortest
prompt at several cache sizes (the cache is static in the jitted loop, so what a step costs beyond the tokens held
shows here). With `--head`, the same two numbers for speculative decoding with that head and tree (its 1-token time
holds the draft head's pass over the prompt). Compile time is excluded (a warm-up call per shape); a time is the
fastest of `--repeat` calls, and the decode cost the fastest long call less the fastest 1-token call over the tokens
between them (`clover_jax.tuning.timing`). `--out PATH` writes the results JSON.
"""

from __future__ import annotations

import argparse
import sys

import toolkit
from clover_jax.tuning.timing import per_iteration, timed_calls


def _two_lengths(run, new: int, repeat: int, iterations) -> tuple[float, float]:
    """(fastest 1-token call's seconds, ms per decode step): `run(n)` makes the call for n new tokens; each length
    called once first (compile, allocate), then `repeat` times; `iterations(out)`: the long call's decode steps."""
    calls = {}
    for n in (1, new):
        run(n)()  # compile / allocate
        calls[n] = timed_calls(run(n), repeat)
    (short, _), (long, out) = calls[1], calls[new]
    return min(short), per_iteration(short, long, iterations(out)) * 1e3


def _ours(model, ids, new, cache, repeat, **spec):
    from clover_jax import generate

    mode = "speculative" if spec else "ar"

    def run(n):
        return lambda: generate(model, [ids], max_new_tokens=n, decode_text=False, mode=mode, cache_size=cache,
                                **spec)

    return _two_lengths(run, new, repeat, lambda res: res.num_generated - 1)


def _peer(ref, ids, new, eos, repeat):
    import torch

    x = torch.tensor([ids])

    def run(n):
        def f():
            with torch.no_grad():
                return ref.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return f

    return _two_lengths(run, new, repeat, lambda out: out.shape[1] - len(ids) - 1)


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cache-sizes", type=int, nargs="*", default=[256, 1024, 2304])
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--head", help="also time speculative decoding with this head (a registered name or folder)")
    ap.add_argument("--tree", default="chain-3", help="the tree for --head (default chain-3)")
    toolkit.add_out_argument(ap)
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)

    from clover_jax.decoding.sizes import bucket_length, round_up
    from clover_jax.io.loader import load_model
    from clover_jax.io.prompts import encode_prompts

    loaded = load_model(args.model)
    prompts, cats = toolkit.load_questions("spec_bench", 104, None)
    ids = encode_prompts(loaded.tokenizer, prompts)
    by_cat: dict[str, list[list[int]]] = {}
    for p, c in zip(ids, cats):
        by_cat.setdefault(c, []).append(p)
    picks = [min(by_cat["qa"], key=len), min(by_cat["extraction"], key=len), min(by_cat["rag"], key=len),
             max(by_cat["summarization"], key=len)]
    ref = None if args.no_peer else toolkit.transformers_model(args.model)
    eos = loaded.config.eos_token_ids[0]
    settings = f"{args.model}, greedy, {args.max_new_tokens} new tokens, batch 1, fastest of {args.repeat}"
    print(f"{settings}; {toolkit.machine()}\n")
    spec_cols = f" speculative ({args.tree}): 1 token s | speculative: decode ms/token |" if args.head else ""
    print("| prompt tokens | bucket | cache | ours: 1 token s | ours: decode ms/token |" + spec_cols +
          " transformers: 1 token s | transformers: decode ms/token |")
    print("|---" * (7 + 2 * bool(args.head)) + "|")
    rows, by_cache = [], []
    for p in picks:
        bucket = bucket_length(len(p))
        cache = round_up(bucket + args.max_new_tokens + 4 + 8, 256)  # bench_spec.py's cache for a 4-node tree
        t1, step = _ours(loaded.model, p, args.max_new_tokens, cache, args.repeat)
        spec = ""
        if args.head:
            s1, sstep = _ours(loaded.model, p, args.max_new_tokens, cache, args.repeat, head=args.head, tree=args.tree)
            spec = f" {s1:.3f} | {sstep:.1f} |"
        peer = _peer(ref, p, args.max_new_tokens, eos, args.repeat) if ref is not None else None
        cols = f"{peer[0]:.3f} | {peer[1]:.1f}" if peer else "- | -"
        print(f"| {len(p)} | {bucket} | {cache} | {t1:.3f} | {step:.1f} |{spec} {cols} |", flush=True)
        rows.append({"prompt_tokens": len(p), "bucket": bucket, "cache": cache, "ours_1_token_s": round(t1, 4),
                     "ours_decode_ms": round(step, 2),
                     **({"speculative_1_token_s": round(s1, 4), "speculative_decode_ms": round(sstep, 2)}
                        if args.head else {}),
                     "transformers_1_token_s": round(peer[0], 4) if peer else None,
                     "transformers_decode_ms": round(peer[1], 2) if peer else None})

    if args.cache_sizes:
        print(f"\nOur decode ms/token for the {len(picks[0])}-token prompt by cache size:\n")
        print("| cache | decode ms/token |")
        print("|---|---|")
        for cache in args.cache_sizes:
            _, step = _ours(loaded.model, picks[0], args.max_new_tokens, cache, args.repeat)
            print(f"| {cache} | {step:.1f} |", flush=True)
            by_cache.append({"cache": cache, "decode_ms": round(step, 2)})
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="bench_context", title="What prompt length and cache size cost, ours and "
        "transformers", settings=settings, rows=rows, by_cache=by_cache, head=args.head, tree=args.tree))


def main(argv=None) -> int:
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
