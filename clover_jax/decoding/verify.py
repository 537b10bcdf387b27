"""Acceptance of a drafted token tree against the target's outputs at every tree node.

Every acceptor is jit-able and batched, each row accepting its own number of drafts (no batch
minimum). Tree buffers (a static `tree.TreeBuffers` or a `topology.TreeTopology` built on device) may be
shared `[...]` or per-row `[B, ...]` (dynamic trees); only `paths`, `children` and `num_children` are read.
Shapes and einsum strings use the axis letters of `clover_jax.axes`.

Three rules (tree speculative sampling: SpecInfer, Miao et al. 2024, arXiv 2305.09781; Medusa/EAGLE code):
- `greedy_accept`: the longest path whose drafts equal the target's argmax (Medusa/EAGLE
  `evaluate_posterior`), bonus = argmax at the last accepted node.
- `sample_accept_topk`: rule (b), deterministic children (top-k / beam drafts): walking down from
  the root, child c is accepted with probability r(c) / sum(r), where r starts as the target's
  p at the node; a rejection zeroes r(c). Lossless for any set of distinct children.
- `sample_accept_sampled`: rule (a), children drawn without replacement from the draft's q
  (EAGLE-1 / Clover-2 code): sibling j is accepted w.p. min(1, r(c_j) / q_j(c_j)) with q_j = q
  minus the earlier siblings, renormalised; a rejection sets r <- norm(relu(r - q_j)). This
  assumes a node's children are the first draws of the sampler (ranks 0..m-1 without gaps,
  `TreeSpec.ranks_contiguous`).
In both sampling rules, when every child of the current node is rejected (or it is a leaf) the
bonus token is sampled from r. The probabilities `p` (and `q`) are already warped
(`sampling.warp_probs`); randomness comes in as explicit uniforms so a numpy oracle
(`reference.py`) can reproduce every decision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from clover_jax.decoding.sampling import argmax_last, sample_with_uniform
from clover_jax.decoding.tree import TreeBuffers

_TINY = 1e-30  # guards a division by a sum that rounding drove to zero


@struct.dataclass
class AcceptResult:
    num_accepted: jax.Array  # [B] int32: accepted DRAFT tokens (root excluded), 0..Dmax
    best_path: jax.Array  # [B] int32: a path row holding every accepted node (the first such row)
    accepted_nodes: jax.Array  # [B, Dmax+1] int32: root, accepted nodes, then 0 (gather-safe)
    next_token: jax.Array  # [B] int32: the bonus token, the target's own next token


def _rows(x, base_ndim: int, batch: int) -> jax.Array:
    """A buffer with a leading batch axis, broadcasting a shared one."""
    x = jnp.asarray(x)
    return x if x.ndim > base_ndim else jnp.broadcast_to(x, (batch,) + x.shape)


def _result(paths: jax.Array, best: jax.Array, num: jax.Array, token: jax.Array) -> AcceptResult:
    """Fill the accepted-node rows from `paths [B, P, Dmax+1]`, `best [B]`, `num [B]`."""
    row = jnp.take_along_axis(paths, best[:, None, None], axis=1)[:, 0]  # [B, Dmax+1]
    keep = jnp.arange(row.shape[-1])[None, :] <= num[:, None]
    return AcceptResult(num_accepted=num.astype(jnp.int32), best_path=best.astype(jnp.int32),
                        accepted_nodes=jnp.where(keep, row, 0).astype(jnp.int32),
                        next_token=token.astype(jnp.int32))


def greedy_accept(tree_tokens: jax.Array, target_logits: jax.Array, buffers: TreeBuffers) -> AcceptResult:
    """Greedy verification.

    tree_tokens [B, U] (node 0 the root), target_logits [B, U, V] (the target's outputs at each
    node). match[p, d] = token(path[p, d]) == argmax(logits[path[p, d-1]]); the accepted length of
    a path is its count of leading matches; `best_path` is the first path of maximal length.
    """
    b = tree_tokens.shape[0]
    paths = _rows(buffers.paths, 2, b)  # [B, P, Dmax+1]
    _, p, d1 = paths.shape
    safe = jnp.maximum(paths, 0).reshape(b, p * d1)
    target = argmax_last(target_logits)  # [B, U]
    drafted = jnp.take_along_axis(tree_tokens, safe, axis=1).reshape(b, p, d1)  # [B, P, Dmax+1]
    wanted = jnp.take_along_axis(target, safe, axis=1).reshape(b, p, d1)
    match = (drafted[:, :, 1:] == wanted[:, :, :-1]) & (paths[:, :, 1:] >= 0)  # [B, P, Dmax]
    acc = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)  # [B, P]
    best = jnp.argmax(acc, axis=-1)  # [B], first max
    num = jnp.take_along_axis(acc, best[:, None], axis=1)[:, 0]
    res = _result(paths, best, num, num)
    last = jnp.take_along_axis(res.accepted_nodes, num[:, None], axis=1)  # [B, 1]
    bonus = jnp.take_along_axis(target, last, axis=1)[:, 0]
    return res.replace(next_token=bonus)


def _walk(tokens, p, q, children, num_children, u_accept, u_sample, sampled: bool):
    """One row of the sampling walk. tokens [U], p/q [U, V], children [U, Cmax], num_children [U],
    u_accept [Dmax, Cmax], u_sample []. Returns (last accepted node, number accepted, bonus token)."""
    dmax, c = u_accept.shape

    def depth_step(d, state):
        node, num, active, r = state  # r [V]: the (unnormalised) target residual at `node`

        def sibling_step(j, s):
            r, qj, chosen = s
            child = children[node, j]
            valid = active & (j < num_children[node]) & (chosen < 0)
            tok = tokens[jnp.maximum(child, 0)]
            u = u_accept[d, j]
            if sampled:  # rule (a)
                rn = r / jnp.maximum(jnp.sum(r), _TINY)
                qn = qj / jnp.maximum(jnp.sum(qj), _TINY)
                accept = u * qn[tok] < rn[tok]  # u < min(1, r(c) / q_j(c))
                r_rej = jnp.maximum(rn - qn, 0.0)
            else:  # rule (b)
                accept = u * jnp.sum(r) < r[tok]  # u < r(c) / sum(r)
                r_rej = r.at[tok].set(0.0)
            reject = valid & ~accept
            chosen = jnp.where(valid & accept, child, chosen)
            r = jnp.where(reject, r_rej, r)
            if sampled:  # q_{j+1}: the draft's q without the siblings drawn so far
                qj = jnp.where(reject, qj.at[tok].set(0.0), qj)
            return r, qj, chosen

        init = (r, q[node] if sampled else r, jnp.int32(-1))
        r, _, chosen = jax.lax.fori_loop(0, c, sibling_step, init)
        down = chosen >= 0
        new_node = jnp.where(down, chosen, node)
        r = jnp.where(down, p[jnp.maximum(chosen, 0)], r)
        return new_node, num + down.astype(jnp.int32), down, r

    init = (jnp.int32(0), jnp.int32(0), jnp.bool_(True), p[0])
    node, num, _, r = jax.lax.fori_loop(0, dmax, depth_step, init)
    return node, num, sample_with_uniform(u_sample, r)


def _sample_accept(tree_tokens, p, q, buffers, u_accept, u_sample, sampled: bool) -> AcceptResult:
    b = tree_tokens.shape[0]
    paths = _rows(buffers.paths, 2, b)  # [B, P, Dmax+1]
    children = _rows(buffers.children, 2, b)  # [B, U, Cmax]
    num_children = _rows(buffers.num_children, 1, b)  # [B, U]
    dmax, c = paths.shape[-1] - 1, children.shape[-1]
    if u_accept.shape != (b, dmax, c):
        raise ValueError(f"u_accept must be [B, Dmax, Cmax] = {(b, dmax, c)}, got {u_accept.shape}")
    p = p.astype(jnp.float32)
    q = p if q is None else q.astype(jnp.float32)  # unused by rule (b)
    walk = jax.vmap(lambda *a: _walk(*a, sampled=sampled))
    node, num, bonus = walk(tree_tokens, p, q, children, num_children,
                            u_accept.astype(jnp.float32), u_sample.astype(jnp.float32))
    at_depth = jnp.take_along_axis(paths, jnp.broadcast_to(num[:, None, None], paths.shape[:2] + (1,)), 2)
    best = jnp.argmax(at_depth[:, :, 0] == node[:, None], axis=-1)  # [B]: first path through `node`
    return _result(paths, best, num, bonus)


def sample_accept_topk(tree_tokens: jax.Array, p: jax.Array, buffers: TreeBuffers,
                       u_accept: jax.Array, u_sample: jax.Array) -> AcceptResult:
    """Rule (b), for deterministic (top-k) children.

    tree_tokens [B, U]; p [B, U, V] warped target probabilities at every node; u_accept
    [B, Dmax, Cmax] uniforms in [0, 1), u_accept[b, d, j] deciding the j-th child of the accepted
    node at depth d; u_sample [B] for the bonus token (inverse CDF).
    """
    return _sample_accept(tree_tokens, p, None, buffers, u_accept, u_sample, sampled=False)


def sample_accept_sampled(tree_tokens: jax.Array, p: jax.Array, q: jax.Array, buffers: TreeBuffers,
                          u_accept: jax.Array, u_sample: jax.Array) -> AcceptResult:
    """Rule (a), for children drawn without replacement from the draft distribution.

    As `sample_accept_topk`, plus q [B, U, V]: the draft distribution each node's children were
    drawn from (read only at nodes that have children).
    """
    return _sample_accept(tree_tokens, p, q, buffers, u_accept, u_sample, sampled=True)


def draw_uniforms(key: jax.Array, batch: int, buffers: TreeBuffers) -> tuple[jax.Array, jax.Array]:
    """(u_accept [B, Dmax, Cmax], u_sample [B]) float32 uniforms in [0, 1) for the sampling acceptors."""
    k_acc, k_smp = jax.random.split(key)
    shape = (batch, buffers.paths.shape[-1] - 1, buffers.children.shape[-1])
    return (jax.random.uniform(k_acc, shape, jnp.float32),
            jax.random.uniform(k_smp, (batch,), jnp.float32))
