"""The axis alphabet of clover_jax, declared once.

Every shape comment (`# [B, T, D]`) and every einsum string (`"BTD,DF->BTF"`) in the package names its axes with
these letters, each letter with one meaning everywhere; a module's docstring refers here instead of declaring its
own. `tests/test_axes.py` checks that the letters the package uses are the ones declared here: a new kind of axis
is added to `AXES` first. Shape comments may also hold numbers and expressions of declared letters
(`[B, U + 1]`, `[B, k * C]`); lower-case letters other than `n` and `k` in comments are index names, not axes.
"""

from __future__ import annotations

AXES: dict[str, str] = {
    # the base model and its cache
    "B": "batch rows",
    "T": "tokens of one forward (query positions), or a sequence's positions",
    "S": "cache slots (key positions), or a row's token slots",
    "C": "positions of one block (a prefill block, a chunk of the loss)",
    "D": "model width",
    "N": "query heads",
    "K": "key/value heads",
    "G": "query heads per key/value head (N = K * G)",
    "H": "head dim",
    "F": "MLP width, and the output width of a head's other projections",
    "I": "the input width of a projection whose input is not D wide (EAGLE's fc: 2D; ReDrafter's drafter: 2D)",
    "V": "vocabulary",
    "Q": "draft vocabulary: the token ids a head drafts from (V without one)",
    "L": "stacked layers or residual blocks",
    # draft heads
    "n": "a head's drafting heads (Medusa, Clover-1) or unrolled drafting steps (ReDrafter)",
    "k": "top-k candidates of one node",
    "E": "tree nodes expanded at one drafting step (the states drafted from)",
    "W": "beams (ReDrafter)",
    "Lb": "a beam's length, root included (ReDrafter)",
    # trees and decoding steps
    "U": "tree nodes: the tokens a speculative step verifies, root included",
    "P": "a tree's root-to-leaf paths, or a node's ancestors",
    "Dmax": "a tree's depths (its longest path, root excluded)",
    "Cmax": "children of a node, in rank order",
    "R": "child ranks",
    "A": "tokens accepted, committed or emitted per step",
    "Z": "a prompt-lookup or n-gram chain's length",
    "O": "an n-gram's context order",
    "M": "entries of a list: an n-gram table, drafted candidates, dataset examples",
}
