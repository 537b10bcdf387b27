"""What one speculative step costs, part by part, against one autoregressive decode step.

  python bench/bench_step.py                                   # SmolLM2-135M shapes, random weights, chain-3
  python bench/bench_step.py --trees chain-3 small-10 clover2-26 --context 300 --cache-size 640
  python bench/bench_step.py --shape llama3-8b --dtype bfloat16 --trees chain-3 small-10 clover2-26 medusa-63
  python bench/bench_step.py --shape llama3-8b --dtype bfloat16 --mesh tp=8 --no-parts   # a TPU v5e-8 / 8 GPUs

Random weights of a real model's shapes (no download, runs on any backend unchanged). Two measurements:

* **loop**: milliseconds per decode-phase step of the real jitted loops (`ar_generate`, `spec_generate`),
  from the difference of two runs with different `max_new_tokens` (prefill and dispatch cancel out). EOS is
  disabled, so every row runs every step. A random head's drafts are rejected, so a speculative step yields one
  token; the cost of a step does not depend on how many drafts it accepts (shapes are static).
* **parts**: each part of a speculative step as its own jitted function on the same shapes (draft, verify
  forward, logits, acceptance, KV compaction, head commit), and the AR step's parts (forward, logits). The
  parts run outside the loop, so their sum differs from the loop's step by what fusing inside the loop saves
  or costs.

`--mesh data=D,tp=T` runs the loops tensor-parallel (weights placed once, outside the timed calls); the parts
are measured on one device and are skipped with a mesh.

Prints one table per tree (ms and ratio to the AR step), then a summary over the trees: verify forward of U
tokens, draft, and `(verify U + draft) / AR forward` (the extra cost of a speculative step that tau has to pay
for), and, with `--json`, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SHAPES = {  # (vocab, hidden, layers, heads, kv_heads, intermediate, tied)
    "tiny": (256, 64, 2, 4, 2, 128, True),  # for a quick check that the script runs
    "smollm2-135m": (49152, 576, 30, 9, 3, 1536, True),
    "smollm2-360m": (49152, 960, 32, 15, 5, 2560, True),
    "llama3-8b": (128256, 4096, 32, 32, 8, 14336, False),
}


def _timeit(fn, *args, repeat: int) -> float:
    """Median wall milliseconds of `fn(*args)` (compiled and warmed up first)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(args):
    import jax.numpy as jnp
    from flax import nnx

    from clover_jax.heads import registry
    from clover_jax.models.config import LlamaConfig
    from clover_jax.models.llama import init_llama

    v, d, layers, heads, kv, inter, tied = SHAPES[args.shape]
    config = LlamaConfig(vocab_size=v, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=d // heads,
                         tie_word_embeddings=tied, max_position_embeddings=max(8192, args.cache_size))
    dtype = jnp.dtype(args.dtype)
    base = init_llama(config, seed=0, dtype=dtype, param_dtype=dtype)
    ht = registry.get(args.head_type)
    kw = {}
    if ht.name == "eagle3":  # its config names the base layers it fuses and its own vocabulary's size
        from clover_jax.heads.eagle3 import default_feature_layers
        kw = {"feature_layers": default_feature_layers(layers),
              "draft_vocab_size": args.draft_vocab if 0 < args.draft_vocab < v else 0}
    head = ht.module_cls(config, ht.config_cls(dtype=dtype, param_dtype=dtype, **kw), rngs=nnx.Rngs(1))
    return config, base, head


