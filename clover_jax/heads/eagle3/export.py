"""EAGLE-3 heads in the published layout (SafeAILab/EAGLE `eagle/model/cnets.py` `Model`; the folders vLLM, SGLang
and TensorRT-LLM load): its parameter names, torch `[out, in]` layouts, the `d2t` / `t2d` vocabulary buffers and a
`LlamaForCausalLMEagle3` config.json.

  fc.weight                                [D, 3D]     no bias
  midlayer.hidden_norm.weight              [D]         on the fused feature
  midlayer.input_layernorm.weight          [D]         on the token embedding
  midlayer.self_attn.{q,k,v}_proj.weight   [N H, 2D], [K H, 2D], [K H, 2D]
  midlayer.self_attn.o_proj.weight         [D, N H]
  midlayer.post_attention_layernorm.weight [D]
  midlayer.mlp.{gate,up,down}_proj.weight  [F, D], [F, D], [D, F]
  norm.weight                              [D]
  lm_head.weight                           [Q, D]
  d2t                                      [Q] int64   target id = draft id + d2t[draft id]
  t2d                                      [V] bool    whether a target id is in the draft vocabulary
  embed_tokens.weight                      [V, D]      the base's, frozen (written with include_frozen)

vLLM and the speculators format store the layer as `layers.0.*`; both prefixes are read.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from clover_jax.heads.eagle3.head import NUM_FEATURES, Eagle3Config, Eagle3Head
from clover_jax.io.export import ExportError, merge_checked
from clover_jax.io.hf import read_weights_dir
from clover_jax.validation import InputError

ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_PREFIXES = ("midlayer.", "layers.0.")

# reference name (after the layer prefix) -> (our parameter, how ours becomes the torch layout)
_LAYER = {
    "hidden_norm.weight": "hidden_norm",
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}


def _to_torch(name: str, a: np.ndarray) -> np.ndarray:
    """Our layer parameter (without its leading [1]) in torch's `[out, in]` layout."""
    if a.ndim == 1:
        return a
    if name in ("wq", "wk", "wv"):  # [2D, N, H] -> [N H, 2D]
        return a.reshape(a.shape[0], -1).T
    if name == "wo":  # [N, H, D] -> [D, N H]
        return a.reshape(-1, a.shape[-1]).T
    return a.T  # [D, F] / [F, D]


def _from_torch(name: str, a: np.ndarray, like: tuple[int, ...]) -> np.ndarray:
    """A torch tensor in our layout `like` (without the leading [1])."""
    if a.ndim == 1:
        return a
    if name in ("wq", "wk", "wv"):
        return a.T.reshape(like)
    if name == "wo":
        return a.T.reshape(like)
    return a.T


def vocab_tensors(head: Eagle3Head, draft_vocab) -> dict[str, np.ndarray]:
    """`d2t [Q]` and `t2d [V]` of the head's draft vocabulary (`draft_vocab`: the Q sorted target ids its output
    columns stand for; None when the head drafts over the whole vocabulary)."""
    q, v = head.vocab_size, head.base_config.vocab_size
    if draft_vocab is None:
        if q != v:
            raise ExportError(f"this EAGLE-3 head scores {q} draft tokens: export it with its draft vocabulary "
                              f"(the {q} ids of draft_vocab.json)")
        ids = np.arange(v, dtype=np.int64)
    else:
        ids = np.asarray(draft_vocab, np.int64)
        if ids.shape != (q,):
            raise ExportError(f"the draft vocabulary holds {ids.size} ids; this EAGLE-3 head scores {q}")
    t2d = np.zeros((v,), bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(q, dtype=np.int64), "t2d": t2d}


def to_reference(head: Eagle3Head, base=None, include_frozen: bool = True, include_lm_head=None
                 ) -> dict[str, np.ndarray]:
    """{published name: numpy array} (torch layouts; `d2t` and `t2d` come from `vocab_tensors`), and with
    `include_frozen` the base's input embedding as `embed_tokens.weight` (the reference module holds a frozen copy,
    so the folder then loads into it with strict key matching)."""
    f32 = lambda x: np.asarray(x[...], np.float32)  # noqa: E731
    out = {"fc.weight": f32(head.fc_w).T, "norm.weight": f32(head.out_norm), "lm_head.weight": f32(head.head_w).T}
    for ref, ours in _LAYER.items():
        out[f"midlayer.{ref}"] = _to_torch(ours, f32(getattr(head, ours))[0])
    if include_frozen:
        if base is None:
            raise ExportError("the embedding copy is read from the base model: pass base=...")
        out["embed_tokens.weight"] = np.asarray(base.embed[...], np.float32)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def config_dict(head: Eagle3Head, base_name=None, extra=None) -> dict:
    """config.json as EAGLE-3 folders carry it (a one-layer Llama config with `draft_vocab_size` and
    `eagle_config.eagle_aux_hidden_state_layer_ids`, the base layers whose inputs are fused), plus ours."""
    b = head.base_config
    layer = head.layer_config.to_hf_dict()  # a Llama layer's config.json fields, whatever the base's family
    return {**layer, "architectures": [ARCHITECTURE], "head_type": "eagle3", "num_hidden_layers": 1,
            "vocab_size": b.vocab_size, "draft_vocab_size": head.vocab_size, "rope_theta": layer["rope_theta"],
            "rope_scaling": layer.get("rope_scaling"), "rope_follows_base": head.cfg.rope_theta is None,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.cfg.feature_layers],
                             "use_aux_hidden_state": True},
            "ttt_steps": head.cfg.num_heads,
            "base_model": {"name_or_path": base_name, "model_type": b.model_type,
                           **{k: getattr(b, k) for k in ("num_hidden_layers", *b.HEAD_FIT_FIELDS)}},
            **(extra or {})}


