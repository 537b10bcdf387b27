"""Does verification compute a chain's tokens bit for bit as decode steps do? The numerics under greedy exactness.

  python bench/bench_rows.py --dtypes bfloat16 float32 --batch-sizes 1 2 --out results/rows.json

Greedy speculative decoding equals autoregressive decoding exactly when a U-token verification forward gives each
row the bits a one-token decode step gives that token. Two measurements on SmolLM2-135M (a chat prompt in the KV
cache, then 4 tokens):

* `products`: a product `x [M, D] @ W [D, F]` in the compute dtype with float32 accumulation, row 0 for M = 1 against
  M = 2, 4, 10 (XLA's one-row product sums in another order than its many-row one);
* `chain`: U = 4 one-token decode steps, each writing its keys and values into the cache, against one U-token
  forward over the same cache: per row, the hidden-state elements (of D) that differ.

Writes a JSON result (`--out`) that `scripts/render_results.py` renders.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import toolkit
from clover_jax.decoding.autoregressive import decode_forward, prefill
from clover_jax.io.loader import load_model
from clover_jax.models.cache import KVCache, causal_mask

PROMPT = "Write a short poem about the sea and the wind, in four lines."


def products(dtype, rng) -> list[dict]:
    """Row 0 of `x[:M] @ W` against `x[:1] @ W`: elements that differ, per shape and M."""
    out = []
    f = jax.jit(lambda a, b: jnp.einsum("MD,DF->MF", a, b, preferred_element_type=jnp.float32))
    for d, width in ((576, 1536), (1536, 576), (576, 49152)):
        x = jnp.asarray(rng.standard_normal((10, d)), dtype)  # [M, D]
        w = jnp.asarray(rng.standard_normal((d, width)) / np.sqrt(d), dtype)  # [D, F]
        one = np.asarray(f(x[:1], w)[0])
        for m in (2, 4, 10):
            out.append({"shape": [d, width], "rows": m, "differing": int((np.asarray(f(x[:m], w)[0]) != one).sum()),
                        "of": width})
    return out


def chain(loaded, tokens: list[int], batch: int) -> list[int]:
    """Per row of a U-token forward, the hidden-state elements that differ from the one-token steps' (batch rows
    all the same prompt)."""
    model, c = loaded.model, loaded.model.config
    graph, state = nnx.split(model)
    u = len(tokens)

    @jax.jit
    def both(state, prompt, new):
        m = nnx.merge(graph, state)
        b, t = prompt.shape
        cache = KVCache.init(c.num_hidden_layers, b, 256, c.num_key_value_heads, c.head_dim, model.dtype)
        _, _, cache = prefill(m, prompt, jnp.full((b,), t), cache)
        pos = jnp.broadcast_to(t + jnp.arange(u), (b, u))  # [B, U]
        verify, _, _, _ = decode_forward(m, new, pos, causal_mask(jnp.ones((b, u), bool)), cache)  # [B, U, D]
        steps = []
        for i in range(u):
            h, nk, nv, cache = decode_forward(m, new[:, i:i + 1], pos[:, i:i + 1], jnp.ones((b, 1, 1), bool), cache)
            cache = cache.append(nk, nv, num_valid=jnp.ones((b,), jnp.int32))
            steps.append(h[:, 0])
        return verify, jnp.stack(steps, 1)  # [B, U, D] twice

    ids = loaded.tokenizer.encode(PROMPT)
    verify, steps = both(state, jnp.asarray([ids] * batch, jnp.int32), jnp.asarray([tokens] * batch, jnp.int32))
    a = np.asarray(verify[0].astype(jnp.float32))
    b = np.asarray(steps[0].astype(jnp.float32))
    return [int(x) for x in (a != b).sum(-1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2])
    toolkit.add_out_argument(ap)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    result = toolkit.results(__file__, argv, benchmark="bench_rows", title="Verification and decode steps, row by row",
                             settings=f"{args.model}, a chat prompt in the KV cache, then 4 tokens", model=args.model,
                             products={}, chain={})
    for name in args.dtypes:
        dtype = getattr(jnp, name)
        result["products"][name] = products(dtype, rng)
        loaded = load_model(args.model, dtype=dtype)
        result["hidden_size"] = loaded.model.config.hidden_size
        tokens = [loaded.tokenizer.encode(" The")[0], 12, 345, 678]
        for b in args.batch_sizes:
            result["chain"][f"{name} batch {b}"] = chain(loaded, tokens, b)
    for name, rows in result["products"].items():
        for r in rows:
            print(f"products {name} {r['shape']} M={r['rows']}: row 0 differs from M=1 in {r['differing']} of {r['of']}")
    for key, diff in result["chain"].items():
        print(f"chain {key}: hidden-state elements differing per row: {diff}")
    toolkit.write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
