"""Head folders of any registered type: export (safetensors under the reference project's names, config.json with
`head_type`, a model card) and import (ours, or a head as its reference project publishes it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from clover_jax.heads import registry
from clover_jax.io.export import DEFAULT_SHARD_BYTES, AtomicDir, ExportError, write_safetensors


def export_head(head, out_dir, *, base=None, base_name: str | None = None, include_embedding: bool = True,
                include_lm_head: bool | None = None, model_card: str | None = None, extra_config: dict | None = None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, dtype=np.float32,
                draft_vocab=None) -> Path:
    """Writes a hub-ready head folder of any registered head type: safetensors under the reference project's
    names, config.json (with `head_type`), README.md.

    `include_embedding` writes the frozen tensors the reference module holds as copies of the base's (Clover-2:
    `clover_embed_tokens.weight`; `include_lm_head`, default as `include_embedding`: the base `lm_head.weight`);
    `dtype` is the tensors' storage type (float32, float16 or bfloat16 via ml_dtypes). `draft_vocab`: the token ids
    the head was trained to draft (`draft_vocab.json`), written as the type's own vocabulary tensors where it has
    them (EAGLE-3's `d2t` / `t2d`, which keep their integer and boolean types)."""
    ht = registry.of_head(head)
    include_lm_head = include_embedding if include_lm_head is None else include_lm_head
    tensors = {k: v.astype(dtype) for k, v in ht.to_reference(head, base, include_embedding, include_lm_head).items()}
    if ht.vocab_tensors is not None:
        tensors.update(ht.vocab_tensors(head, draft_vocab))
    with AtomicDir(out_dir, overwrite) as tmp:
        write_safetensors(tensors, tmp, max_shard_bytes, getattr(ht, "weights_file", None) or "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(ht.config_dict(head, base_name, extra_config), indent=2))
        (tmp / "README.md").write_text(model_card or default_model_card(head, base_name))
    return Path(out_dir)


def default_model_card(head, base_name: str | None) -> str:
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


def import_head(path, base, *, dtype=None, meta: dict | None = None):
    """Loads an exported head folder (any registered `head_type`) for `base`, or a head as its reference project
    publishes it (no `head_type`: Medusa's `medusa_lm_head.pt`, EAGLE's `pytorch_model.bin`, recognized by the
    registry); a folder that is not a head or does not match the base is an error. `meta`: the folder's config.json
    where the caller has read it (`clover_jax.heads.folder.HeadFolder.config`)."""
    path = Path(path)
    if meta is None:
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


