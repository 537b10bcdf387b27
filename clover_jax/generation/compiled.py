"""The decoding loops lowered and compiled on abstract weights: what a request would run, with nothing loaded.

    programs = compile_decoding(base_config, mesh, mode="speculative", head_type="clover2", tree="clover2-26",
                                batch=8, prompt_length=512, max_new_tokens=256, dtype="bfloat16")

Each program is the jitted loop `generate` runs for that shape (`clover_jax.decoding.autoregressive`,
`clover_jax.decoding.speculative.SpeculativeLoop`): the base model and a head of `head_type` (its config from the
head options of an experiment config, or the type's defaults) as `ShapeDtypeStruct`s placed by
`clover_jax.parallel`'s rules, prompts of the bucket that holds `prompt_length`, the cache rung that holds them with
the new tokens and the tree. On a mesh of compile-only TPU devices (`clover_jax.tpu.slice_mesh`), the TPU compiler
reports what each holds per chip. A head-less tree (`lookup-K`) needs no head type.

    steps = compile_steps(base_config, mesh, head_type="clover2", trees=["clover2-26"], batch=8, cache_size=1024)

`compile_steps` compiles one step of each loop on its own (the `lax.while_loop` body: an autoregressive step; a
speculative step's draft, verify, accept and commit), the base model's layers unrolled over per-layer weights and a
per-layer KV cache, so the compiler's cost analysis counts every layer (it counts a loop's body once, a scan's
included), beside `floor`: the bytes a step must read per chip (the decoder layers, the output projection, the whole
KV cache, and the draft head's weights).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax import parallel, tpu
from clover_jax.decoding import autoregressive, speculative
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.sizes import bucket_length, plan_cache
from clover_jax.decoding.speculative import SpeculativeLoop
from clover_jax.decoding.tree import get_tree, is_lookup_only
from clover_jax.heads import registry
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama
from clover_jax.validation import InputError, check_int

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
SETTINGS = ("lower --batch-size, the prompt length or --max-new-tokens (the KV cache), raise the mesh's tp (the "
            "weights), or choose a larger slice")


def abstract_base(base_config: LlamaConfig, dtype) -> Llama:
    """The base model with `ShapeDtypeStruct` weights in `dtype` (nothing allocated)."""
    return nnx.eval_shape(lambda: Llama(base_config, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype))


def abstract_head(head_type: str, base_config: LlamaConfig, dtype, options=None) -> nnx.Module:
    """A head of `head_type` with `ShapeDtypeStruct` parameters: its config from `options` (the `head:` section
    of an experiment config, `clover_jax.heads.options.HeadOptions`) or the type's defaults."""
    ht = registry.get(head_type)
    options = options if options is not None else ht.options_cls(type=head_type)
    if options.type != head_type:
        raise InputError(f"head options of type {options.type!r} given for a {head_type} head")
    config = options.head_config(dtype)
    return nnx.eval_shape(lambda: ht.module_cls(base_config, config, rngs=nnx.Rngs(0)))


def _placed(module, mesh) -> tuple[Any, Any]:
    graph, state = nnx.split(module)
    return graph, tpu.abstract(state, parallel.model_shardings(state, mesh))


