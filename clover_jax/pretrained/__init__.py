"""Draft heads shipped with clover_jax, by registered name.

    clover_jax.generate(lm, prompts, mode="speculative", head="smollm2-135m-instruct-clover2")
    python infer.py --mode speculative --head smollm2-135m-instruct-clover2
    python train.py --config ... --set train.init_head_from=smollm2-135m-instruct-clover2

Every entry point that takes a head (a training run directory or an exported head folder) also takes a
registered name: `head_path(name)` turns it into the folder inside this package. Each folder is an
exported head (`clover_jax.io.export`: reference Clover-2 parameter names, safetensors, `config.json`), its
draft vocabulary (`draft_vocab.json`) and a model card (`README.md`) with its recipe and measurements.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from clover_jax.io import hub

PRETRAINED_DIR = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class PretrainedHead:
    name: str  # the registered name
    base_model: str  # the base model it drafts for (a name `clover_jax.load_model` knows)
    default_tree: str  # the tree to draft with when none is given (the best one measured on a CPU)

    @property
    def path(self) -> Path:
        return PRETRAINED_DIR / self.name


HEADS: dict[str, PretrainedHead] = {
    h.name: h for h in (
        # the default tree: the head's fitted 5-node tree (its calibration.json holds the shape) beside a 4-token
        # chain of prompt lookup, or of the n-gram table shipped with the head where lookup finds nothing
        PretrainedHead("smollm2-135m-instruct-clover2", base_model="smollm2-135m-instruct",
                       default_tree="fit-5-411aab+lookup-4-table"),
    )
}


def get(name: str) -> PretrainedHead | None:
    """The registered head of that name (case-insensitive), or None."""
    return HEADS.get(str(name).lower())


def head_path(name_or_path: str | os.PathLike) -> Path:
    """The folder of a registered head; else `name_or_path` as a path when it exists; else, for a Hugging Face hub
    repository id (`owner/name[@revision]`, `hf://...`), the downloaded (or cached) repository; else the path.

    A registered name whose folder is missing (a package built without its data files) is a
    FileNotFoundError naming the folder."""
    entry = get(str(name_or_path)) if isinstance(name_or_path, str) else None
    if entry is None:
        snapshot = hub.resolve(name_or_path, "head")  # `owner/name[@revision]` that is not a local path
        return snapshot if snapshot is not None else Path(name_or_path).expanduser()
    if not (entry.path / "config.json").is_file():
        raise FileNotFoundError(f"the shipped head {entry.name!r} should be in {entry.path}, which holds no "
                                "config.json: reinstall clover_jax with its package data")
    return entry.path


def default_head(model_name: str | os.PathLike | None) -> str | None:
    """The registered head for a registered base model name (e.g. 'smollm2-135m-instruct'), or None."""
    if model_name is None:
        return None
    key = str(model_name).lower()
    return next((h.name for h in HEADS.values() if h.base_model == key), None)


def default_tree(name_or_path) -> str | None:
    """The registered head's default tree, or None for anything that is not a registered name."""
    entry = get(str(name_or_path)) if isinstance(name_or_path, str) else None
    return entry.default_tree if entry is not None else None


__all__ = ["HEADS", "PRETRAINED_DIR", "PretrainedHead", "default_head", "default_tree", "get", "head_path"]
