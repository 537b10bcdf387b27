"""Acceptors: jitted JAX == numpy oracle on random trees, and lossless sampling (chi-square)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.decoding import reference as R
from clover_jax.decoding import tree as T
from clover_jax.decoding import verify as V

greedy = jax.jit(V.greedy_accept)
topk = jax.jit(V.sample_accept_topk)
sampled = jax.jit(V.sample_accept_sampled)
FIELDS = ("num_accepted", "best_path", "accepted_nodes", "next_token")


def random_spec(rng, num_nodes: int, top_k: int = 3, max_depth: int = 5) -> T.TreeSpec:
    """A random tree of exactly `num_nodes` nodes with contiguous child ranks."""
    choices = [()]
    while len(choices) < num_nodes:
        parent = choices[rng.integers(len(choices))]
        rank = sum(1 for c in choices if c[:-1] == parent and len(c) == len(parent) + 1)
        if rank < top_k and len(parent) < max_depth:
            choices.append(parent + (rank,))
    return T.TreeSpec([list(c) for c in choices[1:]], top_k=top_k)


def random_probs(rng, shape, vocab: int) -> np.ndarray:
    """Peaked float32 distributions, some with zeros (as after top-k/top-p warping)."""
    x = rng.normal(size=shape + (vocab,)) * 2.0
    x = np.where(rng.random(x.shape) < 0.2, -np.inf, x)
    x[..., 0] = np.maximum(x[..., 0], -1.0)  # never all -inf
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def assert_same(got: V.AcceptResult, want: dict):
    for f in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), want[f], err_msg=f)


def random_parents(rng, batch: int, slots: int, max_depth: int) -> np.ndarray:
    """`[B, U]` parent pointers as the dynamic and beam drafters build them: node i hangs under an earlier used
    node of depth < max_depth, or is an unused slot (-1, about one in five) that nothing hangs under."""
    parent = np.full((batch, slots), -1, np.int32)
    for b in range(batch):
        depth = {0: 0}
        for i in range(1, slots):
            if rng.random() < 0.2:
                continue
            p = int(rng.choice([j for j, d in depth.items() if d < max_depth]))
            parent[b, i], depth[i] = p, depth[p] + 1
    return parent


def cases():
    """(buffers, batch) pairs: presets, random shared trees, per-row stacked trees, and per-row trees built on
    device from parent pointers with unused slots (what dynamic and beam policies verify)."""
    from clover_jax.decoding.trees.topology import topology_from_parents

    rng = np.random.default_rng(1)
    out = [(T.build_buffers(T.clover2_26()), 6), (T.build_buffers(T.chain(4)), 5)]
    out += [(T.build_buffers(random_spec(rng, int(n))), 7) for n in (2, 6, 9, 13)]
    for n in (5, 11):
        rows = [T.build_buffers(random_spec(rng, n)) for _ in range(6)]
        out.append((T.stack_buffers(rows), 6))
    for n, depth in ((7, 3), (12, 4)):
        parent = random_parents(rng, 6, n, depth)
        rank = np.broadcast_to(np.arange(n, dtype=np.int32), parent.shape)
        out.append((topology_from_parents(jnp.asarray(parent), jnp.asarray(rank), depth, n), 6))
    return out


CASES = cases()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_matches_reference(case):
    buffers, batch = CASES[case]
    rng = np.random.default_rng(case)
    u = buffers.num_nodes
    for vocab in (3, 5):
        for _ in range(3):
            tokens = rng.integers(0, vocab, (batch, u)).astype(np.int32)
            logits = rng.normal(size=(batch, u, vocab)).astype(np.float32)
            got = greedy(tokens, logits, buffers)
            assert_same(got, R.greedy_accept(tokens, logits, buffers))
            assert got.accepted_nodes.shape == (batch, buffers.max_depth + 1)


def test_greedy_full_chain_and_bonus():
    b = T.build_buffers(T.chain(3))
    logits = jax.nn.one_hot(jnp.array([[5, 6, 7, 8]]), 10)  # target continues 5 6 7, then 8
    res = greedy(jnp.array([[4, 5, 6, 7]]), logits, b)
    assert res.num_accepted.tolist() == [3] and res.next_token.tolist() == [8]
    assert res.accepted_nodes.tolist() == [[0, 1, 2, 3]]
    res = greedy(jnp.array([[4, 5, 9, 7]]), logits, b)  # second draft wrong
    assert res.num_accepted.tolist() == [1] and res.next_token.tolist() == [6]
    assert res.accepted_nodes.tolist() == [[0, 1, 0, 0]]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampling_matches_reference(case):
    buffers, batch = CASES[case]
    rng = np.random.default_rng(100 + case)
    u, vocab = buffers.num_nodes, 6
    key = jax.random.PRNGKey(case)
    for _ in range(4):
        key, sub = jax.random.split(key)
        u_acc, u_smp = (np.asarray(x) for x in V.draw_uniforms(sub, batch, buffers))
        assert u_acc.shape == (batch, buffers.max_depth, buffers.max_children)
        p = random_probs(rng, (batch, u), vocab)
        q = random_probs(rng, (batch, u), vocab)
        # tokens mostly from the high-probability part of p, so paths get accepted
        tokens = np.argsort(-p[:, :, :], axis=-1)[:, :, :3]
        tokens = np.take_along_axis(tokens, rng.integers(0, 3, (batch, u, 1)), -1)[..., 0].astype(np.int32)
        got = topk(tokens, p, buffers, u_acc, u_smp)
        assert_same(got, R.sample_accept_topk(tokens, p, buffers, u_acc, u_smp))
        got = sampled(tokens, p, q, buffers, u_acc, u_smp)
        assert_same(got, R.sample_accept_sampled(tokens, p, q, buffers, u_acc, u_smp))


# ---------------------------------------------------------------------------------------------
# Losslessness: the emitted tokens follow the target distribution whatever the drafts are.

def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was emitted"
    expected = n * probs[keep]
    stat = float(np.sum((counts[keep] - expected) ** 2 / expected))
    dof = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(dof / 2.0, stat / 2.0))


# root with 2 children; node 1 (first child) with 3 children
LOSSLESS_TREE = T.TreeSpec([[0], [1], [0, 0], [0, 1], [0, 2]], top_k=3)
P_NODE = np.array([[0.35, 0.25, 0.2, 0.15, 0.05],  # root
                   [0.05, 0.1, 0.5, 0.0, 0.35],  # node 1
                   [0.2, 0.2, 0.2, 0.2, 0.2],
                   [0.2, 0.2, 0.2, 0.2, 0.2],
                   [0.2, 0.2, 0.2, 0.2, 0.2],
                   [0.2, 0.2, 0.2, 0.2, 0.2]], np.float32)
Q_NODE = np.array([[0.05, 0.1, 0.15, 0.6, 0.1],  # root: the draft favours token 3
                   [0.4, 0.3, 0.1, 0.1, 0.1]] + [[0.2] * 5] * 4, np.float32)


@functools.partial(jax.jit, static_argnames=("rule", "n"))
def _simulate(key, rule: str, n: int):
    """n independent verification steps; returns (first emitted token, accepted node 1, second token)."""
    b = T.build_buffers(LOSSLESS_TREE)
    k_draft, k_u = jax.random.split(key)
    p = jnp.broadcast_to(jnp.asarray(P_NODE), (n, 6, 5))
    q = jnp.broadcast_to(jnp.asarray(Q_NODE), (n, 6, 5))
    if rule == "topk":  # deterministic children: the draft's top-k
        order = jnp.argsort(-q, axis=-1)  # [n, U, V]
    else:  # children drawn without replacement from q (Gumbel top-k)
        g = jax.random.gumbel(k_draft, q.shape)
        order = jnp.argsort(-(jnp.log(q) + g), axis=-1)
    # node -> (parent, rank): 1:(0,0) 2:(0,1) 3:(1,0) 4:(1,1) 5:(1,2)
    parent, rank = jnp.array(b.parent[1:]), jnp.array(b.rank[1:])
    tokens = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), order[:, parent, rank].astype(jnp.int32)], 1)
    u_acc, u_smp = V.draw_uniforms(k_u, n, b)
    if rule == "topk":
        res = V.sample_accept_topk(tokens, p, b, u_acc, u_smp)
    else:
        res = V.sample_accept_sampled(tokens, p, q, b, u_acc, u_smp)
    drafted = jnp.take_along_axis(tokens, res.accepted_nodes[:, 1:], 1)  # [n, Dmax]
    num, bonus = res.num_accepted, res.next_token
    first = jnp.where(num > 0, drafted[:, 0], bonus)
    second = jnp.where(num > 1, drafted[:, 1], jnp.where(num == 1, bonus, -1))
    via_node1 = (res.num_accepted >= 1) & (res.accepted_nodes[:, 1] == 1)
    return first, via_node1, second


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_lossless_statistics(rule):
    n = 40000
    first, via1, second = (np.asarray(x) for x in _simulate(jax.random.PRNGKey(7), rule, n))
    counts = np.bincount(first, minlength=5)
    assert chi_square_pvalue(counts, P_NODE[0].astype(np.float64)) > 1e-3, counts / n
    # the test has power: the draft distribution itself is rejected
    assert chi_square_pvalue(counts, Q_NODE[0].astype(np.float64)) < 1e-9
    # after accepting node 1, the next emitted token follows the target at node 1
    assert via1.sum() > 3000
    counts2 = np.bincount(second[via1], minlength=5)
    assert chi_square_pvalue(counts2, P_NODE[1].astype(np.float64)) > 1e-3, counts2 / via1.sum()
