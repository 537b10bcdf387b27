"""`load_head(source, base)`: a draft head from a registered name, an exported folder, a hub id or a training run
directory (the training layer's part: Orbax checkpoints, `clover_jax.training.checkpoint.load_head_from_run`)."""

from __future__ import annotations

from clover_jax.heads.bundle import open_head
from clover_jax.training.checkpoint import load_head_from_run


def load_head(path, base, step: int | None = None):
    """Loads a draft head (any registered type) for `base` from a registered name (`clover_jax.pretrained`, e.g.
    'smollm2-135m-instruct-clover2'), an exported head folder (config.json with `head_type`), a head as its
    reference project publishes it (Medusa's `medusa_lm_head.pt`, EAGLE-1's `pytorch_model.bin`), a Hugging Face
    hub repository of any of these (`owner/name[@revision]`), or a training run directory (Orbax checkpoints; the
    latest step unless `step` is given)."""
    return open_head(path, base, step=step, run_loader=load_head_from_run).module
