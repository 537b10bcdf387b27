"""Clover-2 drafting over a static tree: the `Drafter` the speculative loop uses with a Clover2Head.

State: the Augmenting Block's KV cache and s^0 (the block's output at the last committed position).
Drafting, per step (as the reference's tree drafting, `XiaoBin1992/clover`): head 0 gives the top-k children of the root; then, depth
by depth, only the tree nodes that have children are expanded: `s = AD2(s_parent, E[token])`,
`o = head_norm(FCout [s; E[token]])`, top-k of `W_lm o`. The tree tokens are gathered from the
per-depth top-k with the tree's `draft_index`.

With a draft vocabulary (`clover_jax.heads.draft_vocab`) the drafts are scored against only those rows of
W_lm (gathered once per generation into the state) and the top-k ids mapped back to the full vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from clover_jax.decoding.sampling import top_k_ids  # noqa: F401  (re-exported for callers of its old home)
from clover_jax.decoding.tree import TreeBuffers, TreeSpec, build_buffers
from clover_jax.heads.clover2 import Clover2Head, check_compatible
from clover_jax.decoding.drafter import Proposal
from clover_jax.models.cache import KVCache
from clover_jax.validation import InputError


@struct.dataclass
class Clover2State:
    cache: KVCache  # Augmenting-Block cache [A_layers, B, S, K, H]
    s0: jax.Array  # [B, D]
    vocab_rows: jax.Array | None = None  # [N, D] W_lm^T rows of the draft vocabulary (None: all V)
    vocab_ids: jax.Array | None = None  # [N] int32 the draft vocabulary's token ids (None: all V)
    buffers: TreeBuffers | None = None  # the tree's index arrays (None: the drafter's own, as constants)


@dataclasses.dataclass(frozen=True, eq=False)
class Clover2Drafter:
    """Static drafting plan for one tree (hashable by identity; build once per tree)."""

    spec: TreeSpec
    sampled_drafts: bool = False
    draft_vocab: tuple[int, ...] | None = None  # sorted token ids the drafts are drawn from (None: all)

    def __post_init__(self):
        object.__setattr__(self, "buffers", build_buffers(self.spec))

    @property
    def num_nodes(self) -> int:
        return self.spec.num_nodes

    @property
    def max_depth(self) -> int:
        return self.spec.max_depth

    def check(self, head: Clover2Head, base) -> None:
        check_compatible(head, base.config)
        if self.max_depth > head.cfg.num_heads:
            raise InputError(f"tree {self.spec.name!r} is {self.max_depth} drafts deep but the head has only "
                             f"{head.cfg.num_heads} heads; use a shallower tree or a head with more heads")
        if self.spec.top_k > base.config.vocab_size:
            raise InputError(f"tree top_k={self.spec.top_k} exceeds the vocabulary ({base.config.vocab_size})")
        if self.draft_vocab is not None:
            from clover_jax.heads.draft_vocab import check_draft_vocab

            check_draft_vocab(self.draft_vocab, base.config.vocab_size)
            if self.spec.top_k > len(self.draft_vocab):
                raise InputError(f"tree top_k={self.spec.top_k} exceeds the draft vocabulary "
                                 f"({len(self.draft_vocab)} ids)")

    def arrays(self) -> dict:
        """The drafter's arrays (tree buffers, draft-vocabulary ids), to pass into a jitted loop as an argument
        and on to `init_state`: arrays closed over in a jitted function become constants of its program, which
        XLA folds and copies at every compile."""
        cached = self.__dict__.get("_arrays")
        if cached is None:  # built once per drafter (drafters are cached per tree and vocabulary), not per call
            ids = None if self.draft_vocab is None else jnp.asarray(self.draft_vocab, jnp.int32)
            cached = {"buffers": jax.tree.map(jnp.asarray, self.buffers), "vocab_ids": ids}
            object.__setattr__(self, "_arrays", cached)
        return cached

    def init_state(self, head: Clover2Head, base, batch: int, cache_size: int, arrays: dict | None = None
                   ) -> Clover2State:
        """The drafting state of a fresh batch; `arrays` is `self.arrays()` (passed into the jitted loop)."""
        arrays = self.arrays() if arrays is None else arrays
        rows = None
        if arrays["vocab_ids"] is not None:
            rows = base.lm_head_rows(arrays["vocab_ids"]).astype(head.cfg.dtype)
        return Clover2State(cache=head.init_cache(batch, cache_size),
                            s0=jnp.zeros((batch, base.config.hidden_size), head.cfg.dtype), vocab_rows=rows,
                            vocab_ids=arrays["vocab_ids"], buffers=arrays["buffers"])

    def start(self, head, base, state: Clover2State, f_prompt, y_prompt, lengths) -> Clover2State:
        s0, cache = head.commit(base, state.cache, f_prompt, y_prompt, lengths)
        return state.replace(cache=cache, s0=s0)

    def commit(self, head, base, state: Clover2State, f_new, y_new, num_new) -> Clover2State:
        s0, cache = head.commit(base, state.cache, f_new, y_new, num_new)
        active = num_new > 0
        return state.replace(cache=cache, s0=jnp.where(active[:, None], s0, state.s0))

    def _top_k(self, head: Clover2Head, base, state: Clover2State, o: jax.Array) -> jax.Array:
        """Top-k draft token ids `[..., k]` of the head output `o [..., D]`."""
        k = self.spec.top_k
        if state.vocab_rows is None:
            return top_k_ids(head.logits(base, o), k)
        logits = jnp.einsum("...D,ND->...N", o.astype(state.vocab_rows.dtype), state.vocab_rows,
                            preferred_element_type=jnp.float32)
        ids = state.vocab_ids if state.vocab_ids is not None else jnp.asarray(self.draft_vocab, jnp.int32)
        return ids[top_k_ids(logits, k)]

    def propose(self, head: Clover2Head, base, state: Clover2State, root: jax.Array, key) -> Proposal:
        buf: TreeBuffers = self.buffers
        k = self.spec.top_k
        b = root.shape[0]
        num_expand = np.asarray(buf.num_expand)
        emax = buf.expand_nodes.shape[1]
        # step 0: the root is the only expanded node
        top0 = self._top_k(head, base, state, head.head0(state.s0))  # [B, k]
        per_step = [jnp.pad(top0[:, None, :], ((0, 0), (0, emax - 1), (0, 0)))]  # each [B, E, k]
        prev_states = state.s0[:, None, :]  # states of the nodes expanded at the previous step [B, E_prev, D]
        prev_top = top0[:, None, :]  # [B, E_prev, k]
        for s in range(1, self.max_depth):
            e = int(num_expand[s])
            slots = np.asarray(buf.expand_parent_slot[s, :e])  # parent's slot among step s-1 expansions
            ranks = np.asarray(buf.expand_rank[s, :e])
            tokens = prev_top[:, slots, ranks]  # [B, e] the expanded nodes' own tokens
            parent_states = prev_states[:, slots]  # [B, e, D]
            new_states, o = head.step(base, parent_states, tokens)
            top = self._top_k(head, base, state, o)  # [B, e, k]
            per_step.append(jnp.pad(top, ((0, 0), (0, emax - e), (0, 0))))
            prev_states, prev_top = new_states, top
        cand = jnp.concatenate([root[:, None], jnp.stack(per_step, 1).reshape(b, -1)], axis=1)
        arrays = state.buffers if state.buffers is not None else jax.tree.map(jnp.asarray, buf)
        tree_tokens = jnp.take(cand, arrays.draft_index, axis=1)  # [B, U]
        tree_tokens = tree_tokens.at[:, 0].set(root)
        return Proposal(tokens=tree_tokens, buffers=arrays)
