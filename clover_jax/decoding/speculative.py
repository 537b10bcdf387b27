"""Speculative decoding: prefill, then draft -> verify -> accept -> compact in one `lax.while_loop`.

Per step and per batch row (rows accept different lengths; there is no batch minimum):
  * the drafter proposes a tree of U tokens under the root (the last generated token, not cached);
  * one base forward runs the U tokens at positions `length + depth` under the tree mask, their K/V
    written to the U slots after the row's length;
  * acceptance picks the longest valid path (greedy argmax match, or lossless tree sampling) and
    a bonus token;
  * the accepted path's K/V are compacted to contiguous slots; the drafter consumes the accepted
    nodes' hidden states; the bonus token becomes the next root.
Greedy output equals plain greedy decoding token for token; sampling preserves the base model's
(warped) distribution.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from clover_jax import parallel
from clover_jax.decoding import acceptance_stats, streaming, verify
from clover_jax.decoding.autoregressive import (
    DecodeOutput,
    decode_cache,
    decode_forward,
    decode_layers,
    is_eos,
    layer_views,
    prefill,
    products_precision,
    row_inputs,
    traced_with,
)
from clover_jax.decoding.drafter import Drafter, check_drafter, check_proposal, check_state
from clover_jax.decoding.sampling import SamplingParams, next_token, vocab_split_over, warp_probs
from clover_jax.decoding.sizes import plan_cache
from clover_jax.models.cache import KVCache


@struct.dataclass
class SpecStats:
    accept_hist: jax.Array  # [B, Dmax+1] steps that accepted n drafts, n = 0..Dmax
    node_hist: jax.Array  # [B, U] steps whose accepted path holds tree node u (the root, node 0, every step)
    row_steps: jax.Array  # [B]


@struct.dataclass
class _SpecState:
    shard_axes: ClassVar[dict[str, str]] = {"tokens": "B S", "lengths": "B", "done": "B", "accept_hist": "B Dmax",
                                            "node_hist": "B U", "row_steps": "B"}
    step: jax.Array
    tokens: jax.Array  # [B, S] prompt + generated; tokens[b, lengths[b]-1] is the root (not cached)
    lengths: jax.Array  # [B]
    cache: KVCache
    head_state: object
    done: jax.Array  # [B]
    accept_hist: jax.Array  # [B, Dmax+1]
    node_hist: jax.Array  # [B, U]
    row_steps: jax.Array  # [B]
    key: jax.Array


def head_layers(mesh=None) -> str:
    """How the draft head's own stacked decoder layers (Clover-2's Augmenting Block) run in the speculative loop:
    `"unrolled"` (per-layer weights taken once before the loop) without a mesh on a CPU or GPU, `"scan"` with a
    mesh (the sharding rules are for stacked layers) or on a TPU (not measured). Unlike the base model's layers
    (`decode_layers`) the choice cannot change an output, only drafts: the head's rounding never reaches
    verification. On a CPU, SmolLM2's 2-layer block commits tokens faster unrolled than scanned."""
    if mesh is not None or jax.default_backend() not in ("cpu", "gpu"):
        return "scan"
    return "unrolled"


def unroll_head_layers(drafter, head, state, mesh=None):
    """The drafter's state before the loop's steps: with the head's own layers' per-layer weights taken once
    (`Drafter.unroll_layers`) where `head_layers` says they run unrolled, else `state` unchanged."""
    return drafter.unroll_layers(head, state) if head_layers(mesh) == "unrolled" else state


def head_layer_copy_bytes(drafter, head, mesh=None) -> int:
    """Bytes the per-layer copy of the head's own layers adds where they run unrolled, for the memory plan."""
    if drafter is None or head_layers(mesh) != "unrolled":
        return 0
    return int(drafter.layer_copy_bytes(head))