def compile_decoding(base_config: LlamaConfig, mesh, *, mode: str = "ar", head_type: str | None = None,
                     head_options=None, tree: str | None = None, batch: int = 1, prompt_length: int = 512,
                     max_new_tokens: int = 256, dtype: str = "bfloat16", greedy: bool = True, draft_vocab=None,
                     ngram_table=None) -> list[tpu.CompiledProgram]:
    """The decoding loop of one request shape compiled for `mesh` (`mode` "ar" or "speculative"; a speculative
    request also compiles nothing else: the drafter runs inside the loop). Returns the compiled program with what
    the compiler reports per device."""
    if mode not in ("ar", "speculative"):
        raise InputError(f"mode must be 'ar' or 'speculative', got {mode!r}")
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    batch = check_int("batch", batch, minimum=1)
    prompt_length = check_int("prompt_length", prompt_length, minimum=1)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    if batch % parallel.batch_divisor(mesh):
        raise InputError(f"batch: {batch} rows cannot be split over the mesh's data*fsdp = "
                         f"{parallel.batch_divisor(mesh)} batch shards; use a multiple, or a mesh with fewer")
    base = abstract_base(base_config, DTYPES[dtype])
    base_graph, base_state = _placed(base, mesh)
    bucket = bucket_length(prompt_length)
    rows = parallel.batch_sharding(mesh, batch)
    rep = parallel.replicated(mesh)
    row_args = (jax.ShapeDtypeStruct((batch, bucket), jnp.int32, sharding=rows),  # prompt [B, T]
                jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows),  # prompt lengths [B]
                jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows))  # max new tokens [B]
    eos = jax.ShapeDtypeStruct((max(len(base_config.eos_token_ids), 1),), jnp.int32, sharding=rep)
    sampling = tpu.abstract(SamplingParams().arrays(), rep)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    lengths = jnp.full((batch,), prompt_length)
    if mode == "ar":
        cache_size = plan_cache(lengths, max_new_tokens, 0, None, None)
        loop = autoregressive.jitted_loop(base, cache_size, greedy, mesh=mesh, layers="scan", graphdef=base_graph)
        return [tpu.compile_program(f"autoregressive loop (batch {batch}, prompt {bucket}, cache {cache_size})",
                                    loop, base_state, *row_args, eos, sampling, key)]
    if tree is None:
        raise InputError("mode 'speculative' needs a tree (clover2-26, chain-4, dynamic-26, beam-4x5, lookup-4, ...)")
    spec = get_tree(tree)
    if is_lookup_only(spec):
        head = NoHead()
    elif head_type is None:
        raise InputError(f"tree {spec.name!r} drafts with a head: give its head type ({', '.join(registry.names())})")
    else:
        head = abstract_head(head_type, base_config, DTYPES[dtype], head_options)
    drafter = registry.drafter_for(type(head), spec, draft_vocab, ngram_table)
    drafter.check(head, base)
    cache_size = plan_cache(lengths, max_new_tokens, drafter.num_nodes, None, None)
    loop = SpeculativeLoop.build(base, drafter, cache_size=cache_size, greedy=greedy, mesh=mesh, layers="scan")
    head_graph, head_params = _placed(head, mesh)
    arrays = tpu.abstract(drafter.arrays(), rep)
    name = (f"speculative loop, {registry.of_head(head).name + ' ' if not isinstance(head, NoHead) else ''}"
            f"{spec.name} (batch {batch}, prompt {bucket}, cache {cache_size})")
    return [tpu.compile_program(name, loop.compiled(base_graph, head_graph), base_state, head_params, arrays,
                                *row_args, eos, sampling, key)]


def _row_args(mesh, batch: int, length: int):
    rows = parallel.batch_sharding(mesh, batch)
    return (jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=rows),  # prompt [B, T]
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows),  # prompt lengths [B]
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows))  # max new tokens [B]


def _state_args(tree, mesh):
    """`ShapeDtypeStruct`s of a decoding state, sharded as its states say (replicated where they do not)."""
    return tpu.abstract(tree, parallel.state_shardings(tree, mesh, default=parallel.replicated(mesh)))


