"""The contract between the speculative decode loop and a draft head.

The loop (`clover_jax.decoding.speculative`) knows a head only through a `Drafter`: a static,
hashable Python object (configuration and tree) whose methods are pure functions of
`(head params module, base model, explicit state)`. A new head type (Medusa, EAGLE, ReDrafter,
dynamic trees) is a new `Drafter`, not a change to the loop.

Per decoding step the loop calls:
  1. `propose(head, base, state, root, key)` -> `Proposal`: the tree tokens `[B, U]` (node 0 is the
     root) and the tree's topology (a static `TreeBuffers`, or a `TreeTopology` a drafter builds on device with
     `topology_from_parents`; shared `[U, ...]` or per row `[B, U, ...]`).
  2. verifies the tree with one base forward, accepts a path per row (`check_proposal` first checks, while the
     loop is traced, that the proposal has the shapes and dtypes the loop reads);
  3. `commit(head, base, state, f_new, y_new, num_new)` with the accepted nodes' pre-norm hidden
     states `[B, A, D]`, the token following each (`y_new [B, A]`, the last one is the new root) and
     the count per row; it returns the state it was given, updated, with the same structure, shapes and
     dtypes (`check_state`: the loop carries it through `lax.while_loop`).
Before the loop, `start(...)` consumes the prompt the same way `commit` consumes accepted tokens (a head that
caches the prompt does it in blocks, `commit_prompt`, as the base model's prefill).
Before `start`, the loop passes the drafter's `arrays()` (tree buffers, a draft vocabulary; None for none) into
the jitted call as an argument and on to `init_state(head, base, batch, cache_size, arrays)`, so they are not baked
into the compiled program as constants, and calls `unroll_layers(head, state)` where the head's own stacked layers
should run unrolled (`clover_jax.decoding.speculative.head_layers`): the per-layer weights are taken once per call
and no step copies a layer's slice. `Drafter` below is the whole contract; the loop checks it once
(`check_drafter`) and calls every method unconditionally.
"""

from __future__ import annotations

import abc
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct

from clover_jax.decoding.autoregressive import PREFILL_CHUNK, run_blocks
from clover_jax.decoding.trees.topology import TreeTopology
from clover_jax.decoding.tree import TreeBuffers
from clover_jax.validation import InputError, check_draft_vocab


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, U] tree tokens, node 0 = the root
    buffers: TreeBuffers | TreeTopology  # the tree's topology (verification reads only those fields), shared
    # [U, ...] or per row [B, U, ...]: a static tree's buffers, or a tree built per step from parent pointers
    draft_probs: jax.Array | None = None  # [B, U, V] draft distribution per node, for sampled drafts


class Drafter(abc.ABC):
    """What the decode loop needs from a draft head, all of it (see the module docstring for the order of calls).

    A drafter is static and hashable (a frozen dataclass compared by identity, say): the jitted loop is compiled
    once per drafter. Its methods are pure functions of `(head module, base model, explicit state)`; the state is
    a pytree the loop carries through `lax.while_loop`, so `start` and `commit` return it with the structure,
    shapes and dtypes `init_state` gave it (`check_state`). `check_drafter` verifies, once per loop, that an object
    is a `Drafter` with every method below.
    """

    sampled_drafts: bool = False  # True: drafts sampled from `Proposal.draft_probs` (acceptance rule (a)); else top-k

    @property
    @abc.abstractmethod
    def num_nodes(self) -> int:
        """U: tokens verified per step, the root included (static)."""

    @property
    @abc.abstractmethod
    def max_depth(self) -> int:
        """The deepest draft below the root (static)."""

    @abc.abstractmethod
    def check(self, head, base) -> None:
        """Raises a clear error if this head cannot draft for this base model (called once, before compiling)."""

    def arrays(self) -> dict[str, jax.Array] | None:
        """Arrays the drafter needs on device (tree buffers, a draft vocabulary), passed into the jitted call as an
        argument rather than baked into the program as constants; None: none."""
        return None

    @abc.abstractmethod
    def init_state(self, head, base, batch: int, cache_size: int, arrays: dict[str, jax.Array] | None) -> Any:
        """The empty state for `batch` rows and a cache of `cache_size` slots; `arrays` is what `arrays()` gave. On a
        mesh the state's type says which of its fields split and how (`shard_axes`, `clover_jax.parallel`); a field
        it does not name is left to XLA's propagation (a `KVCache` in it splits as KV caches do)."""

    def unroll_layers(self, head, state):
        """The state with the head's own stacked layers' per-layer weights taken once before the loop (a head with
        its own decoder layers overrides this; see `clover_jax.decoding.speculative.head_layers`)."""
        return state

    def layer_copy_bytes(self, head) -> int:
        """Bytes `unroll_layers` adds (the memory plan counts them)."""
        return 0

    def feature_layers(self, head) -> tuple[int, ...]:
        """Base layers (0-based, below the last) whose outputs the head reads besides the last layer's: the hidden
        states `start` and `commit` receive are then `[..., (n + 1) D]`, those layers' outputs in this order and the
        last layer's last (`clover_jax.models.llama.Llama.forward_hidden`'s `taps`). None by default."""
        return ()

    @abc.abstractmethod
    def start(self, head, base, state, f_prompt: jax.Array, y_prompt: jax.Array, lengths: jax.Array) -> Any:
        """Consumes the prompt: `f_prompt [B, T, D]` the base's pre-norm hidden states (`[B, T, (n + 1) D]` with
        `feature_layers`), `y_prompt [B, T]` the token after each position (the root after the last), `lengths
        [B]`."""

    @abc.abstractmethod
    def propose(self, head, base, state, root: jax.Array, key: jax.Array) -> Proposal:
        """The step's tree under `root [B]`."""

    @abc.abstractmethod
    def commit(self, head, base, state, f_new: jax.Array, y_new: jax.Array, num_new: jax.Array) -> Any:
        """Consumes the accepted nodes: `f_new [B, A, D]` their hidden states, `y_new [B, A]` the token after each
        (the last one is the next root), `num_new [B]` how many per row."""


