"""EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840; reference `SafeAILab/EAGLE`, `eagle/model/cnets.py` and
`eagle/traineagle3/cnets.py`).

With g_t = [l_t ; m_t ; u_t] the residual stream at the input of three base layers (low, middle, high; the outputs of
base layers `feature_layers`, by default those at the input of layers 2, L//2 and L-3), E the base's frozen input
embedding and x the tokens, the draft at position t reads

  h_t = g_t W_fc                                   (FC: 3D -> D, no bias; only where the input is the base's)
  a   = [RMSNorm_in(E x_{t+1}) ; RMSNorm_hidden(h_t)]                       (2D wide)
  o   = h_t + Attn(a) ;  o = o + MLP(RMSNorm_post(o))                       (the one decoder layer, q/k/v read 2D)
  logits = RMSNorm_out(o) W_head                   (its own output projection onto a draft vocabulary of Q tokens)

and the next draft step feeds o back in place of h (the FC is skipped: the layer's output is already D wide). A
draft-vocabulary index i is the target token `vocab_ids[i]` (the reference's `d2t`: target = i + d2t[i]); Q = V
drafts over the whole vocabulary. The layer's RoPE is the base's (rope_theta None) or plain RoPE with a given base.

Drafting (`Eagle3Drafter`, `Eagle3DynamicDrafter`): as EAGLE-1 (`clover_jax.heads.eagle`), the draft cache holds the
committed pairs (h_t, x_{t+1}) up to the root, s0 is o at the root, and a tree node at depth d runs the layer at
position `committed + d - 1` over the cache, its ancestors' keys/values and itself.

Training (`train_outputs`, "training-time test"): step 0 runs the layer on the fused features of every position
(causal); step i >= 1 feeds each position's step-(i-1) output back with the embedding of x_{t+1+i}, at RoPE
position t + i, attending to step 0's keys up to t and to its own keys of steps 1..i (its path), exactly as a chain
drafted from position t would. Output i at t predicts x_{t+2+i}; the loss (`loss_from_features`) is the soft
cross-entropy against the base's distribution over the draft vocabulary, weighted 0.8^i (`loss.decay`).

Shapes and einsum strings use the axis letters of `clover_jax.axes`; Q counts the draft vocabulary, P a node's
ancestors, and the layer's weights keep a leading `[1]` (one layer) so the base's sharding rules apply.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.heads.clover2.model import aug_block_config
from clover_jax.heads.losses import kd_loss, kd_loss_packed, output_projection
from clover_jax.models.cache import KVCache, attended_cache, causal_mask, check_room, prefix_mask
from clover_jax.models.config import LlamaConfig, rope_inv_freq
from clover_jax.models.llama import Llama, _attention, _dot, apply_rope, check_taps, rms_norm
from clover_jax.validation import InputError

NUM_FEATURES = 3  # low, middle and high base features
NUM_LAYERS = 1  # the reference's `midlayer`


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The base layers (0-based, their outputs) EAGLE-3 reads by default: the residual stream at the input of layers
    2, L//2 and L-3 (the reference's and vLLM's `eagle_aux_hidden_state_layer_ids`), i.e. the outputs of layers 1,
    L//2 - 1 and L - 4."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if num_layers < 8:
        raise InputError(f"EAGLE-3's default feature layers need a base of at least 8 layers (this one has "
                         f"{num_layers}); give head.feature_layers")
    return layers


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    feature_layers: tuple[int, ...] = ()  # the 3 base layers whose outputs are fused (0-based; see the docstring)
    draft_vocab_size: int = 0  # Q: columns of the head's output projection (0: the base's whole vocabulary)
    num_heads: int = 7  # training-time-test steps (depths trained per position); drafting depth is not bounded
    rope_theta: float | None = None  # the layer's RoPE: None the base's own, a number plain RoPE with that base
    dtype: Any = jnp.float32  # compute dtype (norms, attention softmax and logits stay float32)
    param_dtype: Any = jnp.float32
    remat: bool = False  # rematerialise each training-time-test step in the backward pass

    def __post_init__(self):
        layers = tuple(int(i) for i in self.feature_layers)
        if len(layers) != NUM_FEATURES or len(set(layers)) != NUM_FEATURES or min(layers) < 0:
            raise InputError(f"EAGLE-3 fuses {NUM_FEATURES} distinct base layers; feature_layers is "
                             f"{list(self.feature_layers)}")
        object.__setattr__(self, "feature_layers", layers)
        if self.draft_vocab_size < 0:
            raise InputError(f"draft_vocab_size must be >= 0 (0: the whole vocabulary), got {self.draft_vocab_size}")
        if self.num_heads < 1:
            raise InputError(f"num_heads (training-time-test steps) must be >= 1, got {self.num_heads}")
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise InputError(f"rope_theta must be > 0 or None, got {self.rope_theta}")


class Eagle3Head(nnx.Module):
    """EAGLE-3 draft head; parameters only (the draft cache and drafting state are explicit arguments)."""

    def __init__(self, base_config: LlamaConfig, cfg: Eagle3Config, *, rngs: nnx.Rngs):
        c = base_config
        d, n, k, h, f = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
        q = cfg.draft_vocab_size or c.vocab_size
        self.base_config = base_config
        self.cfg = cfg
        # the layer is Llama's whatever the base (no q/k norms or biases of a Qwen base)
        self.layer_config = dataclasses.replace(aug_block_config(base_config, cfg.rope_theta), qk_norm=False,
                                                attention_bias=False, attention_out_bias=False, mlp_bias=False,
                                                model_type="llama")
        pd = cfg.param_dtype

        def linear(shape, fan_in):  # torch nn.Linear's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(fan_in)
            return nnx.Param(jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound).astype(pd))

        ones = lambda shape: nnx.Param(jnp.ones(shape, pd))  # noqa: E731
        self.fc_w = linear((NUM_FEATURES * d, d), NUM_FEATURES * d)  # [3D, D]
        self.input_norm = ones((NUM_LAYERS, d))  # [1, D] on the embedding
        self.hidden_norm = ones((NUM_LAYERS, d))  # [1, D] on the feature
        self.wq = linear((NUM_LAYERS, 2 * d, n, h), 2 * d)  # [1, 2D, N, H]
        self.wk = linear((NUM_LAYERS, 2 * d, k, h), 2 * d)  # [1, 2D, K, H]
        self.wv = linear((NUM_LAYERS, 2 * d, k, h), 2 * d)  # [1, 2D, K, H]
        self.wo = linear((NUM_LAYERS, n, h, d), n * h)  # [1, N, H, D]
        self.mlp_norm = ones((NUM_LAYERS, d))  # [1, D] post_attention_layernorm
        self.w_gate = linear((NUM_LAYERS, d, f), d)  # [1, D, F]
        self.w_up = linear((NUM_LAYERS, d, f), d)  # [1, D, F]
        self.w_down = linear((NUM_LAYERS, f, d), f)  # [1, F, D]
        self.out_norm = ones((d,))  # [D]
        self.head_w = linear((d, q), d)  # [D, Q]

    @property
    def vocab_size(self) -> int:
        """Q, the draft vocabulary's size (the output projection's columns)."""
        return int(self.head_w.shape[-1])

    # ------------------------------------------------------------------ pieces
    def fuse(self, f: jax.Array) -> jax.Array:
        """`h = g W_fc` `[..., D]` from the base features `f [..., (3 + 1) D]` (the three tapped layers' outputs, then
        the last layer's, which the head does not read)."""
        d = self.base_config.hidden_size
        g = jax.lax.stop_gradient(f[..., :NUM_FEATURES * d]).astype(self.cfg.dtype)
        return _dot("...I,ID->...D", g, self.fc_w[...].astype(self.cfg.dtype))

    def embed(self, base: Llama, tokens: jax.Array) -> jax.Array:
        """The base's frozen input embedding `E[tokens]` `[..., D]` (ids clipped to [0, V))."""
        e = jnp.take(jax.lax.stop_gradient(base.embed[...]), tokens, axis=0, mode="clip")
        return e.astype(self.cfg.dtype)

    def logits(self, base: Llama, o: jax.Array) -> jax.Array:
        """float32 logits `[..., Q]` over the draft vocabulary from layer outputs `o [..., D]`."""
        dt = self.cfg.dtype
        return jnp.einsum("...D,DQ->...Q", self.normed(o).astype(dt), self.head_w[...].astype(dt),
                          preferred_element_type=jnp.float32)

    def normed(self, o: jax.Array) -> jax.Array:
        """RMSNorm_out(o) `[..., D]`: what the output projection reads."""
        return rms_norm(o, self.out_norm[...], self.base_config.rms_norm_eps)

    def layer(self, e: jax.Array, h: jax.Array, positions: jax.Array, self_mask: jax.Array | None,
              ck=None, cv=None, cache_mask=None, pk=None, pv=None, cache_extent=None):
        """The decoder layer on embeddings `e [B, T, D]` and features `h [B, T, D]` at RoPE `positions [B, T]`.

        Attention sees the new tokens by `self_mask [B, T, T]` (None: each query sees its own key only, which then
        joins its path), the cache `ck, cv [B, K, S, H]` by `cache_mask [B, T, S]`, and per query its path
        `pk, pv [B, T, P, K, H]`. Returns `(o [B, T, D], k, v [B, T, K, H])` (keys after RoPE)."""
        c = self.layer_config
        dt = self.cfg.dtype
        eps = c.rms_norm_eps
        w = lambda p: p[...][0].astype(dt)  # noqa: E731
        a = jnp.concatenate([rms_norm(e.astype(dt), self.input_norm[...][0], eps),
                             rms_norm(h.astype(dt), self.hidden_norm[...][0], eps)], axis=-1)  # [B, T, 2D]
        rope_len = (0 if ck is None else ck.shape[2]) + e.shape[1] + (0 if pk is None else pk.shape[2])
        inv_freq = jnp.asarray(rope_inv_freq(c, rope_len), jnp.float32)
        q = apply_rope(_dot("BTI,INH->BTNH", a, w(self.wq)), positions, inv_freq)
        k = apply_rope(_dot("BTI,IKH->BTKH", a, w(self.wk)), positions, inv_freq)
        v = _dot("BTI,IKH->BTKH", a, w(self.wv))
        if self_mask is None:  # the own key through the path, no [T, T] block of scores
            grow = lambda p, n: n[:, :, None] if p is None else jnp.concatenate(  # noqa: E731
                [p, n[:, :, None].astype(p.dtype)], axis=2)
            pk, pv = grow(pk, k), grow(pv, v)
            k_new, v_new, self_mask = k[:, :0], v[:, :0], jnp.zeros((*k.shape[:2], 0), bool)
        else:
            k_new, v_new = k, v
        attn = _attention(q, k_new, v_new, self_mask, ck, cv, cache_mask, c.num_key_value_heads, pk, pv,
                          cache_extent)
        wo = w(self.wo)
        o = h.astype(dt) + _dot("BTE,ED->BTD", attn.reshape(*attn.shape[:2], -1), wo.reshape(-1, wo.shape[-1]))
        m = rms_norm(o, self.mlp_norm[...][0], eps)
        gate = _dot("BTD,DF->BTF", m, w(self.w_gate))
        up = _dot("BTD,DF->BTF", m, w(self.w_up))
        return o + _dot("BTF,FD->BTD", jax.nn.silu(gate) * up, w(self.w_down)), k, v

    # ------------------------------------------------------------------ training (training-time test)
    def train_outputs(self, base: Llama, f: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
        """Normed outputs of every training-time-test step `[num_heads, B, T, D]`: `out[i, :, t]` predicts x_{t+2+i}.

        Args:
          f: `[B, T, (3 + 1) D]` the base's tapped features (`feature_layers`' outputs, then the last layer's);
          tokens: `[B, T]` the sequence x (x past the end: 0); valid: `[B, T]` right-padding mask.
        """
        check_compatible(self, base.config)
        b, t = tokens.shape
        valid = valid.astype(bool)
        h = jnp.where(valid[..., None], self.fuse(f), 0)  # [B, T, D]; padding never reaches a valid row
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        causal = causal_mask(valid)  # [B, T, T]

        def step(h, y, i, k0, v0, pk, pv):
            e = self.embed(base, y)
            if i == 0:
                return self.layer(e, h, positions, causal)
            return self.layer(e, h, positions + i, None, k0, v0, causal, pk, pv)

        if self.cfg.remat:
            step = jax.checkpoint(step, static_argnums=(2,))
        outs, path_k, path_v = [], None, None
        k0 = v0 = None
        for i in range(self.cfg.num_heads):
            y = jnp.pad(tokens[:, 1 + i:], ((0, 0), (0, min(1 + i, t))))[:, :t]  # x_{t+1+i}, 0 past the end
            o, k, v = step(h, y, i, k0, v0, path_k, path_v)
            if i == 0:  # step 0's keys are every later step's causal "cache": [B, K, T, H]
                k0, v0 = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
            else:
                grow = lambda p, n: n[:, :, None] if p is None else jnp.concatenate([p, n[:, :, None]], 2)  # noqa: E731
                path_k, path_v = grow(path_k, k), grow(path_v, v)  # [B, T, i, K, H]
            outs.append(self.normed(o))
            h = o
        return jnp.stack(outs)

    # ------------------------------------------------------------------ inference
    def init_cache(self, batch: int, size: int, dtype=None) -> KVCache:
        """Empty draft-layer KV cache `[1, B, K, S, H]`."""
        c = self.base_config
        return KVCache.init(NUM_LAYERS, batch, size, c.num_key_value_heads, c.head_dim, dtype or self.cfg.dtype)

    def commit(self, base: Llama, cache: KVCache, f_new: jax.Array, y_new: jax.Array,
               num_valid: jax.Array, fresh: bool = False, cache_extent: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache]:
        """Feeds newly accepted positions (pairs `(g_t, x_{t+1})`) through the layer.

        Args:
          f_new: `[B, A, (3 + 1) D]` the base's tapped features of the new positions (right padded);
          y_new: `[B, A]` the token following each (the last one: the root); num_valid: `[B]` real positions per
          row; fresh: the cache is known to be empty; cache_extent: see `Clover2Head.commit`.

        Returns `(o [B, D], cache')`: the layer output at each row's last valid position (s0) and the cache with the
        valid positions appended."""
        check_compatible(self, base.config)
        b, a = y_new.shape
        num_valid = num_valid.astype(jnp.int32)
        check_room(cache.lengths + num_valid, 0, cache.size, what="EAGLE-3 head commit")
        valid = jnp.arange(a)[None, :] < num_valid[:, None]  # [B, A]
        h = self.fuse(jnp.where(valid[..., None], f_new, 0))  # [B, A, D]; FC has no bias: padding stays 0
        e = self.embed(base, jnp.where(valid, y_new, 0))
        positions = cache.lengths[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]  # [B, A]
        old, cache_mask = attended_cache(cache, a, fresh)
        ck, cv = (None, None) if old is None else (old.k[0], old.v[0])
        out, new_k, new_v = self.layer(e, h, positions, causal_mask(valid), ck, cv, cache_mask,
                                       cache_extent=cache_extent)
        last = jnp.maximum(num_valid - 1, 0)
        state = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return state, cache.append(new_k[None], new_v[None], num_valid)

    # the recurrent family's node step (`clover_jax.heads.recurrent.RecurrentHead`): a node carries its output and
    # the layer's keys and values along its path
    def root_node(self, base: Llama, cache: KVCache, s0: jax.Array):
        b, _ = s0.shape
        c = self.base_config
        empty = jnp.zeros((b, 1, 0, c.num_key_value_heads, c.head_dim), cache.k.dtype)  # [B, 1, P=0, K, H]
        return {"f": s0[:, None, :], "k": empty, "v": empty}, s0

    def node_step(self, base: Llama, cache: KVCache, parents: dict, tokens: jax.Array, depth: int):
        """One tree level: nodes at `depth` (>= 1) with tokens `[B, E]`, their parents' outputs `parents["f"]
        [B, E, D]` and ancestors' keys/values `[B, E, P, K, H]`; returns their states and outputs `[B, E, D]`."""
        check_compatible(self, base.config)
        b, e = tokens.shape
        positions = jnp.broadcast_to((cache.lengths + depth - 1)[:, None], (b, e)).astype(jnp.int32)
        pk, pv = parents["k"], parents["v"]  # [B, E, P, K, H]
        out, new_k, new_v = self.layer(self.embed(base, tokens), parents["f"], positions, None,
                                       cache.k[0], cache.v[0], prefix_mask(cache.lengths, e, cache.size), pk, pv)
        grow = lambda p, n: jnp.concatenate([p, n[:, :, None].astype(p.dtype)], axis=2)  # noqa: E731
        return {"f": out, "k": grow(pk, new_k), "v": grow(pv, new_v)}, out


def check_compatible(head: Eagle3Head, base_config: LlamaConfig) -> None:
    """An `InputError` naming what of `head` does not fit `base_config` (dimensions or feature layers)."""
    head.base_config.check_head_fits(base_config, "EAGLE-3")
    try:
        check_taps(head.cfg.feature_layers, base_config.num_hidden_layers)
    except ValueError as e:
        raise InputError(f"EAGLE-3 head does not fit the base model: it reads base layers "
                         f"{list(head.cfg.feature_layers)}, and the base has {base_config.num_hidden_layers} "
                         f"({e})") from None
    d = base_config.hidden_size
    if tuple(head.fc_w.shape) != (NUM_FEATURES * d, d):
        raise InputError(f"EAGLE-3 head does not fit the base model: fc has shape {tuple(head.fc_w.shape)}, the "
                         f"base model needs {(NUM_FEATURES * d, d)}")


def init_from_base(base: Llama, cfg: Eagle3Config, seed: int = 0) -> Eagle3Head:
    """A fresh head for `base`: torch `nn.Linear` defaults and norms at 1 (the reference's training start)."""
    head = jax.jit(lambda: Eagle3Head(base.config, cfg, rngs=nnx.Rngs(params=seed)))()
    check_compatible(head, base.config)
    return head


def loss_from_features(head: Eagle3Head, base: Llama, f: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                       valid: jax.Array, loss_cfg, *, index=None, vocab_ids=None, rng=None):
    """The soft cross-entropy of every training-time-test step against the frozen base's distribution over the
    draft vocabulary (`vocab_ids`, the Q ids the head's output columns stand for; None: all V), weighted
    `loss.decay ** i` (the reference's 0.8), through the head's own output projection; `loss.v_weight` adds a
    SmoothL1 of the normed outputs to the base's features (0 in the reference). Two differences from the reference's
    training code: the terms are normalised by the trained positions (`kd_loss`), and a position whose base argmax
    lies outside the draft vocabulary still trains (toward the base's distribution renormalised over it), where the
    reference leaves it out."""
    q = base.config.vocab_size if vocab_ids is None else int(vocab_ids.shape[0])
    if head.vocab_size != q:
        raise InputError(f"the EAGLE-3 head scores {head.vocab_size} draft tokens but the loss's vocabulary holds "
                         f"{q}: train it with loss.draft_vocab and train.draft_vocab_size = head.draft_vocab_size")
    d = base.config.hidden_size
    f = jax.lax.stop_gradient(f)
    teacher = rms_norm(f[..., -d:], jax.lax.stop_gradient(base.final_norm[...]), base.config.rms_norm_eps)
    outputs = head.train_outputs(base, f, tokens, valid)  # [N, B, T, D]
    lm_head = output_projection(base, vocab_ids)  # [D, Q] the teacher's
    proj = head.head_w[...]
    if index is not None:
        return kd_loss_packed(outputs, teacher, loss_mask, valid, lm_head, index, loss_cfg, student_proj=proj)
    return kd_loss(outputs, teacher, tokens, loss_mask, valid, lm_head, loss_cfg, student_proj=proj)
