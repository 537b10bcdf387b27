"""Plain autoregressive generation: prefill + `lax.while_loop` over decode steps, in one jitted call.

Batch rows have their own prompt lengths (right padding) and stop on their own (EOS or
`max_new_tokens`, which is traced so a new value does not recompile). Prompts are padded to a
length bucket so prompts of similar length share one compilation.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from clover_jax import parallel
from clover_jax.decoding import streaming
from clover_jax.decoding import memory
from clover_jax.decoding.sampling import SamplingParams, next_token
from clover_jax.decoding.sizes import PREFILL_CHUNK
from clover_jax.models.cache import KVCache, causal_mask, prefix_mask
from clover_jax.models.llama import Llama
from clover_jax.validation import InputError


@struct.dataclass
class DecodeOutput:
    tokens: jax.Array  # [B, S] prompt then generated tokens (row b valid up to `lengths[b]`)
    prompt_lengths: jax.Array  # [B]
    lengths: jax.Array  # [B] prompt + generated
    num_generated: jax.Array  # [B]
    steps: jax.Array  # [] base-model forward passes after the prefill (decode phase)
    row_steps: jax.Array  # [B] decode forwards each row took part in before it stopped


@struct.dataclass
class _ARState:
    shard_axes: ClassVar[dict[str, str]] = {"tokens": "B S", "lengths": "B", "done": "B", "row_steps": "B"}
    step: jax.Array
    tokens: jax.Array  # [B, S]
    lengths: jax.Array  # [B] tokens written so far (the last one is not yet in the cache)
    cache: KVCache
    done: jax.Array  # [B]
    row_steps: jax.Array  # [B]
    key: jax.Array


DECODE_LAYERS = ("auto", "unrolled", "scan")


def check_layers(layers: str | None, mesh=None) -> str:
    """`layers` (`None` means `"auto"`) if it is one of `DECODE_LAYERS` and fits `mesh`, else an `InputError` naming
    it; `decode_layers` and `generate` check with it before anything compiles."""
    layers = layers or "auto"
    if layers not in DECODE_LAYERS:
        raise InputError(f"layers must be one of {DECODE_LAYERS}, got {layers!r}")
    if layers == "unrolled" and mesh is not None:
        raise InputError("layers: 'unrolled' is not supported with a mesh (the sharding rules are for stacked "
                         "layers); use 'scan' or 'auto'")
    return layers


def layer_weight_bytes(model: Llama) -> int:
    """Bytes of the decoder layers' weights."""
    return int(sum(x.nbytes for x in jax.tree.leaves(model.layers.layer_params())))


def layer_views(model: Llama, layers: str, mesh=None):
    """The per-layer weights a loop whose layers run as `layers` takes as an argument: with unrolled layers, slices
    of the stacked weights that share their memory (`Llama.layers.layer_views`, made once per model), else None.
    None with unrolled layers (a backend that cannot alias them) makes the loop slice inside its program, which
    holds a copy of the layers' weights for the call."""
    if layers != "unrolled" or mesh is not None:
        return None
    return model.layers.layer_views()


def layer_copy_bytes(model: Llama, layers: str, mesh=None) -> int:
    """Bytes of the layers' weights a decoding call holds beyond the model's own: none with scanned layers or with
    `layer_views`, all of them when an unrolled loop slices inside its program."""
    if layers != "unrolled" or layer_views(model, layers, mesh) is not None:
        return 0
    return layer_weight_bytes(model)


