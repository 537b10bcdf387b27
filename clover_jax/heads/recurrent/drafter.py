"""The recurrent family's drafting (`clover_jax.heads.recurrent.RecurrentHead`: Clover-2, Clover-1, EAGLE-1) over a
static tree and an EAGLE-2 dynamic tree: the `Drafter`s the speculative loop uses with those heads. Told for
Clover-2; Clover-1 and EAGLE offer the same methods (EAGLE's node step overrides `_nodes`).

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
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from clover_jax.decoding.drafter import Proposal, TreeDrafterBase, cached_arrays, commit_prompt, vocab_ids
from clover_jax.decoding.sampling import top_k_ids
from clover_jax.decoding.trees.topology import topology_from_parents
from clover_jax.decoding.tree import DynamicTree, TreeBuffers, TreeSpec, build_buffers
from clover_jax.heads import registry
from clover_jax.heads.recurrent import RecurrentHead
from clover_jax.models.cache import KVCache


@struct.dataclass
class RecurrentState:
    shard_axes: ClassVar[dict[str, str]] = {"s0": "B D"}  # the cache: a KVCache's own
    cache: KVCache  # Augmenting-Block cache [A_layers, B, K, S, H]
    s0: jax.Array  # [B, D]
    vocab_rows: jax.Array | None = None  # [Q, D] W_lm^T rows of the draft vocabulary (None: all V)
    vocab_ids: jax.Array | None = None  # [Q] int32 the draft vocabulary's token ids (None: all V)
    buffers: TreeBuffers | None = None  # the tree's index arrays (None: the drafter's own, as constants)
    # the Augmenting Block's per-layer weights, taken once before the loop by `unroll_layers` (None: its layers run
    # as a scan over their stacked weights)
    layer_weights: tuple[dict[str, jax.Array], ...] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class RecurrentDrafter(TreeDrafterBase):
    """Static drafting plan for one tree (hashable by identity; build once per tree)."""

    spec: TreeSpec
    sampled_drafts: bool = False
    draft_vocab: tuple[int, ...] | None = None  # sorted token ids the drafts are drawn from (None: all)

    def __post_init__(self):
        object.__setattr__(self, "buffers", build_buffers(self.spec))

    def check(self, head: RecurrentHead, base) -> None:
        registry.of_head(head).check_compatible(head, base.config)  # Clover-2, or Clover-1 (same drafting)
        self.check_tree(head.cfg.num_heads, base.config.vocab_size)

    def arrays(self) -> dict:
        """The drafter's arrays (tree buffers, draft-vocabulary ids), to pass into a jitted loop as an argument
        and on to `init_state`: arrays closed over in a jitted function become constants of its program, which
        XLA folds and copies at every compile."""
        return cached_arrays(self, lambda: {"buffers": jax.tree.map(jnp.asarray, self.buffers),
                                            "vocab_ids": vocab_ids(self.draft_vocab)})

    def init_state(self, head: RecurrentHead, base, batch: int, cache_size: int, arrays: dict | None = None
                   ) -> RecurrentState:
        """The drafting state of a fresh batch; `arrays` is `self.arrays()` (passed into the jitted loop)."""
        arrays = self.arrays() if arrays is None else arrays
        rows = None
        if arrays["vocab_ids"] is not None:
            rows = base.lm_head_rows(arrays["vocab_ids"]).astype(head.cfg.dtype)
        return RecurrentState(cache=head.init_cache(batch, cache_size),
                            s0=jnp.zeros((batch, base.config.hidden_size), head.cfg.dtype), vocab_rows=rows,
                            vocab_ids=arrays["vocab_ids"], buffers=arrays["buffers"])

    def unroll_layers(self, head, state: RecurrentState) -> RecurrentState:
        """`state` with the Augmenting Block's per-layer weights, taken once, before the loop: every commit then runs
        the block's layers unrolled on them, where a scan over the stacked weights copies each layer's slice at every
        call (on a CPU, SmolLM2's 2-layer block commits faster unrolled than scanned). The loop calls
        it where `clover_jax.decoding.speculative.head_layers` says so."""
        return state.replace(layer_weights=self._layer_stack(head).per_layer_weights())

    def _layer_stack(self, head):
        """The head's own stacked decoder layers (Clover-2 and Clover-1: the Augmenting Block)."""
        return head.aug

    def layer_copy_bytes(self, head) -> int:
        """Bytes `unroll_layers` holds besides the head's own weights (the per-layer copy)."""
        return int(sum(x.nbytes for x in jax.tree.leaves(self._layer_stack(head).layer_params())))

    def _commit_kwargs(self, state: RecurrentState) -> dict:
        return {} if state.layer_weights is None else {"layer_weights": state.layer_weights}

    def start(self, head, base, state: RecurrentState, f_prompt, y_prompt, lengths) -> RecurrentState:
        kw = self._commit_kwargs(state)

        def commit(cache, f, y, num, fresh, extent):
            return head.commit(base, cache, f, y, num, fresh=fresh, cache_extent=extent, **kw)

        s0, cache = commit_prompt(commit, state.cache, f_prompt, y_prompt, lengths)  # init_state's empty cache
        return state.replace(cache=cache, s0=s0)

    def commit(self, head, base, state: RecurrentState, f_new, y_new, num_new) -> RecurrentState:
        s0, cache = head.commit(base, state.cache, f_new, y_new, num_new, **self._commit_kwargs(state))
        active = num_new > 0
        return state.replace(cache=cache, s0=jnp.where(active[:, None], s0, state.s0))

    # The node step (`RecurrentHead.root_node`, `node_step`). A node's state is a pytree of `[B, E, ...]` arrays
    # (Clover-2: the RNN state s `[B, E, D]`; EAGLE: its layer's features, keys and values along the path); `o
    # [B, E, D]` is the output its children are drafted from.
    def _root_node(self, head: RecurrentHead, base, state: RecurrentState):
        """`(root node state [B, 1, ...], o [B, D])`: the root's state and head 0's output."""
        return head.root_node(base, state.cache, state.s0)

    def _step(self, head: RecurrentHead, base, state: RecurrentState, parents, tokens: jax.Array, depth: int):
        """`(node states, o [B, E, D])` of the nodes at `depth` with tokens `[B, E]`, from their parents' states."""
        return head.node_step(base, state.cache, parents, tokens, depth)

    def _top_k(self, head: RecurrentHead, base, state: RecurrentState, o: jax.Array) -> jax.Array:
        """Top-k draft token ids `[..., k]` of the head output `o [..., D]`."""
        k = self.spec.top_k
        if state.vocab_rows is None:
            return top_k_ids(head.logits(base, o), k)
        logits = jnp.einsum("...D,QD->...Q", o.astype(state.vocab_rows.dtype), state.vocab_rows,
                            preferred_element_type=jnp.float32)
        ids = state.vocab_ids if state.vocab_ids is not None else jnp.asarray(self.draft_vocab, jnp.int32)
        return ids[top_k_ids(logits, k)]

    def propose(self, head: RecurrentHead, base, state: RecurrentState, root: jax.Array, key) -> Proposal:
        buf: TreeBuffers = self.buffers
        k = self.spec.top_k
        b = root.shape[0]
        num_expand = np.asarray(buf.num_expand)
        emax = buf.expand_nodes.shape[1]
        # step 0: the root is the only expanded node
        prev_states, o0 = self._root_node(head, base, state)  # the nodes expanded at the previous step [B, E_prev, ..]
        top0 = self._top_k(head, base, state, o0)  # [B, k]
        per_step = [jnp.pad(top0[:, None, :], ((0, 0), (0, emax - 1), (0, 0)))]  # each [B, E, k]
        prev_top = top0[:, None, :]  # [B, E_prev, k]
        for s in range(1, self.max_depth):
            e = int(num_expand[s])
            slots = np.asarray(buf.expand_parent_slot[s, :e])  # parent's slot among step s-1 expansions
            ranks = np.asarray(buf.expand_rank[s, :e])
            tokens = prev_top[:, slots, ranks]  # [B, e] the expanded nodes' own tokens
            parent_states = jax.tree.map(lambda x: x[:, slots], prev_states)  # [B, e, ...]
            new_states, o = self._step(head, base, state, parent_states, tokens, s)
            top = self._top_k(head, base, state, o)  # [B, e, k]
            per_step.append(jnp.pad(top, ((0, 0), (0, emax - e), (0, 0))))
            prev_states, prev_top = new_states, top
        cand = jnp.concatenate([root[:, None], jnp.stack(per_step, 1).reshape(b, -1)], axis=1)
        arrays = state.buffers if state.buffers is not None else jax.tree.map(jnp.asarray, buf)
        tree_tokens = jnp.take(cand, arrays.draft_index, axis=1)  # [B, U]
        tree_tokens = tree_tokens.at[:, 0].set(root)
        return Proposal(tokens=tree_tokens, buffers=arrays)


@dataclasses.dataclass(frozen=True, eq=False)
class RecurrentDynamicDrafter(RecurrentDrafter):
    """Clover-2 drafting of a new tree per step and per row (`tree.DynamicTree`, EAGLE-2's expansion): the
    frontier is the `top_k` nodes of the newest depth with the highest cumulative log-probability under the
    head (over the draft vocabulary when there is one), each expanded by one RNN step into its `top_k` children;
    after `depth` levels the `budget - 1` best candidates are kept. The tree goes to verification as parent
    pointers through `topology_from_parents`, children ranked by their score (the order the sampling walk tries
    them in), so greedy and lossless sampling (rule (b), deterministic children) verify it unchanged."""

    spec: DynamicTree

    def __post_init__(self):
        object.__setattr__(self, "buffers", None)

    def arrays(self) -> dict:
        return cached_arrays(self, lambda: {"buffers": None, "vocab_ids": vocab_ids(self.draft_vocab)})

    def _scored(self, head: RecurrentHead, base, state: RecurrentState, o: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Top-k token ids and their log-probabilities `[..., k]` under the head output `o [..., D]`."""
        if state.vocab_rows is None:
            logits = head.logits(base, o)  # [..., V]
        else:
            logits = jnp.einsum("...D,QD->...Q", o.astype(state.vocab_rows.dtype), state.vocab_rows,
                                preferred_element_type=jnp.float32)  # [..., Q]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        idx = top_k_ids(logp, self.spec.top_k)  # [..., k] into the (draft) vocabulary
        lp = jnp.take_along_axis(logp, idx, axis=-1)
        if self.spec.top_p < 1.0:  # Clover-1's token-level cut: children past cumulative probability top_p
            p = jnp.exp(lp)  # [..., k] descending
            lp = jnp.where(jnp.cumsum(p, axis=-1) - p < self.spec.top_p, lp, -jnp.inf)
        ids = idx if state.vocab_ids is None else state.vocab_ids[idx]
        return ids, lp

    def propose(self, head: RecurrentHead, base, state: RecurrentState, root: jax.Array, key) -> Proposal:
        k, depth, n = self.spec.top_k, self.spec.depth, self.spec.budget
        b = root.shape[0]
        rows = jnp.arange(b)[:, None]
        root_state, o0 = self._root_node(head, base, state)
        ids0, lp0 = self._scored(head, base, state, o0)  # [B, k]
        tokens, scores, parents = [ids0], [lp0], [jnp.full((b, k), -1, jnp.int32)]
        f_tok, f_score = ids0, lp0  # the frontier: [B, k]
        f_state = jax.tree.map(lambda x: jnp.broadcast_to(x, (b, k, *x.shape[2:])), root_state)  # parents' states
        f_index = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # its candidate indices
        offset = k
        for d in range(1, depth):
            new_state, o = self._step(head, base, state, f_state, f_tok, d)  # the frontier nodes' states [B, k, ..]
            ids, lp = self._scored(head, base, state, o)  # their children: [B, k, k]
            cum = (f_score[:, :, None] + lp).reshape(b, k * k)  # cumulative log-probability
            ids = ids.reshape(b, k * k)
            tokens.append(ids)
            scores.append(cum)
            parents.append(jnp.repeat(f_index, k, axis=1))  # child c of frontier slot j sits at j * k + c
            best = jax.lax.top_k(cum, k)[1]  # [B, k] the next frontier
            f_tok = jnp.take_along_axis(ids, best, axis=1)
            f_score = jnp.take_along_axis(cum, best, axis=1)
            f_state = jax.tree.map(lambda x: jnp.take_along_axis(  # noqa: B023  (used at once)
                x, (best // k).reshape(b, k, *([1] * (x.ndim - 2))), axis=1), new_state)
            f_index = (offset + best).astype(jnp.int32)
            offset += k * k
        all_tok = jnp.concatenate(tokens, axis=1)  # [B, M]
        all_score = jnp.concatenate(scores, axis=1)
        all_parent = jnp.concatenate(parents, axis=1)
        kept, sel = jax.lax.top_k(all_score, n - 1)  # [B, U-1] the kept candidates, best first
        node_of = jnp.full(all_tok.shape, -1, jnp.int32).at[rows, sel].set(jnp.arange(1, n, dtype=jnp.int32))
        par = jnp.take_along_axis(all_parent, sel, axis=1)  # candidate index of each kept node's parent
        par_node = jnp.where(par < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par, 0), axis=1))
        par_node = jnp.where(kept > -jnp.inf, par_node, -1)  # cut by top-p: an unused slot (never accepted)
        parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par_node], axis=1)  # [B, U]
        rank = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))  # by score: siblings in that order
        topo = topology_from_parents(parent, rank, depth, k)
        tree_tokens = jnp.concatenate([root[:, None], jnp.take_along_axis(all_tok, sel, axis=1)], axis=1)
        return Proposal(tokens=tree_tokens, buffers=topo)
