"""Tree topology built on device from parent pointers: what verification needs of any draft tree.

Static trees (`tree.build_buffers`, numpy, from a spec of child ranks) and trees a drafter builds per step
and per row (dynamic trees, beam search merged into a tree) share verification through this one description:

  parent [U]     node 0 is the root (parent -1); node i > 0 hangs under parent[i] (any earlier or later node);
                 a node i > 0 with parent -1 is an unused slot of a fixed node budget
  rank   [U]     its rank among its siblings (children are listed in rank order, ties by node index)

`topology_from_parents(parent, rank, max_depth, max_children)` is jittable and batched (`[U]` or `[B, U]`, static
U, max_depth and max_children) and returns a `TreeTopology`: the ancestor mask the verify forward attends with,
the depth of each node (its position offset), children lists for the sampling walks and one root-to-node path per
node for greedy acceptance (a path to every node, not only to leaves: the longest accepted path is the same).
`max_depth` / `max_children` must bound the tree's depth and children counts (a drafter knows them from its own
budget); deeper nodes or extra children would be cut from the paths and children lists.

Shapes and einsum strings use the axis letters of `clover_jax.axes`. P = U here: one path per node.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TreeTopology:
    """The verification view of a tree (shared `[...]` or per row `[B, ...]`); the fields `verify` and the
    speculative loop read, with the meanings of `tree.TreeBuffers`."""

    mask: jax.Array  # [U, U] bool: mask[i, j] iff j is an ancestor-or-self of i
    depth: jax.Array  # [U] int32, root 0
    parent: jax.Array  # [U] int32, root (and unused slots) -1
    rank: jax.Array  # [U] int32
    children: jax.Array  # [U, Cmax] int32 in rank order, padded with -1
    num_children: jax.Array  # [U] int32
    paths: jax.Array  # [P, Dmax+1] int32: root-to-node index chains, padded with -1
    path_len: jax.Array  # [P] int32

    @property
    def num_nodes(self) -> int:
        return self.mask.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[-1] - 1

    @property
    def max_children(self) -> int:
        return self.children.shape[-1]


def _one_row(parent: jax.Array, rank: jax.Array, max_depth: int, max_children: int) -> TreeTopology:
    u = parent.shape[0]
    idx = jnp.arange(u, dtype=jnp.int32)
    parent = parent.astype(jnp.int32)
    attached = (idx == 0) | (parent >= 0)  # [U] the root and every node with a parent
    parent = jnp.where(idx == 0, -1, parent)
    # anc[:, k] = the k-th ancestor (k = 0: the node itself), -1 above the root
    anc = [idx]
    for _ in range(max_depth):
        prev = anc[-1]
        anc.append(jnp.where(prev >= 0, parent[jnp.maximum(prev, 0)], -1))
    anc = jnp.stack(anc, axis=1)  # [U, Dmax+1]
    depth = jnp.where(attached, jnp.sum(anc[:, 1:] >= 0, axis=1), 0).astype(jnp.int32)  # [U]
    mask = jnp.any(anc[:, :, None] == idx[None, None, :], axis=1)  # [U, U]
    mask = mask & (attached[:, None] | (idx[None, :] == idx[:, None]))  # an unused slot sees itself only
    # path of node i: its ancestors by increasing depth; an unused slot's path is the root alone
    d = jnp.arange(max_depth + 1)[None, :]  # [1, Dmax+1]
    pick = jnp.clip(depth[:, None] - d, 0, max_depth)
    paths = jnp.where(d <= depth[:, None], jnp.take_along_axis(anc, pick, axis=1), -1)  # [U, Dmax+1]
    paths = jnp.where(attached[:, None], paths, jnp.where(d == 0, 0, -1)).astype(jnp.int32)
    path_len = jnp.where(attached, depth + 1, 1).astype(jnp.int32)
    # children of p: nodes whose parent is p, by (rank, index)
    is_child = (parent[None, :] == idx[:, None]) & (idx[None, :] > 0)  # [U (parent), U (child)]
    key = jnp.where(is_child, rank[None, :].astype(jnp.int32) * u + idx[None, :], 2 * u * u)
    c = min(max_children, u)  # a node has at most U - 1 children, whatever the bound
    order = jnp.argsort(key, axis=1)[:, :c].astype(jnp.int32)  # [U, c]
    num_children = jnp.sum(is_child, axis=1).astype(jnp.int32)
    children = jnp.where(jnp.arange(c)[None, :] < num_children[:, None], order, -1)
    children = jnp.pad(children, ((0, 0), (0, max_children - c)), constant_values=-1)  # [U, Cmax]
    return TreeTopology(mask=mask, depth=depth, parent=parent, rank=rank.astype(jnp.int32), children=children,
                        num_children=jnp.minimum(num_children, max_children), paths=paths, path_len=path_len)


def topology_from_parents(parent: jax.Array, rank: jax.Array, max_depth: int, max_children: int) -> TreeTopology:
    """The `TreeTopology` of `parent` / `rank` `[U]` (one tree) or `[B, U]` (one per row); see the module
    docstring. Jittable; `max_depth` and `max_children` are static bounds."""
    parent, rank = jnp.asarray(parent), jnp.asarray(rank)
    if parent.shape != rank.shape or parent.ndim not in (1, 2):
        raise ValueError(f"parent and rank must both be [U] or [B, U], got {parent.shape} and {rank.shape}")
    fn = lambda p, r: _one_row(p, r, int(max_depth), int(max_children))  # noqa: E731
    return fn(parent, rank) if parent.ndim == 1 else jax.vmap(fn)(parent, rank)