def _accept(proposal, logits, key, sampling, greedy: bool, sampled_drafts: bool):
    if greedy:
        return verify.greedy_accept(proposal.tokens, logits, proposal.buffers)
    p = warp_probs(logits, sampling["temperature"], sampling["top_k"], sampling["top_p"])
    u_accept, u_sample = verify.draw_uniforms(key, logits.shape[0], proposal.buffers)
    if sampled_drafts:
        return verify.sample_accept_sampled(proposal.tokens, p, proposal.draft_probs, proposal.buffers,
                                            u_accept, u_sample)
    return verify.sample_accept_topk(proposal.tokens, p, proposal.buffers, u_accept, u_sample)


def spec_start(loop: SpeculativeLoop, base, head, drafter_arrays, prompt, prompt_lengths, max_new_tokens, eos_ids,
                sampling, key, layer_weights=None):
    """The speculative loop up to its first step: `(state, the base model's per-layer weights or None, limit [B])`
    after the prefill, the root token and the drafter's start."""
    drafter, cache_size, greedy, mesh, layers, stream = (loop.drafter, loop.cache_size, loop.greedy, loop.mesh,
                                                          loop.layers, loop.stream)
    b, t = prompt.shape
    u, dmax = drafter.num_nodes, drafter.max_depth
    rows = jnp.arange(b)
    shard = functools.partial(parallel.constrain_state, mesh=mesh)  # identity without a mesh

    cache, lw = decode_cache(base, b, cache_size, loop.cache_dtype, layers, layer_weights)  # see decode_layers
    # the hidden states the drafter reads: the last layer's, after the outputs of its `feature_layers` if any
    logits, hidden, cache = prefill(base, prompt, prompt_lengths, shard(cache), layer_weights=lw,
                                    taps=drafter.feature_layers(head))
    key, sub = jax.random.split(key)
    root = next_token(sub, logits, sampling, greedy)  # [B]
    # the head reads (f_t, x_{t+1}) pairs: the prompt shifted by one, then the root
    y_prompt = jnp.concatenate([prompt[:, 1:], jnp.zeros((b, 1), prompt.dtype)], axis=1)
    y_prompt = y_prompt.at[rows, prompt_lengths - 1].set(root)
    # the drafter's arrays (tree buffers, draft vocabulary) come in as an argument, not as program constants
    hs0 = drafter.init_state(head, base, b, cache_size, drafter_arrays)
    hs0 = unroll_head_layers(drafter, head, hs0, mesh)  # a head with its own stacked layers: unrolled
    hs = drafter.start(head, base, shard(hs0), hidden, y_prompt, prompt_lengths)

    tokens = jnp.zeros((b, cache_size), jnp.int32).at[:, :t].set(prompt, mode="drop")
    tokens = tokens.at[rows, prompt_lengths].set(root, mode="drop")
    limit = prompt_lengths + max_new_tokens  # [B] (max_new_tokens [] or [B])
    done = is_eos(root, eos_ids) | (prompt_lengths + 1 >= limit)
    if stream:  # each row's first token (`clover_jax.decoding.streaming`)
        streaming.emit(root[:, None], jnp.ones_like(prompt_lengths))
    st = shard(_SpecState(step=jnp.zeros((), jnp.int32), tokens=tokens, lengths=prompt_lengths + 1, cache=cache,
                          head_state=hs, done=done, accept_hist=jnp.zeros((b, dmax + 1), jnp.int32),
                          node_hist=jnp.zeros((b, u), jnp.int32), row_steps=jnp.zeros((b,), jnp.int32), key=key))
    return st, lw, limit


