"""EAGLE-3's drafters: the recurrent family's static-tree and dynamic-tree (EAGLE-2) drafting
(`clover_jax.heads.recurrent.drafter`) with EAGLE-3's node step, the base's three tapped layers as the features
the loop hands it, and the head's own output projection over its draft vocabulary (a drafted index i is the
target token `draft_vocab[i]`, the reference's `d2t`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from clover_jax.decoding.sampling import top_k_ids
from clover_jax.heads.eagle3.head import Eagle3Head, check_compatible
from clover_jax.heads.recurrent.drafter import RecurrentDrafter, RecurrentDynamicDrafter, RecurrentState
from clover_jax.validation import InputError


class _Eagle3Nodes:
    """What EAGLE-3 changes in the recurrent family's drafting (mixed into both drafters)."""

    def feature_layers(self, head: Eagle3Head) -> tuple[int, ...]:
        return head.cfg.feature_layers

    def unroll_layers(self, head, state: RecurrentState) -> RecurrentState:
        return state  # one layer, no stacked scan to unroll

    def layer_copy_bytes(self, head) -> int:
        return 0

    def check(self, head: Eagle3Head, base) -> None:
        if not isinstance(head, Eagle3Head):
            raise InputError(f"an EAGLE-3 drafter drafts with an EAGLE-3 head, not a {type(head).__name__}")
        check_compatible(head, base.config)
        q, v = head.vocab_size, base.config.vocab_size
        given = None if self.draft_vocab is None else len(self.draft_vocab)
        if q < v and given != q:
            raise InputError(f"this EAGLE-3 head drafts over its own {q}-token vocabulary, so it needs those {q} "
                             f"token ids (draft_vocab.json beside it, or the d2t of its published folder); "
                             f"{'none was given' if given is None else f'{given} ids were given'}")
        if q == v and given is not None:
            raise InputError(f"this EAGLE-3 head drafts over the whole vocabulary; a draft vocabulary "
                             f"({given} ids) would not match its output columns")
        self.check_tree(self.max_depth, v, what="the EAGLE-3 head")  # any depth drafts

    def init_state(self, head: Eagle3Head, base, batch: int, cache_size: int, arrays: dict | None = None
                   ) -> RecurrentState:
        arrays = self.arrays() if arrays is None else arrays
        return RecurrentState(cache=head.init_cache(batch, cache_size),
                              s0=jnp.zeros((batch, base.config.hidden_size), head.cfg.dtype),
                              vocab_rows=None, vocab_ids=arrays["vocab_ids"], buffers=arrays["buffers"])

    def _top_k(self, head: Eagle3Head, base, state: RecurrentState, o: jax.Array) -> jax.Array:
        """Top-k target token ids `[..., k]` of the head output `o [..., D]`."""
        idx = top_k_ids(head.logits(base, o), self.spec.top_k)  # [..., k] draft indices
        return idx if state.vocab_ids is None else state.vocab_ids[idx]


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Drafter(_Eagle3Nodes, RecurrentDrafter):
    """EAGLE-3 drafting over a static tree (hashable by identity; build once per tree)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3DynamicDrafter(_Eagle3Nodes, RecurrentDynamicDrafter):
    """EAGLE-2's dynamic tree (`tree.DynamicTree`, the reference's `topK_genrate`) drafted by an EAGLE-3 head."""
