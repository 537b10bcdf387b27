"""The smallest draft head, defined outside the library: `docs/adding-a-head.md` walks through this file.

Depth i (0-based) of a `ToyHead` is one matrix `W_i [D, V]`: from the base model's normed hidden state h_t of the
last accepted token it scores the token i + 2 positions ahead, `logits_i = h_t W_i` (Medusa-1 without its residual
blocks). Importing this module registers the head type "toy": after that the trainer, checkpoints, export, import
and `generate` handle it like a built-in head, with no library file changed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from safetensors.numpy import load_file

from clover_jax.decoding.drafter import Proposal, TreeDrafterBase, cached_arrays
from clover_jax.decoding.sampling import top_k_ids
from clover_jax.decoding.tree import TreeSpec, build_buffers
from clover_jax.heads import registry
from clover_jax.heads.losses import kd_loss, output_projection
from clover_jax.heads.options import HeadOptions
from clover_jax.io.export import ExportError
from clover_jax.models.llama import rms_norm
from clover_jax.validation import InputError

WEIGHTS_FILE = "model.safetensors"


# 1. the module and its config -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ToyConfig:
    num_heads: int = 3  # depths drafted per step
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    remat: bool = False  # nothing to rematerialise; every head config takes it


class ToyHead(nnx.Module):
    def __init__(self, base_config, cfg: ToyConfig = ToyConfig(), *, rngs: nnx.Rngs):
        self.base_config, self.cfg = base_config, cfg
        d, v = base_config.hidden_size, base_config.vocab_size
        self.proj = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.num_heads, d, v), cfg.param_dtype))

    def logits(self, h: jax.Array, num: int) -> jax.Array:
        """`[num, ..., V]` float32 scores of depths 0..num-1 from normed hidden states `h [..., D]`."""
        return jnp.einsum("...D,nDV->n...V", h.astype(self.cfg.dtype), self.proj[:num].astype(self.cfg.dtype),
                          preferred_element_type=jnp.float32)


def init_from_base(base, cfg: ToyConfig = ToyConfig(), seed: int = 0) -> ToyHead:
    """Every depth starts as a copy of the base's own next-token projection."""
    head = ToyHead(base.config, cfg, rngs=nnx.Rngs(params=seed))
    head.proj[...] = jnp.broadcast_to(base.lm_head_matrix().astype(cfg.param_dtype), head.proj.shape)
    return head


def check_compatible(head: ToyHead, base_config) -> None:
    want = (head.cfg.num_heads, base_config.hidden_size, base_config.vocab_size)
    if tuple(head.proj.shape) != want:
        raise InputError(f"toy head does not fit the base model: proj has shape {tuple(head.proj.shape)}, the base "
                         f"model needs {want}")


# 2. the `head:` section of an experiment config -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ToyOptions(HeadOptions):
    config_cls = ToyConfig
    type: str = "toy"  # num_heads comes from HeadOptions; every option but `type` goes to ToyConfig


# 3. the training loss --------------------------------------------------------------------------------------------
def loss_from_features(head: ToyHead, base, f, tokens, loss_mask, valid, loss_cfg, *, index=None, vocab_ids=None):
    """Distillation from the base's pre-norm features `f [B, T, D]`: the soft cross-entropy of `kd_loss` through
    each depth's own projection (no regression term)."""
    f = jax.lax.stop_gradient(f)
    h = rms_norm(f, jax.lax.stop_gradient(base.final_norm[...]), base.config.rms_norm_eps)  # [B, T, D]
    x = jnp.broadcast_to(h, (head.cfg.num_heads, *h.shape))  # [n, B, T, D]: every depth reads h_t
    cfg = dataclasses.replace(loss_cfg, v_weight=0.0)
    return kd_loss(x, h, tokens, loss_mask, valid, output_projection(base), cfg, student_proj=head.proj[...])


# 4. the drafter --------------------------------------------------------------------------------------------------
@struct.dataclass
class ToyState:
    shard_axes: ClassVar[dict[str, str]] = {"toy_h": "B D"}  # rows over the batch axes on a mesh
    toy_h: jax.Array  # [B, D] normed hidden state of the last accepted token


