"""The block head's exported folder. No reference project publishes this head, so the tensor names are ours
(torch layouts, [out, in] for projections):

  context.weight          [D, (n + 2) D]   W_ctx^T (input: [normed tapped features ; normed feature ; next-token
                                           embedding])
  feature_norms.weight    [n, D]    the tapped features' RMSNorm weights (only with n = len(feature_layers) > 0)
  root.weight             [D, D]    W_root^T
  mask_embeddings.weight  [C, D]    m
  layers.{l}.*            the block's decoder layers under the Hugging Face Llama layer names

and config.json holds `head_type: "block"`, `block_size`, `num_layers`, `window`, `feature_layers`, `rope_theta` and
the base model's config. The head holds no copy of the base (embedding, final norm and lm_head are the base's own)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from clover_jax.heads.block.head import ROPE_THETA, BlockConfig, BlockHead
from clover_jax.io.export import ExportError, merge_checked
from clover_jax.io.hf import _layer_table, read_weights_dir

WEIGHTS_FILE = "model.safetensors"
_OWN = {"context.weight": ("ctx_w", True), "root.weight": ("root_w", True),
        "mask_embeddings.weight": ("mask_emb", False)}  # name -> (our parameter, transposed)
_TAP_NORM = "feature_norms.weight"


def to_reference(head: BlockHead, base=None, include_frozen: bool = True, include_lm_head=None) -> dict:
    """{name: numpy array} under the names above (`include_frozen` is moot: the head holds nothing frozen)."""
    out = {}
    for name, (ours, tr) in _OWN.items():
        a = np.asarray(getattr(head, ours)[...], np.float32)
        out[name] = a.T if tr else a
    if head.cfg.feature_layers:
        out[_TAP_NORM] = np.asarray(head.tap_norm[...], np.float32)
    params = head.layers.layer_params()
    for suffix, (ours, _, to_hf) in _layer_table(head.layers.config).items():
        for i in range(head.cfg.num_layers):
            out[f"layers.{i}.{suffix}"] = to_hf(np.asarray(params[ours][i], np.float32))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def config_dict(head: BlockHead, base_name=None, extra=None) -> dict:
    """config.json: the head's architecture (head_type "block") and the base model's config."""
    b = head.base_config
    return {"head_type": "block", "architectures": ["BlockDrafter"], "block_size": head.cfg.block_size,
            "num_layers": head.cfg.num_layers, "window": head.cfg.window,
            "feature_layers": list(head.cfg.feature_layers), "rope_theta": ROPE_THETA,
            "hidden_size": b.hidden_size, "vocab_size": b.vocab_size,
            "base_model": {"name_or_path": base_name, **b.to_hf_dict()}, **(extra or {})}


def from_reference(folder, meta: dict, base, dtype=None) -> BlockHead:
    """A block head from an exported folder (`config.json`'s sizes, the weights under the names above)."""
    folder = Path(folder)
    missing = [k for k in ("block_size", "num_layers", "window") if k not in meta]
    if missing:
        raise ExportError(f"{folder}: config.json lacks {missing} (a block head folder names its sizes)")
    if float(meta.get("rope_theta", ROPE_THETA)) != ROPE_THETA:
        raise ExportError(f"{folder}: rope_theta {meta['rope_theta']} differs from the block head's {ROPE_THETA}")
    cfg = BlockConfig(block_size=int(meta["block_size"]), num_layers=int(meta["num_layers"]),
                      window=int(meta["window"]), feature_layers=tuple(meta.get("feature_layers", ())),
                      **({"dtype": dtype, "param_dtype": dtype} if dtype else {}))
    get, keys = read_weights_dir(folder)
    keys = set(keys)

    def need(name):
        if name not in keys:
            raise ExportError(f"{folder}: missing tensor {name!r}")
        return np.asarray(get(name), np.float32)

    head = nnx.eval_shape(lambda: BlockHead(base.config, cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    pure = nnx.to_pure_dict(state)
    for name, (ours, tr) in _OWN.items():
        pure[ours] = need(name).T if tr else need(name)
    if cfg.feature_layers:
        pure["tap_norm"] = need(_TAP_NORM)
    for suffix, (ours, to_ours, _) in _layer_table(head.layers.config).items():
        pure["layers"][ours] = np.stack([to_ours(need(f"layers.{i}.{suffix}")) for i in range(cfg.num_layers)])
    return merge_checked(graphdef, state, pure, folder)
