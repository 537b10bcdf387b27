"""The block head's drafter over a static tree: one block forward per step, then the tree's tokens from each block
position's top-k (block position d - 1 fills depth d, as Medusa's heads do), so chains, preset trees and fitted
`fit-*` trees all draft from it. Its state is the window of the newest `window` accepted positions."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from clover_jax.decoding.sampling import top_k_ids
from clover_jax.decoding.trees.topology import TreeTopology
from clover_jax.heads.block.head import BlockHead, check_compatible
from clover_jax.heads.per_depth import PerDepthDrafter


@struct.dataclass
class BlockState:
    shard_axes: ClassVar[dict[str, str]] = {"block_f": "B S D", "block_y": "B S", "block_count": "B"}
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
class BlockDrafter(PerDepthDrafter):
    """Static drafting plan of a block head over one tree (hashable by identity; build once per tree): block
    position d - 1 gives depth d's candidates (`clover_jax.heads.per_depth`)."""

    def check(self, head: BlockHead, base) -> None:
        check_compatible(head, base.config)
        self.check_depths(head.cfg.block_size, base.config.vocab_size, what="the block head (block_size)")

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

    def depth_top_k(self, head: BlockHead, base, state: BlockState, root: jax.Array) -> jax.Array:
        out = head.draft(base, state.block_f, state.block_y, state.block_count, root)  # [B, C, D]
        out = out[:, :self.max_depth]  # [B, Dmax, D]: block position d - 1 drafts depth d
        if state.rows is None:
            logits = base.project(out, head.cfg.dtype)  # [B, Dmax, V]
        else:
            logits = jnp.einsum("BCD,QD->BCQ", out.astype(state.rows.dtype), state.rows,
                                preferred_element_type=jnp.float32)
        return top_k_ids(logits, self.spec.top_k)  # [B, Dmax, k]