def decode_layers(layers: str | None = None, mesh=None, *, tokens_per_step: int = 1, model: Llama | None = None,
                  ) -> str:
    """How a decoding loop runs the base model's layers: `"unrolled"` or `"scan"` (`None` means `"auto"`).

    `"unrolled"`: each layer reads its own weight buffers, slices of the stacked weights that share their memory
    (`layer_views`, no copy; where a backend cannot alias them, the program slices once per call, before the loop,
    and the call holds a second copy of the layers' weights), the KV cache holds one buffer per layer, and each
    step runs the layers unrolled, so nothing is copied per step. `"scan"`: a `lax.scan` over the stacked
    `[L, ...]` weights and cache, which copies each layer's weight and cache slices at every step.

    `"auto"` picks, without a mesh and when the copy of `model`'s layer weights an unrolled call would hold, if
    any (`layer_copy_bytes`), fits twice in the free memory: on a GPU, `"unrolled"` for every loop, autoregressive and speculative, in any dtype; on a CPU,
    `"unrolled"` for a loop of one token per step (autoregressive decoding) of a float32 model; `"scan"` otherwise
    (a mesh, a TPU: not measured, a CPU's multi-token or bfloat16 loops). On a GPU (Llama-3-8B's shapes in
    bfloat16, random weights; measured: `bench/bench_step.py`) one-token and speculative steps cost less than
    half as much unrolled as scanned, at batch 1 and at batch 8. On a CPU (SmolLM2-135M) a one-token step
    costs less unrolled than scanned, while a 4-token verification step costs the same both ways and a 10-token
    one more unrolled (XLA's multi-token products repack the weights at every call either way). In bfloat16 the
    two forms round differently (XLA fuses them differently and keeps excess precision inside fusions), so in
    bfloat16 the autoregressive and speculative loops of a backend get the same form: on a CPU, bf16 speculative
    decoding of SmolLM2 equals autoregressive decoding on fewer MT-Bench prompts with the autoregressive loop
    unrolled and the speculative one scanned than with both scanned, and fewer with both unrolled than with both
    scanned, the more so the longer the output (a U-token verify and a one-token step sum in different orders, and
    bf16 rounds near-ties apart; float32 agrees). bf16 agreement on GPUs is not measured. A mesh needs the stacked
    sharding rules.
    """
    layers = check_layers(layers, mesh)
    if layers != "auto":
        return layers
    backend = jax.default_backend()
    if mesh is not None or backend not in ("cpu", "gpu"):
        return "scan"
    if backend == "cpu" and (tokens_per_step != 1 or (model is not None and jnp.dtype(model.dtype) != jnp.float32)):
        return "scan"
    if model is not None:
        copy = layer_copy_bytes(model, "unrolled")
        free, _ = memory.available_memory() if copy else (None, "")
        if free is not None and 2 * copy > free:
            return "scan"
    return "unrolled"


