"""A draft head from a registered name, an exported folder, a hub id or a training run directory (the training
layer's part: Orbax checkpoints, `clover_jax.training.checkpoint.load_head_from_run`): `open_head_or_run(source,
base)` gives its `HeadBundle` (the module and its folder), `load_head(source, base)` the module."""

from __future__ import annotations

from clover_jax.heads.bundle import HeadBundle, open_head
from clover_jax.training.checkpoint import load_head_from_run


def open_head_or_run(head, base, *, step: int | None = None) -> HeadBundle:
    """`clover_jax.heads.bundle.open_head` that also reads training run directories (Orbax checkpoints; the latest
    step unless `step`): what the generation and tuning layers open a head given by name or path with."""
    return open_head(head, base, step=step, run_loader=load_head_from_run)


def load_head(path, base, step: int | None = None):
    """Loads a draft head (any registered type) for `base` from a registered name (`clover_jax.pretrained`, e.g.
    'smollm2-135m-instruct-clover2'), an exported head folder (config.json with `head_type`), a head as its
    reference project publishes it (Medusa's `medusa_lm_head.pt`, EAGLE-1's `pytorch_model.bin`), a Hugging Face
    hub repository of any of these (`owner/name[@revision]`), or a training run directory (Orbax checkpoints; the
    latest step unless `step` is given)."""
    return open_head_or_run(path, base, step=step).module


__all__ = ["load_head", "open_head_or_run"]
