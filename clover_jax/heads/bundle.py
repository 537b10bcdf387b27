"""A draft head for inference, loaded once with everything beside it: `HeadBundle`.

    bundle = open_head("smollm2-135m-instruct-clover2", base)   # or a head folder, a hub id, a head module
    bundle.module, bundle.default_tree, bundle.draft_vocab, bundle.ngram_table, bundle.tree("fit-5-411aab")

A head given by registered name, exported folder, published reference folder or hub id is read here (its folder
resolved once, `clover_jax.heads.folder`; its weights by the head type's importer, `clover_jax.heads.export`). A
training run directory holds Orbax checkpoints, which the training layer reads: the caller passes that reader as
`run_loader` (`clover_jax.load_head` and `clover_jax.generate` do). Loaded heads are kept per base model while their
folder's files are unchanged, so `generate(head="name")` in a loop loads the head once.
"""

from __future__ import annotations

import collections
import os
import weakref
from typing import Any, Callable, Mapping

import numpy as np
from flax import nnx

from clover_jax import pretrained
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.ngram import NgramTable
from clover_jax.decoding.tree import TreePolicy, get_tree
from clover_jax.decoding.trees.names import names_fitted_tree
from clover_jax.heads import registry
from clover_jax.heads.export import import_head
from clover_jax.heads.folder import HeadFolder, open_folder
from clover_jax.validation import InputError, check_int

RunLoader = Callable[..., Any]  # run_loader(run_dir, base, step=None) -> head module (`training.checkpoint`)


class HeadBundle:
    """A head module and its folder (None for a head given as a module). Everything a request drafts with that the
    request did not name comes from here: the default tree, the draft vocabulary, the n-gram table, fitted trees."""

    def __init__(self, module, folder: HeadFolder | None = None):
        self.module = module
        self.folder = folder

    def __repr__(self) -> str:
        return f"HeadBundle({self.name})"

    @property
    def name(self) -> str | None:
        """The head's registered name or source as given; None for a module or no head."""
        return self.folder.name if self.folder is not None else None

    @property
    def source(self) -> str | os.PathLike | None:
        return self.folder.source if self.folder is not None else None

    @property
    def headless(self) -> bool:
        """A head-less draft (prompt lookup and n-gram chains: `NoHead`)."""
        return isinstance(self.module, NoHead)

    @property
    def default_tree(self) -> str | None:
        """The registered head's default tree, else its type's; None for no head."""
        if self.folder is not None and self.folder.default_tree:
            return self.folder.default_tree
        return None if self.headless else registry.of_head(self.module).default_tree

    @property
    def draft_vocab(self) -> np.ndarray | None:
        return self.folder.draft_vocab if self.folder is not None else None

    @property
    def ngram_table(self) -> NgramTable | None:
        return self.folder.ngram_table if self.folder is not None else None

    @property
    def trees(self) -> Mapping[str, TreePolicy]:
        return self.folder.trees if self.folder is not None else {}

    def tree(self, tree: str | os.PathLike | TreePolicy) -> TreePolicy:
        """The tree policy a name gives for this head (`clover_jax.decoding.tree.get_tree`), its fitted trees
        read for the names the grammar calls fitted (`names_fitted_tree`)."""
        return get_tree(tree, self.trees if names_fitted_tree(tree) else None)


_CACHE: "collections.OrderedDict[tuple, tuple[weakref.ref, Any]]" = collections.OrderedDict()
_CACHE_SIZE = 4


def _is_model(base) -> bool:
    return hasattr(base, "config") and hasattr(base, "forward_hidden")


def open_head(head, base, *, step: int | None = None, run_loader: RunLoader | None = None) -> HeadBundle:
    """The `HeadBundle` of a head given as a module (kept as it is), a registered name, an exported or published
    head folder, a hub id, a training run directory (with `run_loader`; the latest step unless `step`), or a
    `HeadFolder` already opened (`clover_jax.heads.folder.open_folder`: its files are not read again)."""
    if isinstance(head, nnx.Module) or isinstance(head, NoHead):
        return HeadBundle(head)
    if isinstance(head, HeadBundle):
        return head
    if isinstance(head, HeadFolder):
        return _open_folder(head, base, step, run_loader)
    if not isinstance(head, (str, os.PathLike)) or not str(head).strip():
        raise InputError(f"head: expected a registered head name, a head folder, a run directory or a head module, "
                         f"got {type(head).__name__} {head!r}"[:300])
    return _open_folder(open_folder(head), base, step, run_loader)


def _open_folder(folder: HeadFolder, base, step: int | None, run_loader: RunLoader | None) -> HeadBundle:
    if not _is_model(base):
        raise InputError(f"base: expected the base Llama (LoadedModel.model), got {type(base).__name__}")
    check_int("step", step, minimum=0, allow_none=True)
    if not folder.path.exists():
        raise FileNotFoundError(f"head: draft head not found: {folder.path} is neither a folder nor a registered "
                                f"head ({', '.join(pretrained.HEADS)})")
    key = (str(folder.path.resolve()), folder.stamp, id(base), step)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is base:
        _CACHE.move_to_end(key)
        return HeadBundle(hit[1], folder)
    module = _load_module(folder, base, step, run_loader)
    _CACHE[key] = (weakref.ref(base), module)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return HeadBundle(module, folder)


def is_run_dir(folder: HeadFolder) -> bool:
    """A training run directory (Orbax checkpoints), as opposed to an exported or published head folder."""
    meta = folder.config
    return not (meta is not None and ("head_type" in meta or not (folder.path / "checkpoints").is_dir()))


def _load_module(folder: HeadFolder, base, step: int | None, run_loader: RunLoader | None):
    if not is_run_dir(folder):
        return import_head(folder.path, base, meta=folder.config)
    path = folder.path
    if path.is_dir() and not (path / "checkpoints").is_dir() and not any(p.name.isdigit() for p in path.iterdir()):
        held = sorted(p.name for p in path.iterdir())
        raise InputError(f"head: {path} has no config.json (an exported head folder holds one) and no checkpoints "
                         f"(a training run directory holds checkpoints/ or numbered step folders); it holds: "
                         f"{', '.join(held[:12]) or 'nothing'}" + (", ..." if len(held) > 12 else ""))
    if run_loader is None:
        raise InputError(f"head: {folder.path} is a training run directory; load it with clover_jax.load_head(path, "
                         "base) and pass the module, or use clover_jax.generate, which reads run directories")
    return run_loader(folder.path, base, step=step)


__all__ = ["HeadBundle", "RunLoader", "is_run_dir", "open_head"]