def check_drafter(drafter) -> None:
    """A `DrafterError` unless `drafter` is a `Drafter` (every method the loop calls, with static sizes)."""
    if not isinstance(drafter, Drafter):
        raise DrafterError(f"{type(drafter).__name__} is not a clover_jax.decoding.drafter.Drafter: subclass it "
                           "(num_nodes, max_depth, check, init_state, start, propose, commit; arrays, "
                           "unroll_layers and layer_copy_bytes have defaults)")
    for field in ("num_nodes", "max_depth"):
        value = getattr(drafter, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if field == "num_nodes" else 1):
            raise DrafterError(f"{type(drafter).__name__}.{field} must be a static integer >= "
                               f"{2 if field == 'num_nodes' else 1}, got {value!r}")


class DrafterError(TypeError):
    """A drafter broke the loop's contract: a proposal or a state of the wrong shape, dtype or structure. Raised
    while the loop is traced (before anything runs); the message names the drafter, the method and the field."""


def check_proposal(drafter, prop: Proposal, batch: int, vocab_size: int) -> None:
    """A `DrafterError` unless `prop` is what the loop reads: tokens `[B, U]` of an integer dtype, the topology's
    `depth` `[U]` or `[B, U]` (integers) and `mask` `[U, U]` or `[B, U, U]` (bool), and with sampled drafts
    `draft_probs [B, U, V]` (floating, over the base model's whole vocabulary). Checked on shapes and dtypes only,
    at trace time: free at run time."""
    u = drafter.num_nodes

    sizes = {"B": batch, "U": u, "V": vocab_size}

    def expect(field: str, x, axes: tuple[str, ...], kind) -> None:
        try:
            if x is None:
                raise AssertionError("it is None")
            chex.assert_shape(x, tuple(sizes[a] for a in axes))
            chex.assert_type(x, kind)
        except AssertionError as e:
            raise DrafterError(f"{type(drafter).__name__}.propose: {field} must be [{', '.join(axes)}] {kind.__name__} "
                               f"with B = {batch} rows, U = num_nodes = {u}, V = {vocab_size}: {e}") from None

    expect("Proposal.tokens", prop.tokens, ("B", "U"), int)
    for field, shared, kind in (("depth", ("U",), int), ("mask", ("U", "U"), bool)):
        x = getattr(prop.buffers, field)
        per_row = x is not None and x.ndim == len(shared) + 1
        expect(f"Proposal.buffers.{field}", x, ("B", *shared) if per_row else shared, kind)
    if drafter.sampled_drafts:  # acceptance rule (a) reads the drafts' distribution
        expect("Proposal.draft_probs (sampled_drafts=True)", prop.draft_probs, ("B", "U", "V"), float)


def check_state(drafter, method: str, given, returned) -> None:
    """A `DrafterError` unless `returned` has the structure, shapes and dtypes of `given`: the loop carries a
    drafter's state through `lax.while_loop`, so `commit` must return the state it was given, updated."""
    try:
        chex.assert_trees_all_equal_structs(given, returned)
        chex.assert_trees_all_equal_shapes_and_dtypes(given, returned)
    except (AssertionError, ValueError) as e:
        raise DrafterError(f"{type(drafter).__name__}.{method} must return its state with the structure, shapes "
                           f"and dtypes it was given (the loop carries it from step to step): {e}") from None


