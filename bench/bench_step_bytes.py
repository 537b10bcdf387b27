"""Where a decode step's bytes go, read from the compiled programs: XLA's cost and memory analyses of the decoding
loops' steps, against the bytes a step has to read (the weights it multiplies by, the KV cache).

  python bench/bench_step_bytes.py                                          # SmolLM2-135M, AR + chain-3 + clover2-26
  python bench/bench_step_bytes.py --model smollm2-135m-instruct --json results/step-bytes/cpu-smollm2.json
  python bench/bench_step_bytes.py --shape llama3-8b --num-layers 4 --dtype bfloat16   # 8B's shapes, 4 layers
  python bench/bench_step_bytes.py --shape llama3-8b --dtype bfloat16 --batch-sizes 1 8 --time   # on a GPU

For each loop (autoregressive, and the speculative loop of each `--trees` tree with a random head of `--head-type`)
and each form of the base model's layers (`--layers`: unrolled and scan):

* **step**: the loop's step (`ar_step`, `spec_step`: the `lax.while_loop` body, nothing else) jitted on its own,
  its state donated as the loop carries it in place, compiled for the loop's shapes: `cost_analysis()`'s `bytes
  accessed` and `flops`, and the program's temporary bytes (`memory_analysis()`); not for scanned layers, whose
  `lax.scan` is a loop XLA's cost analysis counts one layer of. `bytes / floor` divides the bytes
  accessed by what a step must read: the weights it multiplies by (the decoder layers, the output projection; the
  draft head's for a speculative step) plus the whole KV cache (the step attends over every slot; see the notes).
* **call**: the whole jitted loop (prefill, the `while_loop`), as `generate` runs it: `memory_analysis()`'s
  argument, output, alias and temporary bytes. With unrolled layers the loop takes the per-layer weights as an
  argument, slices that share the stacked weights' memory (`layer_views`; XLA counts them among the arguments a
  second time, but they hold no memory of their own); with `--no-views` the program slices the stacked weights
  itself and its temporary bytes hold that copy of the layers' weights.
* **ms/step** (`--time`): the compiled loop run for `--loop-tokens N1 N2` new tokens (EOS disabled), the
  difference of the two runs per step (best of `--loop-repeat`), and the device's peak bytes in use where the
  backend reports them (`Device.memory_stats()`: the process's peak up to that row).

XLA counts a `while_loop`'s body once in a program's cost analysis, which is why the steps are compiled on their
own. Random weights of a real model's shapes (`--shape`, no download) or a model by name (`--model`); the compiled
programs do not depend on the values. Prints one table and the number of programs compiled; `--json PATH` writes
them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_step's shapes and trees

MIB = 1024 ** 2


def nbytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def build(args):
    """(config, base, head) for `--model` or `--shape` (random weights, `--num-layers` to cut the stack)."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    import bench_step
    from clover_jax.heads import registry
    from clover_jax.models.config import LlamaConfig
    from clover_jax.models.llama import init_llama

    dtype = jnp.dtype(args.dtype)
    if args.model:
        import clover_jax

        loaded = clover_jax.load_model(args.model, dtype=dtype)
        config, base = loaded.config, loaded.model
    else:
        v, d, layers, heads, kv, inter, tied = bench_step.SHAPES[args.shape]
        config = LlamaConfig(vocab_size=v, hidden_size=d, intermediate_size=inter,
                             num_hidden_layers=args.num_layers or layers, num_attention_heads=heads,
                             num_key_value_heads=kv, head_dim=d // heads, tie_word_embeddings=tied,
                             max_position_embeddings=max(8192, args.cache_size))
        base = init_llama(config, seed=0, dtype=dtype, param_dtype=dtype)
    ht = registry.get(args.head_type)
    head = ht.module_cls(config, ht.config_cls(dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(1))
    del dataclasses
    return config, base, head


def floor_bytes(base, head, cache_bytes: int, speculative: bool) -> dict[str, int]:
    """What one step must read: the decoder layers, the output projection (the tied embedding or lm_head), the final
    norm, the whole KV cache; a speculative step also the draft head's weights."""
    from flax import nnx

    from clover_jax.decoding.autoregressive import layer_weight_bytes

    lm = base.embed[...] if base.config.tie_word_embeddings else base.lm_head[...]
    out = {"layers": layer_weight_bytes(base), "output projection": nbytes(lm), "KV cache": cache_bytes}
    if speculative:
        out["draft head"] = nbytes(nnx.state(head, nnx.Param))
    return out


class Counter:
    def __init__(self):
        self.programs = 0

    def compile(self, lowered):
        self.programs += 1
        return lowered.compile()


def analyse(compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    mem = compiled.memory_analysis()
    out = {"bytes_accessed": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0))}
    if mem is not None:
        out |= {"argument": int(mem.argument_size_in_bytes), "output": int(mem.output_size_in_bytes),
                "alias": int(mem.alias_size_in_bytes), "temp": int(mem.temp_size_in_bytes)}
    return out


