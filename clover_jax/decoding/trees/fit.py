"""Static trees fitted to a head: measured per-rank acceptance -> the tree with the most expected accepted tokens.

Sequoia (Chen et al. 2024, arXiv 2402.12374) observes that the best static tree of a given size follows from
one number per child position: how often the target accepts the draft's rank-r candidate given that its parent
was accepted. We keep one such number per depth as well, `p[d, r]` (d = 0 is the root's children), since a
draft head's confidence falls with depth. Under the model that acceptances at different nodes are independent
given their paths (Sequoia's own assumption), a node's chance of being accepted is the product of `p` along
its path, and the expected number of accepted drafts of a tree is the sum of that product over its nodes.

Because `p <= 1`, a node never scores above its parent, so the `n` highest-scoring nodes of the infinite tree
always form a tree (ancestor-closed): a best-first expansion finds the optimal tree of every size exactly, and
a depth limit is one more constraint on the same expansion (`best_tree`). Sequoia's dynamic program is needed
for its sampling-without-replacement acceptance model; under greedy verification (one target token per node,
so the events "rank r accepted" are disjoint and `sum_r p[d, r] <= 1`) the greedy expansion is exact (tested
against exhaustive search). Which size pays depends on the hardware's price per verified token: the
calibration (`clover_jax.tuning.calibrate`) measures it and picks among fitted trees by measured speed.

Estimating `p` (`rank_acceptance`): the speculative loop counts how often each tree node was on the accepted
path (`node_hist`); for a static tree a node is a path of child ranks, so `p[d, r]` is the number of
accepted depth-(d+1) rank-r nodes over the number of accepted parents that had a rank-r child, pooled over
every static tree measured. `probe_tree` is a comb that measures each depth's first ranks along the top-1
spine in one run. Cells seen under few parents are noisy (a calibration can see a rank-4 child accepted more
often than its rank-3 sibling), and a best-first expansion happily builds on such noise, so `smooth_acceptance`
shrinks each cell toward its rank's rate pooled over depths (a Beta prior, empirical Bayes) and then pools
adjacent ranks of a depth whose order is inverted (pool-adjacent-violators, weighted by parents seen) unless the
inversion is significant (a two-proportion z-test): the head ranks its candidates by its own probability, so a
later rank accepted more often is taken for noise unless the counts say otherwise.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import hashlib
import heapq
from typing import Iterable, Sequence

import numpy as np

from clover_jax.decoding.trees.base import TreeSpecError
from clover_jax.decoding.trees.spec import TreeSpec


def probe_tree(widths: Sequence[int]) -> TreeSpec:
    """A comb: along the top-1 spine, the node at depth d has children of ranks 0..widths[d]-1. One run of it
    measures `p[d, r]` for r < widths[d] at every depth. Name `probe-8-6-4` for widths (8, 6, 4)."""
    widths = [int(w) for w in widths]
    if not widths or min(widths) < 1:
        raise TreeSpecError(f"probe tree: widths must be integers >= 1, got {widths}")
    choices = [(0,) * d + (r,) for d, w in enumerate(widths) for r in range(w)]
    return TreeSpec(choices, top_k=max(widths), name="probe-" + "-".join(map(str, widths)))


def rank_acceptance(runs: Iterable[tuple[TreeSpec, Sequence[int]]], max_depth: int, max_rank: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """`(p [Dmax, R], parents [Dmax, R])` from `(tree, node_hist)` pairs of static trees: `p[d, r]` the
    fraction of accepted parents at depth d (with a rank-r child) whose rank-r child was accepted, `parents`
    the number of such parents observed (0 where the trees never had that child: `p` is 0 there)."""
    hits = np.zeros((max_depth, max_rank), np.float64)  # [Dmax, R]
    seen = np.zeros((max_depth, max_rank), np.float64)  # [Dmax, R]
    for spec, node_hist in runs:
        node_hist = np.asarray(node_hist, np.float64)  # [U]
        if node_hist.shape != (spec.num_nodes,):
            raise ValueError(f"node_hist has {node_hist.shape} entries; tree {spec.name} has {spec.num_nodes} nodes")
        index = {c: i + 1 for i, c in enumerate(spec.choices)}  # path -> node (the root is node 0)
        index[()] = 0
        for path, node in index.items():
            if not path or len(path) > max_depth or path[-1] >= max_rank:
                continue
            d, r = len(path) - 1, path[-1]
            hits[d, r] += node_hist[node]
            seen[d, r] += node_hist[index[path[:-1]]]
    p = np.divide(hits, seen, out=np.zeros_like(hits), where=seen > 0)
    return p, seen


def smooth_acceptance(p: np.ndarray, parents: np.ndarray, prior_parents: float = 10.0, z_max: float = 3.0
                      ) -> np.ndarray:
    """`p [Dmax, R]` (from `rank_acceptance`) with each measured cell shrunk toward its rank's acceptance pooled
    over depths, as if `prior_parents` more parents had been seen at that rate; then, within each depth, adjacent
    ranks whose acceptance rises with rank are pooled (weighted by parents seen) unless the raw counts make the
    rise significant (z > `z_max`). Unmeasured cells (0 parents) stay 0. Last, a depth whose rates sum past 1 is
    scaled to sum 1: at most one child of a node is accepted, so its ranks' rates are shares of one probability
    (the prior can pull a rank up at a depth where another rank took every acceptance, and a tree holding both
    would otherwise be predicted more tokens than it is deep)."""
    p = np.asarray(p, np.float64)
    w = np.asarray(parents, np.float64)  # [Dmax, R]
    if p.shape != w.shape:
        raise ValueError(f"p {p.shape} and parents {w.shape} differ in shape")
    hits = p * w
    seen = w.sum(0)  # [R]
    pooled = np.divide(hits.sum(0), seen, out=np.zeros_like(seen), where=seen > 0)  # [R]
    q = np.where(w > 0, (hits + prior_parents * pooled) / np.maximum(w + prior_parents, 1e-12), 0.0)
    for d in range(q.shape[0]):
        cols = np.flatnonzero(w[d] > 0)
        if len(cols) > 1:
            q[d, cols] = _pool_inversions(q[d, cols], p[d, cols], w[d, cols], z_max)
    total = q.sum(1, keepdims=True)  # [Dmax, 1]
    return np.where(total > 1.0, q / np.maximum(total, 1e-12), q)


def _pool_inversions(y: np.ndarray, raw: np.ndarray, n: np.ndarray, z_max: float) -> np.ndarray:
    """Pool-adjacent-violators towards a non-increasing `y`, weighted by `n` trials, leaving alone an increase
    that a two-proportion z-test on the raw rates `raw` (the evidence, before any prior) finds significant."""
    blocks: list[list[float]] = []  # [rate, raw rate, trials, length]
    for yi, ri, ni in zip(y, raw, n):
        blocks.append([float(yi), float(ri), float(ni), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m1, r1, n1, l1), (m2, r2, n2, l2) = blocks[-2], blocks[-1]
            r = (r1 * n1 + r2 * n2) / (n1 + n2)
            se = np.sqrt(max(r * (1 - r), 1e-12) * (1 / n1 + 1 / n2))
            if (r2 - r1) / se > z_max:
                break  # an inversion the counts make certain: keep it
            blocks[-2:] = [[(m1 * n1 + m2 * n2) / (n1 + n2), r, n1 + n2, l1 + l2]]
    return np.concatenate([np.full(int(k), m) for m, _, _, k in blocks])


def path_scores(spec: TreeSpec, p: np.ndarray) -> np.ndarray:
    """[U] each node's chance of being accepted under `p` (the root: 1); ranks or depths outside `p` score 0."""
    p = np.asarray(p, np.float64)
    score = {(): 1.0}
    out = [1.0]
    for path in spec.choices:  # sorted by depth: a parent comes first
        d, r = len(path) - 1, path[-1]
        q = p[d, r] if d < p.shape[0] and r < p.shape[1] else 0.0
        score[path] = score[path[:-1]] * q
        out.append(score[path])
    return np.asarray(out)