class TreeDrafterBase(Drafter):
    """What drafters over a tree spec (a static `TreeSpec` or a `DynamicTree` policy, in `self.spec`, with an
    optional `self.draft_vocab`) share: their static sizes and the checks of the tree against a head and a base."""

    @property
    def num_nodes(self) -> int:
        return self.spec.num_nodes

    @property
    def max_depth(self) -> int:
        return self.spec.max_depth

    def check_tree(self, num_heads: int, vocab_size: int, what: str = "the head") -> None:
        """An `InputError` if the tree is deeper than the head's `num_heads` or asks for more candidates (top_k)
        than the drafting vocabulary holds, or if the draft vocabulary is not valid for `vocab_size`."""
        if self.max_depth > num_heads:
            raise InputError(f"tree {self.spec.name!r} is {self.max_depth} drafts deep but {what} has only "
                             f"{num_heads} heads; use a shallower tree or a head with more heads")
        if self.spec.top_k > vocab_size:
            raise InputError(f"tree top_k={self.spec.top_k} exceeds the vocabulary ({vocab_size})")
        if self.draft_vocab is not None:
            check_draft_vocab(self.draft_vocab, vocab_size)
            if self.spec.top_k > len(self.draft_vocab):
                raise InputError(f"tree top_k={self.spec.top_k} exceeds the draft vocabulary "
                                 f"({len(self.draft_vocab)} ids)")


def cached_arrays(drafter, build) -> dict:
    """`build()`'s arrays for `drafter`, built once per drafter (drafters are cached per tree and vocabulary) and
    always as concrete arrays: asked for first inside a jit trace, they would otherwise be traced values, cached on
    a drafter that later calls share (a leaked tracer)."""
    cached = drafter.__dict__.get("_arrays")
    if cached is None:
        with jax.ensure_compile_time_eval():
            cached = build()
        object.__setattr__(drafter, "_arrays", cached)
    return cached


def vocab_ids(draft_vocab) -> jax.Array | None:
    """The draft vocabulary's token ids `[Vd]` as an int32 array (None: the full vocabulary)."""
    return None if draft_vocab is None else jax.numpy.asarray(draft_vocab, jax.numpy.int32)


def commit_prompt(commit, cache, f_prompt: jax.Array, y_prompt: jax.Array, lengths: jax.Array,
                  chunk: int | None = None):
    """A head's prompt pass in blocks of `chunk` positions, as the base model's prefill runs a long prompt.

    `commit(cache, f [B, C, D], y [B, C], num [B], fresh, cache_extent) -> (state [B, ...], cache')` is the head's
    own commit of accepted positions (the heads' `commit(base, ...)` with the base bound). A prompt of at most
    `chunk` positions (or not a multiple of it) is one commit into the empty cache. A longer one is committed
    block by block in a `lax.while_loop` that stops after the longest row's last block, each block attending to
    the slots the earlier ones filled, read block by block up to the filled length (`cache_extent`): the head's
    attention then holds `[chunk, S]` scores per head, not `[T, T]` for the whole padded prompt (17 GB of float32
    scores for an 8,192-token prompt and 32 heads). A row's state is that of its last block holding a position.

    Args:
      cache: the head's empty cache; f_prompt: `[B, T, D]` the base's pre-norm hidden states of the prompt;
      y_prompt: `[B, T]` the token after each position (the root after the last); lengths: `[B]` prompt lengths.
    Returns:
      `(state [B, ...], cache)` with `cache.lengths = lengths`.
    """
    chunk = chunk or PREFILL_CHUNK
    t = f_prompt.shape[1]
    lengths = lengths.astype(jnp.int32)
    if t <= chunk or t % chunk:
        return commit(cache, f_prompt, y_prompt, lengths, True, None)
    state, cache = commit(cache, f_prompt[:, :chunk], y_prompt[:, :chunk], jnp.minimum(lengths, chunk), True, None)

    def body(start, num, carry):  # num [B]: a row whose prompt ended earlier advances by 0
        state, cache = carry
        f = jax.lax.dynamic_slice_in_dim(f_prompt, start, chunk, axis=1)  # [B, C, D]
        y = jax.lax.dynamic_slice_in_dim(y_prompt, start, chunk, axis=1)  # [B, C]
        new_state, cache = commit(cache, f, y, num, False, jnp.max(cache.lengths))
        keep = (num > 0).reshape(-1, *([1] * (new_state.ndim - 1)))
        return jnp.where(keep, new_state, state), cache

    return run_blocks(body, (state, cache), lengths, chunk, first=1)
