"""Prompt lookup drafting: a chain of tokens copied from the sequence itself, alone or merged with a head's tree.

Where the last `n` tokens of a row (root included) occurred before, the `length` tokens that followed that
occurrence are proposed as a chain under the root (prompt lookup decoding, Saxena 2023, the `prompt_lookup_num_tokens`
of transformers' `generate`; vLLM's n-gram speculator). The longest matching `n <= max_ngram` wins, and among its
occurrences the latest. A row with no match proposes a chain that is verified and rejected like any draft (its
tokens are the root repeated), so nothing changes but the cost of the slots.

Merged with a head (`LookupTree(inner=...)`, names like `fit-5-411aab+lookup-4`), the chain hangs under the root
beside the head's tree, as the root's last child: one base forward verifies both, and the longest accepted path
wins, so a step accepts `max(head path, lookup chain)`. Without a head (`lookup-4`) any model drafts with no
training at all. The chain's tokens are deterministic given the sequence, so greedy and lossless sampling verify
the merged tree as they verify the head's alone (SpecInfer's rule for deterministic children; a lookup token equal
to a head sibling is tried against a residual that has already removed it, and rejected: exact, only wasted).

On SmolLM2-135M-Instruct's own greedy replies a 4-token chain alone accepts tokens on MT-Bench with no training,
and beside the shipped head's 5-token tree it lifts tau well above the head's tree alone.

With an n-gram table (`clover_jax.decoding.ngram`, trees named `...lookup-K-table`), a row whose sequence has no
match at all (its last token never occurred before in it) takes the chain the table drafts instead: the base
model's most frequent continuation in its own earlier replies (REST, He et al. 2024, does this with a datastore).
On SmolLM2-135M-Instruct's MT-Bench first turns that lifts tau beside the shipped head's 5-token tree further, at
the same number of verified tokens (the merged trees' tau: docs/results.md).

The drafter keeps its own copy of each row's tokens (`[B, S]`, S the loop's cache size), fed by `start` (the
prompt) and `commit` (the accepted tokens), so the decode loop needs nothing new.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from clover_jax.decoding.drafter import Drafter, Proposal, cached_arrays
from clover_jax.decoding.ngram import NgramTable, ngram_chain
from clover_jax.decoding.trees.topology import TreeTopology, topology_from_parents
from clover_jax.decoding.tree import LookupTree
from clover_jax.validation import InputError


def lookup_chain(history: jax.Array, length: jax.Array, k: int, max_ngram: int) -> tuple[jax.Array, jax.Array]:
    """The `k` tokens that followed the latest earlier occurrence of each row's longest matching suffix.

    Args:
      history: `[B, S]` int32 tokens; `length`: `[B]` how many are valid (the last one is the root).
      k: chain length; max_ngram: the longest suffix tried (down to 1).
    Returns:
      `(chain [B, Z] int32, ngram [B] int32)`: `ngram` is the matched suffix length (0: no match; the chain is
      then the root repeated). Positions past `length` are never read as a match nor proposed: the chain stops
      at the row's last token and repeats it.
    """
    b, s = history.shape
    length = length.astype(jnp.int32)
    j = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S] the slot right after a candidate occurrence
    rows = jnp.arange(b)[:, None]
    hit = jnp.ones((b, s), bool)  # [B, S] the i-token suffix occurs ending at slot j - 1
    best_n = jnp.zeros((b, s), jnp.int32)
    for i in range(1, max_ngram + 1):
        want = jnp.take_along_axis(history, jnp.maximum(length - i, 0)[:, None], axis=1)  # [B, 1] suffix token i
        prev = jnp.pad(history, ((0, 0), (i, 0)))[:, :s]  # [B, S] h[j - i] (0 for j < i, masked below)
        hit = hit & (prev == want) & (j - i >= 0) & (length[:, None] - i >= 0)
        best_n = jnp.where(hit, i, best_n)
    best_n = jnp.where(j < length[:, None], best_n, 0)  # the occurrence must end before the root's own slot
    score = best_n * s + j  # longest suffix first, then the latest occurrence
    pick = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
    ngram = jnp.take_along_axis(best_n, pick[:, None], axis=1)[:, 0]
    last = jnp.maximum(length - 1, 0)  # [B] the root's slot
    at = pick[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]  # [B, Z]
    at = jnp.where((ngram[:, None] > 0) & (at <= last[:, None]), at, last[:, None])
    return history[rows, at], ngram


@struct.dataclass
class LookupState:
    # on a decoding mesh: each row's tokens over the batch axes, the n-gram table (a few MB) replicated
    shard_axes: ClassVar[dict[str, str]] = {"history": "B S", "lengths": "B", "ngram_keys": "M", "ngram_tokens": "M"}
    inner: Any  # the inner drafter's state (None without one)
    history: jax.Array  # [B, S] int32: each row's tokens (history[lengths - 1] is the root)
    lengths: jax.Array  # [B] int32
    topology: TreeTopology | None = None  # the merged tree when the inner one is static (else built per step)
    ngram_keys: jax.Array | None = None  # [M] uint32 the n-gram table's sorted context hashes (with a table)
    ngram_tokens: jax.Array | None = None  # [M] int32 their next tokens


class NoHead(nnx.Module):
    """The head of a lookup-only tree (`lookup-K`): no parameters; drafting reads only the sequence."""

    def __init__(self):
        pass


@dataclasses.dataclass(frozen=True, eq=False)
class LookupDrafter(Drafter):
    """A `Drafter` (`clover_jax.decoding.drafter`) that adds a prompt-lookup chain to `inner`'s tree (None: to the
    root alone), and, with `table`, the n-gram table's chain where lookup finds no match. Hashable by identity: built
    once per (head type, tree, vocabulary, table) by `clover_jax.heads.registry.drafter_for`."""

    inner: Any
    spec: LookupTree
    table: NgramTable | None = None

    @property
    def num_nodes(self) -> int:
        return (1 if self.inner is None else self.inner.num_nodes) + self.spec.length

    @property
    def max_depth(self) -> int:
        return max(0 if self.inner is None else self.inner.max_depth, self.spec.length)

    @property
    def _max_children(self) -> int:
        return self.spec.top_k

    def check(self, head, base) -> None:
        if self.table is not None and self.table.vocab_size != base.config.vocab_size:
            raise InputError(f"tree {self.spec.name!r}: the n-gram table ({self.table.source or 'given'}) was built "
                             f"for a {self.table.vocab_size}-token vocabulary, the model has "
                             f"{base.config.vocab_size}: build one with this model's tokenizer")
        if self.inner is None:
            return
        if self.inner.sampled_drafts:
            raise InputError(f"tree {self.spec.name!r}: a lookup chain cannot join a tree of sampled drafts "
                             f"({type(self.inner).__name__}); use a top-k tree")
        self.inner.check(head, base)

    def _static_parents(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The merged tree's `(parent, rank) [U]` when the inner tree is static (None when it is built per step)."""
        if self.inner is None:
            parent, rank = np.array([-1], np.int32), np.array([0], np.int32)
        else:
            buf = getattr(self.inner, "buffers", None)  # a static tree's drafter keeps its TreeBuffers there
            if buf is None:
                return None
            parent, rank = np.asarray(buf.parent, np.int32), np.asarray(buf.rank, np.int32)
        return self._merge(np, parent, rank)

    def _merge(self, xp, parent, rank):
        """Appends the chain to parent / rank `[..., U0]`: its first node under the root, ranked after the root's
        other children (tried last by the sampling walks), each next node under the previous one."""
        u0, k = parent.shape[-1], self.spec.length
        lead = parent.shape[:-1]
        first_rank = xp.max(rank, axis=-1, keepdims=True) + 1  # [..., 1] after every other node's rank
        chain_parent = xp.broadcast_to(xp.asarray([0] + list(range(u0, u0 + k - 1)), xp.int32), lead + (k,))
        chain_rank = xp.concatenate([first_rank.astype(xp.int32),
                                     xp.zeros(lead + (k - 1,), xp.int32)], axis=-1)
        return (xp.concatenate([parent.astype(xp.int32), chain_parent], axis=-1),
                xp.concatenate([rank.astype(xp.int32), chain_rank], axis=-1))

    def arrays(self) -> dict:
        def build():
            merged = self._static_parents()
            topo = None if merged is None else topology_from_parents(
                jnp.asarray(merged[0]), jnp.asarray(merged[1]), self.max_depth, self._max_children)
            inner = self.inner.arrays() if self.inner is not None else None
            table = {} if self.table is None else {"ngram_keys": jnp.asarray(self.table.keys, jnp.uint32),
                                                   "ngram_tokens": jnp.asarray(self.table.tokens, jnp.int32)}
            return {"inner": inner, "topology": topo} | table

        return cached_arrays(self, build)

    def layer_copy_bytes(self, head) -> int:
        return self.inner.layer_copy_bytes(head) if self.inner is not None else 0

    def feature_layers(self, head) -> tuple[int, ...]:
        return self.inner.feature_layers(head) if self.inner is not None else ()

    def unroll_layers(self, head, state: LookupState) -> LookupState:
        """The inner drafter's `unroll_layers` (see `clover_jax.decoding.drafter`)."""
        if self.inner is None:
            return state
        return state.replace(inner=self.inner.unroll_layers(head, state.inner))

    def init_state(self, head, base, batch: int, cache_size: int, arrays: dict | None = None) -> LookupState:
        arrays = self.arrays() if arrays is None else arrays
        inner = None
        if self.inner is not None:
            inner = self.inner.init_state(head, base, batch, cache_size, arrays["inner"])
        return LookupState(inner=inner, history=jnp.zeros((batch, cache_size), jnp.int32),
                           lengths=jnp.zeros((batch,), jnp.int32), topology=arrays["topology"],
                           ngram_keys=arrays.get("ngram_keys"), ngram_tokens=arrays.get("ngram_tokens"))

    def start(self, head, base, state: LookupState, f_prompt, y_prompt, lengths) -> LookupState:
        """The prompt: `y_prompt [B, T]` holds x_1 .. x_{P-1} and the root at P-1 (x_0, the first prompt token,
        is not in it and is never matched)."""
        inner = state.inner if self.inner is None else self.inner.start(head, base, state.inner, f_prompt,
                                                                         y_prompt, lengths)
        s, t = state.history.shape[1], y_prompt.shape[1]
        valid = jnp.arange(t)[None, :] < lengths[:, None]
        history = state.history.at[:, :t].set(jnp.where(valid, y_prompt, 0).astype(jnp.int32)[:, :s], mode="drop")
        return state.replace(inner=inner, history=history, lengths=lengths.astype(jnp.int32))

    def commit(self, head, base, state: LookupState, f_new, y_new, num_new) -> LookupState:
        inner = state.inner if self.inner is None else self.inner.commit(head, base, state.inner, f_new, y_new,
                                                                         num_new)
        b, a = y_new.shape
        i = jnp.arange(a)[None, :]
        at = jnp.where(i < num_new[:, None], state.lengths[:, None] + i, state.history.shape[1])  # [B, A]
        history = state.history.at[jnp.arange(b)[:, None], at].set(y_new.astype(jnp.int32), mode="drop")
        return state.replace(inner=inner, history=history, lengths=state.lengths + num_new.astype(jnp.int32))

    def propose(self, head, base, state: LookupState, root: jax.Array, key) -> Proposal:
        b = root.shape[0]
        if self.inner is None:
            tokens, parent, rank = root[:, None], None, None  # the merged topology is static (`arrays`)
        else:
            prop = self.inner.propose(head, base, state.inner, root, key)
            tokens = prop.tokens
            parent, rank = prop.buffers.parent, prop.buffers.rank
        chain, ngram = lookup_chain(state.history, state.lengths, self.spec.length, self.spec.max_ngram)  # [B, Z]
        if self.table is not None:  # rows with no match at all take the table's chain
            table_chain, _ = ngram_chain(state.ngram_keys, state.ngram_tokens, state.history, state.lengths,
                                         self.spec.length, self.table.max_order)  # [B, Z]
            chain = jnp.where((ngram > 0)[:, None], chain, table_chain)
        topo = state.topology
        if topo is None:  # the inner tree is built per step (and per row)
            parent, rank = (jnp.broadcast_to(x, (b, x.shape[-1])) for x in (parent, rank))
            topo = topology_from_parents(*self._merge(jnp, parent, rank), self.max_depth, self._max_children)
        return Proposal(tokens=jnp.concatenate([tokens, chain], axis=1).astype(jnp.int32), buffers=topo)
