"""Flax NNX Llama-family decoder: RMSNorm, RoPE (HF rotate-half layout), GQA attention with an
explicit mask, SwiGLU MLP, layers stacked on a leading `L` axis and run with `lax.scan`. With
`config.qk_norm` (Qwen3) each head's queries and keys are RMS-normed before RoPE.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.

Attention of T new tokens sees two sources, each with its own boolean mask:
  * the cache (`cache_mask [B, T, S]`): what is already stored for the row;
  * the new tokens themselves (`self_mask [B, T, T]`): causal for prefill/decode, the ancestor
    mask for a speculative tree.
The forward returns the new tokens' keys/values so the caller decides where they go in the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.models import views
from clover_jax.models.config import LlamaConfig, rope_inv_freq

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform (never NaN) softmax


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to the input dtype (as transformers' LlamaRMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates `x [B, T, N, H]` at integer `positions [B, T]` (rotate-half layout), in float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")  # layer weights kept in their own dtype (rms_norm: float32)


def _param(rngs: nnx.Rngs, shape, dtype, scale: float | None = None, init: str = "normal"):
    if init == "ones":
        return nnx.Param(jnp.ones(shape, dtype))
    if init == "zeros":
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


class DecoderStack(nnx.Module):
    """`num_layers` Llama decoder layers with weights stacked on a leading `L` axis."""

    def __init__(self, config: LlamaConfig, num_layers: int | None = None, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, dtype=jnp.float32, remat: bool = False,
                 init_std: float = 0.02, attn_norm: bool = True):
        """`attn_norm=False` drops the attention input's RMSNorm (EAGLE's draft layer has none)."""
        c = config
        n_layers = c.num_hidden_layers if num_layers is None else num_layers
        L, D, N, K, H, F = (n_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                            c.head_dim, c.intermediate_size)
        self.config = config
        self.num_layers = n_layers
        self.dtype = dtype
        self.remat = remat
        self.scan_unroll = 1  # layers per scan iteration; decoding can set it higher (see decoding/)
        p = lambda shape, **kw: _param(rngs, shape, param_dtype, init_std, **kw)  # noqa: E731
        if attn_norm:
            self.attn_norm = p((L, D), init="ones")
        self.wq = p((L, D, N, H))
        self.wk = p((L, D, K, H))
        self.wv = p((L, D, K, H))
        self.wo = p((L, N, H, D))
        if c.attention_bias:
            self.bq = p((L, N, H), init="zeros")
            self.bk = p((L, K, H), init="zeros")
            self.bv = p((L, K, H), init="zeros")
        if c.attention_out_bias:
            self.bo = p((L, D), init="zeros")
        if c.qk_norm:
            self.q_norm = p((L, H), init="ones")
            self.k_norm = p((L, H), init="ones")
        self.mlp_norm = p((L, D), init="ones")
        self.w_gate = p((L, D, F))
        self.w_up = p((L, D, F))
        self.w_down = p((L, F, D))
        if c.mlp_bias:
            self.b_gate = p((L, F), init="zeros")
            self.b_up = p((L, F), init="zeros")
            self.b_down = p((L, D), init="zeros")

    def layer_params(self) -> dict[str, jax.Array]:
        names = ["attn_norm"] if hasattr(self, "attn_norm") else []
        names += ["wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
        if self.config.attention_bias:
            names += ["bq", "bk", "bv"]
        if self.config.attention_out_bias:
            names += ["bo"]
        if self.config.qk_norm:
            names += ["q_norm", "k_norm"]
        if self.config.mlp_bias:
            names += ["b_gate", "b_up", "b_down"]
        return {n: getattr(self, n)[...] for n in names}

    def per_layer_weights(self) -> tuple[dict[str, jax.Array], ...]:
        """`layer_params()` as one dict per layer (`[...]` without the `L` axis).

        Inside a jitted function each slice is materialised once, where it is taken (XLA hoists a slice out of the
        loop that reads it): taken before a decoding loop and passed in as `layer_weights`, every step then reads
        each layer's weights in place, at the price of a second copy of the layers' weights in memory
        (`layer_views` makes the same slices without one). A `lax.scan` over the stacked `[L, ...]` weights instead
        copies each layer's slice at every step (on a CPU, a sizable part of a one-token step:
        `bench/bench_step.py time --layers`).
        """
        lp = self.layer_params()
        return tuple({k: v[i] for k, v in lp.items()} for i in range(self.num_layers))

    def layer_views(self) -> tuple[dict[str, jax.Array], ...] | None:
        """`per_layer_weights()` made outside a jitted program, as arrays that share the stacked weights' device
        memory (`clover_jax.models.views`: no copy), or None where the backend cannot alias them (an array over
        several devices, no DLPack import, alignment) or under a trace. Passed into a decoding loop as its
        `layer_weights`, the loop reads each layer in place and the call holds one copy of the weights."""
        sliced = {}
        for name, value in self.layer_params().items():
            if isinstance(value, jax.core.Tracer):
                return None
            sliced[name] = views.leading_slices(value)
            if sliced[name] is None:
                return None
        return tuple({k: v[i] for k, v in sliced.items()} for i in range(self.num_layers))

    def __call__(self, x: jax.Array, positions: jax.Array, self_mask: jax.Array,
                 cache_k: jax.Array | None = None, cache_v: jax.Array | None = None,
                 cache_mask: jax.Array | None = None, path_k: jax.Array | None = None,
                 path_v: jax.Array | None = None, cache_extent: jax.Array | None = None,
                 layer_weights: tuple[dict[str, jax.Array], ...] | None = None, taps: tuple[int, ...] = ()):
        """Runs the stack.

        Args:
          x: `[B, T, D]` inputs.
          positions: `[B, T]` RoPE positions.
          self_mask: `[B, T, T]` which new tokens each new token attends to.
          cache_k, cache_v: optional `[L, B, K, S, H]` cached keys/values (read only), or tuples of L `[B, K, S, H]`.
          cache_mask: `[B, T, S]` which cache slots each new token attends to.
          path_k, path_v: optional `[L, B, T, P, K, H]` keys/values that only new token t attends to, all of
            them (a draft-tree node's ancestors: P = its depth - 1), besides the cache and the new tokens.
          cache_extent: optional `[]` int: no query sees a cache slot at or past it. Attention then reads the cache
            in blocks of `CACHE_BLOCK` slots up to it (`_blocked_cache_attention`) instead of all S slots.
          layer_weights: optional `per_layer_weights()`, taken outside the caller's loop. With it, or with a
            per-layer cache (tuples of `[B, K, S, H]`), the layers run unrolled in Python instead of a `lax.scan`.
          taps: distinct layer indices (0-based, each below L - 1) whose outputs are returned besides the last
            layer's (`check_taps`).

        Returns:
          `(y [B, T, D], new_k [L, B, T, K, H], new_v [L, B, T, K, H])`, with `taps` `y` is `[B, T, (n + 1) D]`:
          the n tapped layers' outputs in the order of `taps`, then the last layer's.
        """
        c = self.config
        per_layer = layer_weights is not None or isinstance(cache_k, tuple)
        cache_len = 0 if cache_k is None else cache_k[0].shape[2] if isinstance(cache_k, tuple) else cache_k.shape[3]
        rope_len = cache_len + x.shape[1]
        inv_freq = jnp.asarray(rope_inv_freq(c, rope_len), jnp.float32)  # [H/2]
        eps = c.rms_norm_eps
        dtype = self.dtype
        use_cache = cache_k is not None

        def layer(h, xs):
            lp, ck, cv, pk, pv = xs
            lp = {k: v.astype(dtype) if k not in _NORMS else v for k, v in lp.items()}
            a = rms_norm(h, lp["attn_norm"], eps) if "attn_norm" in lp else h
            q = _dot("BTD,DNH->BTNH", a, lp["wq"])
            k = _dot("BTD,DKH->BTKH", a, lp["wk"])
            v = _dot("BTD,DKH->BTKH", a, lp["wv"])
            if c.attention_bias:
                q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
            if c.qk_norm:  # per head, over H
                q, k = rms_norm(q, lp["q_norm"], eps), rms_norm(k, lp["k_norm"], eps)
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
            attn = _attention(q, k, v, self_mask, ck, cv, cache_mask, c.num_key_value_heads, pk, pv, cache_extent)
            # one [B, T, N*H] x [N*H, D] product: contracting (N, H) as two axes let XLA transpose wo per call
            o = _dot("BTE,ED->BTD", attn.reshape(*attn.shape[:2], -1), lp["wo"].reshape(-1, lp["wo"].shape[-1]))
            h = h + (o + lp["bo"] if c.attention_out_bias else o)
            m = rms_norm(h, lp["mlp_norm"], eps)
            gate = _dot("BTD,DF->BTF", m, lp["w_gate"])
            up = _dot("BTD,DF->BTF", m, lp["w_up"])
            if c.mlp_bias:
                gate, up = gate + lp["b_gate"], up + lp["b_up"]
            down = _dot("BTF,FD->BTD", jax.nn.silu(gate) * up, lp["w_down"])
            h = h + (down + lp["b_down"] if c.mlp_bias else down)
            return h, (k, v)

        taps = check_taps(taps, self.num_layers)
        if per_layer:  # layers unrolled, each reading its own weight and cache buffers (no slice copied per call)
            h, ks, vs, outs = x.astype(dtype), [], [], {}
            for i, lp in enumerate(layer_weights if layer_weights is not None else self.per_layer_weights()):
                pick = lambda a: None if a is None else a[i]  # noqa: E731
                h, (k, v) = layer(h, (lp, pick(cache_k), pick(cache_v), pick(path_k), pick(path_v)))
                ks.append(k)
                vs.append(v)
                if i in taps:
                    outs[i] = h
            return jnp.concatenate([*(outs[i] for i in taps), h], axis=-1), jnp.stack(ks), jnp.stack(vs)
        if self.remat:
            layer = jax.checkpoint(layer)
        xs = (self.layer_params(), cache_k if use_cache else None, cache_v if use_cache else None, path_k, path_v)
        if not taps:
            y, (new_k, new_v) = jax.lax.scan(layer, x.astype(dtype), xs, unroll=self.scan_unroll)
            return y, new_k, new_v
        # the tapped outputs ride in the carry: slot j holds tap j's output, slot n takes every other layer's
        slot = np.full((self.num_layers,), len(taps), np.int32)
        slot[list(taps)] = np.arange(len(taps), dtype=np.int32)

        def tapped_layer(carry, xs_i):
            h, outs = carry
            h, kv = layer(h, xs_i[:-1])
            return (h, jax.lax.dynamic_update_index_in_dim(outs, h, xs_i[-1], 0)), kv

        h0 = x.astype(dtype)
        outs0 = jnp.zeros((len(taps) + 1, *h0.shape), dtype)  # [n + 1, B, T, D]
        (y, outs), (new_k, new_v) = jax.lax.scan(tapped_layer, (h0, outs0), (*xs, jnp.asarray(slot)),
                                                 unroll=self.scan_unroll)
        return jnp.concatenate([*outs[:-1], y], axis=-1), new_k, new_v


def check_taps(taps, num_layers: int) -> tuple[int, ...]:
    """`taps` as a tuple of distinct layer indices below the last layer (whose output is always returned), or a
    `ValueError` naming what is wrong."""
    taps = tuple(int(i) for i in taps)
    if len(set(taps)) != len(taps) or any(not 0 <= i < num_layers - 1 for i in taps):
        raise ValueError(f"feature layers {taps}: distinct indices of layers 0..{num_layers - 2} (layer "
                         f"{num_layers - 1}, the last, is always read)")
    return taps


def _dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(spec, x, w)` accumulated in float32 and rounded once to `x`'s dtype (a no-op change in float32).

    In bfloat16 this keeps the result of a row independent of how many rows are computed together up to the
    float32 summation order, so a speculative step's U-token forward rounds like U one-token forwards."""
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _attention(q, k, v, self_mask, ck, cv, cache_mask, num_kv_heads, pk=None, pv=None, cache_extent=None):
    """GQA attention of new queries over (cache ++ per-query path ++ new keys); scores, softmax and the weighted
    sum of values in float32 (values and probabilities enter the products in the compute dtype), one rounding at
    the end.

    q: [B, T, N, H]; k, v: [B, T, K, H]; ck, cv: [B, K, S, H] or None; pk, pv: [B, T, P, K, H] or None (keys
    only query t sees, every one of them); cache_extent: [] int or None (no cache slot at or past it is visible:
    the cache is read block by block up to it, `_blocked_cache_attention`).
    """
    b, t, n, h = q.shape
    g = n // num_kv_heads
    f32 = jnp.float32
    qg = q.reshape(b, t, num_kv_heads, g, h) * (h ** -0.5)  # [B, T, K, G, H]
    s_new = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=f32)
    s_new = jnp.where(self_mask[:, None, None], s_new, NEG_INF)
    if ck is not None and cache_extent is not None and pk is None and ck.shape[2] % CACHE_BLOCK == 0:
        return _blocked_cache_attention(qg, s_new, v, ck, cv, cache_mask, cache_extent).reshape(b, t, n, h)
    if ck is None and pk is None:
        p = jax.nn.softmax(s_new, axis=-1).astype(v.dtype)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v, preferred_element_type=f32)
        return out.astype(v.dtype).reshape(b, t, n, h)
    scores = []  # [B, K, G, T, *] blocks, softmaxed together
    if ck is not None:
        s_old = jnp.einsum("BTKGH,BKSH->BKGTS", qg, ck.astype(q.dtype), preferred_element_type=f32)
        scores.append(jnp.where(cache_mask[:, None, None], s_old, NEG_INF))
    if pk is not None:
        scores.append(jnp.einsum("BTKGH,BTPKH->BKGTP", qg, pk.astype(q.dtype), preferred_element_type=f32))
    scores.append(s_new)
    p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(v.dtype)
    # the blocks are summed in float32: where a key sits (cache, path or new) does not round
    out = jnp.zeros((b, t, num_kv_heads, g, h), f32)
    start = 0
    if ck is not None:
        s = ck.shape[2]
        # contracted as [B, K, G*T, S] x [B, K, S, H] (the cache slice as it lies), then the small result moved
        out += jnp.einsum("BKGTS,BKSH->BKGTH", p[..., :s], cv.astype(v.dtype),
                          preferred_element_type=f32).transpose(0, 3, 1, 2, 4)
        start = s
    if pk is not None:
        n_path = pk.shape[2]
        out += jnp.einsum("BKGTP,BTPKH->BTKGH", p[..., start:start + n_path], pv.astype(v.dtype),
                          preferred_element_type=f32)
        start += n_path
    out += jnp.einsum("BKGTS,BSKH->BTKGH", p[..., start:], v, preferred_element_type=f32)
    return out.astype(v.dtype).reshape(b, t, n, h)