def expected_tau(spec: TreeSpec, p: np.ndarray) -> float:
    """Expected tokens per step (accepted drafts plus the bonus token) of a static tree under `p`."""
    return float(path_scores(spec, p).sum())  # the root's 1 stands for the bonus token


def best_tree(p: np.ndarray, num_nodes: int, max_depth: int | None = None) -> TreeSpec:
    """The static tree of at most `num_nodes` nodes (root included) and depth at most `max_depth` with the
    largest `expected_tau` under `p [Dmax, R]` (best-first expansion; see the module docstring). Nodes that
    could never be accepted (score 0) are left out, so the tree may be smaller. Named `fit-N-<hash>`."""
    p = np.asarray(p, np.float64)
    if p.ndim != 2 or p.size == 0:
        raise ValueError(f"p must be [depth, rank] with entries, got shape {p.shape}")
    if np.any(p < 0) or np.any(p > 1):
        raise ValueError("p must hold probabilities in [0, 1]")
    if num_nodes < 2:
        raise TreeSpecError(f"a fitted tree needs at least 2 nodes (the root and one draft), got {num_nodes}")
    depth_cap = p.shape[0] if max_depth is None else min(int(max_depth), p.shape[0])
    # max-heap on score; ties broken by (depth, path) so the result does not depend on float noise in order
    heap = [(-p[0, r], 1, (r,)) for r in range(p.shape[1])]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes - 1:
        neg, depth, path = heapq.heappop(heap)
        if -neg <= 0.0 and chosen:
            break
        chosen.append(path)
        if depth < depth_cap:
            for r in range(p.shape[1]):
                heapq.heappush(heap, (neg * p[depth, r], depth + 1, path + (r,)))
    top_k = max(c[-1] for c in chosen) + 1
    tag = hashlib.sha1(repr(sorted(chosen)).encode()).hexdigest()[:6]
    return TreeSpec(chosen, top_k=top_k, name=f"fit-{len(chosen) + 1}-{tag}")


