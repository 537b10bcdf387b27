"""Clover (Clover-1) draft heads (Xiao et al. 2024, arXiv 2405.00263), the ancestor of Clover-2.

The paper describes three additions to Medusa heads and publishes no code: a **Regressive Connection** (the
token drafted by head i-1 enters head i as an embedding), an **Attention Decoder** that merges that embedding
with the hidden state, and an **Augmenting Block** (a transformer block over the whole sequence that adapts the
base model's hidden states to drafting). The equations below are our reading; each choice and its reason:

  a_t   = aug_norm(Aug(f)_t)                       Augmenting Block over the base's pre-norm features f alone
                                                   (Clover-2 added an attention decoder on (f, e) before it; the
                                                   paper's block "modifies the hidden states"). Its layers and
                                                   norm start as copies of the base's last layer and final norm,
                                                   as Clover-2's reference does.
  s^{-1}_t = a_t
  s^i_t = AD_i(E[x^i], s^{i-1}_t)                  head i (i = 0..n-1); x^0 = x_{t+1}, the root (the token the base
                                                   just emitted), x^i = the token head i-1 drafted (in training the
                                                   data's x_{t+1+i}): the Regressive Connection.
  AD(x, s) = x + concat_h(cos(q_h, k_h) v_h),      q = RMSNorm(x) Wq + bq (from the token), k = s Wk + bk and
                                                   v = s Wv + bv (from the state): the attention decoder of
                                                   Clover-2's reference (one query against one key, gated by
                                                   their cosine, no softmax) with its inputs swapped. Clover-2
                                                   lists "information extraction order" among its changes and
                                                   takes the query from the state and K/V from the token, so
                                                   Clover-1 is read as the opposite order.
  o^i_t = head_norm(FC_i s^i_t + c_i),  logits^i = o^i W_lm      each head its own AD_i and FC_i (Medusa's heads
                                                   share nothing; Clover-2 made the later heads one shared
                                                   RNN), the base's frozen lm_head shared (as Clover-2).

o^i_t predicts x_{t+2+i}, as Medusa's head i and Clover-2's. Initialisation: Clover-2's reference inits for the
attention decoders (Wq, Wk = I + U[0, 0.01), Wv = U[0, 0.01)) and FC (I + U[0, 0.01)), biases 0, head_norm = the
base's final norm. Training uses the library's distillation loss (`kd_loss`: soft cross-entropy against the
base, plus the optional regression of o^i to h_{t+1+i}: `loss.v_weight: 0` for a Medusa-style cross-entropy).

Drafting reuses Clover-2's drafters unchanged (`clover2_draft`): the head exposes the same `commit` / `head0` /
`step` / `logits` interface, `step` reading the weights of its depth. Clover-1's own candidate selection (per
node top-p, then joint-probability ranking into a total budget) is the `dynamic-N-pP` tree policy, usable by
Clover-2 too. With no reference code, export writes this module's own parameter names (`clover1.*`).

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from clover_jax.heads.clover2.model import EMBED_SOURCES, REFERENCE_ROPE_THETA, attention_decoder, aug_block_config
from clover_jax.heads.recurrent import RecurrentNodes
from clover_jax.heads.recurrent.loss import loss_from_features as recurrent_loss_from_features
from clover_jax.io.export import ExportError
from clover_jax.models.cache import KVCache, attended_cache, causal_mask, check_room
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import DecoderStack, Llama, rms_norm
from clover_jax.validation import InputError

_AD = ("norm", "wq", "bq", "wk", "bk", "wv", "bv")


@dataclasses.dataclass(frozen=True)
class Clover1Config:
    num_heads: int = 5  # draft depths, one head each
    num_aug_layers: int = 1  # decoder layers in the Augmenting Block ("a transformer block")
    embed_source: str = "lm_head"  # token embedding E: "lm_head" (W_lm^T, as Clover-2's reference) or "input"
    rope_theta: float | None = REFERENCE_ROPE_THETA  # the Augmenting Block's RoPE (see Clover2Config)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    def __post_init__(self):
        if self.num_heads < 1:
            raise InputError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_aug_layers < 1:
            raise InputError(f"num_aug_layers must be >= 1, got {self.num_aug_layers}")
        if self.embed_source not in EMBED_SOURCES:
            raise InputError(f"embed_source must be one of {EMBED_SOURCES}, got {self.embed_source!r}")


class Clover1Head(RecurrentNodes, nnx.Module):
    """Clover-1 heads for one base model (see the module docstring); parameters only."""

    def __init__(self, base_config: LlamaConfig, cfg: Clover1Config = Clover1Config(), *, rngs: nnx.Rngs):
        d, n = base_config.hidden_size, cfg.num_heads
        if d % base_config.num_attention_heads:
            raise InputError(f"the attention decoder splits hidden_size={d} into num_attention_heads="
                             f"{base_config.num_attention_heads} heads; it must divide evenly")
        self.base_config = base_config
        self.cfg = cfg
        pd = cfg.param_dtype
        uniform = lambda shape: jax.random.uniform(rngs.params(), shape, jnp.float32, 0.0, 0.01)  # noqa: E731
        eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (n, d, d))
        par = lambda x: nnx.Param(jnp.asarray(x).astype(pd))  # noqa: E731
        self.ad_norm = par(jnp.ones((n, d)))  # [n, D]
        self.ad_wq = par(eye + uniform((n, d, d)))  # [n, D, D]
        self.ad_bq = par(jnp.zeros((n, d)))
        self.ad_wk = par(eye + uniform((n, d, d)))
        self.ad_bk = par(jnp.zeros((n, d)))
        self.ad_wv = par(uniform((n, d, d)))
        self.ad_bv = par(jnp.zeros((n, d)))
        self.fc_w = par(eye + uniform((n, d, d)))  # [n, D, D]
        self.fc_b = par(jnp.zeros((n, d)))
        self.aug = DecoderStack(aug_block_config(base_config, cfg.rope_theta), num_layers=cfg.num_aug_layers,
                                rngs=rngs, param_dtype=pd, dtype=cfg.dtype, remat=cfg.remat)
        self.aug_norm = par(jnp.ones((d,)))
        self.head_norm = par(jnp.ones((d,)))

    @property
    def eps(self) -> float:
        return self.base_config.rms_norm_eps

    def embed(self, base: Llama, tokens: jax.Array) -> jax.Array:
        """Frozen token embedding `E[tokens]` `[..., D]` read from the base model."""
        if self.cfg.embed_source == "lm_head":
            e = base.lm_head_rows(tokens)
        else:
            e = jnp.take(jax.lax.stop_gradient(base.embed[...]), tokens, axis=0, mode="clip")
        return e.astype(self.cfg.dtype)

    def _head(self, i: int, state: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Head i: `(s^i, o^i)` from the state `s^{i-1} [..., D]` and the token embedding `e [..., D]`."""
        p = {k: getattr(self, f"ad_{k}")[i] for k in _AD}
        s = attention_decoder(p, e, state, self.base_config.num_attention_heads, self.eps, self.cfg.dtype)
        dt = self.cfg.dtype
        y = s.astype(dt) @ self.fc_w[i].astype(dt) + self.fc_b[i].astype(dt)
        return s, rms_norm(y, self.head_norm[...], self.eps)

    def _aug(self, f, positions, self_mask, cache=None, cache_mask=None, cache_extent=None, layer_weights=None):
        ck, cv = (None, None) if cache is None else (cache.k, cache.v)
        y, new_k, new_v = self.aug(f, positions, self_mask, ck, cv, cache_mask, cache_extent=cache_extent,
                                   layer_weights=layer_weights)
        return rms_norm(y, self.aug_norm[...], self.eps), new_k, new_v

    # ------------------------------------------------------------ the interface Clover-2's drafters use
    def head0(self, s0: jax.Array) -> jax.Array:
        """o^0 from s^0 (`commit` already ran head 0's attention decoder on the root)."""
        dt = self.cfg.dtype
        return rms_norm(s0.astype(dt) @ self.fc_w[0].astype(dt) + self.fc_b[0].astype(dt), self.head_norm[...],
                        self.eps)

    def step(self, base: Llama, state: jax.Array, tokens: jax.Array, depth: int = 1) -> tuple[jax.Array, jax.Array]:
        """Head `depth` (>= 1): `(s^depth, o^depth)` from the parent's state and the parent's drafted token."""
        if not 1 <= depth < self.cfg.num_heads:
            raise InputError(f"Clover-1 head {depth} does not exist (num_heads={self.cfg.num_heads})")
        return self._head(depth, state, self.embed(base, tokens))

    def logits(self, base: Llama, o: jax.Array) -> jax.Array:
        return base.project(o, self.cfg.dtype)

    def init_cache(self, batch: int, size: int, dtype=None) -> KVCache:
        c = self.base_config
        return KVCache.init(self.cfg.num_aug_layers, batch, size, c.num_key_value_heads, c.head_dim,
                            dtype or self.cfg.dtype)

    def commit(self, base: Llama, cache: KVCache, f_new: jax.Array, y_new: jax.Array,
               num_valid: jax.Array, fresh: bool = False, cache_extent: jax.Array | None = None,
               layer_weights: tuple[dict[str, jax.Array], ...] | None = None) -> tuple[jax.Array, KVCache]:
        """Feeds new accepted positions `f_new [B, A, D]` through the Augmenting Block (cache appended by
        `num_valid [B]`) and returns s^0 `[B, D]` = AD_0(E[root], a_last), the root being the token after the
        last valid position (`y_new [B, A]`); `fresh`, `cache_extent`, `layer_weights`: see Clover2Head.commit."""
        b, a = y_new.shape
        num_valid = num_valid.astype(jnp.int32)
        check_room(cache.lengths + num_valid, 0, cache.size, what="Clover-1 head commit")
        valid = jnp.arange(a)[None, :] < num_valid[:, None]  # [B, A]
        f = jnp.where(valid[..., None], f_new, 0).astype(self.cfg.dtype)
        positions = cache.lengths[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]
        s, new_k, new_v = self._aug(f, positions, causal_mask(valid), *attended_cache(cache, a, fresh), cache_extent,
                                    layer_weights)
        last = jnp.maximum(num_valid - 1, 0)
        a_last = jnp.take_along_axis(s, last[:, None, None], axis=1)[:, 0]  # [B, D]
        root = jnp.take_along_axis(jnp.where(valid, y_new, 0), last[:, None], axis=1)[:, 0]  # [B]
        s0, _ = self._head(0, a_last, self.embed(base, root))
        return s0, cache.append(new_k, new_v, num_valid)

    # ------------------------------------------------------------ training (teacher forcing)
    def train_outputs(self, base: Llama, f: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
        """`[n, B, T, D]`: o^i_t (predicts x_{t+2+i}) for t < T - i, zero beyond."""
        b, t = tokens.shape
        valid = valid.astype(bool)
        y = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # x_{t+1}
        e = self.embed(base, y)  # [B, T, D]
        f = jnp.where(valid[..., None], f, 0).astype(self.cfg.dtype)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        s, _, _ = self._aug(f, positions, causal_mask(valid))
        outs = []
        for i in range(self.cfg.num_heads):
            e_i = jnp.pad(e[:, i:], ((0, 0), (0, i), (0, 0)))  # E[x_{t+1+i}], zero past the end
            s, o = self._head(i, s, e_i)
            outs.append(jnp.where((jnp.arange(t) < t - i)[None, :, None], o, 0))
        return jnp.stack(outs)


def check_compatible(head: Clover1Head, base_config: LlamaConfig) -> None:
    d, aug = base_config.hidden_size, head.aug
    shapes = {"hidden_size (fc_w)": (head.fc_w.shape[1:], (d, d)),
              "attention dims (aug.wq)": (aug.wq.shape[1:], (d, base_config.num_attention_heads, base_config.head_dim)),
              "kv dims (aug.wk)": (aug.wk.shape[1:], (d, base_config.num_key_value_heads, base_config.head_dim)),
              "intermediate_size (aug.w_gate)": (aug.w_gate.shape[1:], (d, base_config.intermediate_size))}
    for what, (got, want) in shapes.items():
        if tuple(got) != tuple(want):
            raise InputError(f"Clover-1 head does not fit the base model: {what} has shape {tuple(got)}, the base "
                             f"model needs {tuple(want)}")
    if head.base_config.vocab_size != base_config.vocab_size:
        raise InputError(f"Clover-1 head does not fit the base model: vocab_size is {head.base_config.vocab_size} "
                         f"in the head but {base_config.vocab_size} in the base model")


def init_from_base(base: Llama, cfg: Clover1Config = Clover1Config(), seed: int = 0) -> Clover1Head:
    """Augmenting-Block layers = copies of the base's last layer, aug_norm = head_norm = its final norm."""
    def build(base: Llama) -> Clover1Head:
        head = Clover1Head(base.config, cfg, rngs=nnx.Rngs(params=seed))
        for name, value in base.layers.layer_params().items():
            last = value[-1].astype(cfg.param_dtype)
            getattr(head.aug, name)[...] = jnp.broadcast_to(last, (cfg.num_aug_layers, *last.shape))
        head.aug_norm[...] = base.final_norm[...].astype(cfg.param_dtype)
        head.head_norm[...] = base.final_norm[...].astype(cfg.param_dtype)
        return head

    head = jax.jit(build)(base)
    check_compatible(head, base.config)
    return head


def loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, *, index=None, vocab_ids=None):
    return recurrent_loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, index=index,
                                      vocab_ids=vocab_ids)


