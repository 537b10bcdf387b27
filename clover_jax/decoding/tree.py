"""Static token trees: specs ("choices"), the buffers built from them, and presets.

A tree spec is a list of paths, each a list of child ranks: `[0, 2]` is the third-ranked child of
the top-ranked child of the root. Paths are sorted by `(len, lexicographic)` as in Medusa and
EAGLE; node 0 is the root (the token the target has already emitted, not in `choices`) and node
`j + 1` is sorted choice `j`, so parents always come before children and siblings follow rank order.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.

Drafting is per parent (EAGLE-1 / Clover-2): at step `s` (s = 0..Dmax-1) the drafter expands every
node of depth `s` that has children, in node order (`expand_nodes[s]`), and proposes `top_k`
candidates for each. A node at depth `d` is candidate `rank` of its parent, the parent being entry
`parent_slot` of `expand_nodes[d - 1]`. So with `cand = cat([root], topk_0.flat, topk_1.flat, ...)`
(step `s` flattened as `[E_s, top_k]`) the tree tokens are `cand[cand_index]`, exactly the
`tree_indices` of the Clover/EAGLE-1 code. Medusa instead indexes one top-k per depth (shared by all
parents); those trees are still valid here, drafted per parent.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import re
from typing import Any, ClassVar, Sequence

import numpy as np
from flax import struct

from clover_jax.decoding.topology import TreeTopology
from clover_jax.validation import InputError

MAX_DEPTH = 32  # deeper trees are rejected: no drafter is useful that far out
DEFAULT_TOP_K = 10  # Medusa / EAGLE / Clover TOPK, used for bare-list JSON files


class TreeSpecError(InputError):
    """An invalid tree spec; the message names the offending path."""


def _as_path(raw: Any, i: int) -> tuple[int, ...]:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise TreeSpecError(f"choice {i} ({raw!r}) is not a list of child ranks")
    path = []
    for x in raw:
        if isinstance(x, bool):
            raise TreeSpecError(f"path {list(raw)} (choice {i}): rank {x!r} is not an integer")
        try:
            path.append(operator.index(x))
        except TypeError:
            raise TreeSpecError(f"path {list(raw)} (choice {i}): rank {x!r} is not an integer") from None
    return tuple(path)


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A validated static tree. `choices` is stored sorted by (len, lexicographic).

    Raises `TreeSpecError` for: no paths, an empty path, a negative rank, a rank >= `top_k`, a
    duplicate path, a path whose parent path is not in the tree, or a depth over `MAX_DEPTH`.
    """

    kind: ClassVar[str] = "static tree (clover2-26, small-10, medusa-63, chain-N, a fitted tree or a JSON file)"

    choices: tuple[tuple[int, ...], ...]
    top_k: int = DEFAULT_TOP_K
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 1:
            raise TreeSpecError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if isinstance(self.choices, (str, bytes)) or not isinstance(self.choices, Sequence):
            raise TreeSpecError(f"choices must be a list of paths, got {type(self.choices).__name__}")
        if len(self.choices) == 0:
            raise TreeSpecError("choices is empty: a tree needs at least one draft node")
        seen: set[tuple[int, ...]] = set()
        for i, raw in enumerate(self.choices):
            path = _as_path(raw, i)
            if not path:
                raise TreeSpecError(f"choice {i} is an empty path (the root is implicit; do not list it)")
            for r in path:
                if r < 0:
                    raise TreeSpecError(f"path {list(path)} (choice {i}): negative rank {r}")
                if r >= self.top_k:
                    raise TreeSpecError(f"path {list(path)} (choice {i}): rank {r} >= top_k {self.top_k}")
            if len(path) > MAX_DEPTH:
                raise TreeSpecError(f"path {list(path)} (choice {i}): depth {len(path)} > MAX_DEPTH {MAX_DEPTH}")
            if path in seen:
                raise TreeSpecError(f"path {list(path)} (choice {i}) is listed twice")
            seen.add(path)
        for path in seen:
            if len(path) > 1 and path[:-1] not in seen:
                raise TreeSpecError(f"path {list(path)} has no parent: its prefix {list(path[:-1])} is not in the tree")
        object.__setattr__(self, "choices", tuple(sorted(seen, key=lambda c: (len(c), c))))
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def num_nodes(self) -> int:
        """U: draft nodes plus the root."""
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        return len(self.choices[-1])

    @property
    def depth_counts(self) -> list[int]:
        """Number of nodes at depth 1..max_depth."""
        counts = [0] * self.max_depth
        for c in self.choices:
            counts[len(c) - 1] += 1
        return counts

    @property
    def num_paths(self) -> int:
        """P: number of leaves."""
        parents = {c[:-1] for c in self.choices}
        return sum(1 for c in self.choices if c not in parents)

    @property
    def ranks_contiguous(self) -> bool:
        """Whether every node's children have ranks 0..m-1 (needed by sampled-draft rule (a))."""
        ranks: dict[tuple[int, ...], list[int]] = {}
        for c in self.choices:
            ranks.setdefault(c[:-1], []).append(c[-1])
        return all(r == list(range(len(r))) for r in ranks.values())

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"choices": [list(c) for c in self.choices], "top_k": self.top_k}, f)


