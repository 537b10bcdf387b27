"""EAGLE-1 draft head (Li et al. 2024, arXiv 2401.15077; reference `SafeAILab/EAGLE`, v1), a baseline.

Feature-level autoregression. With h_t the base's last hidden state after the final norm (the input of its
lm_head) and E its frozen input embedding, the draft at position t reads

  z_t = FC([E x_{t+1} ; h_t])                  (FC: 2D -> D, with bias; the embedding half first)
  f^_{t+1} = Layer(z)_t                        (one Llama decoder layer without an input RMSNorm, causal over
                                                the draft's own KV cache; no final norm)
  logits = f^_{t+1} W_lm                       (the base's frozen lm_head) predict x_{t+2}

and the next draft step feeds f^_{t+1} back in place of h_{t+1}. The layer's RoPE is plain RoPE with base
`rope_theta` (the v1 reference builds its rotary embedding with the default 10000 whatever the base uses; None
follows the base's own RoPE). Parameters start as the reference's training script leaves them (torch's
`nn.Linear` default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)); norms 1); `init="base_layer"` instead copies the
base's last decoder layer and starts FC as [0 ; I] (the head starts as "run the last layer once more"). On
SmolLM2-135M that start is the worse one: the copied layer meets the base's un-normalised features (this layer
has no input norm), and on the same data it starts at a far higher loss and, after the same training, drafts
far fewer tokens right.

Training (`loss_from_features`): teacher forcing on the base's own features, the Clover-2 loss with one head:
SmoothL1(f^_{t+1}, h_{t+1}) and the soft cross-entropy against softmax(h_{t+1} W_lm); EAGLE's weights are
`loss.v_weight: 1.0`, `loss.p_weight: 0.1` (configs/smollm2-135m-eagle.yaml). The reference also adds uniform
noise to the input features; we do not.

Drafting (`EagleDrafter`, `EagleDynamicDrafter`): Clover-2's tree drafting with EAGLE's node step. The draft
cache holds the committed pairs (h_t, x_{t+1}) up to the root (the root's pair included), and s0 = f^ at the
root. A tree node at depth d (token x, parent output f^_parent) runs the layer on FC([E x ; f^_parent]) at
position `committed + d - 1`, attending to the committed cache, its ancestors' keys/values (carried with the
node: the reference's tree mask, one path per node) and itself; its output drafts its children. Drafting depth
is not bounded by the head (any static tree, or an EAGLE-2 dynamic tree `dynamic-N`).

Shapes and einsum strings use the axis letters of `clover_jax.axes`. Here P counts a node's ancestors (its
depth - 1) and L the draft layers (1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.heads.recurrent.drafter import RecurrentDrafter, RecurrentDynamicDrafter, RecurrentState
from clover_jax.heads.clover2.model import REFERENCE_ROPE_THETA, aug_block_config
from clover_jax.heads.losses import uniform_feature_noise
from clover_jax.heads.recurrent.loss import loss_from_features as recurrent_loss_from_features
from clover_jax.io.export import ExportError, merge_checked
from clover_jax.io.hf import _layer_table, read_weights_dir
from clover_jax.models.cache import KVCache, attended_cache, causal_mask, check_room, prefix_mask
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import DecoderStack, Llama, rms_norm
from clover_jax.validation import InputError

INITS = ("reference", "base_layer")
NUM_LAYERS = 1  # EAGLE-1's draft is one decoder layer (its published heads: num_hidden_layers 1)


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    # RoPE of the draft layer: a number = plain RoPE with that base (the v1 reference: 10000); None: the base's own
    rope_theta: float | None = REFERENCE_ROPE_THETA
    init: str = "reference"  # "reference" (torch Linear defaults) or "base_layer" (see the module docstring)
    dtype: Any = jnp.float32  # compute dtype (norms, attention softmax and logits stay float32)
    param_dtype: Any = jnp.float32
    remat: bool = False  # rematerialise the draft layer in the backward pass

    def __post_init__(self):
        if self.init not in INITS:
            raise InputError(f"EAGLE init must be one of {INITS}, got {self.init!r}")
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise InputError(f"rope_theta must be > 0 or None, got {self.rope_theta}")


class EagleHead(nnx.Module):
    """EAGLE-1 draft head; parameters only (the draft cache and drafting state are explicit arguments)."""

    def __init__(self, base_config: LlamaConfig, cfg: EagleConfig = EagleConfig(), *, rngs: nnx.Rngs):
        d = base_config.hidden_size
        self.base_config = base_config
        self.cfg = cfg
        pd = cfg.param_dtype
        bound = 1.0 / math.sqrt(2 * d)  # torch nn.Linear(2D, D) default init
        self.fc_w = nnx.Param(jax.random.uniform(rngs.params(), (2 * d, d), pd, -bound, bound))  # [2D, D]
        self.fc_b = nnx.Param(jax.random.uniform(rngs.params(), (d,), pd, -bound, bound))  # [D]
        self.layer = DecoderStack(aug_block_config(base_config, cfg.rope_theta), num_layers=NUM_LAYERS, rngs=rngs,
                                  param_dtype=pd, dtype=cfg.dtype, remat=cfg.remat, attn_norm=False)

    # ------------------------------------------------------------------ pieces
    def features(self, base: Llama, f: jax.Array) -> jax.Array:
        """h = the base's final RMSNorm of pre-norm features `f [..., D]` (frozen), in the compute dtype."""
        h = rms_norm(f, jax.lax.stop_gradient(base.final_norm[...]), base.config.rms_norm_eps)
        return h.astype(self.cfg.dtype)

    def embed(self, base: Llama, tokens: jax.Array) -> jax.Array:
        """The base's frozen input embedding `E[tokens]` `[..., D]` (ids clipped to [0, V))."""
        e = jnp.take(jax.lax.stop_gradient(base.embed[...]), tokens, axis=0, mode="clip")
        return e.astype(self.cfg.dtype)

    def fc(self, e: jax.Array, h: jax.Array) -> jax.Array:
        """`z = [e ; h] W + b` `[..., D]` (the reference's `fc(cat(inputs_embeds, hidden_states))`)."""
        dt = self.cfg.dtype
        x = jnp.concatenate([e.astype(dt), h.astype(dt)], axis=-1)  # [..., 2D]
        y = jnp.einsum("...I,ID->...D", x, self.fc_w[...].astype(dt), preferred_element_type=jnp.float32)
        return (y + self.fc_b[...].astype(jnp.float32)).astype(dt)

    def logits(self, base: Llama, o: jax.Array) -> jax.Array:
        """float32 logits `[..., V]` = f^ @ W_lm (the base's frozen lm_head, no norm in between)."""
        check_compatible(self, base.config)
        return base.project(o, self.cfg.dtype)

    # ------------------------------------------------------------------ training (teacher forcing)
    def train_outputs(self, base: Llama, f: jax.Array, tokens: jax.Array, valid: jax.Array,
                      noise: jax.Array | None = None) -> jax.Array:
        """Predicted features over whole sequences `[1, B, T, D]`: `out[0, :, t] = f^_{t+1}` (predicts x_{t+2}).

        Args:
          f: `[B, T, D]` base pre-final-norm last-layer hidden states; tokens: `[B, T]` the sequence x
            (the draft at t reads E x_{t+1}; x_T = 0); valid: `[B, T]` right-padding mask; noise: `[B, T, D]`
            added to the input features h (EAGLE's training noise), or None.
        """
        check_compatible(self, base.config)
        b, t = tokens.shape
        valid = valid.astype(bool)
        y = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # y_t = x_{t+1}
        h = self.features(base, f)
        if noise is not None:
            h = h + noise.astype(h.dtype)
        h = jnp.where(valid[..., None], h, 0)  # padding never reaches a valid row
        z = self.fc(self.embed(base, y), h)  # [B, T, D]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out, _, _ = self.layer(z, positions, causal_mask(valid))
        return out[None]

    # ------------------------------------------------------------------ inference
    def init_cache(self, batch: int, size: int, dtype=None) -> KVCache:
        """Empty draft-layer KV cache `[1, B, K, S, H]`."""
        c = self.base_config
        return KVCache.init(NUM_LAYERS, batch, size, c.num_key_value_heads, c.head_dim, dtype or self.cfg.dtype)

    def commit(self, base: Llama, cache: KVCache, f_new: jax.Array, y_new: jax.Array,
               num_valid: jax.Array, fresh: bool = False, cache_extent: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache]:
        """Feeds newly accepted positions (pairs `(h_t, x_{t+1})`) through the draft layer.

        Args:
          cache: the draft cache, `cache.lengths [B]` positions committed per row.
          f_new: `[B, A, D]` base pre-norm hidden states of the new positions (right padded).
          y_new: `[B, A]` the token following each (the last one: the root).
          num_valid: `[B]` real positions per row (0: the row is untouched).
          fresh: the cache is known to be empty (the prompt's commit): its slots are not attended to.
          cache_extent: optional `[]` int: read the cache in blocks up to it only (see Clover2Head.commit).

        Returns:
          `(f^ [B, D], cache')`: the layer output at each row's last valid position (f^ after the root: the
          drafting state s0) and the cache with the valid positions appended.
        """
        check_compatible(self, base.config)
        b, a = y_new.shape
        num_valid = num_valid.astype(jnp.int32)
        check_room(cache.lengths + num_valid, 0, cache.size, what="EAGLE head commit")
        valid = jnp.arange(a)[None, :] < num_valid[:, None]  # [B, A]
        h = jnp.where(valid[..., None], self.features(base, f_new), 0)  # a NaN in padding would leak
        z = self.fc(self.embed(base, jnp.where(valid, y_new, 0)), h)  # [B, A, D]
        positions = cache.lengths[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]  # [B, A]
        old, cache_mask = attended_cache(cache, a, fresh)  # cache_mask [B, A, S] or None
        ck, cv = (None, None) if old is None else (old.k, old.v)
        out, new_k, new_v = self.layer(z, positions, causal_mask(valid), ck, cv, cache_mask,
                                       cache_extent=cache_extent)
        last = jnp.maximum(num_valid - 1, 0)
        state = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return state, cache.append(new_k, new_v, num_valid)

    # the node step of the recurrent family's drafter (`clover_jax.heads.recurrent.RecurrentHead`): a node carries
    # its feature and the draft layer's keys and values along its path
    def root_node(self, base: Llama, cache: KVCache, s0: jax.Array):
        b, _ = s0.shape
        c = self.base_config
        empty = jnp.zeros((b, 1, NUM_LAYERS, 0, c.num_key_value_heads, c.head_dim), cache.k.dtype)  # no path yet
        return {"f": s0[:, None, :], "k": empty, "v": empty}, s0

    def node_step(self, base: Llama, cache: KVCache, parents: dict, tokens: jax.Array, depth: int):
        f, k, v = self.draft_step(base, cache, parents["f"], parents["k"], parents["v"], tokens, depth)
        return {"f": f, "k": k, "v": v}, f

    def draft_step(self, base: Llama, cache: KVCache, parent_f: jax.Array, path_k: jax.Array, path_v: jax.Array,
                   tokens: jax.Array, depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One tree level: nodes at `depth` (>= 1) with tokens `[B, E]`, their parents' outputs `parent_f [B, E, D]`
        and ancestors' keys/values `path_k, path_v [B, E, L, depth-1, K, H]` (empty at depth 1).

        Returns `(f^ [B, E, D], path_k', path_v' [B, E, L, depth, K, H])`: each node's output (its children's
        logits come from it) and its path with its own keys/values appended."""
        check_compatible(self, base.config)
        b, e = tokens.shape
        z = self.fc(self.embed(base, tokens), parent_f)  # [B, E, D]
        positions = jnp.broadcast_to((cache.lengths + depth - 1)[:, None], (b, e)).astype(jnp.int32)
        self_mask = jnp.broadcast_to(jnp.eye(e, dtype=bool), (b, e, e))  # a node sees itself, not its cousins
        out, new_k, new_v = self.layer(z, positions, self_mask, cache.k, cache.v,
                                       prefix_mask(cache.lengths, e, cache.size),
                                       jnp.moveaxis(path_k, 2, 0), jnp.moveaxis(path_v, 2, 0))
        # new_k: [L, B, E, K, H] -> appended to each node's path [B, E, L, depth, K, H]
        grow = lambda p, n: jnp.concatenate([p, jnp.moveaxis(n, 0, 2)[:, :, :, None].astype(p.dtype)], axis=3)  # noqa: E731
        return out, grow(path_k, new_k), grow(path_v, new_v)


def check_compatible(head: EagleHead, base_config: LlamaConfig) -> None:
    """An `InputError` naming the dimension in which `head` does not fit `base_config`."""
    head.base_config.check_head_fits(base_config, "EAGLE")
    d = base_config.hidden_size
    if tuple(head.fc_w.shape) != (2 * d, d):
        raise InputError(f"EAGLE head does not fit the base model: fc_w has shape {tuple(head.fc_w.shape)}, the "
                         f"base model needs {(2 * d, d)}")


def init_from_base(base: Llama, cfg: EagleConfig = EagleConfig(), seed: int = 0) -> EagleHead:
    """A fresh head: the reference's torch-default initialisation, or with `cfg.init="base_layer"` the base's last
    decoder layer (its attention-input norm dropped) and FC = [0 ; I]."""
    def build(base: Llama) -> EagleHead:
        head = EagleHead(base.config, cfg, rngs=nnx.Rngs(params=seed))
        pd = cfg.param_dtype
        params = head.layer.layer_params()
        if cfg.init == "base_layer":
            last = base.layers.layer_params()
            for name in params:
                getattr(head.layer, name)[...] = last[name][-1:].astype(pd)
            d = base.config.hidden_size
            head.fc_w[...] = jnp.zeros((2 * d, d), pd).at[d:].set(jnp.eye(d, dtype=pd))
            head.fc_b[...] = jnp.zeros((d,), pd)
            return head
        keys = iter(jax.random.split(jax.random.key(seed + 1), len(params)))
        for name, value in params.items():
            if name.endswith("norm"):
                continue  # RMSNorm weights start at 1
            fan_in = _fan_in(name, base.config)
            bound = 1.0 / math.sqrt(fan_in)
            getattr(head.layer, name)[...] = jax.random.uniform(next(keys), value.shape, pd, -bound, bound)
        return head

    head = jax.jit(build)(base)
    check_compatible(head, base.config)
    return head


def _fan_in(name: str, c: LlamaConfig) -> int:
    """The torch `nn.Linear` fan-in of a decoder-layer parameter (biases use their weight's)."""
    if name in ("wo", "bo"):
        return c.num_attention_heads * c.head_dim
    if name in ("w_down", "b_down"):
        return c.intermediate_size
    return c.hidden_size


# ------------------------------------------------------------------------------------------------ drafting
class _EagleNodes:
    """EAGLE's node step for Clover-2's tree drafters: a node's state is its output and its ancestors' keys and
    values, `{"f": [B, E, D], "k", "v": [B, E, L, P, K, H]}`; the draft cache is the drafter state's `cache`."""

    # EAGLE's one draft layer keeps its scan: unrolled (per-layer weights passed to every draft depth and commit) it
    # ran no faster on a CPU (chain-4 and dynamic-10 steps within noise)
    def unroll_layers(self, head, state: RecurrentState) -> RecurrentState:
        return state

    def layer_copy_bytes(self, head) -> int:
        return 0

    def check(self, head: EagleHead, base) -> None:
        check_compatible(head, base.config)
        self.check_tree(self.max_depth, base.config.vocab_size, what="the EAGLE head")  # any depth drafts



@dataclasses.dataclass(frozen=True, eq=False)
class EagleDrafter(_EagleNodes, RecurrentDrafter):
    """EAGLE-1 drafting over a static tree (hashable by identity; build once per tree)."""


@dataclasses.dataclass(frozen=True, eq=False)
class EagleDynamicDrafter(_EagleNodes, RecurrentDynamicDrafter):
    """EAGLE-2's dynamic tree (`tree.DynamicTree`) drafted by an EAGLE-1 head."""




# ----------------------------------------------------------------------------------- export / import
_FC = {"fc.weight": ("fc_w", True), "fc.bias": ("fc_b", False)}


def to_reference(head: EagleHead, base=None, include_frozen: bool = True, include_lm_head=None) -> dict:
    """{reference name: numpy array} (torch layouts): `fc.weight/bias`, `layers.0.*` under the HF Llama layer
    names (no `input_layernorm`), and with `include_frozen` the base's input embedding as `embed_tokens.weight`
    (the reference module holds a frozen copy)."""
    out = {}
    for ref, (ours, tr) in _FC.items():
        a = np.asarray(getattr(head, ours)[...], np.float32)
        out[ref] = a.T if tr else a
    params = head.layer.layer_params()
    for suffix, (ours, _, to_hf) in _layer_table(head.layer.config).items():
        if ours in params:
            out[f"layers.0.{suffix}"] = to_hf(np.asarray(params[ours][0], np.float32))
    if include_frozen:
        if base is None:
            raise InputError("the embedding copy is read from the base model: pass base=...")
        out["embed_tokens.weight"] = np.asarray(base.embed[...], np.float32)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def config_dict(head: EagleHead, base_name=None, extra=None) -> dict:
    """config.json: the base's HF Llama config with one hidden layer (the reference loads its draft config so),
    plus ours (head_type, the draft layer's RoPE, the base model)."""
    b = head.base_config
    layer = head.layer.config
    return {**b.to_hf_dict(), "head_type": "eagle", "architectures": ["EagleModel"], "num_hidden_layers": NUM_LAYERS,
            "bias": True, "rope_theta": float(layer.rope_theta), "rope_scaling": layer.to_hf_dict().get("rope_scaling"),
            "rope_follows_base": head.cfg.rope_theta is None, "hidden_size": b.hidden_size,
            "vocab_size": b.vocab_size, "base_model": {"name_or_path": base_name, **b.to_hf_dict()}, **(extra or {})}


def from_reference(folder, meta: dict, base, dtype=None) -> EagleHead:
    """An EAGLE head from a folder (ours, or the reference's with its weights as safetensors)."""

    if int(meta.get("num_hidden_layers", NUM_LAYERS)) != NUM_LAYERS:
        raise ExportError(f"{folder}: the EAGLE draft has {meta.get('num_hidden_layers')} layers; EAGLE-1 has one")
    if "head_type" not in meta and meta.get("rope_theta") is None:
        rope = REFERENCE_ROPE_THETA      # a published head without rope_theta: the reference's (and HF Llama's) 10000
    else:
        rope = None if meta.get("rope_follows_base") or meta.get("rope_theta") is None else float(meta["rope_theta"])
    cfg = EagleConfig(rope_theta=rope, **({"dtype": dtype, "param_dtype": dtype} if dtype is not None else {}))
    get, keys = read_weights_dir(folder)
    keys = set(keys)
    head = nnx.eval_shape(lambda: EagleHead(base.config, cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    pure = nnx.to_pure_dict(state)

    def need(name):
        if name not in keys:
            raise ExportError(f"{folder}: missing tensor {name!r}")
        return np.asarray(get(name), np.float32)

    for ref, (ours, tr) in _FC.items():
        pure[ours] = need(ref).T if tr else need(ref)
    for suffix, (ours, to_ours, _) in _layer_table(head.layer.config).items():
        if ours in pure["layer"]:
            pure["layer"][ours] = to_ours(need(f"layers.0.{suffix}"))[None]

    return merge_checked(graphdef, state, pure, folder)


def recognizes(meta: dict, folder) -> bool:
    """A folder as SafeAILab/EAGLE publishes its EAGLE-1 heads: a Llama config.json with one hidden layer and
    weights (`pytorch_model.bin` or `model.safetensors`) holding `fc.weight` and the layer's `layers.0.*`."""
    if meta.get("num_hidden_layers") != NUM_LAYERS:
        return False
    try:
        _, keys = read_weights_dir(folder)
    except (OSError, ValueError):
        return False
    eagle3 = "d2t" in keys or "Eagle3" in " ".join(meta.get("architectures") or [])  # an EAGLE-3 head: never this
    return not eagle3 and "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys


def loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, *, index=None, vocab_ids=None, rng=None):
    """The Clover-2 loss with EAGLE's single output (`loss.v_weight` / `loss.p_weight` set EAGLE's 1.0 / 0.1).
    With `rng` and `loss_cfg.feature_noise > 0`, the input features get EAGLE's uniform training noise
    (`uniform_feature_noise`); the regression targets and the teacher's distribution stay clean."""
    noise = None
    if rng is not None and loss_cfg.feature_noise:
        noise = uniform_feature_noise(rng, valid.astype(bool), f.shape[-1], loss_cfg.feature_noise)
    return recurrent_loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, index=index,
                                      vocab_ids=vocab_ids, noise=noise)