def prefill(model: Llama, prompt: jax.Array, prompt_lengths: jax.Array, cache: KVCache,
            chunk: int = PREFILL_CHUNK, layer_weights=None, taps: tuple[int, ...] = ()):
    """Runs the prompt `[B, T]` (right padded) through the model into an empty cache.

    A prompt of at most `chunk` tokens runs as one block. A longer one (T a multiple of `chunk`) runs block by
    block in a `lax.while_loop`, each block of `chunk` tokens attending to the cache the earlier blocks filled
    plus itself (chunked prefill, as in vLLM and Sarathi, Agrawal et al. 2024), and the loop stops after the
    longest row's last block. Attention then holds `[chunk, S]` scores per head instead of `[T, T]`, the padding
    of the length bucket past the longest prompt is never computed, and each block reads only the cache blocks
    filled so far (`cache_extent`): on a CPU a prompt of about 1,200 tokens (bucket 2,048) runs several times
    faster in blocks than as one block (measured: `bench/bench_context.py`). The blocks' attention sums the same
    terms in another order, so hidden states can differ from the one-block pass in the last bits.

    `layer_weights`: the per-layer weights when the layers run unrolled (`decode_layers`); only the blocks of a long prompt use them (they read a per-layer cache), a one-block prompt runs the scan.

    `taps`: layers whose outputs the hidden states carry besides the last layer's (`Llama.forward_hidden`).

    Returns (last-position logits [B, V], pre-norm hidden [B, T, D] (with `taps` [B, T, (n + 1) D], the last layer's
    last), cache with lengths = prompt_lengths).
    """
    b, t = prompt.shape
    if t <= chunk or t % chunk:
        valid = jnp.arange(t)[None, :] < prompt_lengths[:, None]  # [B, T]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # no cache to read: a scan over the stacked weights (a prompt-length block is bound by the products, not
        # by the slice copies), and an unrolled loop's compile time halves
        hidden, new_k, new_v = model.forward_hidden(prompt, positions, causal_mask(valid), taps=taps)
        cache = cache.append(new_k, new_v, num_valid=prompt_lengths)
    else:
        hidden, cache = _prefill_blocks(model, prompt, prompt_lengths, cache, chunk, layer_weights, taps)
    d = model.config.hidden_size
    last = jnp.take_along_axis(hidden[..., -d:], (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    return model.logits(last), hidden, cache


def _prefill_blocks(model: Llama, prompt: jax.Array, prompt_lengths: jax.Array, cache: KVCache, chunk: int,
                    layer_weights=None, taps: tuple[int, ...] = ()):
    """`prefill` of a prompt `[B, T]` in blocks of `chunk` tokens; returns (pre-norm hidden [B, T, (n + 1) D] for
    n `taps`, cache)."""
    b, t = prompt.shape
    offsets = jnp.arange(chunk, dtype=jnp.int32)  # [C]
    hidden0 = jnp.zeros((b, t, (len(taps) + 1) * model.config.hidden_size), model.dtype)  # [B, T, (n + 1) D]

    def body(start, num, carry):
        cache, hidden = carry
        ids = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)  # [B, C]
        positions = jnp.broadcast_to(start + offsets, (b, chunk))  # [B, C]
        valid = positions < prompt_lengths[:, None]  # [B, C]
        h, new_k, new_v = model.forward_hidden(ids, positions, causal_mask(valid), cache,
                                               prefix_mask(cache.lengths, chunk, cache.size),
                                               cache_extent=jnp.max(cache.lengths), layer_weights=layer_weights,
                                               taps=taps)
        # a row whose prompt ended in an earlier block advances by 0; its block lands past its length, unread
        cache = cache.append(new_k, new_v, num_valid=num)
        hidden = jax.lax.dynamic_update_slice_in_dim(hidden, h.astype(hidden.dtype), start, axis=1)
        return cache, hidden

    cache, hidden = run_blocks(body, (cache, hidden0), prompt_lengths, chunk)
    return hidden, cache


def run_blocks(body, carry, lengths: jax.Array, chunk: int, first: int = 0):
    """Runs `carry = body(start [], num [B], carry)` over a prompt's blocks of `chunk` positions, from block `first`
    through the longest row's last block, in a `lax.while_loop` (the bucket's padding past every row's prompt never
    runs). `start` is the block's first position, `num` how many of each row's prompt positions fall in the block
    (0 for a row whose prompt ended earlier). Shared by the base prefill and the draft heads' prompt pass
    (`clover_jax.decoding.drafter.commit_prompt`)."""
    num_blocks = (jnp.max(lengths) + chunk - 1) // chunk  # [] blocks holding some row's prompt

    def step(c):
        i, carry = c
        start = i * chunk
        return i + 1, body(start, jnp.clip(lengths - start, 0, chunk), carry)

    return jax.lax.while_loop(lambda c: c[0] < num_blocks, step, (jnp.asarray(first, jnp.int32), carry))[1]


def decode_cache(model: Llama, batch: int, cache_size: int, cache_dtype, layers: str, layer_weights=None):
    """`(empty KV cache, per-layer weights or None)` for a decoding loop whose layers run as `layers` (`"unrolled"`
    or `"scan"`, see `decode_layers`): unrolled, the cache holds one buffer per layer and the per-layer weights are
    `layer_weights` (the loop's argument, `layer_views`: no copy), or when there are none, the stacked weights
    split here, once per call (a copy of the layers' weights for the call)."""
    c = model.config
    unrolled = layers == "unrolled"
    lw = (layer_weights if layer_weights is not None else model.layers.per_layer_weights()) if unrolled else None
    cache = KVCache.init(c.num_hidden_layers, batch, cache_size, c.num_key_value_heads, c.head_dim, cache_dtype,
                         per_layer=unrolled)
    return cache, lw


def decode_forward(model: Llama, tokens: jax.Array, positions: jax.Array, self_mask: jax.Array, cache: KVCache,
                   layer_weights=None, taps: tuple[int, ...] = ()):
    """One decoding forward of `tokens [B, U]` at `positions [B, U]` (`self_mask [B, U, U]`) after each row's cached
    prefix; returns `(pre-norm hidden [B, U, D] (with n `taps` [B, U, (n + 1) D], the last layer's last), new_k,
    new_v [L, B, U, K, H], cache)`, the cache to write them
    into. With `layer_weights` (unrolled layers) an optimization barrier orders every layer's cache read before any
    write, so XLA writes the per-layer cache buffers in place instead of copying all of them at every step."""
    hidden, nk, nv = model.forward_hidden(tokens, positions, self_mask, cache,
                                          prefix_mask(cache.lengths, tokens.shape[1], cache.size),
                                          layer_weights=layer_weights, taps=taps)
    if layer_weights is not None:
        cache, hidden, nk, nv = jax.lax.optimization_barrier((cache, hidden, nk, nv))
    return hidden, nk, nv, cache


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def ar_start(model: Llama, prompt, prompt_lengths, max_new_tokens, eos_ids, sampling, key, *, cache_size: int,
              greedy: bool, cache_dtype, mesh=None, layers: str = "scan", stream: bool = False, layer_weights=None):
    """The autoregressive loop up to its first decode step: `(state, per-layer weights or None, limit [B])` after
    the prefill and each row's first token."""
    b, t = prompt.shape
    shard = functools.partial(parallel.constrain_state, mesh=mesh)  # identity without a mesh
    cache, lw = decode_cache(model, b, cache_size, cache_dtype, layers, layer_weights)
    logits, _, cache = prefill(model, prompt, prompt_lengths, shard(cache), layer_weights=lw)
    key, sub = jax.random.split(key)
    first = next_token(sub, logits, sampling, greedy)  # [B]
    tokens = jnp.zeros((b, cache_size), jnp.int32)
    tokens = tokens.at[:, :t].set(prompt, mode="drop")
    tokens = tokens.at[jnp.arange(b), prompt_lengths].set(first, mode="drop")
    limit = prompt_lengths + max_new_tokens  # [B] final length bound per row (max_new_tokens [] or [B])
    done = is_eos(first, eos_ids) | (prompt_lengths + 1 >= limit)
    if stream:  # each row's first token (`clover_jax.decoding.streaming`)
        streaming.emit(first[:, None], jnp.ones_like(prompt_lengths))
    st = shard(_ARState(step=jnp.zeros((), jnp.int32), tokens=tokens, lengths=prompt_lengths + 1, cache=cache,
                        done=done, row_steps=jnp.zeros((b,), jnp.int32), key=key))
    return st, lw, limit


def ar_step(model: Llama, lw, s: _ARState, limit, eos_ids, sampling, *, greedy: bool, mesh=None,
             stream: bool = False) -> _ARState:
    """One decode step of the autoregressive loop (its `lax.while_loop` body): the last token through the stack,
    its K/V appended, the next token drawn. `lw`: the per-layer weights with unrolled layers, else None."""
    b, cache_size = s.tokens.shape
    rows = jnp.arange(b)
    last = jnp.take_along_axis(s.tokens, (s.lengths - 1)[:, None], axis=1)  # [B, 1]
    pos = s.cache.lengths[:, None]  # [B, 1]
    hidden, nk, nv, cache = decode_forward(model, last, pos, jnp.ones((b, 1, 1), bool), s.cache, lw)
    active = ~s.done
    cache = cache.append(nk, nv, num_valid=active.astype(jnp.int32))
    key, sub = jax.random.split(s.key)
    tok = next_token(sub, model.logits(hidden[:, 0]), sampling, greedy)
    write_at = jnp.where(active, s.lengths, cache_size)  # inactive rows: dropped write
    tokens = s.tokens.at[rows, write_at].set(tok, mode="drop")
    lengths = s.lengths + active
    done = s.done | (active & (is_eos(tok, eos_ids) | (lengths >= limit)))
    if stream:
        streaming.emit(tok[:, None], active)
    return parallel.constrain_state(_ARState(step=s.step + 1, tokens=tokens, lengths=lengths, cache=cache, done=done,
                                             row_steps=s.row_steps + active, key=key), mesh=mesh)


def _ar_generate(graphdef, state, prompt, prompt_lengths, max_new_tokens, eos_ids, sampling, key, layer_weights=None,
                 *, cache_size: int, greedy: bool, cache_dtype, mesh=None, layers: str = "scan", stream: bool = False):
    model = nnx.merge(graphdef, state)
    st, lw, limit = ar_start(model, prompt, prompt_lengths, max_new_tokens, eos_ids, sampling, key,
                              cache_size=cache_size, greedy=greedy, cache_dtype=cache_dtype, mesh=mesh, layers=layers,
                              stream=stream, layer_weights=layer_weights)

    def cond(s: _ARState):
        # `lengths < cache_size` keeps the next write in range (also checked on the host before the call)
        return ~jnp.all(s.done) & jnp.all(s.done | (s.lengths < cache_size))

    def body(s: _ARState):
        return ar_step(model, lw, s, limit, eos_ids, sampling, greedy=greedy, mesh=mesh, stream=stream)

    st = jax.lax.while_loop(cond, body, st)
    return DecodeOutput(tokens=st.tokens, prompt_lengths=prompt_lengths, lengths=st.lengths,
                        num_generated=st.lengths - prompt_lengths, steps=st.step, row_steps=st.row_steps)


def products_precision(dtype) -> str | None:
    """The matmul precision a decoding loop of a `dtype` model is traced with: `"highest"` for float32, else None
    (the precision in force). A precision the caller chose (`jax.default_matmul_precision(...)` around the call, or
    `JAX_DEFAULT_MATMUL_PRECISION`) is kept: None then too.

    Float32 products are not float32 everywhere by default: JAX computes them with TensorFloat-32 inputs on recent
    NVIDIA GPUs and with bfloat16 passes on TPUs (`jax.default_matmul_precision`). Speculative decoding equals
    autoregressive decoding only as far as a U-token verification rounds as a one-token step does, and inputs
    rounded to a 10-bit (TF32) or 7-bit (bfloat16) mantissa turn more near-ties between the top logits into
    different tokens. So float32 decoding asks for float32 products on every backend (at the batch sizes decoding
    runs, a step is bound by reading the weights, not by arithmetic). bfloat16 models keep the default: their
    inputs are bfloat16 already. On a GPU with the default precision, a sizable share of greedy MT-Bench outputs
    of float32 SmolLM2 differ between speculative and autoregressive decoding (the cause not isolated)."""
    if jax.config.jax_default_matmul_precision is not None:
        return None
    return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def traced_with(precision: str | None, fn):
    """`fn` traced under `jax.default_matmul_precision(precision)` (unchanged when `precision` is None)."""
    if precision is None:
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return wrapped


@functools.lru_cache(maxsize=None)
def _jitted(graphdef, cache_size: int, greedy: bool, cache_dtype, mesh=None, layers: str = "scan",
            precision: str | None = None, stream: bool = False):
    def autoregressive_loop(*args, layer_weights=None):  # the name compile logs and CompileCounter report
        return _ar_generate(graphdef, *args, layer_weights=layer_weights, cache_size=cache_size, greedy=greedy, cache_dtype=cache_dtype, mesh=mesh,
                            layers=layers, stream=stream)

    return jax.jit(traced_with(precision, autoregressive_loop))


def jitted_loop(model: Llama, cache_size: int, greedy: bool, cache_dtype=None, mesh=None, layers: str | None = None,
                *, graphdef=None, stream: bool = False):
    """The jitted autoregressive loop `ar_generate` runs for these settings (cached: one per setting, each
    compiled once per prompt bucket)."""
    graphdef = nnx.split(model)[0] if graphdef is None else graphdef
    return _jitted(graphdef, int(cache_size), greedy, jnp.dtype(cache_dtype or model.dtype), mesh,
                   decode_layers(layers, mesh, model=model), products_precision(model.dtype), bool(stream))


def row_inputs(prompt, prompt_lengths, max_new_tokens, mesh=None):
    """`(prompt [B, T], prompt_lengths [B], max_new_tokens [B])` as int32 device arrays, rows split over the
    mesh's batch axes when a mesh is given; `max_new_tokens` may be one number or one per row."""
    prompt = jnp.asarray(prompt, jnp.int32)
    lens = jnp.asarray(prompt_lengths, jnp.int32)
    new = jnp.broadcast_to(jnp.asarray(max_new_tokens, jnp.int32), lens.shape)
    return parallel.place_rows(mesh, prompt, lens, new)


def ar_generate(model: Llama, prompt, prompt_lengths, *, max_new_tokens, cache_size: int, sampling=None,
                key=None, eos_ids=None, cache_dtype=None, mesh=None, layers: str | None = None,
                stream: bool = False) -> DecodeOutput:
    """Jitted autoregressive generation on padded prompts. Inputs are validated by `clover_jax.generation.api`.

    With a `mesh` (`clover_jax.parallel`), the weights are placed by the sharding rules (no copy when the
    model was loaded onto that mesh), the rows split over its batch axes and the KV cache over rows and KV
    heads. `layers`: see `decode_layers`. `stream`: hand each step's tokens to the host as they come
    (`clover_jax.decoding.streaming`; one device only)."""
    sampling = sampling or SamplingParams()
    graphdef, state = nnx.split(model)
    state = parallel.place(state, mesh)
    eos = jnp.asarray(list(eos_ids if eos_ids is not None else model.config.eos_token_ids) or [-1], jnp.int32)
    key = jax.random.key(0) if key is None else key
    fn = jitted_loop(model, cache_size, sampling.greedy, cache_dtype, mesh, layers, graphdef=graphdef, stream=stream)
    lw = layer_views(model, decode_layers(layers, mesh, model=model), mesh)
    return fn(state, *row_inputs(prompt, prompt_lengths, max_new_tokens, mesh), eos, sampling.arrays(), key,
              layer_weights=lw)


@dataclasses.dataclass(frozen=True)
class AutoregressiveLoop:
    """The autoregressive loop for one static configuration, as `SpeculativeLoop` (`clover_jax.decoding.speculative`)
    is for speculative decoding: a frozen, hashable object of what the compiled program depends on; calling it runs
    the loop and returns `(DecodeOutput, stats, seconds)` (no statistics: `{}`)."""

    cache_size: int  # KV-cache slots per row
    greedy: bool  # argmax (else sampling)
    cache_dtype: Any  # the KV cache's dtype
    mesh: Any = None  # a `jax.sharding.Mesh` to decode on (None: one device)
    layers: str = "scan"  # how the layers run (`decode_layers`)
    precision: str | None = None  # the matrix products' precision (`products_precision`)
    stream: bool = False  # hand each step's token to the host (`clover_jax.decoding.streaming`)

    @classmethod
    def build(cls, model: Llama, *, cache_size: int, greedy: bool = True, mesh=None, layers: str | None = None,
              stream: bool = False) -> "AutoregressiveLoop":
        return cls(cache_size=int(cache_size), greedy=bool(greedy), cache_dtype=jnp.dtype(model.dtype), mesh=mesh,
                   layers=decode_layers(layers, mesh, model=model), precision=products_precision(model.dtype),
                   stream=bool(stream))

    def __call__(self, model: Llama, prompt, prompt_lengths, *, max_new_tokens, sampling: SamplingParams, key,
                 eos_ids=None, stat_rows: int | None = None):
        graphdef, state = nnx.split(model)
        state = parallel.place(state, self.mesh)
        eos = jnp.asarray(list(eos_ids if eos_ids is not None else model.config.eos_token_ids) or [-1], jnp.int32)
        fn = _jitted(graphdef, self.cache_size, self.greedy, self.cache_dtype, self.mesh, self.layers,
                     self.precision, self.stream)
        inputs = row_inputs(prompt, prompt_lengths, max_new_tokens, self.mesh)
        lw = layer_views(model, self.layers, self.mesh)  # unrolled: the layers' weights in place (made once)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(state, *inputs, eos, sampling.arrays(), key, layer_weights=lw))
        return out, {}, time.perf_counter() - t0
