"""One decoding step, three ways: what it costs part by part (`time`), where its bytes go in the compiled programs
(`bytes`), and where its time goes op by op (`trace`).

  python bench/bench_step.py time                                  # SmolLM2-135M shapes, random weights, chain-3
  python bench/bench_step.py time --trees chain-3 small-10 clover2-26 --context 300 --cache-size 640
  python bench/bench_step.py time --shape llama3-8b --dtype bfloat16 --mesh tp=8 --no-parts   # a TPU v5e-8 / 8 GPUs
  python bench/bench_step.py time --head-type eagle --trees chain-4 --out artifacts/step-eagle.json
  python bench/bench_step.py bytes --model smollm2-135m-instruct --out results/step-bytes/cpu-smollm2.json
  python bench/bench_step.py bytes --shape llama3-8b --dtype bfloat16 --batch-sizes 1 8 --time   # on a GPU
  python bench/bench_step.py trace --tree fit-5-411aab+lookup-4-table --layers scan --top 30

Random weights of a real model's shapes (`--shape`, no download, any backend) or a model by name (`--model`), a random
head of `--head-type`; EOS disabled, so every call runs every step (a random head's drafts are rejected: a
speculative step yields one token, and costs what any step costs: shapes are static).

* `time`: **loop**, ms per decode-phase step of the real jitted loops (`ar_generate`, `spec_generate`), from calls
  of `--loop-tokens N1 N2` new tokens (`clover_jax.tuning.timing`: the fastest of `--loop-repeat` calls each; prefill
  and dispatch cancel); **parts**, each part of a speculative step as its own jitted function on the same shapes
  (draft, verify forward, logits, acceptance, KV compaction, head commit) and the AR step's (forward, logits), the
  median of `--repeat` calls: their sum differs from the loop's step by what fusing inside the loop saves or costs.
  `--mesh data=D,tp=T` runs the loops sharded (parts skipped). Prints a table per tree and a summary: verify forward
  of U tokens, draft, and `(verify U + draft) / AR forward`, what tau has to pay for.
* `bytes`: per loop (autoregressive and each tree) and form of the layers (`--layers unrolled scan`), XLA's analyses
  of the compiled programs. **step**: the loop's body (`ar_step`, `spec_step`) jitted alone with its state donated:
  bytes accessed, flops, temporaries (not for scanned layers, whose `lax.scan` XLA counts one layer of), and
  `bytes / floor`, over what a step must read (the weights it multiplies by, the draft head's, the whole KV cache).
  **call**: the whole jitted loop as `generate` runs it: argument, output, alias and temporary bytes (with unrolled
  layers its per-layer weights are views of the stacked ones, `layer_views`; `--no-views` slices them inside the
  program). `--time`: each compiled loop's ms per step and the device's peak bytes where the backend reports them.
  XLA counts a `while_loop`'s body once in a program's cost analysis, which is why the steps compile alone.
* `trace`: the loop of `--tree` (`ar`: the autoregressive loop) compiled, warmed, and recorded under
  `jax.profiler.trace` for 16 and `--new-tokens` new tokens: each op's summed time's difference per step, grouped by
  the JAX operation its fusion came from (`op_name` in the optimised HLO, dumped for this; `.../while/body/while/...`
  is inside the scan over the layers). The profiler slows the ops and ops on two threads overlap: the table ranks
  where the time goes rather than adding up to the step (`time` measures that).

`--out PATH` writes the results JSON (`bench_step`, `step_bytes`, `step_trace`; `bench/head_types.py --steps` reads
`time`'s).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import toolkit
from clover_jax.tuning.timing import per_iteration, timed_calls

MIB = 1024 ** 2


# ------------------------------------------------------------------------------------------------- shared
def build(args):
    """(config, base, head): `--model` by name, or `--shape` with random weights (`--num-layers` cuts the stack)."""
    dtype = jnp.dtype(args.dtype)
    if args.model:
        import clover_jax

        base = clover_jax.load_model(args.model, dtype=dtype).model
    else:
        base = toolkit.random_base(args.shape, dtype, num_layers=args.num_layers, positions=args.cache_size)
    return base.config, base, toolkit.random_head(base, args.head_type, dtype, args.draft_vocab)


def tree_drafter(config, head, tree: str, vocab, ngram_table=None):
    """`(spec, drafter)` of `tree` for a random model of `config`'s shapes: a shipped head's fitted tree names
    (`fit-N-<hash>`) resolve, and trees named `...-table` draft from `ngram_table` (default: the shipped SmolLM2
    head's table, which needs SmolLM2's vocabulary)."""
    from clover_jax import pretrained
    from clover_jax.decoding.ngram import resolve_ngram_table
    from clover_jax.decoding.tree import LookupTree, get_tree
    from clover_jax.heads.folder import open_folder
    from clover_jax.heads.registry import drafter_for

    known = {}  # fit-N-<hash>: a tree fitted by a shipped head's calibration
    for name in pretrained.HEADS:
        known.update(open_folder(name).trees)
    spec = get_tree(tree, known)
    table = None
    if isinstance(spec, LookupTree) and spec.table:
        table = (resolve_ngram_table(ngram_table) if ngram_table else
                 open_folder(pretrained.default_head("smollm2-135m-instruct")).ngram_table)
        if table.vocab_size != config.vocab_size:
            raise SystemExit(f"{tree}: the n-gram table was built for a vocabulary of {table.vocab_size}, the "
                             f"model of these shapes has {config.vocab_size} (--ngram-table)")
    return spec, drafter_for(type(head), spec, vocab, table)


def draft_vocabulary(args, config, rng):
    """`[V']` sorted random token ids of `--draft-vocab` size, or None for the full vocabulary."""
    if not 0 < args.draft_vocab < config.vocab_size:
        return None
    return np.sort(rng.choice(config.vocab_size, args.draft_vocab, replace=False)).astype(np.int32)


def ms_per_step(run, lengths, repeat: int, steps_of) -> float:
    """ms per loop step of `run(n)` (a blocking call for n new tokens): one call to compile, then `repeat` calls of
    each length, fastest long less fastest short over the steps between them (`clover_jax.tuning.timing`)."""
    n1, n2 = lengths
    run(n1)  # compile
    (short, out1), (long, out2) = (timed_calls(lambda n=n: run(n), repeat) for n in (n1, n2))
    return per_iteration(short, long, steps_of(out2) - steps_of(out1)) * 1e3


def _median_ms(fn, *args, repeat: int) -> float:
    """Median wall milliseconds of `fn(*args)` (compiled and warmed up first)."""
    jax.block_until_ready(fn(*args))
    return statistics.median(timed_calls(lambda: jax.block_until_ready(fn(*args)), repeat)[0]) * 1e3


def _check_cache(args, new_tokens: int) -> None:
    if args.context + new_tokens + 64 > args.cache_size:
        raise SystemExit(f"--cache-size {args.cache_size} cannot hold --context {args.context} + {new_tokens} new "
                         "tokens + a tree; raise it")


# --------------------------------------------------------------------------------------------------- time
def loop_ms(args, base, head, drafter, prompt, lens) -> tuple[float, float]:
    """(AR ms/step, speculative ms/step) of the jitted loops."""
    from clover_jax.decoding.autoregressive import ar_generate
    from clover_jax.decoding.sampling import SamplingParams
    from clover_jax.decoding.speculative import spec_generate

    kw = dict(cache_size=args.cache_size, sampling=SamplingParams(), key=jax.random.key(0), eos_ids=[-1],
              mesh=args.mesh_obj)

    def ar(n):
        return jax.block_until_ready(ar_generate(base, prompt, lens, max_new_tokens=n, layers=args.ar_layers, **kw))

    def spec(n):
        return spec_generate(base, head, prompt, lens, max_new_tokens=n, drafter=drafter, layers=args.spec_layers,
                             **kw)[0]

    steps = lambda out: int(out.steps)  # noqa: E731
    return (ms_per_step(ar, args.loop_tokens, args.loop_repeat, steps),
            ms_per_step(spec, args.loop_tokens, args.loop_repeat, steps))


def parts_ms(args, config, base, head, drafter, prompt, lens) -> dict[str, float]:
    """Milliseconds of each part of an AR step and of a speculative step, each jitted on its own."""
    from clover_jax.decoding import verify
    from clover_jax.decoding.autoregressive import prefill
    from clover_jax.decoding.speculative import unroll_head_layers
    from clover_jax.models.cache import KVCache, prefix_mask

    c = config
    b, s = prompt.shape[0], args.cache_size
    u, dmax = drafter.num_nodes, drafter.max_depth
    bg, bs = nnx.split(base)
    hg, hp = nnx.split(head)
    arrays = drafter.arrays()
    dtype = jnp.dtype(args.dtype)
    # per-layer weight buffers for unrolled layers, made once (as the loops make them once per call, before
    # their steps); the AR and the speculative parts run the layers as their loops do (`decode_layers`)
    split = jax.jit(lambda bs: nnx.merge(bg, bs).layers.per_layer_weights())(bs) if "unrolled" in (
        args.ar_layers, args.spec_layers) else None
    lw_ar = split if args.ar_layers == "unrolled" else None
    lw = split if args.spec_layers == "unrolled" else None

    @jax.jit
    def setup(bs, lw, hp, arrays, prompt, lens):
        base_, head_ = nnx.merge(bg, bs), nnx.merge(hg, hp)
        cache = KVCache.init(c.num_hidden_layers, b, s, c.num_key_value_heads, c.head_dim, dtype,
                             per_layer=lw is not None)
        _, hidden, cache = prefill(base_, prompt, lens, cache, layer_weights=lw, taps=drafter.feature_layers(head_))
        y = jnp.concatenate([prompt[:, 1:], prompt[:, :1]], axis=1)
        hs = unroll_head_layers(drafter, head_, drafter.init_state(head_, base_, b, s, arrays))  # as the loop does
        return cache, drafter.start(head_, base_, hs, hidden, y, lens)

    cache, hs = setup(bs, lw, hp, arrays, prompt, lens)  # laid out for the speculative parts
    cache_ar = setup(bs, lw_ar, hp, arrays, prompt, lens)[0] if lw_ar is not lw else cache
    root, key, r = prompt[:, 0], jax.random.key(0), args.repeat
    out: dict[str, float] = {}

    # --- the autoregressive step: one token through the stack, its K/V appended, logits, argmax
    @jax.jit
    def ar_forward(bs, lw, cache, tok):
        h, nk, nv = nnx.merge(bg, bs).forward_hidden(tok[:, None], cache.lengths[:, None], jnp.ones((b, 1, 1), bool),
                                                     cache, prefix_mask(cache.lengths, 1, s), layer_weights=lw)
        return h, cache.append(nk, nv)

    @jax.jit
    def ar_logits(bs, h):
        return jnp.argmax(nnx.merge(bg, bs).logits(h[:, 0]), axis=-1)

    out["ar: forward + KV append"] = _median_ms(ar_forward, bs, lw_ar, cache_ar, root, repeat=r)
    h1, _ = ar_forward(bs, lw_ar, cache_ar, root)
    out["ar: logits + argmax"] = _median_ms(ar_logits, bs, h1, repeat=r)

    # --- the speculative step
    taps = drafter.feature_layers(nnx.merge(hg, hp))  # base layers the head reads besides the last

    @jax.jit
    def draft(bs, hp, hs, root, key):
        return drafter.propose(nnx.merge(hg, hp), nnx.merge(bg, bs), hs, root, key)

    prop = draft(bs, hp, hs, root, key)

    @jax.jit
    def verify_forward(bs, lw, cache, tokens, buffers):
        depth = jnp.broadcast_to(buffers.depth, (b, u))
        mask = jnp.broadcast_to(buffers.mask, (b, u, u))
        length = cache.lengths
        h, nk, nv = nnx.merge(bg, bs).forward_hidden(tokens, length[:, None] + depth, mask, cache,
                                                     prefix_mask(length, u, s), layer_weights=lw,
                                                     taps=taps)  # [B, U, (n + 1) D]
        return h, cache.write(nk, nv, length[:, None] + jnp.arange(u)[None, :])

    hv, cache_v = verify_forward(bs, lw, cache, prop.tokens, prop.buffers)

    @jax.jit
    def logits(bs, h):
        return nnx.merge(bg, bs).logits(h[..., -c.hidden_size:])

    lg = logits(bs, hv)

    @jax.jit
    def accept(tokens, lg, buffers):
        return verify.greedy_accept(tokens, lg, buffers)

    acc = accept(prop.tokens, lg, prop.buffers)

    @jax.jit
    def compact(cache, nodes, n):
        return cache.gather_to_prefix(cache.lengths[:, None] + nodes, n + 1)

    @jax.jit
    def commit(bs, hp, hs, f_new, y_new, num):
        new = drafter.commit(nnx.merge(hg, hp), nnx.merge(bg, bs), hs, f_new, y_new, num)
        # the leaves the commit changed only: returning an unchanged one (a head's projections kept in its state)
        # would time a copy of it, which the loop, carrying the state, never makes
        return [n for n, o in zip(jax.tree.leaves(new), jax.tree.leaves(hs)) if n is not o]

    f_new = jnp.take_along_axis(hv, acc.accepted_nodes[..., None], axis=1)  # [B, Dmax+1, (n + 1) D]
    y_new = jnp.zeros((b, dmax + 1), jnp.int32)
    out["spec: draft"] = _median_ms(draft, bs, hp, hs, root, key, repeat=r)
    out["spec: verify forward + KV write"] = _median_ms(verify_forward, bs, lw, cache, prop.tokens, prop.buffers,
                                                        repeat=r)
    out["spec: logits"] = _median_ms(logits, bs, hv, repeat=r)
    out["spec: acceptance"] = _median_ms(accept, prop.tokens, lg, prop.buffers, repeat=r)
    out["spec: KV compaction"] = _median_ms(compact, cache_v, acc.accepted_nodes, acc.num_accepted, repeat=r)
    out["spec: head commit"] = _median_ms(commit, bs, hp, hs, f_new, y_new, acc.num_accepted + 1, repeat=r)
    return out


def time_main(args, argv) -> int:
    from clover_jax.decoding.autoregressive import decode_layers
    from clover_jax.decoding.tree import LookupTree

    _check_cache(args, args.loop_tokens[1])
    config, base, head = build(args)
    args.mesh_obj = None
    if args.mesh:
        from clover_jax import parallel

        args.mesh_obj = parallel.parse_mesh(args.mesh)
        args.no_parts = True
        nnx.update(base, parallel.place(nnx.state(base), args.mesh_obj))  # once, outside the timed calls
        nnx.update(head, parallel.place(nnx.state(head), args.mesh_obj))
    rng = np.random.default_rng(0)
    b, t = args.batch_size, args.context
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32)
    lens = jnp.full((b,), t, jnp.int32)
    args.draft_vocab = args.draft_vocab if args.draft_vocab < config.vocab_size else 0  # e.g. 8,192 on --shape tiny
    vocab = draft_vocabulary(args, config, rng)
    what = args.model or f"{args.shape} shapes"
    report = {"head_type": args.head_type, "backend": jax.default_backend(), "device": str(jax.devices()[0]),
              "shape": args.shape, "model": args.model, "dtype": args.dtype, "batch": b, "context": t,
              "cache_size": args.cache_size, "draft_vocab": args.draft_vocab, "mesh": args.mesh,
              "layers_asked": args.layers, "layers": {}, "trees": {}, "steps": {}}
    print(f"# {args.head_type} head, {what} {args.dtype}, batch {b}, context {t}, cache {args.cache_size}, draft "
          f"vocabulary {args.draft_vocab or 'full'}, backend {report['backend']} ({report['device']})"
          + (f", mesh {args.mesh}" if args.mesh else "") + f", --layers {args.layers}")
    sizes = {}
    for tree in args.trees:
        spec, drafter = tree_drafter(config, head, tree, vocab, args.ngram_table)
        parts = not args.no_parts and not isinstance(spec, LookupTree)  # parts: head trees only
        # the AR loop's choice; with --layers auto the speculative loop makes its own (scan on a CPU)
        args.ar_layers = decode_layers(args.layers, args.mesh_obj, model=base)
        args.spec_layers = decode_layers(args.layers, args.mesh_obj, tokens_per_step=drafter.num_nodes, model=base)
        ar_ms, spec_ms = loop_ms(args, base, head, drafter, prompt, lens)
        rows = {"loop: AR step": ar_ms, "loop: speculative step": spec_ms}
        if parts:
            rows |= parts_ms(args, config, base, head, drafter, prompt, lens)
        report["trees"][tree] = rows
        report["layers"][tree] = {"ar": args.ar_layers, "speculative": args.spec_layers}
        report["steps"][tree] = {"head": args.head_type, "tree": tree, "verified_tokens": drafter.num_nodes,
                                 "depth": drafter.max_depth, "ar_step_ms": round(ar_ms, 3),
                                 "speculative_step_ms": round(spec_ms, 3), "ratio": round(spec_ms / ar_ms, 3),
                                 **({"draft_ms": round(rows["spec: draft"], 3),
                                     "commit_ms": round(rows["spec: head commit"], 3)} if parts else {})}
        sizes[tree] = drafter.num_nodes
        print(f"\n## {tree} ({drafter.num_nodes} verified tokens, {drafter.max_depth} deep; layers: AR "
              f"{args.ar_layers}, speculative {args.spec_layers})\n")
        print("| part | ms | / AR loop step |\n|---|---|---|")
        for name, ms in rows.items():
            print(f"| {name} | {ms:.2f} | {ms / ar_ms:.2f} |")
        if parts:
            spec_sum = sum(v for k, v in rows.items() if k.startswith("spec:"))
            ar_sum = sum(v for k, v in rows.items() if k.startswith("ar:"))
            print(f"| sum of spec parts | {spec_sum:.2f} | {spec_sum / ar_ms:.2f} |")
            print(f"| sum of AR parts | {ar_sum:.2f} | {ar_sum / ar_ms:.2f} |")
    if not args.no_parts:
        print("\n## summary: a speculative step's extra cost over an AR step (parts, ms)\n")
        print("| tree | U verified | AR forward | verify U forward | draft | (verify U + draft) / AR forward |")
        print("|---|---|---|---|---|---|")
        summary = {}
        for tree, rows in report["trees"].items():
            if "ar: forward + KV append" not in rows:
                continue
            ar_f = rows["ar: forward + KV append"]
            ver, dr = rows["spec: verify forward + KV write"], rows["spec: draft"]
            summary[tree] = {"U": sizes[tree], "ratio": (ver + dr) / ar_f}
            print(f"| {tree} | {sizes[tree]} | {ar_f:.2f} | {ver:.2f} | {dr:.2f} | {(ver + dr) / ar_f:.2f} |")
        report["summary"] = summary
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="bench_step", title=f"One decoding step against an autoregressive one: "
        f"{args.head_type} head, {what}, {args.dtype}", settings=(
            f"random weights, batch {b}, context {t}, cache {args.cache_size}, draft vocabulary "
            f"{args.draft_vocab or 'full'}, layers {args.layers}" + (f", mesh {args.mesh}" if args.mesh else "")),
        **report))
    return 0


# -------------------------------------------------------------------------------------------------- bytes
def nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def floor_bytes(base, head, cache_bytes: int, speculative: bool) -> dict[str, int]:
    """What one step must read: the decoder layers, the output projection (the tied embedding or lm_head), the final
    norm, the whole KV cache; a speculative step also the draft head's weights."""
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
    from clover_jax.decoding import autoregressive as ar
    from clover_jax.decoding import speculative as sp
    from clover_jax.decoding.sampling import SamplingParams

    config = base.config
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.context)), jnp.int32)
    lens = jnp.full((batch,), args.context, jnp.int32)
    new = jnp.full((batch,), args.loop_tokens[0], jnp.int32)
    eos = jnp.asarray([-1], jnp.int32)
    sp_arrays = SamplingParams().arrays()
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

        step_weights, nodes = (state,), 1
    else:
        _, drafter = tree_drafter(config, head, tree, draft_vocabulary(args, config, rng))
        loop = sp.SpeculativeLoop(drafter=drafter, cache_size=s, greedy=True, cache_dtype=cache_dtype, layers=layers,
                                  precision=precision)
        head_graph, head_params = nnx.split(head)
        full = loop.compiled(graphdef, head_graph)
        call_args = (state, head_params, drafter.arrays(), prompt, lens, new, eos, sp_arrays, key)

        def start(state, head_params, arrays, prompt, lens, new, eos, sampling, key):
            return sp.spec_start(loop, nnx.merge(graphdef, state), nnx.merge(head_graph, head_params), arrays, prompt,
                                 lens, new, eos, sampling, key)

        def step(state, head_params, lw, st, limit, eos, sampling):
            return sp.spec_step(loop, nnx.merge(graphdef, state), nnx.merge(head_graph, head_params), lw, st, limit,
                                eos, sampling)

        step_weights, nodes = (state, head_params), drafter.num_nodes
    # unrolled: the loop's per-layer weights, slices sharing the stacked weights' memory (`layer_views`), or with
    # --no-views (the loops before them) none: the program slices the stacked weights itself
    views = ar.layer_views(base, layers) if args.views else None
    kw = {} if views is None else {"layer_weights": views}
    st, lw, limit = jax.eval_shape(ar.traced_with(precision, start), *call_args)
    step_a = {"bytes_accessed": None, "flops": None}
    if args.step:
        step_fn = jax.jit(ar.traced_with(precision, step), donate_argnums=(len(step_weights) + 1,))
        step_a = analyse(counter.compile(step_fn.lower(*step_weights, lw, st, limit, eos, sp_arrays)))
    call_compiled = counter.compile(full.lower(*call_args, **kw))
    floor = floor_bytes(base, head, nbytes(st.cache.k) + nbytes(st.cache.v), tree is not None)
    if layers == "scan":  # the layers' lax.scan is a while loop too: XLA counts one layer of it
        step_a["bytes_accessed"] = step_a["flops"] = None
    row = {"loop": "autoregressive" if tree is None else tree, "verified_tokens": nodes, "layers": layers,
           "layer_views": views is not None, "batch": batch, "floor": floor, "floor_bytes": sum(floor.values()),
           "step": step_a, "call": analyse(call_compiled),
           "bytes_over_floor": None if step_a["bytes_accessed"] is None else
           step_a["bytes_accessed"] / sum(floor.values())}
    if args.time:
        def run(n):
            a = list(call_args)
            a[-4] = jnp.full(new.shape, n, jnp.int32)  # max_new_tokens [B]
            out = call_compiled(*a, **kw)
            return jax.block_until_ready(out[0] if isinstance(out, tuple) else out)

        row["ms_per_step"] = ms_per_step(run, args.loop_tokens, args.loop_repeat, lambda out: int(out.steps))
        try:
            stats = jax.devices()[0].memory_stats() or {}
        except Exception:  # noqa: BLE001 - not implemented on some backends
            stats = {}
        if stats.get("peak_bytes_in_use"):
            row["device_peak_bytes_so_far"] = int(stats["peak_bytes_in_use"])  # the process's peak up to here
    return row


