"""Export to / import from Hugging Face folders: base models (transformers LlamaForCausalLM layout) and
Clover-2 heads (the reference implementation's parameter names and torch layouts, `Clover2Model` of `XiaoBin1992/clover`).

Folders are written to a temporary sibling and renamed into place, so a failure never leaves a
partial folder behind, and an existing folder is only replaced when `overwrite=True`.
"""

from __future__ import annotations

from typing import Any

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.io.hf import _layer_table, params_to_hf, read_weights_dir
from clover_jax.models.config import LlamaConfig
from clover_jax.validation import InputError

DEFAULT_SHARD_BYTES = 2 * 1024**3
HEAD_TYPE = "clover2"


class ExportError(InputError):
    """A folder or checkpoint that cannot be exported or imported; the message names it."""


# --------------------------------------------------------------------------- writing safetensors
def write_safetensors(tensors: dict[str, np.ndarray], out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      filename: str = "model.safetensors"):
    """`filename` (model.safetensors), or `model-0000i-of-0000n.safetensors` + index above `max_shard_bytes`."""
    from safetensors.numpy import save_file

    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, str(out_dir / filename), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: np.ascontiguousarray(tensors[n]) for n in shard}, str(out_dir / fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    total = int(sum(t.nbytes for t in tensors.values()))
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_permissions(folder: Path, umask: int | None = None) -> None:
    """Folders 0755 and files 0644 (less what the umask removes), as a plain `mkdir` / `open` would give:
    `tempfile.mkdtemp` makes the folder 0700 and a rename keeps that."""
    umask = _current_umask() if umask is None else umask
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~umask)


class _AtomicDir:
    """Context manager: yields a temp dir next to `out`, renamed to `out` on success, removed on error.
    The result has ordinary permissions (`publish_permissions`); a place that cannot be written is an
    ExportError naming `out`."""

    def __init__(self, out: str | os.PathLike, overwrite: bool):
        self.out = Path(out)
        self.overwrite = overwrite

    def __enter__(self) -> Path:
        if self.out.exists() and not self.overwrite:
            raise ExportError(f"out: {self.out} already exists (pass overwrite=True / --overwrite to replace it)")
        if self.out.exists() and not self.out.is_dir():
            raise ExportError(f"out: {self.out} is a file, not a folder")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp", dir=self.out.parent))
        except OSError as e:
            raise ExportError(f"out: cannot write the folder {self.out}: {e.strerror or e}") from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, ExportError):  # e.g. a full disk while writing
                raise ExportError(f"out: writing {self.out} failed: {exc.strerror or exc}; nothing was "
                                  "written") from None
            return False
        try:
            publish_permissions(self.tmp)
            if self.out.exists():
                old = self.out.with_name(f".{self.out.name}.old{os.getpid()}")
                self.out.rename(old)
                self.tmp.rename(self.out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                self.tmp.rename(self.out)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise ExportError(f"out: cannot write the folder {self.out}: {e.strerror or e}") from None
        return False


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), dtype=np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x)