def fit_step_cost(points: Sequence[tuple[int, int, float]]):
    """A step-cost model `cost(num_nodes, depth)` (in units of one autoregressive step) fitted by least squares
    to measured `(num_nodes, depth, cost)` points: `a + b * num_nodes + c * depth`, the verify forward growing
    with the tokens it verifies and the draft with the levels it expands. With fewer than three distinct points
    (or a negative slope) the model falls back to the measured costs' linear fit in `num_nodes` alone, and to a
    constant with one point."""
    pts = np.asarray(points, np.float64)
    if pts.ndim != 2 or len(pts) == 0:
        raise ValueError("fit_step_cost needs at least one measured (num_nodes, depth, cost) point")
    n, d, y = pts[:, 0], pts[:, 1], pts[:, 2]
    if len(np.unique(pts[:, :2], axis=0)) >= 3:
        coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n, d], 1), y, rcond=None)
        if coef[1] >= 0 and coef[2] >= 0:
            return lambda nodes, depth: float(coef[0] + coef[1] * nodes + coef[2] * depth)
    if len(np.unique(n)) >= 2:
        b, a = np.polyfit(n, y, 1)
        b = max(b, 0.0)
        return lambda nodes, depth: float(a + b * nodes)
    return lambda nodes, depth: float(y.mean())


def fitted_candidates(p: np.ndarray, cost, max_nodes: int, max_depth: int, count: int = 2
                      ) -> list[tuple[TreeSpec, float, float]]:
    """The `count` fitted trees (distinct) with the highest predicted speed-up over autoregressive decoding,
    `expected_tau / cost(num_nodes, depth)`, over sizes 2..max_nodes and depth limits 1..max_depth; each as
    `(tree, expected tau, predicted speed-up)`, best first."""
    found: dict[tuple, tuple[TreeSpec, float, float]] = {}
    for n in range(2, int(max_nodes) + 1):
        for d in range(1, int(max_depth) + 1):
            spec = best_tree(p, n, d)
            if spec.choices in found:
                continue
            tau = expected_tau(spec, p)
            found[spec.choices] = (spec, tau, tau / max(cost(spec.num_nodes, spec.max_depth), 1e-9))
    return sorted(found.values(), key=lambda t: -t[2])[:count]
