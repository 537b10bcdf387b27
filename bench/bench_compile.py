"""Compile time of the jitted speculative loop, and the constants baked into its program.

  python bench/bench_compile.py                       # SmolLM2-135M shapes (random weights), batch 8, clover2-26
  python bench/bench_compile.py --draft-vocab 8192 --batch-size 8 --tree clover2-26 --repeat 2 --out compile.json

Builds a random Llama of `--shape` and a random head (`--head-type`), lowers the loop `spec_generate` runs and
compiles it (fresh each repeat: the jit caches are cleared), and reports the seconds of each phase plus the largest
constants in the lowered program (any array baked in as a constant is folded and copied by XLA at compile time).
One JSON line per repeat; `--out PATH` writes the results JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import toolkit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(toolkit.SHAPES), default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128, help="padded prompt length (a bucket)")
    ap.add_argument("--cache-size", type=int, default=512)
    ap.add_argument("--tree", default="clover2-26")
    ap.add_argument("--head-type", default="clover2", help="a registered head type (clover2, clover1, eagle, medusa, redrafter)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: the full vocabulary)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=1)
    toolkit.add_out_argument(ap)
    args = ap.parse_args(argv)

    from clover_jax.decoding import speculative
    from clover_jax.decoding.sampling import SamplingParams
    from clover_jax.heads import registry

    base = toolkit.random_base(args.shape, jnp.float32)
    head = toolkit.random_head(base, args.head_type, jnp.float32)
    config = base.config
    rng = np.random.default_rng(0)
    vocab = (np.sort(rng.choice(config.vocab_size, args.draft_vocab, replace=False)).astype(np.int32)
             if 0 < args.draft_vocab < config.vocab_size else None)
    b, t = args.batch_size, args.prompt_len
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32)
    lens = jnp.full((b,), t - 3, jnp.int32)
    sampling = SamplingParams(temperature=args.temperature)
    rows = []
    for r in range(args.repeat):
        speculative._jitted.cache_clear()
        registry._drafter_for.cache_clear()
        jax.clear_caches()
        drafter = registry.drafter_for(type(head), args.tree, vocab)
        base_graph, base_state = nnx.split(base)
        head_graph, head_params = nnx.split(head)
        fn = speculative.SpeculativeLoop(drafter, args.cache_size, sampling.greedy,
                                         jnp.dtype(base.dtype)).compiled(base_graph, head_graph)
        eos = jnp.asarray(list(config.eos_token_ids) or [-1], jnp.int32)
        call_args = (base_state, head_params, drafter.arrays(), prompt, lens, jnp.asarray(16, jnp.int32), eos,
                     sampling.arrays(), jax.random.key(0))
        t0 = time.perf_counter()
        lowered = fn.lower(*call_args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        sizes = [int(np.prod([int(d) for d in m.group(1).split("x")])) for m in re.finditer(
            r"stablehlo\.constant dense<[^>]*> : tensor<([0-9x]+)x[a-z0-9]+>", lowered.as_text())]
        rows.append({"repeat": r, "backend": jax.default_backend(), "head_type": args.head_type, "batch": b,
                     "prompt_len": t, "cache_size": args.cache_size, "tree": args.tree,
                     "draft_vocab": args.draft_vocab, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
                     "constants_over_256_elements": sum(s > 256 for s in sizes),
                     "largest_constants": sorted(sizes, reverse=True)[:5]})
        print(json.dumps(rows[-1]), flush=True)
        del compiled
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="bench_compile", title="Compile time of the speculative loop",
        settings=f"{args.shape} shapes, random weights, {args.head_type} head, {args.tree}, batch {b}, prompt {t}, "
                 f"cache {args.cache_size}", rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