def spec_step(loop: SpeculativeLoop, base, head, lw, s: _SpecState, limit, eos_ids, sampling) -> _SpecState:
    """One step of the speculative loop (its `lax.while_loop` body): draft, verify, accept, compact, commit."""
    drafter, cache_size, greedy, mesh, stream = loop.drafter, loop.cache_size, loop.greedy, loop.mesh, loop.stream
    b = s.tokens.shape[0]
    u, dmax = drafter.num_nodes, drafter.max_depth
    rows = jnp.arange(b)
    shard = functools.partial(parallel.constrain_state, mesh=mesh)  # identity without a mesh
    key, k_draft, k_acc = jax.random.split(s.key, 3)
    root = jnp.take_along_axis(s.tokens, (s.lengths - 1)[:, None], axis=1)[:, 0]  # [B]
    with vocab_split_over(mesh):  # a vocabulary split over tp: each chip's top k, then the chips'
        prop = drafter.propose(head, base, s.head_state, root, k_draft)
    # trace time: a clear error for a drafter that breaks the contract
    check_proposal(drafter, prop, b, base.config.vocab_size)
    buf = prop.buffers
    depth = buf.depth if buf.depth.ndim == 2 else jnp.broadcast_to(buf.depth, (b, u))
    tree_mask = buf.mask if buf.mask.ndim == 3 else jnp.broadcast_to(buf.mask, (b, u, u))
    length = s.cache.lengths
    positions = length[:, None] + depth  # [B, U]
    # hidden [B, U, (n + 1) D]: the outputs of the drafter's n feature layers, then the last layer's
    hidden, nk, nv, cache = decode_forward(base, prop.tokens, positions, tree_mask, s.cache, lw,
                                           taps=drafter.feature_layers(head))
    cache = cache.write(nk, nv, length[:, None] + jnp.arange(u)[None, :])
    logits = base.logits(hidden[..., -base.config.hidden_size:])  # [B, U, V]
    acc = _accept(prop, logits, k_acc, sampling, greedy, drafter.sampled_drafts)
    active = ~s.done
    n = jnp.where(active, acc.num_accepted, 0)  # accepted drafts per row
    nodes = acc.accepted_nodes  # [B, Dmax+1], root first
    # base cache: compact root + accepted drafts to contiguous slots
    cache = cache.gather_to_prefix(length[:, None] + nodes, jnp.where(active, n + 1, 0))
    # new tokens after the root: accepted drafts then the bonus token
    drafts = jnp.take_along_axis(prop.tokens, nodes, axis=1)  # [B, Dmax+1] (entry 0 = root)
    i = jnp.arange(dmax + 1)[None, :]
    new = jnp.where(i < n[:, None], jnp.roll(drafts, -1, axis=1), acc.next_token[:, None])
    new = jnp.where(i <= n[:, None], new, 0)  # [B, Dmax+1]: n drafts, bonus, then padding
    # stop at the first EOS among them and at the length limit
    eos_at = jnp.where(is_eos(new, eos_ids) & (i <= n[:, None]), i, dmax + 1).min(axis=1)
    num_new = jnp.minimum(jnp.minimum(n + 1, eos_at + 1), limit - s.lengths)
    num_new = jnp.where(active, num_new, 0)
    write_at = jnp.where(i < num_new[:, None], s.lengths[:, None] + i, cache_size)
    tokens = s.tokens.at[rows[:, None], write_at].set(new, mode="drop")
    lengths = s.lengths + num_new
    done = s.done | (active & ((eos_at <= n) | (lengths >= limit)))
    if stream:
        streaming.emit(new, num_new)
    # the head consumes (f, next token) for the root and the accepted drafts
    f_new = jnp.take_along_axis(hidden, nodes[..., None], axis=1)  # [B, Dmax+1, (n + 1) D]
    hs = drafter.commit(head, base, s.head_state, f_new, new, jnp.where(active, n + 1, 0))
    check_state(drafter, "commit", s.head_state, hs)
    hist = s.accept_hist + (jax.nn.one_hot(n, dmax + 1, dtype=jnp.int32) * active[:, None])
    # which nodes were on the accepted path (for a static tree: which child ranks were accepted per depth)
    on_path = (i <= n[:, None]) & active[:, None]  # [B, Dmax+1]
    node_hist = s.node_hist + (jax.nn.one_hot(nodes, u, dtype=jnp.int32) * on_path[..., None]).sum(1)
    return shard(_SpecState(step=s.step + 1, tokens=tokens, lengths=lengths, cache=cache, head_state=hs,
                            done=done, accept_hist=hist, node_hist=node_hist, row_steps=s.row_steps + active,
                            key=key))