def bytes_main(args, argv) -> int:
    _check_cache(args, args.loop_tokens[1])
    config, base, head = build(args)
    counter = Counter()
    what = args.model or f"{args.shape} shapes, {config.num_hidden_layers} layers, random weights"
    print(f"# {what}, {args.dtype}, context {args.context}, cache {args.cache_size}, backend {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}), XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| loop | layers | views | batch | step bytes accessed (MiB) | floor: weights + KV (MiB) | bytes / floor | "
          "step GFLOP | step temp (MiB) | call args (MiB) | call temp (MiB) | ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x, k=1.0, f="{:.1f}": "-" if x is None else f.format(x / k)  # noqa: E731
    rows, t0 = [], time.perf_counter()
    for batch in args.batch_sizes:
        for tree in ([] if args.no_ar else [None]) + list(args.trees):
            for layers in args.layers:
                r = loop_rows(args, base, head, tree, layers, batch, counter)
                rows.append(r)
                print(f"| {r['loop']} | {layers} | {'yes' if r['layer_views'] else 'no'} | {batch} | "
                      f"{fmt(r['step']['bytes_accessed'], MIB)} | {r['floor_bytes'] / MIB:.1f} | "
                      f"{fmt(r['bytes_over_floor'], 1, '{:.2f}')} | {fmt(r['step']['flops'], 1e9, '{:.3f}')} | "
                      f"{fmt(r['step'].get('temp'), MIB)} | {r['call'].get('argument', 0) / MIB:.1f} | "
                      f"{r['call'].get('temp', 0) / MIB:.1f} | {fmt(r.get('ms_per_step'), 1, '{:.2f}')} |", flush=True)
    print(f"# {counter.programs} programs compiled in {time.perf_counter() - t0:.0f} s")
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="step_bytes", title=f"Where a decode step's bytes go: {what}",
        settings=f"{args.dtype}, context {args.context}, cache {args.cache_size}, {args.head_type} head"
                 + (f"; {args.label}" if args.label else ""),
        model=what, dtype=args.dtype, context=args.context, cache_size=args.cache_size, head_type=args.head_type,
        draft_vocab=args.draft_vocab, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
        xla_flags=os.environ.get("XLA_FLAGS", ""), label=args.label, weight_bytes=nbytes(nnx.state(base)),
        programs_compiled=counter.programs, rows=rows))
    return 0


