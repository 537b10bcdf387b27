"""A block drafter: one forward proposes the next `block_size` tokens at once.

Parallel drafters (DFlash, arXiv 2602.06036: a small block-diffusion drafter conditioned on the target model's
hidden features; PARD, arXiv 2504.18583: several masked positions predicted in one pass) replace the depth-by-depth
draft loop with one pass over a block of positions. This head is our own version of that idea, built from the
pieces this library already has (the base's frozen embedding, final norm and lm_head; Llama decoder layers).

Notation: f_j the base's pre-norm last-layer feature at position j (it predicts x_{j+1}); g^1_j .. g^n_j the
outputs of the base layers `feature_layers` at j (none by default; DFlash reads several of the target's layers);
E the base's input embedding; W_lm its output projection; C = `block_size`; S = `window`.

  context   c_j = [RMSNorm_1(g^1_j) ; .. ; RMSNorm_n(g^n_j) ; RMSNorm_base(f_j) ; E x_{j+1}] W_ctx
            (W_ctx [(n + 2) D, D]; RMSNorm_i learned, init 1) for the S newest pairs j
  block     z_0 = m_0 + E(root) W_root,  z_k = m_k (k >= 1)      (m [C, D] learned; root = x_{s+1})
  layers    `num_layers` pre-norm Llama decoder layers over z: block position k attends to every block position
            (bidirectional) and to the valid window entries, whose keys/values each layer projects from c
            (its own input norm, W_k, W_v): the context is read by every layer and never updated
  output    logits_k = RMSNorm_base(z^L_k) W_lm                 (base final norm and lm_head, frozen, shared)

Block position k scores x_{s+2+k}: the token k + 1 positions after the root, the node at depth k + 1 of a tree
under the root. So a tree node at depth d with child rank r takes block position d - 1's r-th most likely token
(Medusa's node -> candidate mapping), and any static tree of depth <= C drafts from one forward.

RoPE (plain, base `ROPE_THETA`) uses positions relative to the block: window slot i (oldest first) at i, block
position k at S + k, so the same relative distances hold at every point of a sequence.

Design choices the code's contracts asked for:
- The window pairs each feature with the token *after* it, (f_j, x_{j+1}), because that is what `commit`
  receives (`f_new`, `y_new`) and EAGLE's pairing of a feature with the sampled next token; the newest pair's
  token is the root itself, which the block's first position also reads.
- Training scores block position k of the anchor s (newest window entry s, root x_{s+1}) against the base's
  distribution at s + 1 + k, masked by `lm[s + k]`: `kd_loss`'s head-k-at-start-s convention, so the dense path
  is `kd_loss` itself. With `loss.vocab_positions_per_row` (M sampled trained positions per row) the blocks run at
  those M positions as anchors only (`anchored_kd_loss`): a block per anchor costs C positions through the
  layers, so sampling anchors rather than scored positions (`kd_loss_packed`, whose scored position u needs the
  block at every u - k) makes a step T / M times cheaper (T = 448, M = 64 on the SmolLM2 recipe).
- Distillation only (no regression term: the block's outputs are not features of given positions);
  `vloss` is reported as 0, as Medusa's.

Shapes and einsum strings use the axis letters of `clover_jax.axes`; C counts block positions, S window slots.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.heads.losses import (
    anchored_kd_loss,
    kd_loss,
    next_token_labels,
    output_projection,
)
from clover_jax.models.config import LlamaConfig, RopeScaling, rope_inv_freq
from clover_jax.models.llama import DecoderStack, Llama, apply_rope, check_taps, rms_norm
from clover_jax.validation import InputError

INIT_LAYERS = ("random", "base")
ROPE_THETA = 10000.0  # plain RoPE over block-relative positions (< window + block_size): no long-context scaling


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    block_size: int = 8  # C: tokens drafted by one forward (the deepest tree it drafts)
    num_layers: int = 2  # decoder layers of the block
    window: int = 16  # S: accepted positions whose base features the block attends to
    init_layers: str = "random"  # the block's decoder layers at init: "random", or "base" (the base's last layers)
    # base layers (0-based, below the last) whose outputs the context reads besides the last layer's
    feature_layers: tuple[int, ...] = ()
    dtype: Any = jnp.float32  # compute dtype (norms, attention softmax and logits stay float32)
    param_dtype: Any = jnp.float32
    remat: bool = False  # rematerialise the block's layers in the backward pass

    def __post_init__(self):
        for name in ("block_size", "num_layers", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"block head: {name} must be an integer >= 1, got {value!r}")
        if self.init_layers not in INIT_LAYERS:
            raise InputError(f"block head: init_layers must be one of {INIT_LAYERS}, got {self.init_layers!r}")
        if not distinct_indices(self.feature_layers):
            raise InputError(f"block head: feature_layers must be distinct layer indices >= 0, got "
                             f"{self.feature_layers!r}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))


def distinct_indices(layers) -> bool:
    """Whether `layers` is a list or tuple of distinct integers >= 0 (what `feature_layers` takes)."""
    return isinstance(layers, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) and len(set(layers)) == len(layers)


def layer_config(base_config: LlamaConfig) -> LlamaConfig:
    """The block's decoder-layer config: the base's widths and heads, plain RoPE of base `ROPE_THETA`."""
    return dataclasses.replace(base_config, rope_theta=ROPE_THETA, rope_scaling=RopeScaling())


class BlockHead(nnx.Module):
    """Block drafter parameters (see the module docstring); the window of accepted positions is explicit state."""

    def __init__(self, base_config: LlamaConfig, cfg: BlockConfig = BlockConfig(), *, rngs: nnx.Rngs):
        d = base_config.hidden_size
        self.base_config = base_config
        self.cfg = cfg
        pd = cfg.param_dtype

        def uniform(shape, fan_in):  # torch nn.Linear's default init
            bound = 1.0 / math.sqrt(fan_in)
            return nnx.Param(jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound).astype(pd))

        n = len(cfg.feature_layers)
        # [I = (n + 2) D, D]: [normed tapped features ; normed last-layer feature ; next-token embedding] -> context
        self.ctx_w = uniform(((n + 2) * d, d), (n + 2) * d)
        if n:
            self.tap_norm = nnx.Param(jnp.ones((n, d), pd))  # [n, D] the tapped features' RMSNorm weights
        self.root_w = uniform((d, d), d)  # [D, D]: the root's embedding into the block
        self.mask_emb = nnx.Param((0.02 * jax.random.normal(rngs.params(), (cfg.block_size, d))).astype(pd))  # [C, D]
        self.layers = DecoderStack(layer_config(base_config), num_layers=cfg.num_layers, rngs=rngs, param_dtype=pd,
                                   dtype=cfg.dtype, remat=cfg.remat)

    # ------------------------------------------------------------------ pieces
    def _dot(self, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        dt = self.cfg.dtype
        return jnp.einsum(spec, x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32).astype(dt)

    def context(self, base: Llama, f: jax.Array, y: jax.Array) -> jax.Array:
        """`c [..., D]` of pairs (pre-norm features `f [..., (n + 1) D]`: the `feature_layers`' outputs, then the
        last layer's; the token after them `y [...]`)."""
        d, eps = base.config.hidden_size, base.config.rms_norm_eps
        taps = [rms_norm(f[..., j * d:(j + 1) * d], self.tap_norm[...][j], eps)
                for j in range(len(self.cfg.feature_layers))]
        h = rms_norm(f[..., -d:], jax.lax.stop_gradient(base.final_norm[...]), eps)
        e = jnp.take(jax.lax.stop_gradient(base.embed[...]), y, axis=0, mode="clip")  # [..., D]
        x = jnp.concatenate([t.astype(self.cfg.dtype) for t in (*taps, h, e)], axis=-1)  # [..., (n + 2) D]
        return self._dot("...I,ID->...D", x, self.ctx_w[...])

    def context_kv(self, c: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each layer's keys and values of context vectors `c [B, T, D]`, before RoPE: `[L, B, T, K, H]` each."""
        lp = self.layers.layer_params()
        eps = self.base_config.rms_norm_eps
        ks, vs = [], []
        for i in range(self.cfg.num_layers):
            a = rms_norm(c, lp["attn_norm"][i], eps)
            k = self._dot("BTD,DKH->BTKH", a, lp["wk"][i])
            v = self._dot("BTD,DKH->BTKH", a, lp["wv"][i])
            if self.base_config.attention_bias:
                k, v = k + lp["bk"][i].astype(k.dtype), v + lp["bv"][i].astype(v.dtype)
            ks.append(k)
            vs.append(v)
        return jnp.stack(ks), jnp.stack(vs)

    def window_cache(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Window keys `k` and values `v` `[L, B, S, K, H]` (slot i oldest first) as the layers read a cache,
        `[L, B, K, S, H]`, the keys rotated to their block-relative positions 0..S-1."""
        l, b, s, nk, hd = k.shape
        c = self.cfg.block_size
        inv_freq = jnp.asarray(rope_inv_freq(self.layers.config, s + c), jnp.float32)  # the layers' own (S + C)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (l * b, s))
        k = apply_rope(k.reshape(l * b, s, nk, hd), pos, inv_freq).reshape(l, b, s, nk, hd)
        return jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)

    def block(self, base: Llama, ck: jax.Array, cv: jax.Array, window_mask: jax.Array, root: jax.Array) -> jax.Array:
        """Normed block outputs `[B, C, D]` (the input of the base's lm_head) from the window's per-layer cache
        `ck, cv [L, B, K, S, H]`, its valid slots `window_mask [B, S]` and the root tokens `root [B]`."""
        b, s = window_mask.shape
        c = self.cfg.block_size
        e = jnp.take(jax.lax.stop_gradient(base.embed[...]), root, axis=0, mode="clip")  # [B, D]
        x = jnp.broadcast_to(self.mask_emb[...].astype(self.cfg.dtype)[None], (b, c, e.shape[-1]))  # [B, C, D]
        x = x.at[:, 0].add(self._dot("BD,DF->BF", e, self.root_w[...]))
        positions = jnp.broadcast_to(s + jnp.arange(c, dtype=jnp.int32), (b, c))
        self_mask = jnp.ones((b, c, c), bool)  # bidirectional inside the block
        cache_mask = jnp.broadcast_to(window_mask[:, None, :], (b, c, s))  # [B, C, S]
        y, _, _ = self.layers(x, positions, self_mask, ck, cv, cache_mask)
        return rms_norm(y, jax.lax.stop_gradient(base.final_norm[...]), base.config.rms_norm_eps)

    # ------------------------------------------------------------------ drafting and training
    def draft(self, base: Llama, f_win: jax.Array, y_win: jax.Array, count: jax.Array, root: jax.Array) -> jax.Array:
        """Normed outputs `[B, C, D]` of one block from a window `f_win [B, S, (n + 1) D]`, `y_win [B, S]` whose last
        `count [B]` slots are valid, under `root [B]`."""
        check_compatible(self, base.config)
        s = f_win.shape[1]
        mask = jnp.arange(s)[None, :] >= (s - count)[:, None]  # [B, S]
        c = jnp.where(mask[..., None], self.context(base, f_win, jnp.where(mask, y_win, 0)), 0)
        ck, cv = self.window_cache(*self.context_kv(c))
        return self.block(base, ck, cv, mask, root)

    def train_outputs(self, base: Llama, f: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
        """Teacher-forced block outputs at every anchor `[C, B, T, D]` (normed): `out[k, :, s]` is block position
        k of the block whose window ends at s (pairs (f_j, x_{j+1}), j = s-S+1..s) under the root x_{s+1}."""
        check_compatible(self, base.config)
        b, t = tokens.shape
        s = self.cfg.window
        valid = valid.astype(bool)
        y = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # y_j = x_{j+1}
        c = jnp.where(valid[..., None], self.context(base, f, jnp.where(valid, y, 0)), 0)  # [B, T, D]
        k, v = self.context_kv(c)  # [L, B, T, K, H]
        idx = jnp.arange(t)[:, None] - s + 1 + jnp.arange(s)[None, :]  # [T, S] positions of each anchor's window
        at = jnp.clip(idx, 0, t - 1)
        mask = (idx >= 0)[None] & valid[:, at]  # [B, T, S]
        gather = lambda x: x[:, :, at].reshape(x.shape[0], b * t, s, *x.shape[3:])
        ck, cv = self.window_cache(gather(k), gather(v))
        out = self.block(base, ck, cv, mask.reshape(b * t, s), y.reshape(b * t))  # [B*T, C, D]
        return jnp.moveaxis(out.reshape(b, t, *out.shape[1:]), 2, 0)

    def anchor_outputs(self, base: Llama, f: jax.Array, tokens: jax.Array, valid: jax.Array,
                       anchors: jax.Array) -> jax.Array:
        """Teacher-forced block outputs `[C, B, M, D]` (normed) at the anchors `anchors [B, M]` only (positions s,
        -1 = empty slot, clipped): `train_outputs(...)[:, b, anchors[b, m]]`, computing M blocks per row, not T."""
        check_compatible(self, base.config)
        b, t = tokens.shape
        m = anchors.shape[1]
        s = self.cfg.window
        valid = valid.astype(bool)
        y = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # y_j = x_{j+1}
        c = jnp.where(valid[..., None], self.context(base, f, jnp.where(valid, y, 0)), 0)  # [B, T, D]
        k, v = self.context_kv(c)  # [L, B, T, K, H]
        a = jnp.clip(anchors.astype(jnp.int32), 0, t - 1)  # [B, M]
        idx = a[..., None] - s + 1 + jnp.arange(s)  # [B, M, S] positions of each anchor's window
        at = jnp.clip(idx, 0, t - 1).reshape(b, m * s)
        mask = (idx >= 0) & jnp.take_along_axis(valid, at, axis=1).reshape(b, m, s)  # [B, M, S]
        gather = lambda x: jnp.take_along_axis(x, at[None, :, :, None, None], axis=2).reshape(  # noqa: E731
            x.shape[0], b * m, s, *x.shape[3:])
        ck, cv = self.window_cache(gather(k), gather(v))
        root = jnp.take_along_axis(y, a, axis=1)  # [B, M]
        out = self.block(base, ck, cv, mask.reshape(b * m, s), root.reshape(b * m))  # [B*M, C, D]
        return jnp.moveaxis(out.reshape(b, m, *out.shape[1:]), 2, 0)


def check_compatible(head: BlockHead, base_config: LlamaConfig) -> None:
    """An `InputError` naming the dimension in which `head` does not fit `base_config`."""
    head.base_config.check_head_fits(base_config, "block")
    try:
        check_taps(head.cfg.feature_layers, base_config.num_hidden_layers)
    except ValueError as e:
        raise InputError(f"block head does not fit the base model: {e}") from None
    d, n = base_config.hidden_size, len(head.cfg.feature_layers)
    for what, got, want in (("ctx_w", head.ctx_w.shape, ((n + 2) * d, d)), ("root_w", head.root_w.shape, (d, d)),
                            ("mask_emb", head.mask_emb.shape, (head.cfg.block_size, d))):
        if tuple(got) != tuple(want):
            raise InputError(f"block head does not fit the base model: {what} has shape {tuple(got)}, the base "
                             f"model needs {want}")


def init_from_base(base: Llama, cfg: BlockConfig = BlockConfig(), seed: int = 0) -> BlockHead:
    """A fresh block head for `base` (random: torch's Linear defaults for the projections, N(0, 0.02) for the
    decoder layers, norms 1; with `cfg.init_layers == "base"` the decoder layers start as copies of the base's last
    `num_layers` layers, as PARD starts its drafter from a pretrained model of the family); it shares the base's
    embedding, final norm and lm_head rather than copying them."""
    head = BlockHead(base.config, cfg, rngs=nnx.Rngs(params=seed))
    check_compatible(head, base.config)
    if cfg.init_layers == "base":
        n = cfg.num_layers
        if n > base.config.num_hidden_layers:
            raise InputError(f"block head: init_layers 'base' copies {n} layers; the base model has "
                             f"{base.config.num_hidden_layers}")
        for name, value in base.layers.layer_params().items():
            getattr(head.layers, name)[...] = value[-n:].astype(cfg.param_dtype)
    return head


# ------------------------------------------------------------------------------------------------ training
def loss_from_features(head: BlockHead, base: Llama, f, tokens, loss_mask, valid, loss_cfg, *, index=None,
                       vocab_ids=None):
    """Distillation from the base's pre-norm features `f [B, T, (n + 1) D]` (the `feature_layers`' outputs, then the
    last layer's): block position k at anchor s against the
    base's distribution softmax(W_lm h_{s+1+k}) (`kd_loss`'s head k at start s), through the shared frozen lm_head
    (or its draft-vocabulary columns), weights `loss_cfg.decay ** k`, no regression term (its metrics are 0).
    Without `index` a block runs at every position (`kd_loss`); with `index` (`loss.vocab_positions_per_row`: M
    sampled trained positions per row) only at those M anchors (`anchored_kd_loss`): T / M times fewer blocks."""
    f = jax.lax.stop_gradient(f)
    h = rms_norm(f[..., -base.config.hidden_size:], jax.lax.stop_gradient(base.final_norm[...]),
                 base.config.rms_norm_eps)  # [B, T, D] the base's own distribution's input
    proj = output_projection(base, vocab_ids)  # [D, V or Q]
    cfg = dataclasses.replace(loss_cfg, v_weight=0.0)
    labels = next_token_labels(tokens, valid, vocab_ids) if cfg.hard_labels else None
    if index is not None:
        out = head.anchor_outputs(base, f, tokens, valid, index)  # [C, B, M, D]
        return anchored_kd_loss(out, h, loss_mask, valid, proj, index, cfg, labels=labels)
    out = head.train_outputs(base, f, tokens, valid)  # [C, B, T, D]
    loss, m = kd_loss(out, h, tokens, loss_mask, valid, proj, cfg, labels=labels)
    m["vloss"] = jnp.zeros_like(m["vloss"])
    return loss, m
