"""Drafting a static tree from one prediction per depth: Medusa's heads, a block head's positions.

A head that predicts each depth below the root without looking at the tree (Medusa's head i, or the block head's
position i, predicts depth i + 1) fills any static tree the same way: the node at depth d with child rank r takes the
r-th most likely token of prediction d - 1, whatever its parent (the Medusa reference's `generate_medusa_buffers`
indexing). `PerDepthDrafter` is that drafter without the predictions: a head type's drafter subclasses it with its
state, `check`, `init_state`, `start`, `commit` and `depth_top_k`.

Shapes use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.decoding.drafter import Proposal, TreeDrafterBase, cached_arrays, vocab_ids
from clover_jax.decoding.tree import TreeSpec, build_buffers
from clover_jax.validation import InputError


def per_depth_node_index(buffers, top_k: int) -> np.ndarray:
    """`[U]` int32: the index of each tree node's token in `cat([root], top_k candidates of depth 1, of depth 2,
    ...)`: node 0 -> 0 (the root); a node at depth d, child rank r -> 1 + (d-1) * top_k + r."""
    depth, rank = np.asarray(buffers.depth), np.asarray(buffers.rank)
    return np.where(depth == 0, 0, 1 + (depth - 1) * top_k + rank).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class PerDepthDrafter(TreeDrafterBase):
    """A static tree drafted from one top-k per depth (see the module docstring); hashable by identity, built once
    per tree. A subclass's state holds the arrays `arrays()` gives under the same names: `vocab_ids [Q]` (None: all
    V), `buffers` (the tree's topology) and `node_index [U]`."""

    spec: TreeSpec
    draft_vocab: tuple[int, ...] | None = None  # sorted token ids the drafts are drawn from (None: all)
    sampled_drafts: bool = False

    def __post_init__(self):
        object.__setattr__(self, "buffers", build_buffers(self.spec))

    def check_depths(self, num_predictions: int, vocab_size: int, what: str) -> None:
        """An `InputError` if the tree is deeper than `num_predictions`, asks for more candidates than the (draft)
        vocabulary holds, or has a child rank its depth's top-k does not reach."""
        self.check_tree(num_predictions, vocab_size, what=what)
        if int(np.max(np.asarray(self.buffers.rank))) >= self.spec.top_k:
            raise InputError(f"tree {self.spec.name!r} has a child rank >= its top_k={self.spec.top_k}")

    def arrays(self) -> dict:
        """The drafter's arrays, passed into the jitted loop as an argument (not baked in as constants)."""
        return cached_arrays(self, lambda: {"buffers": jax.tree.map(jnp.asarray, self.buffers.topology()),
                                            "vocab_ids": vocab_ids(self.draft_vocab),
                                            "node_index": jnp.asarray(per_depth_node_index(self.buffers,
                                                                                           self.spec.top_k))})

    @abc.abstractmethod
    def depth_top_k(self, head, base, state, root: jax.Array) -> jax.Array:
        """`[B, Dmax, k]` int: the k most likely tokens of each depth's prediction, best first (indices into the draft
        vocabulary when there is one), for the tree under `root [B]`."""

    def propose(self, head, base, state, root: jax.Array, key) -> Proposal:
        top = self.depth_top_k(head, base, state, root)  # [B, Dmax, k]
        if state.vocab_ids is not None:
            top = state.vocab_ids[top]
        cand = jnp.concatenate([root[:, None], top.reshape(root.shape[0], -1)], axis=1)  # [B, 1 + Dmax * k]
        return Proposal(tokens=jnp.take(cand, state.node_index, axis=1), buffers=state.buffers)  # tokens [B, U]