def feature_layers_of(meta: dict, num_base_layers: int) -> tuple[int, ...]:
    """Our `feature_layers` (outputs of base layers) from a config.json: `eagle_aux_hidden_state_layer_ids` names the
    layers whose inputs are read; without it, the reference's default (inputs of layers 2, L//2, L-3)."""
    ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [2, num_base_layers // 2, num_base_layers - 3]
    if len(ids) != NUM_FEATURES or any(int(i) < 1 for i in ids):
        raise ExportError(f"eagle_aux_hidden_state_layer_ids {ids}: EAGLE-3 reads the inputs of {NUM_FEATURES} base "
                          "layers, each above the embedding (>= 1)")
    return tuple(int(i) - 1 for i in ids)


def from_reference(folder, meta: dict, base, dtype=None) -> Eagle3Head:
    """An EAGLE-3 head from a folder: ours, or one published in the reference layout (`midlayer.*` or vLLM's
    `layers.0.*`; `embed_tokens.weight` and `t2d` are not read: the base's embedding is used)."""
    if int(meta.get("num_hidden_layers", 1)) != 1:
        raise ExportError(f"{folder}: the draft has {meta.get('num_hidden_layers')} layers; this EAGLE-3 layout has "
                          "one")
    if meta.get("norm_before_residual"):
        raise ExportError(f"{folder}: norm_before_residual heads (the residual taken after hidden_norm) are a "
                          "variant this EAGLE-3 head does not compute")
    target = meta.get("target_hidden_size")
    if target is not None and int(target) != int(meta.get("hidden_size", target)):
        raise ExportError(f"{folder}: the draft's hidden_size {meta.get('hidden_size')} differs from the target's "
                          f"{target}; this EAGLE-3 head takes the base's width")
    get, keys = read_weights_dir(folder)
    keys = set(keys)
    prefix = next((p for p in LAYER_PREFIXES if f"{p}self_attn.q_proj.weight" in keys), None)
    if prefix is None:
        raise ExportError(f"{folder}: no EAGLE-3 layer tensors (midlayer.* or layers.0.*)")

    def need(name):
        if name not in keys:
            raise ExportError(f"{folder}: missing tensor {name!r}")
        return np.asarray(get(name))

    head_w = need("lm_head.weight")  # [Q, D]
    q = int(head_w.shape[0])
    v = base.config.vocab_size
    if meta.get("draft_vocab_size") is not None and int(meta["draft_vocab_size"]) != q:
        raise ExportError(f"{folder}: config.json says draft_vocab_size={meta['draft_vocab_size']} but lm_head has "
                          f"{q} rows")
    if q < v and "d2t" not in keys:
        raise ExportError(f"{folder}: the head drafts {q} of {v} tokens and has no d2t to map them to target ids")
    if meta.get("rope_follows_base") or ("head_type" not in meta and meta.get("rope_theta") in
                                         (None, base.config.rope_theta)):
        rope = None
    else:
        rope = float(meta["rope_theta"]) if meta.get("rope_theta") is not None else None
    try:
        cfg = Eagle3Config(feature_layers=feature_layers_of(meta, base.config.num_hidden_layers),
                           draft_vocab_size=0 if q == v else q, num_heads=int(meta.get("ttt_steps", 7)),
                           rope_theta=rope, **({"dtype": dtype, "param_dtype": dtype} if dtype is not None else {}))
    except InputError as e:
        raise ExportError(f"{folder}: {e}") from None
    head = nnx.eval_shape(lambda: Eagle3Head(base.config, cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    pure = nnx.to_pure_dict(state)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    pure["fc_w"] = f32(need("fc.weight")).T
    pure["out_norm"] = f32(need("norm.weight"))
    pure["head_w"] = f32(head_w).T
    for ref, ours in _LAYER.items():
        like = tuple(pure[ours].shape[1:])
        pure[ours] = _from_torch(ours, f32(need(prefix + ref)), like)[None]
    return merge_checked(graphdef, state, pure, folder)


def folder_vocab(folder) -> np.ndarray | None:
    """The target ids `[Q]` of a folder's draft vocabulary read from its `d2t` (draft id i -> target i + d2t[i]), or
    None when the folder has none or it maps every id to itself (the whole vocabulary)."""
    try:
        get, keys = read_weights_dir(folder)
    except (OSError, ValueError):
        return None
    if "d2t" not in keys:
        return None
    d2t = np.asarray(get("d2t"), np.int64)
    v = int(np.asarray(get("t2d")).shape[0]) if "t2d" in keys else None
    if not np.any(d2t) and v in (None, d2t.shape[0]):
        return None  # every draft id is its own target id, over the whole vocabulary
    ids = np.arange(d2t.shape[0], dtype=np.int64) + d2t
    if np.any(np.diff(ids) <= 0):
        raise ExportError(f"{folder}: d2t maps draft ids to target ids out of order; expected increasing target ids")
    return ids.astype(np.int32)


def recognizes(meta: dict, folder) -> bool:
    """A folder as EAGLE-3 heads are published: config.json names `LlamaForCausalLMEagle3` or has
    `draft_vocab_size` / `eagle_config`, and the weights hold `fc.weight` and the layer under `midlayer.` or
    `layers.0.` with 2D-wide q/k/v inputs."""
    arch = " ".join(meta.get("architectures") or [])
    if "Eagle3" not in arch and "eagle_config" not in meta and "draft_vocab_size" not in meta:
        return False
    try:
        _, keys = read_weights_dir(folder)
    except (OSError, ValueError):
        return False
    return "fc.weight" in keys and any(f"{p}self_attn.q_proj.weight" in keys for p in LAYER_PREFIXES)
