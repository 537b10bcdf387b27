"""Float32 decoding with float32 products (what `generate` asks for, `products_precision`) against the backend's
default matmul precision (TF32 on recent NVIDIA GPUs, bfloat16 passes on TPUs, float32 on CPUs), chosen as a caller
would, with `jax.default_matmul_precision("default")` around the calls: the same tokens? the same speed?
Autoregressive and speculative decoding, one prompt at a time, alternating, best of `--repeat`.

  python bench/bench_precision.py --limit 8 --max-new-tokens 64 --tree chain-3 [--out results.json]
"""

from __future__ import annotations

import argparse
import sys

import toolkit


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-clover2")
    ap.add_argument("--tree", default="chain-3")
    ap.add_argument("--questions", default="mt_bench")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    toolkit.add_out_argument(ap)
    args = ap.parse_args(argv)

    import contextlib

    import jax

    from clover_jax import generate
    from clover_jax.io.loader import load_model
    from clover_jax.io.prompts import encode_prompts
    from clover_jax.training.loading import open_head_or_run

    lm = load_model(args.model)
    bundle = open_head_or_run(args.head, lm.model)
    head, dv = bundle.module, bundle.draft_vocab
    prompts, _ = toolkit.load_questions(args.questions, args.limit, None)
    ids = encode_prompts(lm.tokenizer, prompts)
    cache = 512 + args.max_new_tokens
    settings = {"default": lambda: jax.default_matmul_precision("default"), "float32 (asked)": contextlib.nullcontext}
    seconds, tokens = {}, {}
    for _ in range(args.repeat):
        for name, context in settings.items():
            for mode in ("ar", "speculative"):
                kw = dict(mode="speculative", head=head, tree=args.tree, draft_vocab=dv) if mode != "ar" else {}
                out, total = [], 0.0
                for p in ids:
                    with context():
                        generate(lm.model, [p], max_new_tokens=1, cache_size=cache, decode_text=False, **kw)
                        r = generate(lm.model, [p], max_new_tokens=args.max_new_tokens, cache_size=cache,
                                     decode_text=False, **kw)
                    out.append(r.token_ids[0])
                    total += r.seconds
                seconds.setdefault((name, mode), []).append(total)
                tokens[(name, mode)] = out
    what = (f"{len(ids)} prompts ({args.questions}), {args.max_new_tokens} new tokens, tree {args.tree}, fastest of "
            f"{args.repeat}")
    print(f"{what}; {toolkit.machine()}\n")
    print("| loop | default precision (s) | float32 products (s) | outputs identical | speculative == AR |")
    print("|---|---|---|---|---|")
    rows = []
    for mode in ("ar", "speculative"):
        same = sum(a == b for a, b in zip(tokens[("default", mode)], tokens[("float32 (asked)", mode)]))
        exact = {n: sum(a == b for a, b in zip(tokens[(n, "ar")], tokens[(n, "speculative")])) for n in settings}
        rows.append({"loop": mode, "default_s": round(min(seconds[("default", mode)]), 3),
                     "float32_s": round(min(seconds[("float32 (asked)", mode)]), 3), "identical": f"{same}/{len(ids)}",
                     "speculative_equals_ar": None if mode == "ar" else
                     {n: f"{exact[n]}/{len(ids)}" for n in ("default", "float32 (asked)")}})
        print(f"| {mode} | {rows[-1]['default_s']:.2f} | {rows[-1]['float32_s']:.2f} | "
              f"{same}/{len(ids)} | " + (f"default {exact['default']}/{len(ids)}, float32 "
                                         f"{exact['float32 (asked)']}/{len(ids)}" if mode != "ar" else "") + " |")
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="bench_precision", title="Float32 products asked against the backend's default "
        "matmul precision", settings=f"{args.model}, head {args.head}; {what}", rows=rows))


def main(argv=None) -> int:
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