CACHE_BLOCK = 256  # cache slots per block of `_blocked_cache_attention`


def _blocked_cache_attention(qg, s_new, v, ck, cv, cache_mask, cache_extent):
    """Attention over (cache ++ new keys) reading only the cache blocks below `cache_extent`.

    The cache's `[S]` axis is visited in blocks of `CACHE_BLOCK` slots by a `lax.fori_loop` with a traced trip
    count, `ceil(cache_extent / CACHE_BLOCK)`, keeping a running maximum, normaliser and weighted sum per query
    (the online softmax of Milakov & Gimelshein 2018, as in FlashAttention), then folding in the new keys' block.
    A prefill block of a long prompt thereby costs what the slots filled so far cost, not the whole cache. The
    terms are those of `_attention`'s one softmax, summed in another order.

    qg: [B, T, K, G, H] scaled queries; s_new: [B, K, G, T, T'] masked scores of the new keys; v: [B, T', K, H];
    ck, cv: [B, K, S, H] with S a multiple of CACHE_BLOCK; cache_mask: [B, T, S]; cache_extent: [] int.
    Returns [B, T, K, G, H] in v's dtype.
    """
    b, t, kh, g, h = qg.shape
    f32 = jnp.float32
    num_blocks = jnp.clip((cache_extent + CACHE_BLOCK - 1) // CACHE_BLOCK, 0, ck.shape[2] // CACHE_BLOCK)

    def fold(carry, scores, values, spec):
        """Adds one block of scores [B, K, G, T, S'] and its values (layout `spec`) to the running softmax."""
        m, l, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, H]
        m_new = jnp.maximum(m, scores.max(axis=-1))
        alpha = jnp.exp(m - m_new)  # [B, K, G, T]
        p = jnp.exp(scores - m_new[..., None])  # [B, K, G, T, S']
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum(
            f"BKGTS,{spec}->BKGTH", p.astype(values.dtype), values, preferred_element_type=f32)
        return m_new, l, acc

    def body(j, carry):
        start = j * CACHE_BLOCK
        kb = jax.lax.dynamic_slice_in_dim(ck, start, CACHE_BLOCK, axis=2).astype(qg.dtype)  # [B, K, S', H]
        vb = jax.lax.dynamic_slice_in_dim(cv, start, CACHE_BLOCK, axis=2).astype(v.dtype)  # [B, K, S', H]
        mb = jax.lax.dynamic_slice_in_dim(cache_mask, start, CACHE_BLOCK, axis=2)  # [B, T, S']
        scores = jnp.einsum("BTKGH,BKSH->BKGTS", qg, kb, preferred_element_type=f32)
        return fold(carry, jnp.where(mb[:, None, None], scores, NEG_INF), vb, "BKSH")

    init = (jnp.full((b, kh, g, t), NEG_INF, f32), jnp.zeros((b, kh, g, t), f32), jnp.zeros((b, kh, g, t, h), f32))
    m, l, acc = fold(jax.lax.fori_loop(0, num_blocks, body, init), s_new, v, "BSKH")
    return (acc / l[..., None]).transpose(0, 3, 1, 2, 4).astype(v.dtype)  # [B, T, K, G, H]