@struct.dataclass
class TreeBuffers:
    """Index arrays of one static tree (numpy; a pytree, so it can be a jit argument).

    Two parts: the topology every tree has (mask .. path_len: the fields of `topology.TreeTopology`, all that
    verification and the loop read) and the per-parent expansion plan of drafters that expand a static tree
    depth by depth (cand_index .. draft_index: Clover-2's). `topology()` keeps only the first part; trees built
    on device from parent pointers (`topology.topology_from_parents`) have only that part.
    Per-row buffers (dynamic trees) carry a leading batch axis B on every array.
    """

    mask: np.ndarray  # [U, U] bool: mask[i, j] iff j is an ancestor-or-self of i (column 0 all true)
    depth: np.ndarray  # [U] int32, root 0 (the position offset of each node)
    parent: np.ndarray  # [U] int32, root -1
    rank: np.ndarray  # [U] int32: child rank under the parent, root 0
    children: np.ndarray  # [U, Cmax] int32: children in rank order, padded with -1
    num_children: np.ndarray  # [U] int32
    paths: np.ndarray  # [P, Dmax+1] int32: root-to-leaf node indices, padded with -1
    path_len: np.ndarray  # [P] int32: valid entries of each path row (root included)
    cand_index: np.ndarray  # [U] int32: index into cat([root], topk_0.flat, topk_1.flat, ...)
    parent_slot: np.ndarray  # [U] int32: the parent's position in expand_nodes[depth-1], root -1
    expand_nodes: np.ndarray  # [Dmax, E] int32: nodes the drafter expands at step s, padded with -1
    num_expand: np.ndarray  # [Dmax] int32
    expand_parent_slot: np.ndarray  # [Dmax, E] int32: parent_slot of expand_nodes (0 where padded)
    expand_rank: np.ndarray  # [Dmax, E] int32: rank of expand_nodes (0 where padded)
    draft_index: np.ndarray  # [U] int32: index into cat([root], topk.flat) with topk [Dmax, E, top_k]
    top_k: int = struct.field(pytree_node=False, default=DEFAULT_TOP_K)

    @property
    def num_nodes(self) -> int:
        return self.mask.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[-1] - 1

    @property
    def max_children(self) -> int:
        return self.children.shape[-1]

    def topology(self):
        """The verification view (`topology.TreeTopology`) of these buffers, without the expansion plan."""
        return TreeTopology(mask=self.mask, depth=self.depth, parent=self.parent, rank=self.rank,
                            children=self.children, num_children=self.num_children, paths=self.paths,
                            path_len=self.path_len)


