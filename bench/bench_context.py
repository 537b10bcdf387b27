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
holds the draft head's pass over the prompt). Compile time is excluded (a warm-up call per shape); each number is the best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _best(fn, repeat):
    fn()  # compile / allocate
    out = None
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _ours(model, ids, new, cache, repeat, **spec):
    from clover_jax import generate

    mode = "speculative" if spec else "ar"

    def run(n):
        return lambda: generate(model, [ids], max_new_tokens=n, decode_text=False, mode=mode, cache_size=cache,
                                **spec)

    t1, _ = _best(run(1), repeat)
    tn, res = _best(run(new), repeat)
    return t1, (tn - t1) / max(res.num_generated - 1, 1) * 1e3


def _peer(ref, ids, new, eos, repeat):
    import torch

    x = torch.tensor([ids])

    def run(n):
        def f():
            with torch.no_grad():
                return ref.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return f

    t1, _ = _best(run(1), repeat)
    tn, out = _best(run(new), repeat)
    return t1, (tn - t1) / max(out.shape[1] - len(ids) - 1, 1) * 1e3


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cache-sizes", type=int, nargs="*", default=[256, 1024, 2304])
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--head", help="also time speculative decoding with this head (a registered name or folder)")
    ap.add_argument("--tree", default="chain-3", help="the tree for --head (default chain-3)")
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)

    from bench_spec import load_questions

    from clover_jax.decoding.sizes import bucket_length, round_up
    from clover_jax.io.prompts import encode_prompts
    from clover_jax.io.loader import load_model, resolve_model_path

    loaded = load_model(args.model)
    prompts, cats = load_questions("spec_bench", 104, None)
    ids = encode_prompts(loaded.tokenizer, prompts)
    by_cat: dict[str, list[list[int]]] = {}
    for p, c in zip(ids, cats):
        by_cat.setdefault(c, []).append(p)
    picks = [min(by_cat["qa"], key=len), min(by_cat["extraction"], key=len), min(by_cat["rag"], key=len),
             max(by_cat["summarization"], key=len)]
    ref = eos = None
    if not args.no_peer:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 2)
        path = resolve_model_path(args.model)
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                dtype=torch.float32).eval()
    eos = loaded.config.eos_token_ids[0]

    print(f"{args.model}, greedy, {args.max_new_tokens} new tokens, batch 1, best of {args.repeat}; "
          f"{os.cpu_count()} cores\n")
    spec_cols = f" speculative ({args.tree}): 1 token s | speculative: decode ms/token |" if args.head else ""
    print("| prompt tokens | bucket | cache | ours: 1 token s | ours: decode ms/token |" + spec_cols +
          " transformers: 1 token s | transformers: decode ms/token |")
    print("|---" * (7 + 2 * bool(args.head)) + "|")
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

    if args.cache_sizes:
        print(f"\nOur decode ms/token for the {len(picks[0])}-token prompt by cache size:\n")
        print("| cache | decode ms/token |")
        print("|---|---|")
        for cache in args.cache_sizes:
            _, step = _ours(loaded.model, picks[0], args.max_new_tokens, cache, args.repeat)
            print(f"| {cache} | {step:.1f} |", flush=True)


def main(argv=None) -> int:
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
