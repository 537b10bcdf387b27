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
    ngram_table_from: str | None = None  # a registered head whose folder holds the n-gram table this one drafts
    # `...-table` trees with (one table per base model: it holds the base's continuations, not a head's)

    @property
    def path(self) -> Path:
        return PRETRAINED_DIR / self.name


HEADS: dict[str, PretrainedHead] = {
    h.name: h for h in (
        # the default tree: the head's fitted 5-node tree (its calibration.json holds the shape) beside a 4-token
        # chain of prompt lookup, or of the n-gram table shipped with the head where lookup finds nothing
        PretrainedHead("smollm2-135m-instruct-clover2", base_model="smollm2-135m-instruct",
                       default_tree="fit-5-411aab+lookup-4-table"),
        # an EAGLE-1 head (one decoder layer) for the same model: higher acceptance, dearer drafts; its default tree
        # is its own fitted 5-node tree (a 3-deep chain of top-1 drafts and the root's second child) beside the chain
        PretrainedHead("smollm2-135m-instruct-eagle", base_model="smollm2-135m-instruct",
                       default_tree="fit-5-36f662+lookup-4-table", ngram_table_from="smollm2-135m-instruct-clover2"),
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


def heads_for(model_name: str | os.PathLike | None) -> list[str]:
    """The registered heads of a registered base model name (e.g. 'smollm2-135m-instruct'), in registry order."""
    key = str(model_name).lower() if model_name is not None else None
    return [h.name for h in HEADS.values() if h.base_model == key]


def default_head(model_name: str | os.PathLike | None) -> str | None:
    """The first registered head for a registered base model name, or None. (With no head named, speculative
    decoding drafts with its default tree, or plain decoding, by a measurement on this machine; `calibrate --quick`
    chooses among `heads_for(model)`: `clover_jax.tuning.choose`.)"""
    heads = heads_for(model_name)
    return heads[0] if heads else None


def ngram_table_folder(name_or_path: str | os.PathLike) -> Path:
    """The folder whose `ngram_table.npz` a head drafts `...-table` trees with: its own, or for a registered head
    that shares another's table (`PretrainedHead.ngram_table_from`), that head's folder."""
    entry = get(str(name_or_path)) if isinstance(name_or_path, str) else None
    if entry is not None and entry.ngram_table_from:
        return head_path(entry.ngram_table_from)
    return head_path(name_or_path)


def default_tree(name_or_path) -> str | None:
    """The registered head's default tree, or None for anything that is not a registered name."""
    entry = get(str(name_or_path)) if isinstance(name_or_path, str) else None
    return entry.default_tree if entry is not None else None


__all__ = ["HEADS", "PRETRAINED_DIR", "PretrainedHead", "default_head", "default_tree", "get", "head_path", "heads_for",
           "ngram_table_folder"]
