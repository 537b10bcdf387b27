"""Plain numpy reference of the acceptors in `verify.py`: loops, one row at a time.

A test oracle and documentation: each function follows the acceptance rules of `verify.py` step by step,
using only `parent` (children are recomputed from it) and `paths` (for the path-based greedy rule
and the reported `best_path`). Arithmetic is float32 in the same order of operations as the JAX
code, so decisions agree except at ties within rounding. Each function returns a dict with the
fields of `verify.AcceptResult` as numpy arrays.
"""

from __future__ import annotations

import numpy as np

from clover_jax.decoding.tree import TreeBuffers

_TINY = np.float32(1e-30)


def _row(buffers: TreeBuffers, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent [U], paths [P, Dmax+1]) of row b, shared or per-row buffers."""
    parent, paths = np.asarray(buffers.parent), np.asarray(buffers.paths)
    return (parent[b], paths[b]) if paths.ndim == 3 else (parent, paths)


def _children(parent: np.ndarray, node: int) -> list[int]:
    return [j for j in range(len(parent)) if parent[j] == node]  # node order is rank order


def _finish(paths: np.ndarray, best: int, num: int, token: int, out: dict, b: int) -> None:
    out["num_accepted"][b] = num
    out["best_path"][b] = best
    out["accepted_nodes"][b, :num + 1] = paths[best, :num + 1]
    out["next_token"][b] = token


def _empty(batch: int, dmax: int) -> dict:
    z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    return {"num_accepted": z(batch), "best_path": z(batch), "accepted_nodes": z(batch, dmax + 1),
            "next_token": z(batch)}


def sample_with_uniform(u: float, probs: np.ndarray) -> int:
    """Inverse CDF on unnormalised float32 probs, never returning a zero-probability tail token."""
    probs = probs.astype(np.float32)
    cdf = np.cumsum(probs, dtype=np.float32)
    idx = int(np.sum(cdf <= np.float32(u) * cdf[-1]))
    last_nonzero = int(np.nonzero(probs > 0)[0][-1]) if np.any(probs > 0) else len(probs) - 1
    return min(idx, last_nonzero)


def greedy_accept(tree_tokens: np.ndarray, target_logits: np.ndarray, buffers: TreeBuffers) -> dict:
    """Longest path of drafts equal to the target argmax at their parents; first such path wins."""
    batch = tree_tokens.shape[0]
    dmax = np.asarray(buffers.paths).shape[-1] - 1
    out = _empty(batch, dmax)
    for b in range(batch):
        _, paths = _row(buffers, b)
        target = np.argmax(target_logits[b], axis=-1)
        best, best_len = 0, -1
        for p in range(paths.shape[0]):
            n = 0
            for d in range(1, dmax + 1):
                node, prev = paths[p, d], paths[p, d - 1]
                if node < 0 or tree_tokens[b, node] != target[prev]:
                    break
                n += 1
            if n > best_len:
                best, best_len = p, n
        last = paths[best, best_len]
        _finish(paths, best, best_len, int(target[last]), out, b)
    return out


def _sample_accept(tree_tokens, p, q, buffers, u_accept, u_sample, sampled: bool) -> dict:
    batch = tree_tokens.shape[0]
    dmax = np.asarray(buffers.paths).shape[-1] - 1
    out = _empty(batch, dmax)
    for b in range(batch):
        parent, paths = _row(buffers, b)
        node, num = 0, 0
        r = p[b, 0].astype(np.float32)  # the target residual at the current node
        while True:
            kids = _children(parent, node)
            qj = q[b, node].astype(np.float32).copy() if sampled else None
            chosen = -1
            for j, child in enumerate(kids):
                tok = tree_tokens[b, child]
                u = np.float32(u_accept[b, num, j])
                if sampled:  # rule (a): accept w.p. min(1, r(c) / q_j(c))
                    rn = r / max(r.sum(dtype=np.float32), _TINY)
                    qn = qj / max(qj.sum(dtype=np.float32), _TINY)
                    if u * qn[tok] < rn[tok]:
                        chosen = child
                        break
                    r = np.maximum(rn - qn, np.float32(0))
                    qj[tok] = 0
                else:  # rule (b): accept w.p. r(c) / sum(r)
                    if u * r.sum(dtype=np.float32) < r[tok]:
                        chosen = child
                        break
                    r = r.copy()
                    r[tok] = 0
            if chosen < 0:  # every child rejected, or a leaf: the bonus comes from r
                break
            node, num = chosen, num + 1
            r = p[b, node].astype(np.float32)
        best = next(i for i in range(paths.shape[0]) if paths[i, num] == node)
        _finish(paths, best, num, sample_with_uniform(u_sample[b], r), out, b)
    return out


def sample_accept_topk(tree_tokens, p, buffers, u_accept, u_sample) -> dict:
    """Rule (b) of `verify.py` (deterministic children)."""
    return _sample_accept(tree_tokens, p, None, buffers, u_accept, u_sample, sampled=False)


def sample_accept_sampled(tree_tokens, p, q, buffers, u_accept, u_sample) -> dict:
    """Rule (a) of `verify.py` (children drawn without replacement from q)."""
    return _sample_accept(tree_tokens, p, q, buffers, u_accept, u_sample, sampled=True)
