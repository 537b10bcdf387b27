"""`load_head(source, base)`: a draft head from a registered name, an exported folder or a training run directory."""

from __future__ import annotations

import json
from pathlib import Path


def load_head(path, base, step: int | None = None):
    """Loads a Clover-2 head for `base` from a registered name (`clover_jax.pretrained`, e.g.
    'smollm2-135m-instruct-clover2'), an exported head folder (config.json with `head_type`) or a training run
    directory (Orbax checkpoints; the latest step unless `step` is given)."""
    from clover_jax import pretrained

    path = pretrained.head_path(path)
    if not path.exists():
        known = ", ".join(pretrained.HEADS)
        raise FileNotFoundError(f"draft head not found: {path} is neither a folder nor a registered head ({known})")
    cfg = path / "config.json"
    if cfg.is_file() and "head_type" in json.loads(cfg.read_text()):
        from clover_jax.io.export import import_head

        return import_head(path, base)
    from clover_jax.training.checkpoint import load_head_from_run

    return load_head_from_run(path, base, step=step)