def build_buffers(spec: TreeSpec) -> TreeBuffers:
    """All index arrays of a static tree; see `TreeBuffers` for each field."""
    choices, k = spec.choices, spec.top_k
    u, dmax = spec.num_nodes, spec.max_depth
    index = {(): 0} | {c: j + 1 for j, c in enumerate(choices)}
    nodes = [()] + list(choices)
    depth = np.array([len(c) for c in nodes], np.int32)
    parent = np.array([-1] + [index[c[:-1]] for c in choices], np.int32)
    rank = np.array([0] + [c[-1] for c in choices], np.int32)

    kids: list[list[int]] = [[] for _ in range(u)]
    for j in range(1, u):
        kids[parent[j]].append(j)  # node order within a parent is rank order
    cmax = max(len(x) for x in kids)
    children = np.full((u, cmax), -1, np.int32)
    for i, x in enumerate(kids):
        children[i, :len(x)] = x
    num_children = np.array([len(x) for x in kids], np.int32)

    mask = np.zeros((u, u), bool)
    for i in range(u):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]

    # Medusa's retrieve_indices order: leaves by decreasing node index (deepest, last-sorted first)
    leaves = [i for i in range(u - 1, 0, -1) if num_children[i] == 0]
    paths = np.full((len(leaves), dmax + 1), -1, np.int32)
    for p, leaf in enumerate(leaves):
        chain = []
        j = leaf
        while j >= 0:
            chain.append(j)
            j = parent[j]
        paths[p, :len(chain)] = chain[::-1]
    path_len = (paths >= 0).sum(-1).astype(np.int32)

    expanded = [[i for i in range(u) if depth[i] == s and num_children[i] > 0] for s in range(dmax)]
    emax = max(len(x) for x in expanded)
    expand_nodes = np.full((dmax, emax), -1, np.int32)
    for s, x in enumerate(expanded):
        expand_nodes[s, :len(x)] = x
    num_expand = np.array([len(x) for x in expanded], np.int32)
    slot_of = {n: e for x in expanded for e, n in enumerate(x)}
    parent_slot = np.array([-1] + [slot_of[parent[j]] for j in range(1, u)], np.int32)

    offset = np.concatenate([[1], 1 + np.cumsum(num_expand * k)])  # start of step s in cand
    cand_index = np.zeros(u, np.int32)
    draft_index = np.zeros(u, np.int32)
    for j in range(1, u):
        s = depth[j] - 1
        cand_index[j] = offset[s] + parent_slot[j] * k + rank[j]
        draft_index[j] = 1 + (s * emax + parent_slot[j]) * k + rank[j]

    valid = expand_nodes >= 0
    safe = np.maximum(expand_nodes, 0)
    return TreeBuffers(
        mask=mask, depth=depth, parent=parent, rank=rank, children=children, num_children=num_children,
        paths=paths, path_len=path_len, cand_index=cand_index, parent_slot=parent_slot,
        expand_nodes=expand_nodes, num_expand=num_expand,
        expand_parent_slot=np.where(valid, parent_slot[safe], 0).astype(np.int32),
        expand_rank=np.where(valid, rank[safe], 0).astype(np.int32),
        draft_index=draft_index, top_k=k)


