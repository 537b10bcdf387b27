"""`load_head(source, base)`: a draft head from a registered name, an exported folder or a training run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

from clover_jax import pretrained
from clover_jax.heads.export import import_head
from clover_jax.training.checkpoint import load_head_from_run
from clover_jax.validation import InputError, check_int


def load_head(path, base, step: int | None = None):
    """Loads a draft head (any registered type) for `base` from a registered name (`clover_jax.pretrained`, e.g.
    'smollm2-135m-instruct-clover2'), an exported head folder (config.json with `head_type`), a head as its
    reference project publishes it (Medusa's `medusa_lm_head.pt`, EAGLE-1's `pytorch_model.bin`), a Hugging Face
    hub repository of any of these (`owner/name[@revision]`), or a training run directory (Orbax checkpoints; the
    latest step unless `step` is given)."""

    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise InputError(f"head: expected a registered head name, a head folder or a run directory, got {path!r}")
    if not (hasattr(base, "config") and hasattr(base, "forward_hidden")):
        raise InputError(f"base: expected the base Llama (LoadedModel.model), got {type(base).__name__}")
    check_int("step", step, minimum=0, allow_none=True)
    path = pretrained.head_path(path)
    if not path.exists():
        known = ", ".join(pretrained.HEADS)
        raise FileNotFoundError(f"head: draft head not found: {path} is neither a folder nor a registered head "
                                f"({known})")
    cfg = path / "config.json"
    if cfg.is_file() and ("head_type" in _read_json(cfg) or not (path / "checkpoints").is_dir()):
        return import_head(path, base)
    return load_head_from_run(path, base, step=step)


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"head: {path} is not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise InputError(f"head: {path} holds {type(out).__name__}, not a JSON object")
    return out
