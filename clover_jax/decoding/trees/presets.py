"""Preset static trees (`clover2-26`, `medusa-63`, `small-10`, `chain-N`) and the parsers of their names."""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from clover_jax.decoding.trees.base import TreePolicy, TreeSpecError
from clover_jax.decoding.trees.spec import TreeSpec

# EAGLE-1 `eagle/model/choices.py::mc_sim_7b_63`, also Clover's `clover/model/choices.py`: 25 drafts.
CLOVER2_26 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
              [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
              [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]

# FasterDecoding/Medusa `medusa/model/medusa_choices.py::mc_sim_7b_63`: 63 drafts (64 nodes with the
# root), depth counts [10, 28, 23, 2], 42 leaves. The "63" counts draft nodes, not the root.
MEDUSA_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
             [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
             [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
             [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
             [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
             [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
             [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]


def clover2_26() -> TreeSpec:
    """Clover-2 / EAGLE-1 `mc_sim_7b_63`: 25 drafts + root, depths [4, 8, 8, 3, 2], 15 paths, top_k 10."""
    return TreeSpec(CLOVER2_26, top_k=10, name="clover2-26")


def medusa_63() -> TreeSpec:
    """Medusa `mc_sim_7b_63`: 63 drafts + root, depths [10, 28, 23, 2], 42 paths, top_k 10."""
    return TreeSpec(MEDUSA_63, top_k=10, name="medusa-63")


# A 10-token tree for machines where verifying many tokens costs more than one decode step (CPUs):
# three candidates at depth 1, two at depth 2, then the top-1 chain of the best path to depth 5.
SMALL_10 = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]


def small_10() -> TreeSpec:
    """9 drafts + root, depths [3, 3, 1, 1, 1], 4 paths, top_k 10 (see SMALL_10)."""
    return TreeSpec(SMALL_10, top_k=10, name="small-10")


def chain(k: int) -> TreeSpec:
    """A single path of `k` drafts (top-1 at every step): plain speculative decoding."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise TreeSpecError(f"chain length must be an integer >= 1, got {k!r}")
    return TreeSpec([[0] * d for d in range(1, k + 1)], top_k=1, name=f"chain-{k}")


PRESETS = {"clover2-26": clover2_26, "medusa-63": medusa_63, "small-10": small_10}


def parse_preset(name: str, resolve: Callable[[str], TreePolicy]) -> TreeSpec | None:
    """A preset's tree by its name (a key of `PRESETS`), or None."""
    return PRESETS[name]() if name in PRESETS else None


def parse_chain(name: str, resolve: Callable[[str], TreePolicy]) -> TreeSpec | None:
    """`chain-N`: `chain(N)`, or None."""
    m = re.fullmatch(r"chain-(\d+)", name)
    return chain(int(m.group(1))) if m else None