def tree_drafter(config, head, tree: str, vocab, ngram_table=None):
    """`(spec, drafter)` of `tree` for a random model of `config`'s shapes: a shipped head's fitted tree names
    (`fit-N-<hash>`) resolve, and trees named `...-table` draft from `ngram_table` (default: the shipped SmolLM2
    head's table, which needs SmolLM2's vocabulary)."""
    from clover_jax import pretrained
    from clover_jax.heads.folder import open_folder
    from clover_jax.decoding.ngram import resolve_ngram_table
    from clover_jax.heads.registry import drafter_for
    from clover_jax.decoding.tree import LookupTree, get_tree

    known = {}  # fit-N-<hash>: a tree fitted by a shipped head's calibration
    for name in pretrained.HEADS:
        known.update(open_folder(name).trees)
    spec = get_tree(tree, known)
    table = None
    if isinstance(spec, LookupTree) and spec.table:
        table = resolve_ngram_table(ngram_table, None if ngram_table else
                                    pretrained.default_head("smollm2-135m-instruct"))
        if table.vocab_size != config.vocab_size:
            raise SystemExit(f"{tree}: the n-gram table was built for a vocabulary of {table.vocab_size}, the "
                             f"model of these shapes has {config.vocab_size} (--ngram-table)")
    return spec, drafter_for(type(head), spec, vocab, table)


def loop_ms_per_step(args, base, head, drafter, prompt, lens) -> tuple[float, float]:
    """(AR ms/step, speculative ms/step) of the jitted loops, from runs of n1 and n2 new tokens."""
    import jax
    import jax.numpy as jnp

    from clover_jax.decoding.autoregressive import ar_generate
    from clover_jax.decoding.sampling import SamplingParams
    from clover_jax.decoding.speculative import spec_generate

    sampling = SamplingParams()
    no_eos = [-1]
    n1, n2 = args.loop_tokens
    key = jax.random.key(0)

    mesh = getattr(args, "mesh_obj", None)

    def ar(n):
        out = ar_generate(base, prompt, lens, max_new_tokens=n, cache_size=args.cache_size, sampling=sampling,
                          key=key, eos_ids=no_eos, mesh=mesh, layers=args.layers)
        return jax.block_until_ready(out)

    def spec(n):
        out, stats, secs = spec_generate(base, head, prompt, lens, max_new_tokens=n, cache_size=args.cache_size,
                                         sampling=sampling, key=key, eos_ids=no_eos, drafter=drafter, mesh=mesh,
                                         layers=args.spec_layers)
        return out, secs

    def per_step(run, steps_of):
        run(n1)  # compile
        res = {}
        for n in (n1, n2):
            best = float("inf")
            for _ in range(args.loop_repeat):
                t0 = time.perf_counter()
                out = run(n)
                best = min(best, time.perf_counter() - t0)
            res[n] = (best, steps_of(out))
        (t1, s1), (t2, s2) = res[n1], res[n2]
        return (t2 - t1) / max(s2 - s1, 1) * 1e3

    ar_ms = per_step(ar, lambda out: int(out.steps))
    spec_ms = per_step(spec, lambda r: int(r[0].steps))
    del jnp
    return ar_ms, spec_ms


