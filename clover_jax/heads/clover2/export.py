"""Clover-2 heads in the reference project's format (`Clover2Model` of `XiaoBin1992/clover`): its parameter names,
torch `[out, in]` layouts and config.json."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from clover_jax.heads.clover2.model import Clover2Config, Clover2Head
from clover_jax.io.export import ExportError, merge_checked, to_numpy
from clover_jax.io.hf import _layer_table, read_weights_dir
from clover_jax.models.config import LlamaConfig


def _ad_names(prefix: str, ours: str):
    out = {f"{prefix}.input_layernorm.weight": (f"{ours}_norm", False)}
    for x in "qkv":
        out[f"{prefix}.{x}.weight"] = (f"{ours}_w{x}", True)
        out[f"{prefix}.{x}.bias"] = (f"{ours}_b{x}", False)
    return out


def head_name_table(num_aug_layers: int, base_config: LlamaConfig) -> dict[str, tuple[str, bool]]:
    """Reference name -> (our flat param name, transpose?) for every exported head tensor but the embedding.

    The Augmenting Block's layers use the HF Llama layer names (handled separately via `_layer_table`).
    """
    t = {}
    t.update(_ad_names("clover_head_mlp_rnn", "ad1"))
    t.update(_ad_names("clover_head_mlp_rnn2", "ad2"))
    t["clover_norm.weight"] = ("aug_norm", False)
    t["clover_head_mlp.weight"] = ("fc0_w", True)
    t["clover_head_mlp.bias"] = ("fc0_b", False)
    t["clover_head_mlp2.weight"] = ("fcout_w", True)
    t["clover_head_mlp2.bias"] = ("fcout_b", False)
    t["clover_head_norm.weight"] = ("head_norm", False)
    return t


def to_reference(head, base=None, include_frozen: bool = True,
                 include_lm_head: bool | None = None) -> dict[str, np.ndarray]:
    """The head's tensors under the reference Clover-2 names and torch `[out, in]` layouts.

    `include_frozen` adds the frozen embedding copy `clover_embed_tokens.weight` `[V, H]` and
    `include_lm_head` the frozen base `lm_head.weight` `[V, H]`: the reference module registers both, so a
    folder with both loads into it with strict key matching (`include_lm_head` defaults to `include_frozen`). Both are
    read from `base`; neither is trained."""
    include_embedding = include_frozen
    include_lm_head = include_frozen if include_lm_head is None else include_lm_head
    state = jax.tree.map(to_numpy, nnx.to_pure_dict(nnx.state(head, nnx.Param)))
    out = {ref: (state[ours].T if tr else state[ours]) for ref, (ours, tr) in
           head_name_table(head.cfg.num_aug_layers, head.base_config).items()}
    for suffix, (ours, _, to_hf) in _layer_table(head.aug.config).items():
        for i in range(head.cfg.num_aug_layers):
            out[f"layers.{i}.{suffix}"] = np.ascontiguousarray(to_hf(state["aug"][ours][i]))
    if include_embedding:
        if base is None:
            raise ExportError("the embedding copy is read from the base model: pass base=...")
        if head.cfg.embed_source == "lm_head":
            emb = to_numpy(base.lm_head_matrix()).T
        else:
            emb = to_numpy(base.embed[...])
        out["clover_embed_tokens.weight"] = np.ascontiguousarray(emb)
    if include_lm_head:
        if base is None:
            raise ExportError("lm_head.weight is read from the base model: pass base=...")
        out["lm_head.weight"] = np.ascontiguousarray(to_numpy(base.lm_head_matrix()).T)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def config_dict(head, base_name: str | None = None, extra: dict | None = None) -> dict:
    """config.json of an exported head. `rope_theta` / `rope_scaling` are what the Augmenting Block actually
    uses (the reference's plain RoPE with base 10000 unless the head follows the base's RoPE)."""
    c, b = head.cfg, head.base_config
    aug = head.aug.config
    return {
        "head_type": "clover2",
        "architectures": ["Clover2Model"],
        "num_heads": c.num_heads,
        "num_layers": c.num_aug_layers,
        "embed_source": c.embed_source,
        "rope_theta": float(aug.rope_theta),
        "rope_scaling": aug.to_hf_dict().get("rope_scaling"),
        "rope_follows_base": c.rope_theta is None,
        "hidden_size": b.hidden_size,
        "vocab_size": b.vocab_size,
        "base_model": {"name_or_path": base_name, **b.to_hf_dict()},
        **(extra or {}),
    }


def from_reference(path, meta, base, dtype=None):
    """A Clover-2 head from an exported folder (reference `Clover2Model` names); `meta` is its config.json."""
    bc = base.config
    # rope_theta null (older exports) or rope_follows_base: the base model's RoPE; else plain RoPE, that base
    rope_theta = None if meta.get("rope_follows_base") or meta.get("rope_theta") is None else float(meta["rope_theta"])
    cfg = Clover2Config(num_heads=int(meta["num_heads"]), num_aug_layers=int(meta["num_layers"]),
                        embed_source=meta.get("embed_source", "lm_head"), rope_theta=rope_theta,
                        **({"dtype": dtype, "param_dtype": dtype} if dtype is not None else {}))
    get, keys = read_weights_dir(path)
    keys = set(keys)
    abstract = nnx.eval_shape(lambda: Clover2Head(bc, cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)

    def need(name):
        if name not in keys:
            raise ExportError(f"{path}: missing tensor {name!r}")
        return np.asarray(get(name))

    for ref, (ours, tr) in head_name_table(cfg.num_aug_layers, bc).items():
        arr = need(ref)
        pure[ours] = arr.T if tr else arr
    for suffix, (ours, to_ours, _) in _layer_table(abstract.aug.config).items():
        pure["aug"][ours] = np.stack([to_ours(need(f"layers.{i}.{suffix}")) for i in range(cfg.num_aug_layers)])

    return merge_checked(graphdef, state, pure, path)


