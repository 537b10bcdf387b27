"""Index arrays of static trees: `TreeBuffers` (a pytree), `build_buffers(spec)` and `stack_buffers` (per row).

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

from typing import Sequence

import numpy as np
from flax import struct

from clover_jax.decoding.trees.topology import TreeTopology
from clover_jax.decoding.trees.base import DEFAULT_TOP_K, TreeSpecError
from clover_jax.decoding.trees.spec import TreeSpec


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