def parts_ms(args, config, base, head, drafter, prompt, lens) -> dict[str, float]:
    """Milliseconds of each part of an AR step and of a speculative step, each jitted on its own."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from clover_jax.decoding import verify
    from clover_jax.decoding.speculative import unroll_head_layers
    from clover_jax.decoding.autoregressive import prefill
    from clover_jax.models.cache import KVCache, prefix_mask

    c = config
    b = prompt.shape[0]
    s = args.cache_size
    u, dmax = drafter.num_nodes, drafter.max_depth
    bg, bs = nnx.split(base)
    hg, hp = nnx.split(head)
    arrays = drafter.arrays()
    dtype = jnp.dtype(args.dtype)
    # per-layer weight buffers for unrolled layers, made once (as the loops make them once per call, before
    # their steps); the AR and the speculative parts run the layers as their loops do (`decode_layers`)
    split = jax.jit(lambda bs: nnx.merge(bg, bs).layers.per_layer_weights())(bs) if "unrolled" in (
        args.layers, args.spec_layers) else None
    lw_ar = split if args.layers == "unrolled" else None
    lw = split if args.spec_layers == "unrolled" else None

    @jax.jit
    def setup(bs, lw, hp, arrays, prompt, lens):
        base_, head_ = nnx.merge(bg, bs), nnx.merge(hg, hp)
        cache = KVCache.init(c.num_hidden_layers, b, s, c.num_key_value_heads, c.head_dim, dtype,
                             per_layer=lw is not None)
        _, hidden, cache = prefill(base_, prompt, lens, cache, layer_weights=lw, taps=drafter.feature_layers(head_))
        y = jnp.concatenate([prompt[:, 1:], prompt[:, :1]], axis=1)
        hs = unroll_head_layers(drafter, head_, drafter.init_state(head_, base_, b, s, arrays))  # as the loop does
        hs = drafter.start(head_, base_, hs, hidden, y, lens)
        return cache, hs

    cache, hs = setup(bs, lw, hp, arrays, prompt, lens)  # laid out for the speculative parts
    cache_ar = setup(bs, lw_ar, hp, arrays, prompt, lens)[0] if lw_ar is not lw else cache
    root = prompt[:, 0]
    key = jax.random.key(0)
    out: dict[str, float] = {}
    r = args.repeat

    # --- the autoregressive step: one token through the stack, its K/V appended, logits, argmax
    @jax.jit
    def ar_forward(bs, lw, cache, tok):
        base_ = nnx.merge(bg, bs)
        h, nk, nv = base_.forward_hidden(tok[:, None], cache.lengths[:, None], jnp.ones((b, 1, 1), bool), cache,
                                         prefix_mask(cache.lengths, 1, s), layer_weights=lw)
        return h, cache.append(nk, nv)

    @jax.jit
    def ar_logits(bs, h):
        return jnp.argmax(nnx.merge(bg, bs).logits(h[:, 0]), axis=-1)

    out["ar: forward + KV append"] = _timeit(ar_forward, bs, lw_ar, cache_ar, root, repeat=r)
    h1, _ = ar_forward(bs, lw_ar, cache_ar, root)
    out["ar: logits + argmax"] = _timeit(ar_logits, bs, h1, repeat=r)

    # --- the speculative step
    taps = drafter.feature_layers(nnx.merge(hg, hp))  # base layers the head reads besides the last

    @jax.jit
    def draft(bs, hp, hs, root, key):
        return drafter.propose(nnx.merge(hg, hp), nnx.merge(bg, bs), hs, root, key)

    prop = draft(bs, hp, hs, root, key)

    @jax.jit
    def verify_forward(bs, lw, cache, tokens, buffers):
        base_ = nnx.merge(bg, bs)
        depth = jnp.broadcast_to(buffers.depth, (b, u))
        mask = jnp.broadcast_to(buffers.mask, (b, u, u))
        length = cache.lengths
        h, nk, nv = base_.forward_hidden(tokens, length[:, None] + depth, mask, cache, prefix_mask(length, u, s),
                                         layer_weights=lw, taps=taps)  # [B, U, (n + 1) D]
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
    out["spec: draft"] = _timeit(draft, bs, hp, hs, root, key, repeat=r)
    out["spec: verify forward + KV write"] = _timeit(verify_forward, bs, lw, cache, prop.tokens, prop.buffers,
                                                         repeat=r)
    out["spec: logits"] = _timeit(logits, bs, hv, repeat=r)
    out["spec: acceptance"] = _timeit(accept, prop.tokens, lg, prop.buffers, repeat=r)
    out["spec: KV compaction"] = _timeit(compact, cache_v, acc.accepted_nodes, acc.num_accepted, repeat=r)
    out["spec: head commit"] = _timeit(commit, bs, hp, hs, f_new, y_new, acc.num_accepted + 1, repeat=r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--head-type", default="clover2", help="a registered head type (clover2, clover1, eagle, eagle3, medusa, redrafter, block)")
    ap.add_argument("--trees", nargs="+", default=["chain-3"])
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: the full vocabulary)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=300, help="tokens already in the cache (prompt length)")
    ap.add_argument("--cache-size", type=int, default=640)
    ap.add_argument("--repeat", type=int, default=30, help="timed calls per part (median)")
    ap.add_argument("--loop-tokens", type=int, nargs=2, default=(16, 80), metavar=("N1", "N2"),
                    help="new tokens of the two loop runs whose difference gives ms/step")
    ap.add_argument("--loop-repeat", type=int, default=3, help="runs per loop length (best)")
    ap.add_argument("--no-parts", action="store_true", help="only the loop measurement")
    ap.add_argument("--mesh", default=None, help="run the loops on a mesh, e.g. 'tp=8' or 'data=2,tp=4' (parts skipped)")
    ap.add_argument("--layers", default="auto", choices=["auto", "unrolled", "scan"],
                    help="how the base model's layers run while decoding (auto: see clover_jax.decoding.autoregressive."
                    "decode_layers; unrolled for every loop on a GPU, for one-token float32 loops on a CPU)")
    ap.add_argument("--ngram-table", default=None,
                    help="an n-gram table (.npz or a head folder) for trees named ...-table; default: the shipped "
                    "SmolLM2 head's table when --shape smollm2-135m")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from clover_jax.decoding.autoregressive import decode_layers
    from clover_jax.decoding.tree import LookupTree

    if args.context + args.loop_tokens[1] + 64 > args.cache_size:
        raise SystemExit(f"--cache-size {args.cache_size} cannot hold --context {args.context} + "
                         f"{args.loop_tokens[1]} new tokens + a tree; raise it")
    config, base, head = build(args)
    args.mesh_obj = None
    if args.mesh:
        from flax import nnx

        from clover_jax import parallel

        args.mesh_obj = parallel.parse_mesh(args.mesh)
        args.no_parts = True
        nnx.update(base, parallel.place(nnx.state(base), args.mesh_obj))  # once, outside the timed calls
        nnx.update(head, parallel.place(nnx.state(head), args.mesh_obj))
    layers_asked = args.layers
    rng = np.random.default_rng(0)
    b, t = args.batch_size, args.context
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32)
    lens = jnp.full((b,), t, jnp.int32)
    if args.draft_vocab >= config.vocab_size:  # e.g. the default 8,192 on --shape tiny: the full vocabulary
        args.draft_vocab = 0
    vocab = (np.sort(rng.choice(config.vocab_size, args.draft_vocab, replace=False)).astype(np.int32)
             if args.draft_vocab else None)
    report = {"head_type": args.head_type, "backend": jax.default_backend(), "device": str(jax.devices()[0]), "shape": args.shape,
              "dtype": args.dtype, "batch": b, "context": t, "cache_size": args.cache_size,
              "draft_vocab": args.draft_vocab, "mesh": args.mesh, "layers_asked": args.layers, "layers": {},
              "trees": {}}
    print(f"# {args.head_type} head, {args.shape} {args.dtype}, batch {b}, context {t}, cache {args.cache_size}, "
          f"draft vocabulary {args.draft_vocab or 'full'}, backend {report['backend']} ({report['device']})"
          + (f", mesh {args.mesh}" if args.mesh else "") + f", --layers {args.layers}")
    sizes = {}
    for tree in args.trees:
        spec, drafter = tree_drafter(config, head, tree, vocab, args.ngram_table)
        parts = not args.no_parts and not isinstance(spec, LookupTree)  # parts: head trees only
        # the AR loop's choice; with --layers auto the speculative loop makes its own (scan on a CPU)
        args.layers = decode_layers(layers_asked, args.mesh_obj, model=base)
        args.spec_layers = decode_layers(layers_asked, args.mesh_obj, tokens_per_step=drafter.num_nodes, model=base)
        ar_ms, spec_ms = loop_ms_per_step(args, base, head, drafter, prompt, lens)
        rows = {"loop: AR step": ar_ms, "loop: speculative step": spec_ms}
        if parts:
            rows |= parts_ms(args, config, base, head, drafter, prompt, lens)
        report["trees"][tree] = rows
        report["layers"][tree] = {"ar": args.layers, "speculative": args.spec_layers}
        sizes[tree] = drafter.num_nodes
        print(f"\n## {tree} ({drafter.num_nodes} verified tokens, {drafter.max_depth} deep; layers: AR {args.layers}, "
              f"speculative {args.spec_layers})\n")
        print("| part | ms | / AR loop step |")
        print("|---|---|---|")
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
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