def _spec_generate(loop: SpeculativeLoop, base_graph, base_state, head_graph, head_state_params, drafter_arrays,
                   prompt, prompt_lengths, max_new_tokens, eos_ids, sampling, key, layer_weights=None):
    base = nnx.merge(base_graph, base_state)
    head = nnx.merge(head_graph, head_state_params)
    u, cache_size = loop.drafter.num_nodes, loop.cache_size
    st, lw, limit = spec_start(loop, base, head, drafter_arrays, prompt, prompt_lengths, max_new_tokens, eos_ids,
                                sampling, key, layer_weights)

    def cond(s: _SpecState):
        room = s.cache.lengths + u <= cache_size  # the tree's K/V must fit after each row's prefix
        return ~jnp.all(s.done) & jnp.all(s.done | room)

    def body(s: _SpecState):
        return spec_step(loop, base, head, lw, s, limit, eos_ids, sampling)

    st = jax.lax.while_loop(cond, body, st)
    out = DecodeOutput(tokens=st.tokens, prompt_lengths=prompt_lengths, lengths=st.lengths,
                       num_generated=st.lengths - prompt_lengths, steps=st.step, row_steps=st.row_steps)
    return out, SpecStats(accept_hist=st.accept_hist, node_hist=st.node_hist, row_steps=st.row_steps)


@dataclasses.dataclass(frozen=True)
class SpeculativeLoop:
    """The speculative loop for one static configuration: a frozen, hashable object whose fields are everything the
    compiled program depends on besides the arrays' shapes (the static `self` of its jitted call, as gemma's
    sampler loop). `build` makes it for a checked request; calling the loop runs it on weights and padded prompts.

        loop = SpeculativeLoop.build(base, drafter, cache_size=512)
        out, stats, seconds = loop(base, head, prompt, lens, max_new_tokens=128, sampling=SamplingParams(), key=key)
    """

    drafter: Drafter  # proposes each step's tree (`clover_jax.decoding.drafter`)
    cache_size: int  # KV-cache slots per row
    greedy: bool  # greedy acceptance (else lossless sampling)
    cache_dtype: Any  # the KV cache's dtype (the model's compute dtype)
    mesh: Any = None  # a `jax.sharding.Mesh` to decode on (None: one device)
    layers: str = "scan"  # how the base model's layers run (`decode_layers`)
    precision: str | None = None  # the matrix products' precision (`products_precision`)
    stream: bool = False  # hand each step's accepted tokens to the host (`clover_jax.decoding.streaming`)

    @classmethod
    def build(cls, base, drafter, *, cache_size: int, greedy: bool = True, mesh=None, layers: str | None = None,
              stream: bool = False) -> "SpeculativeLoop":
        """The loop of a checked request (`clover_jax.generation.plan.build_plan` checks the drafter's contract, its
        fit to the head and base, and the cache size, once): the static configuration of its jitted program."""
        return cls(drafter=drafter, cache_size=int(cache_size), greedy=bool(greedy),
                   cache_dtype=jnp.dtype(base.dtype), mesh=mesh,
                   layers=decode_layers(layers, mesh, tokens_per_step=drafter.num_nodes, model=base),
                   precision=products_precision(base.dtype), stream=bool(stream))

    def compiled(self, base_graph, head_graph):
        """The jitted loop for these module graphs (cached: compiled once per prompt bucket)."""
        return _jitted(self, base_graph, head_graph)

    def __call__(self, base, head, prompt, prompt_lengths, *, max_new_tokens, sampling: SamplingParams, key,
                 eos_ids=None, stat_rows: int | None = None):
        """Runs the loop on `prompt [B, T]` (right-padded) and `prompt_lengths [B]`; returns (DecodeOutput, stats
        dict, seconds). `max_new_tokens`: one number or one per row; `stat_rows`: count only the first rows in the
        statistics (the rest pad the batch)."""
        lens = np.asarray(prompt_lengths)
        base_graph, base_state = nnx.split(base)
        head_graph, head_params = nnx.split(head)
        base_state, head_params = parallel.place(base_state, self.mesh), parallel.place(head_params, self.mesh)
        eos = jnp.asarray(list(eos_ids if eos_ids is not None else base.config.eos_token_ids) or [-1], jnp.int32)
        fn = self.compiled(base_graph, head_graph)
        inputs = row_inputs(prompt, lens, max_new_tokens, self.mesh)
        lw = layer_views(base, self.layers, self.mesh)  # unrolled: the layers' weights in place (made once)
        t0 = time.perf_counter()
        out, st = fn(base_state, head_params, self.drafter.arrays(), *inputs, eos, sampling.arrays(), key,
                     layer_weights=lw)
        out = jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        hist = parallel.to_host(st.accept_hist)[:stat_rows]  # [B, Dmax+1] (the rows padding the batch cut)
        stats = {"tau": acceptance_stats.tau(hist), "accept_hist": hist.sum(0).tolist(),
                 "accept_rate_per_depth": acceptance_stats.accept_rates(hist),
                 "node_hist": parallel.to_host(st.node_hist)[:stat_rows].sum(0).tolist(),
                 "row_tau": acceptance_stats.row_tau(hist)}
        return out, stats, seconds