def _pad_to(x: np.ndarray, shape: tuple[int, ...], fill: int) -> np.ndarray:
    out = np.full(shape, fill, x.dtype)
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def stack_buffers(buffers: Sequence[TreeBuffers]) -> TreeBuffers:
    """Per-row buffers `[B, ...]` from trees with the same number of nodes U.

    P, Dmax, C and E are padded to the largest: extra path rows are the root alone (`[0, -1, ...]`,
    length 1), extra columns -1, so every acceptor gives the same result as on the unpadded tree.
    `cand_index` and `draft_index` keep each row's own layout. All trees must share `top_k`.
    """
    if len({b.num_nodes for b in buffers}) != 1 or len({b.top_k for b in buffers}) != 1:
        raise TreeSpecError("stack_buffers needs trees with the same number of nodes and top_k")
    p = max(b.paths.shape[0] for b in buffers)
    d = max(b.max_depth for b in buffers)
    c = max(b.max_children for b in buffers)
    e = max(b.expand_nodes.shape[1] for b in buffers)
    u = buffers[0].num_nodes

    def paths(b):
        out = _pad_to(b.paths, (p, d + 1), -1)
        out[b.paths.shape[0]:, 0] = 0
        return out

    rows = {
        "paths": [paths(b) for b in buffers],
        "path_len": [_pad_to(b.path_len, (p,), 1) for b in buffers],
        "children": [_pad_to(b.children, (u, c), -1) for b in buffers],
        "expand_nodes": [_pad_to(b.expand_nodes, (d, e), -1) for b in buffers],
        "num_expand": [_pad_to(b.num_expand, (d,), 0) for b in buffers],
        "expand_parent_slot": [_pad_to(b.expand_parent_slot, (d, e), 0) for b in buffers],
        "expand_rank": [_pad_to(b.expand_rank, (d, e), 0) for b in buffers],
    }
    same = ("mask", "depth", "parent", "rank", "num_children", "cand_index", "parent_slot", "draft_index")
    fields = {f: np.stack(v) for f, v in rows.items()}
    fields |= {f: np.stack([getattr(b, f) for b in buffers]) for f in same}
    return TreeBuffers(**fields, top_k=buffers[0].top_k)


# ---------------------------------------------------------------------------------------------
# Presets