# ----------------------------------------------------------------------------- export / import (own names)
def _flat(head: Clover1Head, leaf) -> dict:
    """{`clover1.<parameter path>`: leaf(array)} over the head's parameters."""
    out = {}

    def walk(prefix, tree):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                out[f"clover1.{prefix}{k}"] = leaf(v)

    walk("", nnx.to_pure_dict(nnx.state(head, nnx.Param)))
    return out


def to_reference(head: Clover1Head, base=None, include_frozen: bool = True, include_lm_head=None) -> dict:
    """{`clover1.<parameter path>`: numpy array} in this module's `[in, out]` layouts (no reference code exists)."""
    return _flat(head, lambda v: np.asarray(v, np.float32))


def config_dict(head: Clover1Head, base_name=None, extra=None) -> dict:
    b, c = head.base_config, head.cfg
    return {"head_type": "clover1", "architectures": ["Clover1Heads"], "num_heads": c.num_heads,
            "num_aug_layers": c.num_aug_layers, "embed_source": c.embed_source, "rope_theta": c.rope_theta,
            "hidden_size": b.hidden_size, "vocab_size": b.vocab_size,
            "base_model": {"name_or_path": base_name, **b.to_hf_dict()}, **(extra or {})}


def from_reference(folder, meta: dict, base, dtype=None) -> Clover1Head:
    file = Path(folder) / "model.safetensors"
    if not file.is_file():
        raise ExportError(f"{folder}: no model.safetensors")
    try:
        cfg = Clover1Config(num_heads=int(meta["num_heads"]), num_aug_layers=int(meta["num_aug_layers"]),
                            embed_source=meta.get("embed_source", "lm_head"), rope_theta=meta.get("rope_theta"),
                            **({"dtype": dtype, "param_dtype": dtype} if dtype is not None else {}))
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{folder}: config.json lacks a valid Clover-1 configuration ({e})") from None
    head = nnx.eval_shape(lambda: Clover1Head(base.config, cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    want = _flat(head, lambda v: tuple(v.shape))
    with safe_open(str(file), framework="numpy") as fh:
        keys = set(fh.keys())
        missing = sorted(set(want) - keys)
        if missing:
            raise ExportError(f"{file}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        tree: dict = {}
        for name, shape in want.items():
            a = np.asarray(fh.get_tensor(name), np.float32)
            if a.shape != shape:
                raise ExportError(f"{file}: {name} has shape {a.shape}, the base model needs {shape}")
            node = tree
            parts = name.split(".")[1:]
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = jnp.asarray(a, cfg.param_dtype)
    nnx.replace_by_pure_dict(state, tree)
    return nnx.merge(graphdef, state)