@functools.lru_cache(maxsize=None)
def _jitted(loop: SpeculativeLoop, base_graph, head_graph):
    def speculative_loop(base_state, head_params, *args, layer_weights=None):  # the name CompileCounter reports
        return _spec_generate(loop, base_graph, base_state, head_graph, head_params, *args, layer_weights)

    return jax.jit(traced_with(loop.precision, speculative_loop))


def jitted_loop(base, head, drafter, cache_size: int, greedy: bool, mesh=None, layers: str | None = None, *,
                graphs=None, stream: bool = False):
    """The jitted speculative loop for these settings (no checks: see `SpeculativeLoop.build`)."""
    base_graph, head_graph = (nnx.split(base)[0], nnx.split(head)[0]) if graphs is None else graphs
    loop = SpeculativeLoop.build(base, drafter, cache_size=cache_size, greedy=greedy, mesh=mesh, layers=layers,
                                 stream=stream)
    return loop.compiled(base_graph, head_graph)


def spec_generate(base, head, prompt, prompt_lengths, *, max_new_tokens, cache_size: int | None,
                  sampling: SamplingParams, key, drafter, eos_ids=None, mesh=None, stat_rows: int | None = None,
                  layers: str | None = None, stream: bool = False):
    """Runs the jitted speculative loop; returns (DecodeOutput, stats dict, seconds): `SpeculativeLoop.build` then
    the loop, in one call.

    `drafter`: what proposes each step's tree (`clover_jax.decoding.drafter`); the loop never looks a head type
    up itself: `clover_jax.heads.registry.drafter_for(type(head), tree, ...)` gives a head type's drafter for a tree.
    With a `mesh` (`clover_jax.parallel`) the base and head weights are placed by the sharding rules, rows split
    over the batch axes, and both KV caches over rows and KV heads. `layers`: how the base model's layers run
    (`clover_jax.decoding.autoregressive.decode_layers`). `stream`: hand each step's accepted tokens to the host as
    they come (`clover_jax.decoding.streaming`; one device only)."""
    check_drafter(drafter)
    drafter.check(head, base)
    cache_size = plan_cache(np.asarray(prompt_lengths), int(np.max(max_new_tokens)), drafter.num_nodes, cache_size,
                            None)
    loop = SpeculativeLoop.build(base, drafter, cache_size=cache_size, greedy=sampling.greedy, mesh=mesh,
                                 layers=layers, stream=stream)
    return loop(base, head, prompt, prompt_lengths, max_new_tokens=max_new_tokens, sampling=sampling, key=key,
                eos_ids=eos_ids, stat_rows=stat_rows)