def compile_steps(base_config: LlamaConfig, mesh, *, head_type: str | None = None, head_options=None,
                  trees: tuple[str, ...] | list[str] = (), batch: int = 1, cache_size: int = 1024,
                  dtype: str = "bfloat16") -> list[tuple[tpu.CompiledProgram, dict[str, int]]]:
    """One autoregressive step and one speculative step per tree, each compiled alone for `mesh` with the layers
    unrolled (see the module docstring); returns `(program, floor)` pairs, `floor` the bytes per chip the step must
    read, by part."""
    batch = check_int("batch", batch, minimum=1)
    cache_size = check_int("cache_size", cache_size, minimum=64)
    base = abstract_base(base_config, DTYPES[dtype])
    base_graph, base_state = _placed(base, mesh)
    layers = jax.eval_shape(lambda st: nnx.merge(base_graph, st).layers.per_layer_weights(), base_state)
    lw = tpu.abstract(layers, parallel.model_shardings(layers, mesh))
    rep = parallel.replicated(mesh)
    eos = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep)
    sampling = tpu.abstract(SamplingParams().arrays(), rep)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    prompt = _row_args(mesh, batch, cache_size // 2)
    precision = autoregressive.products_precision(base.dtype)
    out_proj = base_state["embed"] if base_config.tie_word_embeddings else base_state["lm_head"]
    weights = {"layers": tpu.held_bytes(lw), "output projection": tpu.held_bytes(out_proj)}
    cache_dtype = jnp.dtype(DTYPES[dtype])
    out = []

    def ar_start(state, lw, prompt, lens, new, eos, sampling, key):
        return autoregressive.ar_start(nnx.merge(base_graph, state), prompt, lens, new, eos, sampling, key,
                                       cache_size=cache_size, greedy=True, cache_dtype=cache_dtype, mesh=mesh,
                                       layers="unrolled", layer_weights=lw)

    def ar_step(state, lw, st, limit, eos, sampling):
        return autoregressive.ar_step(nnx.merge(base_graph, state), lw, st, limit, eos, sampling, greedy=True,
                                      mesh=mesh)

    st, _, limit = jax.eval_shape(ar_start, base_state, lw, *prompt, eos, sampling, key)
    st, limit = _state_args(st, mesh), tpu.abstract(limit, parallel.batch_sharding(mesh, batch))
    step = jax.jit(autoregressive.traced_with(precision, ar_step), donate_argnums=(2,))
    floor = {**weights, "KV cache": tpu.held_bytes((st.cache.k, st.cache.v))}
    out.append((tpu.compile_program(f"autoregressive step (batch {batch}, cache {cache_size})", step, base_state, lw,
                                    st, limit, eos, sampling), floor))
    for name in trees:
        spec = get_tree(name)
        head = NoHead() if is_lookup_only(spec) else abstract_head(head_type, base_config, DTYPES[dtype], head_options)
        drafter = registry.drafter_for(type(head), spec)
        loop = speculative.SpeculativeLoop(drafter=drafter, cache_size=cache_size, greedy=True,
                                           cache_dtype=cache_dtype, mesh=mesh, layers="unrolled", precision=precision)
        head_graph, head_params = _placed(head, mesh)
        arrays = tpu.abstract(drafter.arrays(), rep)

        def spec_start(state, head_params, lw, arrays, prompt, lens, new, eos, sampling, key, loop=loop,
                       head_graph=head_graph):
            return speculative.spec_start(loop, nnx.merge(base_graph, state), nnx.merge(head_graph, head_params),
                                          arrays, prompt, lens, new, eos, sampling, key, layer_weights=lw)

        def spec_step(state, head_params, lw, st, limit, eos, sampling, loop=loop, head_graph=head_graph):
            return speculative.spec_step(loop, nnx.merge(base_graph, state), nnx.merge(head_graph, head_params), lw,
                                         st, limit, eos, sampling)

        st, _, limit = jax.eval_shape(spec_start, base_state, head_params, lw, arrays, *prompt, eos, sampling, key)
        st, limit = _state_args(st, mesh), tpu.abstract(limit, parallel.batch_sharding(mesh, batch))
        step = jax.jit(autoregressive.traced_with(precision, spec_step), donate_argnums=(3,))
        floor = {**weights, "KV cache": tpu.held_bytes((st.cache.k, st.cache.v)),
                 "draft head": tpu.held_bytes(head_params)}
        label = "" if isinstance(head, NoHead) else registry.of_head(head).name + " "
        out.append((tpu.compile_program(f"speculative step, {label}{spec.name} ({drafter.num_nodes} tokens verified, "
                                        f"batch {batch}, cache {cache_size})", step, base_state, head_params, lw, st,
                                        limit, eos, sampling), floor))
    return out


__all__ = ["SETTINGS", "abstract_base", "abstract_head", "compile_decoding", "compile_steps"]