# -------------------------------------------------------------------------------------------------- trace
def hlo_op_names(dump_dir: str) -> dict[str, str]:
    """Instruction name -> `op_name` metadata, from the largest optimised HLO module in `dump_dir` (the loop)."""
    files = [f for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")) if "buffer" not in f]
    if not files:
        return {}
    names = {}
    for line in open(max(files, key=os.path.getsize)):
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*metadata=\{([^}]*)\}", line)
        if m:
            op = re.search(r'op_name="([^"]+)"', m.group(2))
            names[m.group(1)] = op.group(1) if op else ""
    return names


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """(total microseconds, calls) per traced op name, over every thread, from the profiler's trace."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise SystemExit(f"no trace written under {trace_dir}")
    with gzip.open(files[0]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    skip = ("$", "Thunk", "Pjit", "Common", "Slinky", "end:")
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(skip):
            total[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    return total, calls


def trace_main(args, argv) -> int:
    if args.new_tokens <= 16:
        raise SystemExit(f"--new-tokens must be above 16 (the shorter traced call), got {args.new_tokens}")
    # read when JAX starts its backend: in a process where it already has (a test), ops keep their HLO names
    flags = os.environ.get("XLA_FLAGS")
    with tempfile.TemporaryDirectory(prefix="trace_step_hlo_") as dump:
        os.environ["XLA_FLAGS"] = ((flags or "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text "
                                   "--xla_dump_hlo_module_re=.*jit_(fn|wrapped).*").strip()
        try:
            return _trace(args, argv, dump)
        finally:
            if flags is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = flags


def _trace(args, argv, dump: str) -> int:
    from clover_jax.decoding.autoregressive import ar_generate
    from clover_jax.decoding.sampling import SamplingParams
    from clover_jax.decoding.speculative import spec_generate

    config, base, head = build(args)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, args.context)), jnp.int32)
    lens = np.array([args.context])
    kw = dict(cache_size=args.cache_size, sampling=SamplingParams(), key=jax.random.key(0), eos_ids=[-1],
              layers=None if args.layers == "auto" else args.layers)
    if args.tree == "ar":
        def run(n):
            return jax.block_until_ready(ar_generate(base, prompt, lens, max_new_tokens=n, **kw))
    else:
        vocab = np.arange(8192, dtype=np.int32) if config.vocab_size > 8192 else None  # a draft vocabulary
        _, drafter = tree_drafter(config, head, args.tree, vocab)

        def run(n):
            return spec_generate(base, head, prompt, lens, max_new_tokens=n, drafter=drafter, **kw)[0]

    names, runs = None, []
    for n in (16, args.new_tokens):
        run(n)
        run(n)
        with tempfile.TemporaryDirectory(prefix="trace_step_") as trace:
            with jax.profiler.trace(trace, create_perfetto_trace=True):
                out = run(n)
            total, calls = op_times(trace)
        names = names or hlo_op_names(dump)
        by_op, n_by_op = collections.Counter(), collections.Counter()
        for name, us in total.items():
            op = re.sub(r"^jit\([^)]*\)/", "", names.get(name, "")) or name
            by_op[op] += us
            n_by_op[op] += calls[name]
        runs.append((int(out.steps), by_op, n_by_op))
    (s1, t1, c1), (s2, t2, c2) = runs
    steps = max(s2 - s1, 1)
    per_step = {op: (t2[op] - t1[op]) / 1e3 / steps for op in t2}
    what = args.model or f"{args.shape} shapes"
    print(f"# {args.tree} on {what}, {args.dtype}, batch 1, {args.context} tokens cached; traced calls of {s1} and "
          f"{s2} steps; backend {jax.default_backend()}\n")
    print(f"all traced ops: {sum(per_step.values()):.2f} ms per step (ops on different threads overlap)\n")
    print("| ms per step | calls per step | JAX operation (or HLO op) |\n|---|---|---|")
    rows = []
    for op, ms in sorted(per_step.items(), key=lambda kv: -kv[1])[:args.top]:
        rows.append({"ms_per_step": round(ms, 4), "calls_per_step": round((c2[op] - c1[op]) / steps, 2),
                     "op": op[-100:]})
        print(f"| {ms:.3f} | {rows[-1]['calls_per_step']:.1f} | {op[-100:]} |")
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="step_trace", title=f"Where a decoding step's time goes, op by op: {args.tree}",
        settings=f"{what}, {args.dtype}, batch 1, context {args.context}; traced calls of {s1} and {s2} steps",
        tree=args.tree, all_ops_ms_per_step=round(sum(per_step.values()), 4), rows=rows))
    return 0


# --------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="a model by name (e.g. smollm2-135m-instruct); default: --shape")
    common.add_argument("--shape", choices=sorted(toolkit.SHAPES), default="smollm2-135m")
    common.add_argument("--num-layers", type=int, default=0, help="decoder layers of a --shape model (0: the shape's)")
    common.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    common.add_argument("--head-type", default="clover2",
                        help="a registered head type (clover2, clover1, eagle, eagle3, medusa, redrafter, block)")
    common.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: the full vocabulary)")
    common.add_argument("--context", type=int, default=300, help="tokens already in the cache (prompt length)")
    common.add_argument("--cache-size", type=int, default=640)
    toolkit.add_out_argument(common)
    loops = argparse.ArgumentParser(add_help=False)
    loops.add_argument("--loop-tokens", type=int, nargs=2, default=(16, 80), metavar=("N1", "N2"),
                       help="new tokens of the two loop runs whose difference gives ms/step")
    loops.add_argument("--loop-repeat", type=int, default=3, help="runs per loop length (the fastest counts)")
    layers_one = dict(default="auto", choices=["auto", "unrolled", "scan"],
                      help="how the base model's layers run while decoding (auto: see clover_jax.decoding."
                           "autoregressive.decode_layers; unrolled for every loop on a GPU, for one-token float32 "
                           "loops on a CPU)")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("time", parents=[common, loops], help="what a step costs, part by part")
    t.add_argument("--trees", nargs="+", default=["chain-3"])
    t.add_argument("--batch-size", type=int, default=1)
    t.add_argument("--repeat", type=int, default=30, help="timed calls per part (median)")
    t.add_argument("--no-parts", action="store_true", help="only the loop measurement")
    t.add_argument("--mesh", default=None, help="run the loops on a mesh, e.g. 'tp=8' or 'data=2,tp=4' (no parts)")
    t.add_argument("--layers", **layers_one)
    t.add_argument("--ngram-table", default=None,
                   help="an n-gram table (.npz or a head folder) for trees named ...-table; default: the shipped "
                        "SmolLM2 head's table when --shape smollm2-135m")

    b = sub.add_parser("bytes", parents=[common, loops], help="XLA's cost and memory analyses of the step programs")
    b.add_argument("--trees", nargs="*", default=["chain-3", "clover2-26"])
    b.add_argument("--no-ar", action="store_true", help="skip the autoregressive loop")
    b.add_argument("--layers", nargs="+", default=["unrolled", "scan"], choices=["unrolled", "scan"])
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    b.add_argument("--time", action="store_true", help="also run each compiled loop: ms per step, device peak")
    b.add_argument("--no-step", dest="step", action="store_false",
                   help="skip the step programs' cost analysis (one program less per loop)")
    b.add_argument("--no-views", dest="views", action="store_false",
                   help="unrolled loops slice the stacked weights inside their program (as before layer_views)")
    b.add_argument("--label", default="", help="a label for this run's settings (e.g. the XLA flags)")

    r = sub.add_parser("trace", parents=[common], help="a profiler trace of the loop, op by op")
    r.add_argument("--tree", default="chain-3", help="a tree name, or 'ar' for the autoregressive loop")
    r.add_argument("--layers", **layers_one)
    r.add_argument("--new-tokens", type=int, default=80)
    r.add_argument("--top", type=int, default=25, help="ops listed")
    args = ap.parse_args(argv)
    return {"time": time_main, "bytes": bytes_main, "trace": trace_main}[args.command](args, argv)


if __name__ == "__main__":
    sys.exit(main())
