"""Static token trees: `TreeSpec` (a validated list of paths, "choices") and its JSON file form.

A tree spec is a list of paths, each a list of child ranks: `[0, 2]` is the third-ranked child of
the top-ranked child of the root. Paths are sorted by `(len, lexicographic)` as in Medusa and
EAGLE; node 0 is the root (the token the target has already emitted, not in `choices`) and node
`j + 1` is sorted choice `j`, so parents always come before children and siblings follow rank order.
The index arrays drafting and verification read are built from a spec by `buffers.build_buffers`.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from clover_jax.decoding.trees.base import DEFAULT_TOP_K, MAX_DEPTH, TreePolicy, TreeSpecError


def _as_path(raw: Any, i: int) -> tuple[int, ...]:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise TreeSpecError(f"choice {i} ({raw!r}) is not a list of child ranks")
    path = []
    for x in raw:
        if isinstance(x, bool):
            raise TreeSpecError(f"path {list(raw)} (choice {i}): rank {x!r} is not an integer")
        try:
            path.append(operator.index(x))
        except TypeError:
            raise TreeSpecError(f"path {list(raw)} (choice {i}): rank {x!r} is not an integer") from None
    return tuple(path)


@dataclasses.dataclass(frozen=True)
class TreeSpec(TreePolicy):
    """A validated static tree. `choices` is stored sorted by (len, lexicographic).

    Raises `TreeSpecError` for: no paths, an empty path, a negative rank, a rank >= `top_k`, a
    duplicate path, a path whose parent path is not in the tree, or a depth over `MAX_DEPTH`.
    """

    kind: ClassVar[str] = "static tree (clover2-26, small-10, medusa-63, chain-N, a fitted tree or a JSON file)"

    choices: tuple[tuple[int, ...], ...]
    top_k: int = DEFAULT_TOP_K
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 1:
            raise TreeSpecError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if isinstance(self.choices, (str, bytes)) or not isinstance(self.choices, Sequence):
            raise TreeSpecError(f"choices must be a list of paths, got {type(self.choices).__name__}")
        if len(self.choices) == 0:
            raise TreeSpecError("choices is empty: a tree needs at least one draft node")
        seen: set[tuple[int, ...]] = set()
        for i, raw in enumerate(self.choices):
            path = _as_path(raw, i)
            if not path:
                raise TreeSpecError(f"choice {i} is an empty path (the root is implicit; do not list it)")
            for r in path:
                if r < 0:
                    raise TreeSpecError(f"path {list(path)} (choice {i}): negative rank {r}")
                if r >= self.top_k:
                    raise TreeSpecError(f"path {list(path)} (choice {i}): rank {r} >= top_k {self.top_k}")
            if len(path) > MAX_DEPTH:
                raise TreeSpecError(f"path {list(path)} (choice {i}): depth {len(path)} > MAX_DEPTH {MAX_DEPTH}")
            if path in seen:
                raise TreeSpecError(f"path {list(path)} (choice {i}) is listed twice")
            seen.add(path)
        for path in seen:
            if len(path) > 1 and path[:-1] not in seen:
                raise TreeSpecError(f"path {list(path)} has no parent: its prefix {list(path[:-1])} is not in the tree")
        object.__setattr__(self, "choices", tuple(sorted(seen, key=lambda c: (len(c), c))))
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def num_nodes(self) -> int:
        """U: draft nodes plus the root."""
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        return len(self.choices[-1])

    @property
    def depth_counts(self) -> list[int]:
        """Number of nodes at depth 1..max_depth."""
        counts = [0] * self.max_depth
        for c in self.choices:
            counts[len(c) - 1] += 1
        return counts

    @property
    def num_paths(self) -> int:
        """P: number of leaves."""
        parents = {c[:-1] for c in self.choices}
        return sum(1 for c in self.choices if c not in parents)

    @property
    def ranks_contiguous(self) -> bool:
        """Whether every node's children have ranks 0..m-1 (needed by sampled-draft rule (a))."""
        ranks: dict[tuple[int, ...], list[int]] = {}
        for c in self.choices:
            ranks.setdefault(c[:-1], []).append(c[-1])
        return all(r == list(range(len(r))) for r in ranks.values())

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"choices": [list(c) for c in self.choices], "top_k": self.top_k}, f)

    @classmethod
    def parse(cls, name: str, resolve: Callable[[str], TreePolicy]) -> TreeSpec | None:
        """A JSON file's tree: `name` ends in `.json` (it must exist) or is an existing file; None otherwise."""
        if name.endswith(".json") or os.path.isfile(name):
            if not os.path.isfile(name):
                raise TreeSpecError(f"tree file {name!r} does not exist")
            return from_json(name)
        return None


def from_json(path: str | os.PathLike) -> TreeSpec:
    """A spec from `{"choices": [...], "top_k": k}` or a bare list of paths (top_k 10)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TreeSpecError(f"tree file {os.fspath(path)}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise TreeSpecError(f"tree file {os.fspath(path)}: not a text file ({e})") from None
    name = os.path.basename(os.fspath(path))
    if isinstance(data, list):
        return TreeSpec(data, top_k=DEFAULT_TOP_K, name=name)
    if not isinstance(data, dict) or "choices" not in data:
        raise TreeSpecError(f"{path}: expected a list of paths or an object with 'choices' (and 'top_k')")
    unknown = set(data) - {"choices", "top_k", "name"}
    if unknown:
        raise TreeSpecError(f"{path}: unknown keys {sorted(unknown)}; allowed: choices, top_k, name")
    return TreeSpec(data["choices"], top_k=data.get("top_k", DEFAULT_TOP_K), name=data.get("name", name))