# EAGLE-1 `eagle/model/choices.py::mc_sim_7b_63`, also Clover's `clover/model/choices.py`: 25 drafts.
CLOVER2_26 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
              [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
              [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]

# FasterDecoding/Medusa `medusa/model/medusa_choices.py::mc_sim_7b_63`: 63 drafts (64 nodes with the
# root), depth counts [10, 28, 23, 2], 42 leaves. The "63" counts draft nodes, not the root.
MEDUSA_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
             [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
             [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
             [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
             [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
             [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
             [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]


def clover2_26() -> TreeSpec:
    """Clover-2 / EAGLE-1 `mc_sim_7b_63`: 25 drafts + root, depths [4, 8, 8, 3, 2], 15 paths, top_k 10."""
    return TreeSpec(CLOVER2_26, top_k=10, name="clover2-26")


def medusa_63() -> TreeSpec:
    """Medusa `mc_sim_7b_63`: 63 drafts + root, depths [10, 28, 23, 2], 42 paths, top_k 10."""
    return TreeSpec(MEDUSA_63, top_k=10, name="medusa-63")


# A 10-token tree for machines where verifying many tokens costs more than one decode step (CPUs):
# three candidates at depth 1, two at depth 2, then the top-1 chain of the best path to depth 5.
SMALL_10 = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]


def small_10() -> TreeSpec:
    """9 drafts + root, depths [3, 3, 1, 1, 1], 4 paths, top_k 10 (see SMALL_10)."""
    return TreeSpec(SMALL_10, top_k=10, name="small-10")


def chain(k: int) -> TreeSpec:
    """A single path of `k` drafts (top-1 at every step): plain speculative decoding."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise TreeSpecError(f"chain length must be an integer >= 1, got {k!r}")
    return TreeSpec([[0] * d for d in range(1, k + 1)], top_k=1, name=f"chain-{k}")


def from_json(path: str | os.PathLike) -> TreeSpec:
    """A spec from `{"choices": [...], "top_k": k}` or a bare list of paths (top_k 10)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TreeSpecError(f"tree file {os.fspath(path)}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise TreeSpecError(f"tree file {os.fspath(path)}: not a text file ({e})") from None
    name = os.path.basename(os.fspath(path))
    if isinstance(data, list):
        return TreeSpec(data, top_k=DEFAULT_TOP_K, name=name)
    if not isinstance(data, dict) or "choices" not in data:
        raise TreeSpecError(f"{path}: expected a list of paths or an object with 'choices' (and 'top_k')")
    unknown = set(data) - {"choices", "top_k", "name"}
    if unknown:
        raise TreeSpecError(f"{path}: unknown keys {sorted(unknown)}; allowed: choices, top_k, name")
    return TreeSpec(data["choices"], top_k=data.get("top_k", DEFAULT_TOP_K), name=data.get("name", name))


PRESETS = {"clover2-26": clover2_26, "medusa-63": medusa_63, "small-10": small_10}


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A tree policy, not a tree: the drafter builds a new tree per step and per row (EAGLE-2, Li et al. 2024,
    arXiv 2406.16858). From the root it expands the `top_k` frontier nodes with the highest cumulative draft
    log-probability, `depth` times, each into its `top_k` most likely children; then it keeps the `budget - 1`
    best of all the candidates by cumulative log-probability (an ancestor-closed set: a child never scores
    above its parent) and verifies them with the root. Name: `dynamic-N` (N = budget, root included), optionally
    `dynamic-N-dD-kK`. The defaults (depth 5, top-k 8), the Clover-2 head's depth and EAGLE-2's order of
    magnitude, gave the shipped SmolLM2 head the highest tau of depth 3-5 x top-k 2-8 on 24 MT-Bench prompts (10 and
    26 tokens; top-k 12 adds 0.3% and 1.7% for 2.25x the candidates scored; docs/benchmarks.md).

    `top_p < 1` adds Clover-1's candidate selection (Xiao et al. 2024, arXiv 2405.00263): each node keeps only
    its children up to cumulative draft probability `top_p` (the first always), the rest are never verified;
    what is kept is ranked by joint probability into the same budget, so a confident head verifies fewer tokens
    (the slots left over are unused). Name suffix `-pP`, e.g. `dynamic-10-p0.8`."""

    kind: ClassVar[str] = "dynamic tree policy (dynamic-N, dynamic-N-pP)"

    budget: int
    depth: int = 5
    top_k: int = 8
    top_p: float = 1.0
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        for field, lo in (("budget", 2), ("depth", 1), ("top_k", 1)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise TreeSpecError(f"dynamic tree: {field} must be an integer >= {lo}, got {v!r}")
        if self.depth > MAX_DEPTH:
            raise TreeSpecError(f"dynamic tree: depth {self.depth} > MAX_DEPTH {MAX_DEPTH}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise TreeSpecError(f"dynamic tree: top_p must be in (0, 1], got {self.top_p!r}")
        if self.budget - 1 > self.num_candidates:
            raise TreeSpecError(f"dynamic tree: budget {self.budget} needs {self.budget - 1} drafts but depth "
                                f"{self.depth} x top-k {self.top_k} proposes only {self.num_candidates}")
        if not self.name:
            p = "" if self.top_p == 1 else f"-p{self.top_p:g}"
            object.__setattr__(self, "name", f"dynamic-{self.budget}-d{self.depth}-k{self.top_k}{p}")

    @property
    def num_candidates(self) -> int:
        """Draft nodes generated per step before the final selection: k at depth 1, k*k at each deeper one."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def num_nodes(self) -> int:
        return int(self.budget)

    @property
    def max_depth(self) -> int:
        return int(self.depth)


@dataclasses.dataclass(frozen=True)
class BeamTree:
    """A tree policy for beam-search drafters (ReDrafter, Zhang et al. 2024, arXiv 2403.09919): per step and
    per row the drafter runs a beam search of `width` beams of `length` tokens (the root included, the
    reference's `BeamShape(width, length)`), then merges beams that share a prefix into one tree (each distinct
    prefix one node). The distinct nodes are packed in (beam, depth) order into a budget of `budget` verified
    tokens, root included (default `1 + width * (length - 1)`: every node of every beam fits); a smaller budget
    keeps the best beams whole and cuts the later ones, and slots that dedup left empty are unused (verified but
    never accepted). Name: `beam-WxL`, optionally `beam-WxL-uN`."""

    kind: ClassVar[str] = "beam-search policy (beam-WxL)"

    width: int
    length: int
    budget: int = 0
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        for field, lo in (("width", 1), ("length", 2), ("budget", 0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise TreeSpecError(f"beam tree: {field} must be an integer >= {lo}, got {v!r}")
        if self.length - 1 > MAX_DEPTH:
            raise TreeSpecError(f"beam tree: length {self.length} drafts {self.length - 1} deep > MAX_DEPTH "
                                f"{MAX_DEPTH}")
        full = 1 + self.width * (self.length - 1)
        if self.budget == 0:
            object.__setattr__(self, "budget", full)
        if not self.length <= self.budget <= full:
            raise TreeSpecError(f"beam tree: budget {self.budget} must lie between the beam length {self.length} "
                                f"(the best beam whole) and {full} (every node of {self.width} beams)")
        if not self.name:
            suffix = "" if self.budget == full else f"-u{self.budget}"
            object.__setattr__(self, "name", f"beam-{self.width}x{self.length}{suffix}")

    @property
    def num_nodes(self) -> int:
        return int(self.budget)

    @property
    def max_depth(self) -> int:
        return int(self.length) - 1

    top_k = property(lambda self: int(self.width))  # the most children a node can have


@dataclasses.dataclass(frozen=True)
class LookupTree:
    """A tree policy (`clover_jax.decoding.lookup`): `inner` (a head's static tree or per-step policy, or None: the
    root alone) plus a chain of `length` tokens found by prompt lookup, under the root. Names: `lookup-K[-nN][-table]`
    (no head), `TREE+lookup-K[-nN][-table]` (N = `max_ngram`, default 3; `-table`: where the sequence has no match,
    the chain comes from an n-gram table of the base model's replies, `clover_jax.decoding.ngram`)."""

    kind: ClassVar[str] = "prompt-lookup tree (lookup-K, TREE+lookup-K)"

    inner: Any  # TreeSpec, DynamicTree or BeamTree (a head drafts it), or None: the root alone
    length: int
    max_ngram: int = 3
    name: str = dataclasses.field(default="", compare=False)
    table: bool = False  # fall back to an n-gram table (the drafter is given one) where lookup finds no match

    def __post_init__(self):
        for field, lo in (("length", 1), ("max_ngram", 1)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise TreeSpecError(f"lookup tree: {field} must be an integer >= {lo}, got {v!r}")
        if self.length > MAX_DEPTH:
            raise TreeSpecError(f"lookup tree: a chain of {self.length} tokens is deeper than MAX_DEPTH {MAX_DEPTH}")
        if isinstance(self.inner, LookupTree):
            raise TreeSpecError("lookup tree: the inner tree is already a lookup tree (one lookup chain per tree)")
        if not self.name:
            n = "" if self.max_ngram == 3 else f"-n{self.max_ngram}"
            inner = "" if self.inner is None else f"{self.inner.name}+"
            object.__setattr__(self, "name", f"{inner}lookup-{self.length}{n}{'-table' if self.table else ''}")

    @property
    def num_nodes(self) -> int:
        return (1 if self.inner is None else int(self.inner.num_nodes)) + int(self.length)

    @property
    def max_depth(self) -> int:
        return max(0 if self.inner is None else int(self.inner.max_depth), int(self.length))

    @property
    def top_k(self) -> int:  # the most children a node can have: the inner tree's, plus the chain under the root
        return (0 if self.inner is None else int(self.inner.top_k)) + 1


TreePolicy = (TreeSpec, DynamicTree, BeamTree, LookupTree)


def policy_kind(policy_type: type) -> str:
    """What a tree-policy type is called in messages ("a static tree (clover2-26, ...)"), with the names that give
    one."""
    return getattr(policy_type, "kind", policy_type.__name__)

# trees named at run time (the fitted trees of a calibration, `clover_jax.decoding.tree_fit`): name -> spec
_REGISTERED: dict[str, TreeSpec] = {}


def register_tree(spec: TreeSpec) -> TreeSpec:
    """Makes `get_tree(spec.name)` return `spec` in this process (how a calibration's fitted trees are reached
    by name). Re-registering the same tree is a no-op; another tree under a taken name is an error."""
    if not isinstance(spec, TreeSpec):
        raise TreeSpecError(f"only static trees can be registered, got {type(spec).__name__}")
    try:
        taken = get_tree(spec.name)
    except TreeSpecError:
        taken = None
    if taken is not None and taken != spec:
        raise TreeSpecError(f"tree name {spec.name!r} is already taken by another tree")
    _REGISTERED[spec.name] = spec
    return spec


def get_tree(name_or_path: str | os.PathLike | TreeSpec | DynamicTree | BeamTree | LookupTree
             ) -> TreeSpec | DynamicTree | BeamTree | LookupTree:
    """Resolve "clover2-26", "medusa-63", "chain-N", "dynamic-N[-dD][-kK]" (a `DynamicTree` policy),
    "beam-WxL[-uN]" (a `BeamTree` policy), "lookup-K[-nN][-table]" or "TREE+lookup-K[-nN][-table]" (a
    `LookupTree`: a prompt lookup chain alone or beside TREE, with an n-gram table's chain where lookup finds no
    match), or a JSON file path (a policy object passes through)."""
    if isinstance(name_or_path, TreePolicy):
        return name_or_path
    key = os.fspath(name_or_path)
    m = re.fullmatch(r"(?:(.+)\+)?lookup-(\d+)(?:-n(\d+))?(-table)?", key)
    if m and key not in _REGISTERED:
        inner, k, n, table = m.groups()
        return LookupTree(None if inner is None else get_tree(inner), int(k), int(n) if n else 3, name=key,
                          table=bool(table))
    if key in PRESETS:
        return PRESETS[key]()
    if key in _REGISTERED:
        return _REGISTERED[key]
    m = re.fullmatch(r"chain-(\d+)", key)
    if m:
        return chain(int(m.group(1)))
    m = re.fullmatch(r"dynamic-(\d+)(?:-d(\d+))?(?:-k(\d+))?(?:-p(\d*\.?\d+))?", key)
    if m:
        n, d, k, p = m.groups()
        return DynamicTree(int(n), depth=int(d) if d else 5, top_k=int(k) if k else 8,
                           top_p=float(p) if p else 1.0, name=key)
    m = re.fullmatch(r"beam-(\d+)x(\d+)(?:-u(\d+))?", key)
    if m:
        w, n, u = m.groups()
        return BeamTree(int(w), int(n), int(u) if u else 0, name=key)
    if key.endswith(".json") or os.path.isfile(key):
        if not os.path.isfile(key):
            raise TreeSpecError(f"tree file {key!r} does not exist")
        return from_json(key)
    known = ", ".join(list(PRESETS) + ["chain-N", "dynamic-N", "beam-WxL", "lookup-K", "TREE+lookup-K"])
    if re.fullmatch(r"(fit|probe)-[0-9a-f-]+", key):
        raise TreeSpecError(f"tree {key!r} is a calibration's fitted tree, not known in this process: ask for "
                            "tree='auto' (it loads the calibration's trees), or save it as JSON (TreeSpec.to_json)")
    raise TreeSpecError(f"unknown tree {key!r}; known names: {known}, or a path to a .json file")


def is_lookup_only(tree) -> bool:
    """Whether `tree` is a prompt-lookup chain alone (`lookup-K`, `lookup-K-table`), which drafts without a head.
    False for None, "auto" and a name that cannot be resolved here (a calibration's fitted tree, known once its head
    is given; a bad name is reported when the tree is resolved with the head)."""
    if tree is None or (isinstance(tree, str) and tree.strip().lower() == "auto"):
        return False
    try:
        spec = get_tree(tree)
    except TreeSpecError:
        return False
    return isinstance(spec, LookupTree) and spec.inner is None


def is_table_tree(tree) -> bool:
    """Whether `tree` names a prompt-lookup chain with an n-gram table's fallback (`...lookup-K-table`)."""
    if tree is None or (isinstance(tree, str) and tree.strip().lower() == "auto"):
        return False
    try:
        spec = get_tree(tree)
    except TreeSpecError:
        return False
    return isinstance(spec, LookupTree) and spec.table