def loop_rows(args, base, head, tree: str | None, layers: str, batch: int, counter: Counter) -> dict:
    """The step's and the call's analyses (and, with `--time`, ms per step) of one loop."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import bench_step
    from clover_jax.decoding import autoregressive as ar
    from clover_jax.decoding import speculative as sp
    from clover_jax.decoding.sampling import SamplingParams

    config = base.config
    rng = np.random.default_rng(0)
    t = args.context
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, t)), jnp.int32)
    lens = jnp.full((batch,), t, jnp.int32)
    new = jnp.full((batch,), args.loop_tokens[0], jnp.int32)
    eos = jnp.asarray([-1], jnp.int32)
    sampling = SamplingParams()
    sp_arrays = sampling.arrays()
    key = jax.random.key(0)
    graphdef, state = nnx.split(base)
    precision = ar.products_precision(base.dtype)
    cache_dtype = jnp.dtype(base.dtype)
    s = args.cache_size

    if tree is None:  # the autoregressive loop
        full = ar._jitted(graphdef, s, True, cache_dtype, None, layers, precision, False)
        call_args = (state, prompt, lens, new, eos, sp_arrays, key)

        def start(state, prompt, lens, new, eos, sampling, key):
            return ar.ar_start(nnx.merge(graphdef, state), prompt, lens, new, eos, sampling, key, cache_size=s,
                                greedy=True, cache_dtype=cache_dtype, layers=layers)

        def step(state, lw, st, limit, eos, sampling):
            return ar.ar_step(nnx.merge(graphdef, state), lw, st, limit, eos, sampling, greedy=True)

        start_args, step_weights = (state, prompt, lens, new, eos, sp_arrays, key), (state,)
        nodes = 1
    else:
        vocab = (np.sort(rng.choice(config.vocab_size, args.draft_vocab, replace=False)).astype(np.int32)
                 if 0 < args.draft_vocab < config.vocab_size else None)
        _, drafter = bench_step.tree_drafter(config, head, tree, vocab)
        loop = sp.SpeculativeLoop(drafter=drafter, cache_size=s, greedy=True, cache_dtype=cache_dtype, layers=layers,
                                  precision=precision)
        head_graph, head_params = nnx.split(head)
        full = loop.compiled(graphdef, head_graph)
        arrays = drafter.arrays()
        call_args = (state, head_params, arrays, prompt, lens, new, eos, sp_arrays, key)

        def start(state, head_params, arrays, prompt, lens, new, eos, sampling, key):
            return sp.spec_start(loop, nnx.merge(graphdef, state), nnx.merge(head_graph, head_params), arrays, prompt,
                                  lens, new, eos, sampling, key)

        def step(state, head_params, lw, st, limit, eos, sampling):
            return sp.spec_step(loop, nnx.merge(graphdef, state), nnx.merge(head_graph, head_params), lw, st, limit,
                                 eos, sampling)

        start_args, step_weights = call_args, (state, head_params)
        nodes = drafter.num_nodes

    # unrolled: the loop's per-layer weights, slices sharing the stacked weights' memory (`layer_views`), or with
    # --no-views (the loops before them) none: the program slices the stacked weights itself
    views = ar.layer_views(base, layers) if args.views else None
    kw = {} if views is None else {"layer_weights": views}
    st, lw, limit = jax.eval_shape(ar.traced_with(precision, start), *start_args)
    step_a = {"bytes_accessed": None, "flops": None}
    if args.step:
        step_fn = jax.jit(ar.traced_with(precision, step), donate_argnums=(len(step_weights) + 1,))
        step_a = analyse(counter.compile(step_fn.lower(*step_weights, lw, st, limit, eos, sp_arrays)))
    call_compiled = counter.compile(full.lower(*call_args, **kw))
    cache_bytes = nbytes(st.cache.k) + nbytes(st.cache.v)
    floor = floor_bytes(base, head, cache_bytes, tree is not None)
    call_a = analyse(call_compiled)
    if layers == "scan":  # the layers' lax.scan is a while loop too: XLA counts one layer of it
        step_a["bytes_accessed"] = step_a["flops"] = None
    row = {"loop": "autoregressive" if tree is None else tree, "verified_tokens": nodes, "layers": layers,
           "layer_views": views is not None,
           "batch": batch, "floor": floor, "floor_bytes": sum(floor.values()), "step": step_a, "call": call_a,
           "bytes_over_floor": None if step_a["bytes_accessed"] is None else
           step_a["bytes_accessed"] / sum(floor.values())}
    if args.time:
        row |= time_loop(args, call_compiled, call_args, new, kw)
    return row


def time_loop(args, compiled, call_args, new, kw) -> dict:
    """ms per step of the compiled loop (two runs of different lengths, best of `--loop-repeat`), and the device's
    peak bytes in use after the runs where the backend reports it."""
    import jax
    import jax.numpy as jnp

    def run(n):
        a = list(call_args)
        a[-4] = jnp.full(new.shape, n, jnp.int32)  # max_new_tokens [B]
        out = compiled(*a, **kw)
        out = out[0] if isinstance(out, tuple) else out
        jax.block_until_ready(out)
        return out

    run(args.loop_tokens[0])  # warm
    res = {}
    for n in args.loop_tokens:
        best = float("inf")
        for _ in range(args.loop_repeat):
            t0 = time.perf_counter()
            out = run(n)
            best = min(best, time.perf_counter() - t0)
        res[n] = (best, int(out.steps))
    (t1, s1), (t2, s2) = (res[n] for n in args.loop_tokens)
    row = {"ms_per_step": (t2 - t1) / max(s2 - s1, 1) * 1e3}
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not implemented on some backends
        stats = {}
    if stats.get("peak_bytes_in_use"):
        row["device_peak_bytes_so_far"] = int(stats["peak_bytes_in_use"])  # the process's peak up to here
    return row


def main(argv=None) -> int:
    import bench_step

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model by name (e.g. smollm2-135m-instruct); default: --shape")
    ap.add_argument("--shape", choices=sorted(bench_step.SHAPES), default="smollm2-135m")
    ap.add_argument("--num-layers", type=int, default=0, help="decoder layers of a --shape model (0: the shape's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--head-type", default="clover2")
    ap.add_argument("--trees", nargs="*", default=["chain-3", "clover2-26"])
    ap.add_argument("--no-ar", action="store_true", help="skip the autoregressive loop")
    ap.add_argument("--layers", nargs="+", default=["unrolled", "scan"], choices=["unrolled", "scan"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens")
    ap.add_argument("--cache-size", type=int, default=640)
    ap.add_argument("--time", action="store_true", help="also run each compiled loop: ms per step, device peak")
    ap.add_argument("--loop-tokens", type=int, nargs=2, default=(16, 80), metavar=("N1", "N2"))
    ap.add_argument("--loop-repeat", type=int, default=3)
    ap.add_argument("--no-step", dest="step", action="store_false",
                    help="skip the step programs' cost analysis (one program less per loop)")
    ap.add_argument("--no-views", dest="views", action="store_false",
                    help="unrolled loops slice the stacked weights inside their program (as before layer_views)")
    ap.add_argument("--label", default="", help="a label for this run's settings (e.g. the XLA flags), in the JSON")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = ap.parse_args(argv)

    import jax

    if args.context + args.loop_tokens[1] + 64 > args.cache_size:
        raise SystemExit(f"--cache-size {args.cache_size} cannot hold --context {args.context} + "
                         f"{args.loop_tokens[1]} new tokens + a tree; raise it")
    config, base, head = build(args)
    counter = Counter()
    what = args.model or f"{args.shape} shapes, {config.num_hidden_layers} layers, random weights"
    print(f"# {what}, {args.dtype}, context {args.context}, cache {args.cache_size}, backend {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}), XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| loop | layers | views | batch | step bytes accessed (MiB) | floor: weights + KV (MiB) | bytes / floor | "
          "step GFLOP | step temp (MiB) | call args (MiB) | call temp (MiB) | ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    loops = ([] if args.no_ar else [None]) + list(args.trees)
    t0 = time.perf_counter()
    for batch in args.batch_sizes:
        for tree in loops:
            for layers in args.layers:
                r = loop_rows(args, base, head, tree, layers, batch, counter)
                rows.append(r)
                ms = f"{r['ms_per_step']:.2f}" if "ms_per_step" in r else "-"
                fmt = lambda x, k=1.0, f="{:.1f}": "-" if x is None else f.format(x / k)  # noqa: E731
                print(f"| {r['loop']} | {layers} | {'yes' if r['layer_views'] else 'no'} | {batch} | {fmt(r['step']['bytes_accessed'], MIB)} | "
                      f"{r['floor_bytes'] / MIB:.1f} | {fmt(r['bytes_over_floor'], 1, '{:.2f}')} | "
                      f"{fmt(r['step']['flops'], 1e9, '{:.3f}')} | "
                      f"{fmt(r['step'].get('temp'), MIB)} | {r['call'].get('argument', 0) / MIB:.1f} | "
                      f"{r['call'].get('temp', 0) / MIB:.1f} | {ms} |", flush=True)
    print(f"# {counter.programs} programs compiled in {time.perf_counter() - t0:.0f} s")
    report = {"model": what, "dtype": args.dtype, "context": args.context, "cache_size": args.cache_size,
              "head_type": args.head_type, "draft_vocab": args.draft_vocab, "backend": jax.default_backend(),
              "device": jax.devices()[0].device_kind, "machine": platform.processor() or platform.machine(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "label": args.label, "command": " ".join(sys.argv),
              "weight_bytes": nbytes(jax.tree.leaves(__import__("flax").nnx.state(base))),
              "programs_compiled": counter.programs, "rows": rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
