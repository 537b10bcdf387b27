"""The block head's drafter over a static tree: one block forward per step, then the tree's tokens from each block
position's top-k (block position d - 1 fills depth d, as Medusa's heads do), so chains, preset trees and fitted
`fit-*` trees all draft from it. Its state is the window of the newest `window` accepted positions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from clover_jax import parallel
from clover_jax.decoding.drafter import (
    Proposal,
    TreeDrafterBase,
    cached_arrays,
    per_depth_node_index,
    vocab_ids,
)
from clover_jax.decoding.sampling import top_k_ids
from clover_jax.decoding.tree import TreeSpec, build_buffers
from clover_jax.decoding.trees.topology import TreeTopology
from clover_jax.heads.block.head import BlockHead, check_compatible
from clover_jax.validation import InputError

# BlockState's per-row leaves on a decoding mesh
parallel.add_rules({"block_f": (parallel.BATCH_AXES, None, None), "block_y": (parallel.BATCH_AXES, None),
                    "block_count": (parallel.BATCH_AXES,)}, state=True)


@struct.dataclass
class BlockState:
    block_f: jax.Array  # [B, S, (n + 1) D] pre-norm base features of the newest accepted positions, oldest first
    block_y: jax.Array  # [B, S] int32 the token after each (the last valid one: the root)
    block_count: jax.Array  # [B] int32 valid slots, the last ones (<= S)
    rows: jax.Array | None  # [Q, D] the lm_head rows of the draft vocabulary (None: the whole vocabulary)
    vocab_ids: jax.Array | None  # [Q] int32 the draft vocabulary's ids (None: all V)
    buffers: TreeTopology  # the tree's topology
    node_index: jax.Array  # [U] int32 index of each node's token in cat([root], top-k of block positions, flat)


def shift_in(f_old: jax.Array, y_old: jax.Array, count: jax.Array, f_new: jax.Array, y_new: jax.Array,
             num_new: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The window `(f [B, S, D], y [B, S], count [B])` after appending each row's first `num_new [B]` entries of
    `f_new [B, A, D]`, `y_new [B, A]` (rows advance by different amounts; 0 leaves a row as it was): the last S
    entries of the row's old window followed by its new ones."""
    s = f_old.shape[1]
    num_new = num_new.astype(jnp.int32)
    f = jnp.concatenate([f_old, f_new.astype(f_old.dtype)], axis=1)  # [B, S + A, D]
    y = jnp.concatenate([y_old, y_new.astype(y_old.dtype)], axis=1)  # [B, S + A]
    at = num_new[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]: the row's S entries ending at S+num-1
    f = jnp.take_along_axis(f, at[..., None], axis=1)
    y = jnp.take_along_axis(y, at, axis=1)
    return f, y, jnp.minimum(count + num_new, s).astype(count.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockDrafter(TreeDrafterBase):
    """Static drafting plan of a block head over one tree (hashable by identity; build once per tree)."""

    spec: TreeSpec
    draft_vocab: tuple[int, ...] | None = None  # sorted token ids the drafts are drawn from (None: all)
    sampled_drafts: bool = False

    def __post_init__(self):
        object.__setattr__(self, "buffers", build_buffers(self.spec))

    def check(self, head: BlockHead, base) -> None:
        check_compatible(head, base.config)
        self.check_tree(head.cfg.block_size, base.config.vocab_size, what="the block head (block_size)")
        if int(np.max(np.asarray(self.buffers.rank))) >= self.spec.top_k:
            raise InputError(f"tree {self.spec.name!r} has a child rank >= its top_k={self.spec.top_k}")

    def arrays(self) -> dict:
        """The drafter's arrays, passed into the jitted loop as an argument (not baked in as constants)."""
        return cached_arrays(self, lambda: {"buffers": jax.tree.map(jnp.asarray, self.buffers.topology()),
                                            "vocab_ids": vocab_ids(self.draft_vocab),
                                            "node_index": jnp.asarray(per_depth_node_index(self.buffers, self.spec.top_k))})

    def init_state(self, head: BlockHead, base, batch: int, cache_size: int, arrays: dict | None = None
                   ) -> BlockState:
        arrays = self.arrays() if arrays is None else arrays
        s, d = head.cfg.window, (len(head.cfg.feature_layers) + 1) * base.config.hidden_size
        ids = arrays["vocab_ids"]
        return BlockState(block_f=jnp.zeros((batch, s, d), head.cfg.dtype),
                          block_y=jnp.zeros((batch, s), jnp.int32), block_count=jnp.zeros((batch,), jnp.int32),
                          rows=None if ids is None else base.lm_head_rows(ids).astype(head.cfg.dtype),
                          vocab_ids=ids, buffers=arrays["buffers"], node_index=arrays["node_index"])

    def feature_layers(self, head: BlockHead) -> tuple[int, ...]:
        return head.cfg.feature_layers

    def start(self, head, base, state: BlockState, f_prompt, y_prompt, lengths) -> BlockState:
        """The window from the prompt's last `window` positions (an empty window shifted by the whole prompt)."""
        empty = (jnp.zeros_like(state.block_f), jnp.zeros_like(state.block_y), jnp.zeros_like(state.block_count))
        f, y, n = shift_in(*empty, f_prompt, y_prompt, lengths)
        return state.replace(block_f=f, block_y=y, block_count=n)

    def commit(self, head, base, state: BlockState, f_new, y_new, num_new) -> BlockState:
        f, y, n = shift_in(state.block_f, state.block_y, state.block_count, f_new, y_new, num_new)
        return state.replace(block_f=f, block_y=y, block_count=n)

    def propose(self, head: BlockHead, base, state: BlockState, root: jax.Array, key) -> Proposal:
        b, k, depth = root.shape[0], self.spec.top_k, self.max_depth
        out = head.draft(base, state.block_f, state.block_y, state.block_count, root)[:, :depth]  # [B, Dmax, D]
        if state.rows is None:
            logits = base.project(out, head.cfg.dtype)  # [B, Dmax, V]
        else:
            logits = jnp.einsum("BCD,QD->BCQ", out.astype(state.rows.dtype), state.rows,
                                preferred_element_type=jnp.float32)
        top = top_k_ids(logits, k)  # [B, Dmax, k]
        if state.vocab_ids is not None:
            top = state.vocab_ids[top]
        cand = jnp.concatenate([root[:, None], top.reshape(b, -1)], axis=1)  # [B, 1 + Dmax*k]
        return Proposal(tokens=jnp.take(cand, state.node_index, axis=1), buffers=state.buffers)