class Llama(nnx.Module):
    """Llama-family causal LM. `__call__` returns (logits, pre-norm last hidden state, new K, new V)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 dtype=jnp.float32, remat: bool = False):
        c = config
        self.config = config
        self.dtype = dtype
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), param_dtype, 0.02)  # [V, D]
        self.layers = DecoderStack(c, rngs=rngs, param_dtype=param_dtype, dtype=dtype, remat=remat)
        self.final_norm = _param(rngs, (c.hidden_size,), param_dtype, init="ones")
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), param_dtype, 0.02)  # [D, V]

    def lm_head_matrix(self) -> jax.Array:
        """The output projection `[D, V]` (the transposed embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)

    def forward_hidden(self, tokens, positions, self_mask, cache=None, cache_mask=None, cache_extent=None,
                       layer_weights=None, taps: tuple[int, ...] = ()):
        """Pre-final-norm hidden states `[B, T, D]` and new K/V `[L, B, T, K, H]`. `cache_extent` (`[]` int):
        no query sees a cache slot at or past it, so attention reads only the cache blocks below it. With `taps`
        (layer indices) the hidden states are `[B, T, (n + 1) D]`: those layers' outputs, then the last layer's
        (`hidden[..., -D:]`, what `logits` reads)."""
        x = self.embed_tokens(tokens)
        ck = cv = None
        if cache is not None:
            ck, cv = cache.k, cache.v
            if cache_mask is None:
                raise ValueError("cache_mask [B, T, S] is required when a cache is given")
        return self.layers(x, positions, self_mask, ck, cv, cache_mask, cache_extent=cache_extent,
                           layer_weights=layer_weights, taps=taps)

    def logits(self, hidden_prenorm: jax.Array) -> jax.Array:
        """float32 logits `[..., V]` from pre-norm hidden states `[..., D]`."""
        return self.project(rms_norm(hidden_prenorm, self.final_norm[...], self.config.rms_norm_eps))

    def project(self, h: jax.Array, dtype=None) -> jax.Array:
        """float32 logits `[..., V]` = `h @ W_lm` for already-normed `h [..., D]` (no transposed copy of W_lm)."""
        dtype = dtype or self.dtype
        if self.config.tie_word_embeddings:  # contract with the [V, D] table directly
            w = jax.lax.stop_gradient(self.embed[...]).astype(dtype)
            return jnp.einsum("...D,VD->...V", h.astype(dtype), w, preferred_element_type=jnp.float32)
        w = jax.lax.stop_gradient(self.lm_head[...]).astype(dtype)
        return jnp.einsum("...D,DV->...V", h.astype(dtype), w, preferred_element_type=jnp.float32)

    def lm_head_rows(self, tokens: jax.Array) -> jax.Array:
        """`W_lm^T[tokens]` `[..., D]`: the output-embedding row of each token (gathered, never transposed)."""
        if self.config.tie_word_embeddings:
            return jnp.take(jax.lax.stop_gradient(self.embed[...]), tokens, axis=0, mode="clip")
        w = jax.lax.stop_gradient(self.lm_head[...])  # [D, V]
        return jnp.moveaxis(jnp.take(w, tokens, axis=1, mode="clip"), 0, -1)

    def __call__(self, tokens, positions=None, self_mask=None, cache=None, cache_mask=None):
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if self_mask is None:
            self_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        hidden, new_k, new_v = self.forward_hidden(tokens, positions, self_mask, cache, cache_mask)
        return self.logits(hidden), hidden, new_k, new_v