# --------------------------------------------------------------------------- base model
def export_base(model, out_dir, *, tokenizer=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                overwrite: bool = False, dtype=np.float32) -> Path:
    """Writes a transformers `LlamaForCausalLM` folder: safetensors (+ index), config, generation config, tokenizer."""
    config: LlamaConfig = model.config
    params = jax.tree.map(_np, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tensors = {k: v.astype(dtype) for k, v in params_to_hf(config, params).items()}
    with _AtomicDir(out_dir, overwrite) as tmp:
        write_safetensors(tensors, tmp, max_shard_bytes)
        hf = config.to_hf_dict()
        hf["torch_dtype"] = np.dtype(dtype).name
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        eos = list(config.eos_token_ids)
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
               "pad_token_id": config.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(out_dir)


# --------------------------------------------------------------------------- Clover-2 heads
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


def head_to_reference(head, base=None, include_embedding: bool = True, include_lm_head: bool = False,
                      ) -> dict[str, np.ndarray]:
    """The head's tensors under the reference Clover-2 names and torch `[out, in]` layouts.

    `include_embedding` adds the frozen embedding copy `clover_embed_tokens.weight` `[V, H]` and
    `include_lm_head` the frozen base `lm_head.weight` `[V, H]`: the reference module registers both, so a
    folder with both loads into it with strict key matching. Both are read from `base`; neither is trained."""
    state = jax.tree.map(_np, nnx.to_pure_dict(nnx.state(head, nnx.Param)))
    out = {ref: (state[ours].T if tr else state[ours]) for ref, (ours, tr) in
           head_name_table(head.cfg.num_aug_layers, head.base_config).items()}
    for suffix, (ours, _, to_hf) in _layer_table(head.aug.config).items():
        for i in range(head.cfg.num_aug_layers):
            out[f"layers.{i}.{suffix}"] = np.ascontiguousarray(to_hf(state["aug"][ours][i]))
    if include_embedding:
        if base is None:
            raise ExportError("the embedding copy is read from the base model: pass base=...")
        if head.cfg.embed_source == "lm_head":
            emb = _np(base.lm_head_matrix()).T
        else:
            emb = _np(base.embed[...])
        out["clover_embed_tokens.weight"] = np.ascontiguousarray(emb)
    if include_lm_head:
        if base is None:
            raise ExportError("lm_head.weight is read from the base model: pass base=...")
        out["lm_head.weight"] = np.ascontiguousarray(_np(base.lm_head_matrix()).T)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# the keys head_config_dict writes (anything else in an exported config.json is extra information)
HEAD_CONFIG_KEYS = frozenset({"head_type", "architectures", "num_heads", "num_layers", "embed_source", "rope_theta",
                              "rope_scaling", "rope_follows_base", "hidden_size", "vocab_size", "base_model"})


def head_config_dict(head, base_name: str | None = None, extra: dict | None = None) -> dict:
    """config.json of an exported head. `rope_theta` / `rope_scaling` are what the Augmenting Block actually
    uses (the reference's plain RoPE with base 10000 unless the head follows the base's RoPE)."""
    c, b = head.cfg, head.base_config
    aug = head.aug.config
    return {
        "head_type": HEAD_TYPE,
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


def export_head(head, out_dir, *, base=None, base_name: str | None = None, include_embedding: bool = True,
                include_lm_head: bool | None = None, model_card: str | None = None, extra_config: dict | None = None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, dtype=np.float32) -> Path:
    """Writes a hub-ready head folder of any registered head type: safetensors under the reference project's
    names, config.json (with `head_type`), README.md.

    `include_embedding` writes the frozen tensors the reference module holds as copies of the base's (Clover-2:
    `clover_embed_tokens.weight`; `include_lm_head`, default as `include_embedding`: the base `lm_head.weight`);
    `dtype` is the tensors' storage type (float32, float16 or bfloat16 via ml_dtypes)."""
    from clover_jax.heads import registry

    ht = registry.of_head(head)
    include_lm_head = include_embedding if include_lm_head is None else include_lm_head
    tensors = {k: v.astype(dtype) for k, v in ht.to_reference(head, base, include_embedding, include_lm_head).items()}
    with _AtomicDir(out_dir, overwrite) as tmp:
        write_safetensors(tensors, tmp, max_shard_bytes, getattr(ht, "weights_file", None) or "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(ht.config_dict(head, base_name, extra_config), indent=2))
        (tmp / "README.md").write_text(model_card or default_model_card(head, base_name))
    return Path(out_dir)


def default_model_card(head, base_name: str | None) -> str:
    from clover_jax.heads import registry

    ht = registry.of_head(head)
    fields = ", ".join(f"{k}={getattr(head.cfg, k)}" for k in ht.fields)
    return f"""---
library_name: clover_jax
tags: [speculative-decoding, {ht.name}, draft-head, jax]
---
# {ht.name} draft head for `{base_name or 'its base model'}`

{ht.description} ({fields}), for speculative decoding with clover_jax. Tensors use the reference project's
parameter names (torch `[out, in]` layouts).

```python
import clover_jax
lm = clover_jax.load_model("{base_name or 'BASE_MODEL'}")
out = clover_jax.generate(lm, ["Hello!"], mode="speculative", head="THIS_FOLDER")
```
"""


def import_head(path, base, *, dtype=None):
    """Loads an exported head folder (any registered `head_type`) for `base`, or a head as its reference project
    publishes it (no `head_type`: Medusa's `medusa_lm_head.pt`, EAGLE's `pytorch_model.bin`, recognized by the
    registry); a folder that is not a head or does not match the base is an error."""
    from clover_jax.heads import registry

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{path}: no config.json: not a draft-head folder")
    meta = json.loads(cfg_file.read_text())
    kind = meta.get("head_type")
    if kind is None:  # a head as its reference project publishes it (e.g. Medusa's, EAGLE's)
        found = registry.recognize(meta, path)
        kind = found.name if found is not None else None
        if kind is None:
            raise ExportError(f"{path}: config.json has no head_type and the folder is not a published head of a "
                              f"known type ({', '.join(registry.names())}); is this a base-model folder?")
    if kind not in registry.names():
        raise ExportError(f"{path}: config.json has head_type={kind!r}, expected one of {registry.names()} "
                          "(is this a base-model folder?)")
    bc = base.config
    for key in ("hidden_size", "vocab_size"):
        if key in meta and meta[key] != getattr(bc, key):  # published heads may not say; their shapes are checked
            raise ExportError(f"{path}: head {key}={meta.get(key)} does not match the base model's {getattr(bc, key)}")
    ht = registry.get(kind)
    head = ht.from_reference(path, meta, base, dtype)
    ht.check_compatible(head, bc)
    return head


def clover2_from_reference(path, meta, base, dtype=None):
    """A Clover-2 head from an exported folder (reference `Clover2Model` names); `meta` is its config.json."""
    from clover_jax.heads.clover2 import Clover2Config, Clover2Head

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


def merge_checked(graphdef, state, pure: dict, where) -> Any:
    """The module `graphdef` with `state`'s leaves replaced by the arrays of `pure` (same tree), each checked
    against the abstract leaf's shape (an `ExportError` naming `where` otherwise) and cast to its dtype."""
    def place(abs_leaf, arr):
        arr = np.asarray(arr)
        if arr.shape != abs_leaf.shape:
            raise ExportError(f"{where}: tensor shape {arr.shape} != expected {abs_leaf.shape}")
        return jnp.asarray(arr, abs_leaf.dtype)

    nnx.replace_by_pure_dict(state, jax.tree.map(place, nnx.to_pure_dict(state), pure))
    return nnx.merge(graphdef, state)
