"""The recurrent head family: heads that draft depth by depth from one state, Clover-2 (an RNN over an Augmenting
Block), Clover-1 (one attention decoder per depth) and EAGLE-1 (a decoder layer over the base's features). They
share one drafter per tree policy and one loss; a head of the family offers `RecurrentHead`'s methods.

  drafter.py  `RecurrentDrafter` (static trees) and `RecurrentDynamicDrafter` (EAGLE-2's per-step trees)
  loss.py     `loss_from_features`: the teacher-forced outputs of every depth distilled from the base
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from clover_jax.models.cache import KVCache


@runtime_checkable
class RecurrentHead(Protocol):
    """The six methods the family's drafter and loss call on a head (shapes: `clover_jax.axes`; a node state is a
    pytree of `[B, E, ...]` arrays, E the nodes of one depth):

      commit(base, cache, f_new [B, A, D], y_new [B, A], num_valid [B], ...) -> (s0 [B, D], cache')
                      feeds the accepted positions through the head; s0, the state depth 0 drafts from
      root_node(base, cache, s0 [B, D]) -> (root state [B, 1, ...], o [B, D])
                      the tree root's node state and the output its children are drafted from
      node_step(base, cache, parents [B, E, ...], tokens [B, E], depth) -> (states [B, E, ...], o [B, E, D])
                      one depth: the parents' states and the drafted tokens give the children's
      logits(base, o [..., D]) -> [..., V] float32     an output scored by the frozen lm_head
      init_cache(batch, size, dtype=None) -> KVCache   the head's own KV cache, empty
      train_outputs(base, f [B, T, D], tokens [B, T], valid [B, T]) -> [num_heads, B, T, D]   teacher forcing
    and a config `cfg` with `dtype`. Clover-2 and Clover-1 draft a node from an RNN-like state (`RecurrentNodes`:
    `head0`, `step`); EAGLE-1's node carries its decoder layer's keys and values along the path.
    """

    def root_node(self, base, cache: KVCache, s0: jax.Array) -> tuple[object, jax.Array]: ...

    def node_step(self, base, cache: KVCache, parents, tokens: jax.Array, depth: int) -> tuple[object, jax.Array]: ...

    def logits(self, base, o: jax.Array) -> jax.Array: ...

    def init_cache(self, batch: int, size: int, dtype=None) -> KVCache: ...

    def commit(self, base, cache: KVCache, f_new: jax.Array, y_new: jax.Array, num_valid: jax.Array,
               **kw) -> tuple[jax.Array, KVCache]: ...

    def train_outputs(self, base, f: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array: ...


class RecurrentNodes:
    """`root_node` and `node_step` of a head whose node state is one vector: `head0(s [..., D]) -> o` gives depth
    0's output, `step(base, s, tokens, depth) -> (s', o)` a child's (Clover-2's RNN, Clover-1's per-depth decoders)."""

    def root_node(self, base, cache: KVCache, s0: jax.Array) -> tuple[jax.Array, jax.Array]:
        return s0[:, None, :], self.head0(s0)  # [B, 1, D], [B, D]

    def node_step(self, base, cache: KVCache, parents: jax.Array, tokens: jax.Array, depth: int
                  ) -> tuple[jax.Array, jax.Array]:
        return self.step(base, parents, tokens, depth=depth)  # [B, E, D], [B, E, D]


__all__ = ["RecurrentHead", "RecurrentNodes"]
