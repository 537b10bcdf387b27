"""What the products of a decoding step cost by the number of rows (verified tokens) on this backend.

  python bench/bench_products.py                       # SmolLM2-135M shapes, fp32, rows 1 4 5 9 26
  python bench/bench_products.py --shape llama3-8b --dtype bfloat16 --rows 1 8 26 64

A speculative step verifies U tokens where an autoregressive step feeds one, so its cost over a one-token step is
how much more a U-row product costs than a one-row product. Measured here in isolation, random weights:

* **logits**: `[U, D] x [V, D]^T`, the output table contracted as `Llama.project` does (float32 accumulation);
* **MLP, per layer**: the gate/up and down products of all layers' MLPs in sequence (each layer's weights read
  once per call, as a decoding step reads them), divided by the number of layers;
* **argmax** over `[U, V]` float32 logits: `jnp.argmax` against `clover_jax.decoding.sampling.argmax_last`, the two
  plain reductions the decoding loops take.

Prints ms per call (the fastest of 5 rounds of `--repeat` calls) and each U's ratio to U = 1; `--out PATH` writes the
results JSON.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import toolkit
from clover_jax.decoding.sampling import argmax_last
from clover_jax.tuning.timing import timed_calls


def _best_ms(fn, *args, repeat: int) -> float:
    """ms per call of `fn(*args)`: the fastest of 5 rounds of `repeat` calls in a row (compiled first)."""
    jax.block_until_ready(fn(*args))

    def round_of_calls():
        for _ in range(repeat):
            out = fn(*args)
        return jax.block_until_ready(out)

    return min(timed_calls(round_of_calls, 5)[0]) / repeat * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(toolkit.SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 9, 26])
    ap.add_argument("--layers", type=int, default=0, help="layers of MLP weights (0: the shape's)")
    ap.add_argument("--repeat", type=int, default=20)
    toolkit.add_out_argument(ap)
    args = ap.parse_args(argv)
    if min(args.rows) < 1:
        raise SystemExit(f"--rows must be >= 1, got {args.rows}")

    v, d, layers, _, _, inter, _ = toolkit.SHAPES[args.shape]
    layers = args.layers or layers
    dt = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((v, d), np.float32) * 0.02, dt)  # [V, D]
    up = [jnp.asarray(rng.standard_normal((d, inter), np.float32) * 0.03, dt) for _ in range(layers)]  # [D, F]
    down = [jnp.asarray(rng.standard_normal((inter, d), np.float32) * 0.03, dt) for _ in range(layers)]  # [F, D]

    logits = jax.jit(lambda h, w: jnp.einsum("uD,VD->uV", h, w, preferred_element_type=jnp.float32))

    @jax.jit
    def mlp(h, up, down):  # the layers in sequence: each product waits for the one before
        for u_, d_ in zip(up, down):
            h = (jnp.tanh(h @ u_) @ d_).astype(h.dtype)
        return h

    argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1))
    fast = jax.jit(argmax_last)
    print(f"# {args.shape} shapes (V {v}, D {d}, F {inter}, {layers} layers), {args.dtype}, backend "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind}), ms per call\n")
    print("| rows U | logits | / U=1 | MLP per layer | / U=1 | jnp.argmax | argmax_last |")
    print("|---|---|---|---|---|---|---|")
    base, rows = None, []
    for u in args.rows:
        h = jnp.asarray(rng.standard_normal((u, d), np.float32), dt)
        x = jnp.asarray(rng.standard_normal((u, v), np.float32))
        row = (_best_ms(logits, h, table, repeat=args.repeat),
               _best_ms(mlp, h, up, down, repeat=max(args.repeat // 4, 2)) / layers,
               _best_ms(argmax, x, repeat=args.repeat), _best_ms(fast, x, repeat=args.repeat))
        base = base or row
        print(f"| {u} | {row[0]:.3f} | {row[0] / base[0]:.2f} | {row[1]:.4f} | {row[1] / base[1]:.2f} | "
              f"{row[2]:.3f} | {row[3]:.3f} |")
        rows.append({"rows": u, "logits_ms": round(row[0], 4), "logits_vs_1": round(row[0] / base[0], 3),
                     "mlp_per_layer_ms": round(row[1], 5), "mlp_vs_1": round(row[1] / base[1], 3),
                     "jnp_argmax_ms": round(row[2], 4), "argmax_last_ms": round(row[3], 4)})
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="bench_products", title="What a decoding step's products cost by rows",
        settings=f"{args.shape} shapes (V {v}, D {d}, F {inter}, {layers} layers), {args.dtype}, random weights",
        rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
