"""A head's folder, read once: where a head given by name or path lives and what lies beside its weights.

    folder = open_folder("smollm2-135m-instruct-clover2")   # a registered name, a folder, a run directory, a hub id
    folder.default_tree, folder.draft_vocab, folder.ngram_table, folder.trees, folder.digest

`open_folder` turns the source into a folder once (`clover_jax.pretrained.head_path`); each file beside the weights
is read on first use and kept: the registered default tree, the draft vocabulary the head was trained on
(`draft_vocab.json`), the n-gram table of `...-table` trees (`ngram_table.npz`, or the registered head's that it
shares), the digest of the weight files, and the trees its calibrations fitted (`fit-N-<hash>`, from
`calibration.json` beside the head and from the user's cache). The calibration store's writers live in
`clover_jax.generation.calibration`; the files and keys they share are defined here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from clover_jax import pretrained
from clover_jax.decoding.ngram import NGRAM_FILE, NgramTable, load_ngram_table
from clover_jax.decoding.tree import TreeSpec
from clover_jax.heads.draft_vocab import folder_draft_vocab
from clover_jax.validation import InputError

CALIBRATION_FILE = "calibration.json"  # beside a head: its calibrations (and the trees they fitted)
KEPT_TREES = "kept_trees"  # calibration.json: tree shapes of replaced entries, still resolvable by name
_WEIGHT_SUFFIXES = (".safetensors", ".msgpack", ".bin", ".pt")
_DIGESTS: dict[tuple, str] = {}


def cache_dir() -> Path:
    """The user's calibration cache: `~/.cache/clover_jax/calibration` (`CLOVER_JAX_CACHE` overrides the root)."""
    root = os.environ.get("CLOVER_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "clover_jax")
    return Path(root) / "calibration"


def read_json(path: Path) -> dict:
    """A JSON object file's contents, or {} where it is missing or unreadable."""
    try:
        out = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def weights_digest(folder: Path) -> str:
    """A digest of the contents of a head folder's weight files (not their dates, so a fresh clone of a repository
    agrees with the copy that was calibrated). A calibration saved with one digest is not reused for other weights
    (a head replaced in place, a run directory trained further)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or
                                                                      "checkpoints" in p.relative_to(folder).parts))
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if stamp not in _DIGESTS:
        h = hashlib.sha1()
        for p in files:
            h.update(str(p.relative_to(folder)).encode())
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        _DIGESTS[stamp] = h.hexdigest()[:16]
    return _DIGESTS[stamp]


def fitted_trees(data: dict) -> dict[str, TreeSpec]:
    """The trees a calibration file names (`kept_trees` and every entry's `trees`): name -> `TreeSpec`."""
    out: dict[str, TreeSpec] = {}
    groups = [data.get(KEPT_TREES) or {}] + [e.get("trees") or {} for e in (data.get("entries") or {}).values()]
    for group in groups:
        for name, t in group.items():
            out[name] = TreeSpec(tuple(tuple(c) for c in t["choices"]), top_k=int(t["top_k"]), name=name)
    return out


class HeadFolder:
    """A head's folder (see the module docstring); every property reads its files at most once."""

    def __init__(self, source: str | os.PathLike, path: Path):
        self.source = source  # as the request gave it
        self.path = path
        self.registered = pretrained.get(source) if isinstance(source, str) else None

    def __repr__(self) -> str:
        return f"HeadFolder({str(self.source)!r})"

    @property
    def name(self) -> str:
        """How messages and saved choices name the head: its registered name, else its source as given."""
        return self.registered.name if self.registered is not None else str(self.source)

    @property
    def default_tree(self) -> str | None:
        """The registered head's default tree (None for a folder: its type's default applies)."""
        return self.registered.default_tree if self.registered is not None else None

    @property
    def is_dir(self) -> bool:
        return self.path.is_dir()

    @functools.cached_property
    def stamp(self) -> tuple[int, int]:
        """(newest modification time, number of files): changes when the folder's files do."""
        files = [self.path] if self.path.is_file() else [p for p in self.path.rglob("*") if p.is_file()]
        return max((p.stat().st_mtime_ns for p in files), default=0), len(files)

    @functools.cached_property
    def config(self) -> dict[str, Any] | None:
        """Its config.json (None where it has none), read once; a file that is not a JSON object is an error."""
        path = self.path / "config.json"
        if not path.is_file():
            return None
        out = read_json(path)
        if not out and path.stat().st_size:
            raise InputError(f"head: {path} is not a JSON object")
        return out

    @functools.cached_property
    def draft_vocab(self) -> np.ndarray | None:
        """`[V']` the token ids the head was trained to draft from, or None (all)."""
        return folder_draft_vocab(self.path, meta=self.config) if self.is_dir else None

    @functools.cached_property
    def ngram_table(self) -> NgramTable | None:
        """The n-gram table of its `...-table` trees (its own, or the registered head's it shares), or None."""
        shared = self.registered.ngram_table_from if self.registered is not None else None
        folder = pretrained.head_path(shared) if shared else self.path
        path = folder / NGRAM_FILE if folder.is_dir() else None
        return load_ngram_table(path) if path is not None and path.is_file() else None

    @functools.cached_property
    def digest(self) -> str | None:
        return weights_digest(self.path) if self.is_dir else None

    @property
    def calibration_files(self) -> list[Path]:
        """Where calibrations of this head are read from, in order: the head's folder, then the user cache (by
        the digest of its weights)."""
        if not self.is_dir:
            return []
        return [self.path / CALIBRATION_FILE, cache_dir() / f"{self.digest}.json"]

    @functools.cached_property
    def trees(self) -> dict[str, TreeSpec]:
        """The trees this head's calibrations fitted, by name (`fit-N-<hash>`, `probe-...`)."""
        out: dict[str, TreeSpec] = {}
        for path in self.calibration_files:
            out.update(fitted_trees(read_json(path)))
        return out

    @functools.cached_property
    def reference(self) -> dict[str, Any]:
        """The `reference` of its `calibration.json` (per tree: tau and per-prompt tokens and steps), or {}."""
        if not self.is_dir:
            return {}
        ref = read_json(self.path / CALIBRATION_FILE).get("reference")
        return ref if isinstance(ref, dict) else {}


def open_folder(source: str | os.PathLike) -> HeadFolder:
    """The folder of a head given by registered name, path or hub id (`clover_jax.pretrained.head_path`)."""
    return HeadFolder(source, pretrained.head_path(source))


__all__ = ["CALIBRATION_FILE", "HeadFolder", "KEPT_TREES", "cache_dir", "fitted_trees", "open_folder", "read_json",
           "weights_digest"]
