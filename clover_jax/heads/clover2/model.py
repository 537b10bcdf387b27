"""Clover-2 draft head (arXiv 2408.00264; reference `XiaoBin1992/clover:clover/model/clover2.py`).

Pieces (the reference's `Clover2Model`; `clover_jax.io.export` maps them to its parameter names):
  AD1   attention decoder on (base pre-norm feature f_t, token embedding e_t = E[x_{t+1}])
  aug   Augmenting Block: `num_aug_layers` Llama decoder layers with their own KV cache, + aug_norm
  FC0   head 0:          o^0 = head_norm(FC0 s^0),                s^0 = aug output
  AD2   heads 1..n-1:    s^i = AD2(s^{i-1}, e), o^i = head_norm(FCout [s^i; e])   (shared weights: an RNN)
  logits = o @ W_lm     (the base model's frozen lm_head)

The frozen token embedding `E` is not stored: it is read from the base model at call time (the
lm_head matrix transposed for `embed_source="lm_head"`, as the reference; the base input embedding
for `"input"`). Everything read from the base is wrapped in `stop_gradient`.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.heads.recurrent import RecurrentNodes
from clover_jax.models.cache import KVCache, attended_cache, causal_mask, check_room
from clover_jax.models.config import LlamaConfig, RopeScaling
from clover_jax.models.llama import DecoderStack, Llama, rms_norm
from clover_jax.validation import InputError

EMBED_SOURCES = ("lm_head", "input")
# The reference's Augmenting Block builds its rotary embedding with base 10000 whatever the base's `rope_theta`
# (it applies linear/dynamic `rope_scaling` on top when the draft config has one, and fails on Llama 3's "llama3"
# type). A number here is plain RoPE with that base, no scaling: the reference's function for unscaled bases.
REFERENCE_ROPE_THETA = 10000.0
_AD_NAMES = ("norm", "wq", "bq", "wk", "bk", "wv", "bv")


@dataclasses.dataclass(frozen=True)
class Clover2Config:
    """Clover-2 head hyper-parameters (defaults = reference `h5-vloss10-layer2`)."""

    num_heads: int = 5  # depths drafted per step: head 0 + (num_heads-1) RNN steps
    num_aug_layers: int = 2  # decoder layers in the Augmenting Block
    embed_source: str = "lm_head"  # "lm_head" (reference: frozen copy of W_lm^T) or "input" (base embed)
    # RoPE of the Augmenting Block: a number is plain RoPE with that base (the reference: 10000 whatever the
    # base model uses, no scaling); None: the base model's own RoPE (its rope_theta and rope_scaling).
    rope_theta: float | None = REFERENCE_ROPE_THETA
    dtype: Any = jnp.float32  # compute dtype (norms, cosine and logits stay float32)
    param_dtype: Any = jnp.float32
    remat: bool = False  # rematerialise the Augmenting Block layers in the backward pass

    def __post_init__(self):
        if self.num_heads < 1:
            raise InputError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_aug_layers < 1:
            raise InputError(f"num_aug_layers must be >= 1, got {self.num_aug_layers}")
        if self.embed_source not in EMBED_SOURCES:
            raise InputError(f"embed_source must be one of {EMBED_SOURCES}, got {self.embed_source!r}")


# ----------------------------------------------------------------------------- pure functions
def cosine_similarity(q: jax.Array, k: jax.Array, eps: float) -> jax.Array:
    """`torch.nn.functional.cosine_similarity(q, k, dim=-1, eps)` in float32.

    torch (ATen `cosine_similarity`, 2.x) divides each input by its own norm clamped at `eps`
    (`x / max(|x|, eps)`) and the clamp is done under `NoGradGuard`, so autograd sees the unclamped
    norm; both the value and the gradient are reproduced here.
    """

    def clamped_norm(x):
        sq = jnp.sum(x * x, axis=-1, keepdims=True)
        n = jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)  # zero-safe gradient
        return n + jax.lax.stop_gradient(jnp.maximum(n, eps) - n)

    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    return jnp.sum((q / clamped_norm(q)) * (k / clamped_norm(k)), axis=-1)


def attention_decoder(p: dict[str, jax.Array], x: jax.Array, e: jax.Array, num_heads: int, eps: float,
                      dtype=jnp.float32) -> jax.Array:
    """Reference `ResAttentionBlock`: one query (from the state) against one key (from the token).

    q = RMSNorm(x) Wq + bq, k = e Wk + bk, v = e Wv + bv, split into `num_heads` heads;
    out = x + concat_h(cos(q_h, k_h) * v_h). No softmax, no output projection.

    Args:
      p: `norm [D]`, `wq/wk/wv [D, D]` (Flax layout [in, out]), `bq/bk/bv [D]`.
      x: `[..., D]` state; e: `[..., D]` token embedding.
    """
    d = x.shape[-1]
    hd = d // num_heads
    xn = rms_norm(x, p["norm"], eps).astype(dtype)
    e = e.astype(dtype)
    q = xn @ p["wq"].astype(dtype) + p["bq"].astype(dtype)  # [..., D]
    k = e @ p["wk"].astype(dtype) + p["bk"].astype(dtype)
    v = e @ p["wv"].astype(dtype) + p["bv"].astype(dtype)
    split = lambda t: t.reshape(*t.shape[:-1], num_heads, hd)  # noqa: E731  [..., nH, hd]
    a = cosine_similarity(split(q), split(k), eps)  # [..., nH] float32
    gated = (a[..., None] * split(v).astype(jnp.float32)).reshape(v.shape)  # [..., D]
    return (x.astype(jnp.float32) + gated).astype(x.dtype)


def check_compatible(head: "Clover2Head", base_config: LlamaConfig) -> None:
    """Raises ValueError naming the first dimension in which `head` does not fit `base_config`."""
    head.base_config.check_head_fits(base_config, "Clover-2")
    d, aug = base_config.hidden_size, head.aug
    shapes = {
        "hidden_size (ad1_wq)": (head.ad1_wq.shape, (d, d)),
        "hidden_size (fcout_w)": (head.fcout_w.shape, (2 * d, d)),
        "attention dims (aug.wq)": (aug.wq.shape[1:], (d, base_config.num_attention_heads, base_config.head_dim)),
        "kv dims (aug.wk)": (aug.wk.shape[1:], (d, base_config.num_key_value_heads, base_config.head_dim)),
        "intermediate_size (aug.w_gate)": (aug.w_gate.shape[1:], (d, base_config.intermediate_size)),
    }
    for what, (got, want) in shapes.items():
        if tuple(got) != tuple(want):
            raise InputError(f"Clover-2 head does not fit the base model: {what} has shape {tuple(got)}, "
                             f"the base model needs {tuple(want)}")


def aug_block_config(base_config: LlamaConfig, rope_theta: float | None) -> LlamaConfig:
    """The Augmenting Block's layer config: the base's, with plain RoPE of base `rope_theta` (None: the
    base's own RoPE, theta and scaling)."""
    if rope_theta is None:
        return base_config
    return dataclasses.replace(base_config, rope_theta=float(rope_theta), rope_scaling=RopeScaling())


# ----------------------------------------------------------------------------- module
class Clover2Head(RecurrentNodes, nnx.Module):
    """Clover-2 draft head; parameters only (caches and decode state are explicit arguments)."""

    def __init__(self, base_config: LlamaConfig, cfg: Clover2Config = Clover2Config(), *, rngs: nnx.Rngs):
        c = base_config
        d = c.hidden_size
        if d % c.num_attention_heads:
            raise InputError(f"the attention decoder splits hidden_size={d} into num_attention_heads="
                             f"{c.num_attention_heads} heads; it must divide evenly")
        self.base_config = base_config
        self.cfg = cfg
        aug_config = aug_block_config(base_config, cfg.rope_theta)
        pd = cfg.param_dtype

        def uniform(shape):  # torch nn.init.uniform_(t, b=0.01): U[0, 0.01)
            return jax.random.uniform(rngs.params(), shape, jnp.float32, minval=0.0, maxval=0.01)

        eye = jnp.eye(d, dtype=jnp.float32)
        par = lambda x: nnx.Param(jnp.asarray(x).astype(pd))  # noqa: E731
        for name in ("ad1", "ad2"):
            setattr(self, f"{name}_norm", par(jnp.ones((d,))))
            setattr(self, f"{name}_wq", par(eye + uniform((d, d))))
            setattr(self, f"{name}_bq", par(jnp.zeros((d,))))
            setattr(self, f"{name}_wk", par(eye + uniform((d, d))))
            setattr(self, f"{name}_bk", par(jnp.zeros((d,))))
            setattr(self, f"{name}_wv", par(uniform((d, d))))
            setattr(self, f"{name}_bv", par(jnp.zeros((d,))))
        self.aug = DecoderStack(aug_config, num_layers=cfg.num_aug_layers, rngs=rngs, param_dtype=pd,
                                dtype=cfg.dtype, remat=cfg.remat)
        self.aug_norm = par(jnp.ones((d,)))
        self.fc0_w = par(eye + uniform((d, d)))  # [D, D]
        self.fc0_b = par(jnp.zeros((d,)))
        fcout = uniform((2 * d, d)).at[:d].add(eye)  # identity on the state half [s ; e]
        self.fcout_w = par(fcout)  # [2D, D]
        self.fcout_b = par(jnp.zeros((d,)))
        self.head_norm = par(jnp.ones((d,)))

    # ------------------------------------------------------------------ helpers
    @property
    def eps(self) -> float:
        return self.base_config.rms_norm_eps

    def _ad_params(self, name: str) -> dict[str, jax.Array]:
        return {n: getattr(self, f"{name}_{n}")[...] for n in _AD_NAMES}

    def _ad(self, name: str, x: jax.Array, e: jax.Array) -> jax.Array:
        return attention_decoder(self._ad_params(name), x, e, self.base_config.num_attention_heads,
                                 self.eps, self.cfg.dtype)

    def embed(self, base: Llama, tokens: jax.Array) -> jax.Array:
        """Frozen token embedding `E[tokens]` `[..., D]` read from the base model (ids clipped to [0, V))."""
        if self.cfg.embed_source == "lm_head":
            e = base.lm_head_rows(tokens)  # E = W_lm^T, gathered without a transposed copy
        else:
            e = jnp.take(jax.lax.stop_gradient(base.embed[...]), tokens, axis=0, mode="clip")
        return e.astype(self.cfg.dtype)

    def _fc(self, x: jax.Array, w: nnx.Param, b: nnx.Param) -> jax.Array:
        dt = self.cfg.dtype
        y = x.astype(dt) @ w[...].astype(dt) + b[...].astype(dt)
        return rms_norm(y, self.head_norm[...], self.eps)

    def _aug_block(self, g, positions, self_mask, cache=None, cache_mask=None, cache_extent=None, layer_weights=None):
        ck, cv = (None, None) if cache is None else (cache.k, cache.v)
        y, new_k, new_v = self.aug(g, positions, self_mask, ck, cv, cache_mask, cache_extent=cache_extent,
                                   layer_weights=layer_weights)
        return rms_norm(y, self.aug_norm[...], self.eps), new_k, new_v

    # ------------------------------------------------------------------ per-depth pieces
    def head0(self, state: jax.Array) -> jax.Array:
        """Head 0: `o^0 = head_norm(FC0 s^0 + b0)`; `state [..., D]` (s^0, the Augmenting Block output)."""
        return self._fc(state, self.fc0_w, self.fc0_b)

    def step(self, base: Llama, state: jax.Array, tokens: jax.Array, depth: int = 1) -> tuple[jax.Array, jax.Array]:
        """One RNN step (heads 1..): `s' = AD2(s, E[tok])`, `o = head_norm(FCout [s'; E[tok]] + b2)`.

        Args:
          state: `[..., D]` the parent's state (s^{i-1}); tokens: `[...]` the parent's drafted token.
          depth: the head index i (>= 1); the RNN shares its weights over depths, so it is unused here (heads
            with one set of weights per depth, Clover-1's, read it).
        Returns:
          `(new_state [..., D], o [..., D])`.
        """
        check_compatible(self, base.config)
        return self._step_embedded(state, self.embed(base, tokens))

    def logits(self, base: Llama, o: jax.Array) -> jax.Array:
        """float32 logits `[..., V]` = o @ W_lm (frozen base lm_head; o is already head-normed)."""
        check_compatible(self, base.config)
        return base.project(o, self.cfg.dtype)  # frozen W_lm, float32 accumulation

    # ------------------------------------------------------------------ training (teacher forcing)
    def train_outputs(self, base: Llama, f: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
        """Head outputs over whole sequences, stacked and zero-padded: `[num_heads, B, T, D]`.

        `out[i, :, t] = o^i_t` (predicts x_{t+2+i}) for `t < T - i`, zero beyond.

        Args:
          f: `[B, T, D]` base pre-final-norm last-layer hidden states.
          tokens: `[B, T]` the sequence x (head inputs use y_t = x_{t+1}, y_{T-1} = 0).
          valid: `[B, T]` right-padding mask (causal + key padding in the Augmenting Block).
        """
        check_compatible(self, base.config)
        b, t = tokens.shape
        valid = valid.astype(bool)
        y = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # y_t = x_{t+1}
        e = self.embed(base, y)  # [B, T, D]
        f = jnp.where(valid[..., None], f, 0).astype(self.cfg.dtype)  # padding never reaches a valid row
        g = self._ad("ad1", f, e)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        s, _, _ = self._aug_block(g, positions, causal_mask(valid))  # s^0 [B, T, D]
        outs = [self.head0(s)]
        for i in range(1, self.cfg.num_heads):
            e_i = jnp.pad(e[:, i:], ((0, 0), (0, i), (0, 0)))  # e_{t+i}, zero past the end
            s, o = self._step_embedded(s, e_i)
            keep = (jnp.arange(t) < t - i)[None, :, None]
            outs.append(jnp.where(keep, o, 0))
        return jnp.stack(outs)

    def _step_embedded(self, state: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        s = self._ad("ad2", state, e)
        o = self._fc(jnp.concatenate([s.astype(e.dtype), e], axis=-1), self.fcout_w, self.fcout_b)
        return s, o

    # ------------------------------------------------------------------ inference
    def init_cache(self, batch: int, size: int, dtype=None) -> KVCache:
        """Empty Augmenting-Block KV cache `[num_aug_layers, B, K, S, H]`."""
        c = self.base_config
        return KVCache.init(self.cfg.num_aug_layers, batch, size, c.num_key_value_heads, c.head_dim,
                            dtype or self.cfg.dtype)

    def commit(self, base: Llama, cache: KVCache, f_new: jax.Array, y_new: jax.Array,
               num_valid: jax.Array, fresh: bool = False, cache_extent: jax.Array | None = None,
               layer_weights: tuple[dict[str, jax.Array], ...] | None = None) -> tuple[jax.Array, KVCache]:
        """Feeds newly accepted positions through AD1 + the Augmenting Block; returns s^0.

        Args:
          cache: the head's KV cache; `cache.lengths [B]` positions already committed per row.
          f_new: `[B, A, D]` base pre-norm hidden states of the new positions (right padded).
          y_new: `[B, A]` the token that follows each new position (x_{t+1}: the next accepted token,
            or the bonus/root token for the last one).
          num_valid: `[B]` how many of the A positions are real in each row (0 allowed: row untouched).
          fresh: the cache is known to be empty (the prompt's commit): its slots are not attended to at all.
          cache_extent: optional `[]` int, at least every row's `cache.lengths`: the cache is then read in blocks
            up to it only (a block of a long prompt, `commit_prompt`), not over all its slots.
          layer_weights: optional `self.aug.per_layer_weights()`, taken before a decoding loop: the block's layers
            then run unrolled, reading their weights in place (see `RecurrentDrafter.unroll_layers`).

        Returns:
          `(state [B, D], cache')`: the Augmenting-Block output (after aug_norm) at the last valid new
          position of each row (s^0 for head 0; arbitrary for rows with num_valid = 0), and the cache
          with the valid positions appended and `lengths += num_valid`. RoPE positions are
          `lengths + arange(A)`; padding positions attend only to valid ones, their K/V land past the
          row's new length, so they never affect a valid row.
        """
        check_compatible(self, base.config)
        b, a = y_new.shape
        num_valid = num_valid.astype(jnp.int32)
        check_room(cache.lengths + num_valid, 0, cache.size, what="Clover-2 head commit")
        valid = jnp.arange(a)[None, :] < num_valid[:, None]  # [B, A]
        # Zero the padding inputs: a NaN there would leak through 0-weight attention terms.
        e = self.embed(base, jnp.where(valid, y_new, 0))  # [B, A, D]
        g = self._ad("ad1", jnp.where(valid[..., None], f_new, 0).astype(self.cfg.dtype), e)
        positions = cache.lengths[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]  # [B, A]
        self_mask = causal_mask(valid)  # [B, A, A]
        old, cache_mask = attended_cache(cache, a, fresh)  # cache_mask [B, A, S] or None
        s, new_k, new_v = self._aug_block(g, positions, self_mask, old, cache_mask, cache_extent, layer_weights)
        last = jnp.maximum(num_valid - 1, 0)
        state = jnp.take_along_axis(s, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return state, cache.append(new_k, new_v, num_valid)


def init_from_base(base: Llama, cfg: Clover2Config = Clover2Config(), seed: int = 0) -> Clover2Head:
    """A head initialised as the reference: every Augmenting-Block layer = a copy of the base's last
    decoder layer, aug_norm = head_norm = the base final norm, AD/FC identity-plus-U[0, 0.01) inits.

    Runs under `jax.jit`: one compile instead of one per parameter shape, and the throw-away random
    init of the Augmenting Block is dead code that XLA removes.
    """
    def build(base: Llama) -> Clover2Head:
        head = Clover2Head(base.config, cfg, rngs=nnx.Rngs(params=seed))
        pd = cfg.param_dtype
        for name, value in base.layers.layer_params().items():  # each [L_base, ...]
            last = value[-1].astype(pd)
            getattr(head.aug, name)[...] = jnp.broadcast_to(last, (cfg.num_aug_layers, *last.shape))
        head.aug_norm[...] = base.final_norm[...].astype(pd)
        head.head_norm[...] = base.final_norm[...].astype(pd)
        return head

    head = jax.jit(build)(base)
    check_compatible(head, base.config)
    return head