def init_llama(config: LlamaConfig, seed: int = 0, **kw) -> Llama:
    return Llama(config, rngs=nnx.Rngs(params=seed), **kw)


def first_layers(model: Llama, num_layers: int, **config_changes) -> Llama:
    """A model made of `model`'s first `num_layers` decoder layers and its embedding, final norm and output
    projection (the layers' weights sliced without a copy where the backend allows, the rest shared), its config changed by `config_changes` besides
    `num_hidden_layers`. What it computes is not `model`'s function; what a step of it costs is, per layer, what a
    step of `model` costs: `clover_jax.tuning.choose` times loops on two such models and extrapolates to the full
    depth instead of compiling the full unrolled stack."""
    c = model.config
    if not 1 <= num_layers <= c.num_hidden_layers:
        raise ValueError(f"num_layers {num_layers}: the model has {c.num_hidden_layers} layers")
    config = dataclasses.replace(c, num_hidden_layers=int(num_layers), **config_changes)
    graph, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=model.dtype,
                                                             remat=model.layers.remat)))
    full = dict(nnx.to_flat_state(nnx.state(model)))
    leaves = []
    for path, var in nnx.to_flat_state(state):
        value = full[path].get_value()
        if path[0] == "layers" and value.shape != var.get_value().shape:  # a stacked [L, ...] layer weight
            prefix = views.leading_prefix(value, num_layers)  # no copy where the backend allows
            value = value[:num_layers] if prefix is None else prefix
        leaves.append((path, var.replace(value)))
    out = nnx.merge(graph, nnx.from_flat_state(leaves))
    out.layers.scan_unroll = model.layers.scan_unroll
    return out


def count_params(module: nnx.Module) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(module, nnx.Param))))