@dataclasses.dataclass(frozen=True, eq=False)
class ToyDrafter(TreeDrafterBase):
    """Drafts a static tree: the node at depth d, child rank r takes depth d-1's r-th best token."""

    spec: TreeSpec
    draft_vocab: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "buffers", build_buffers(self.spec))

    def check(self, head: ToyHead, base) -> None:
        check_compatible(head, base.config)
        if self.draft_vocab is not None:
            raise InputError("the toy head drafts from the whole vocabulary")
        self.check_tree(head.cfg.num_heads, base.config.vocab_size, what="the toy head")

    def arrays(self) -> dict:
        depth, rank = np.asarray(self.buffers.depth), np.asarray(self.buffers.rank)
        index = np.where(depth == 0, 0, 1 + (depth - 1) * self.spec.top_k + rank).astype(np.int32)  # [U]
        return cached_arrays(self, lambda: {"topology": jax.tree.map(jnp.asarray, self.buffers.topology()),
                                            "node_index": jnp.asarray(index)})

    def init_state(self, head, base, batch: int, cache_size: int, arrays) -> ToyState:
        return ToyState(toy_h=jnp.zeros((batch, base.config.hidden_size), jnp.float32))

    def _normed(self, base, f, at):  # f [B, A, D], at [B] -> [B, D]
        x = jnp.take_along_axis(f, at[:, None, None], axis=1)[:, 0]
        return rms_norm(x, base.final_norm[...], base.config.rms_norm_eps).astype(jnp.float32)

    def start(self, head, base, state: ToyState, f_prompt, y_prompt, lengths) -> ToyState:
        return state.replace(toy_h=self._normed(base, f_prompt, lengths - 1))

    def commit(self, head, base, state: ToyState, f_new, y_new, num_new) -> ToyState:
        h = self._normed(base, f_new, jnp.maximum(num_new - 1, 0))
        return state.replace(toy_h=jnp.where((num_new > 0)[:, None], h, state.toy_h))

    def propose(self, head: ToyHead, base, state: ToyState, root, key) -> Proposal:
        arrays = self.arrays()
        top = top_k_ids(head.logits(state.toy_h, self.max_depth), self.spec.top_k)  # [n, B, k]
        cand = jnp.concatenate([root[:, None], jnp.moveaxis(top, 0, 1).reshape(root.shape[0], -1)], axis=1)
        return Proposal(tokens=jnp.take(cand, arrays["node_index"], axis=1), buffers=arrays["topology"])


# 5. export and import --------------------------------------------------------------------------------------------
def to_reference(head: ToyHead, base=None, include_frozen: bool = True, include_lm_head=None) -> dict:
    return {f"heads.{i}.weight": np.asarray(head.proj[i]).T for i in range(head.cfg.num_heads)}  # torch [V, D]


def config_dict(head: ToyHead, base_name=None, extra=None) -> dict:
    return {"head_type": "toy", "num_heads": head.cfg.num_heads, "hidden_size": head.base_config.hidden_size,
            "vocab_size": head.base_config.vocab_size, "base_model": base_name, **(extra or {})}


def from_reference(folder, meta: dict, base, dtype=None) -> ToyHead:
    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    cfg = ToyConfig(num_heads=int(meta["num_heads"]))
    head = ToyHead(base.config, cfg, rngs=nnx.Rngs(0))
    try:
        head.proj[...] = jnp.stack([jnp.asarray(tensors[f"heads.{i}.weight"]).T for i in range(cfg.num_heads)])
    except KeyError as e:
        raise ExportError(f"{folder}: missing tensor {e}; config.json: {json.dumps(meta)}") from None
    return head


# 6. one registration ---------------------------------------------------------------------------------------------
TOY = registry.register(registry.HeadType(
    name="toy", config_cls=ToyConfig, module_cls=ToyHead, options_cls=ToyOptions, fields=("num_heads",),
    init_from_base=init_from_base, drafters={TreeSpec: ToyDrafter}, loss_from_features=loss_from_features,
    to_reference=to_reference, from_reference=from_reference, config_dict=config_dict,
    check_compatible=check_compatible, sharding_rules={"proj": ("fsdp", "tp")},  # [n, D, V]
    description="a toy head: one projection per depth from the last hidden state", default_tree="chain-2",
    weights_file=WEIGHTS_FILE))
