"""`load_head(path, base)`: a draft head from an exported folder or a training run directory."""

from __future__ import annotations

import json
from pathlib import Path


def load_head(path, base, step: int | None = None):
    """Loads a Clover-2 head for `base` from an exported head folder (config.json with `head_type`) or from a
    training run directory (Orbax checkpoints; the latest step unless `step` is given)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"draft head not found: {path}")
    cfg = path / "config.json"
    if cfg.is_file() and "head_type" in json.loads(cfg.read_text()):
        from clover_jax.io.export import import_head

        return import_head(path, base)
    from clover_jax.training.checkpoint import load_head_from_run

    return load_head_from_run(path, base, step=step)
