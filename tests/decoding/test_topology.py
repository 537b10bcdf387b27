"""`topology_from_parents` (jitted, on device) describes every preset tree as the host-built buffers do, and the
acceptors give the same decisions on either; per-row trees and unused node slots work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.decoding import verify
from clover_jax.decoding.trees.topology import topology_from_parents
from clover_jax.decoding.tree import build_buffers, get_tree

TREES = ["chain-3", "small-10", "clover2-26", "medusa-63"]
build = jax.jit(topology_from_parents, static_argnums=(2, 3))


def _topology(spec):
    buf = build_buffers(spec)
    return buf, build(jnp.asarray(buf.parent), jnp.asarray(buf.rank), spec.max_depth, buf.children.shape[1])


@pytest.mark.parametrize("name", TREES)
def test_same_description_as_the_host_buffers(name):
    buf, top = _topology(get_tree(name))
    for field in ("mask", "depth", "parent", "rank", "children", "num_children"):
        np.testing.assert_array_equal(np.asarray(getattr(top, field)), getattr(buf, field), err_msg=field)
    # a path to every node: each is the node's ancestor chain; the host's leaf paths are among them
    paths = {tuple(int(x) for x in row if x >= 0) for row in np.asarray(top.paths)}
    assert {tuple(int(x) for x in row if x >= 0) for row in buf.paths} <= paths
    for row, n in zip(np.asarray(top.paths), np.asarray(top.path_len)):
        chain = [int(x) for x in row if x >= 0]
        assert len(chain) == n and chain[0] == 0
        assert all(buf.parent[c] == p for p, c in zip(chain, chain[1:]))


def _tokens_and_logits(buf, seed, batch=3, vocab=64):
    """Tree tokens (distinct among siblings, as top-k drafts are) and target logits where some paths match the
    target's argmax for a few steps."""
    rng = np.random.default_rng(seed)
    u = buf.mask.shape[0]
    offset = rng.integers(0, vocab, (batch, 1))
    tokens = ((offset + 11 * buf.parent[None, :] + buf.rank[None, :]) % vocab).astype(np.int32)
    logits = rng.normal(size=(batch, u, vocab)).astype(np.float32)
    for b in range(batch):  # make the target agree with the drafts along random nodes
        for i in rng.choice(np.arange(1, u), size=min(u - 1, 6), replace=False):
            logits[b, buf.parent[i], tokens[b, i]] += 10.0
    return jnp.asarray(tokens), jnp.asarray(logits)


@pytest.mark.parametrize("name", TREES)
@pytest.mark.slow  # a speculative loop per tree and acceptor
def test_acceptors_decide_the_same_on_either(name):
    buf, top = _topology(get_tree(name))
    for seed in range(4):
        tokens, logits = _tokens_and_logits(buf, seed)
        a, b = verify.greedy_accept(tokens, logits, buf), verify.greedy_accept(tokens, logits, top)
        for field in ("num_accepted", "accepted_nodes", "next_token"):
            np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)))
        p = jax.nn.softmax(logits, axis=-1)
        u_acc, u_smp = verify.draw_uniforms(jax.random.key(seed), tokens.shape[0], buf)
        a = verify.sample_accept_topk(tokens, p, buf, u_acc, u_smp)
        b = verify.sample_accept_topk(tokens, p, top, u_acc, u_smp)
        for field in ("num_accepted", "accepted_nodes", "next_token"):
            np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)))


def test_per_row_trees_and_unused_slots():
    """Row 0: chain-3 plus 6 unused slots; row 1: small-10. Each row verifies as its own tree alone."""
    chain, small = build_buffers(get_tree("chain-3")), build_buffers(get_tree("small-10"))
    u = small.mask.shape[0]
    parent = np.full((2, u), -1, np.int32)
    rank = np.zeros((2, u), np.int32)
    parent[0, :4], rank[0, :4] = chain.parent, chain.rank
    parent[1], rank[1] = small.parent, small.rank
    top = build(jnp.asarray(parent), jnp.asarray(rank), 5, small.children.shape[1])
    assert top.mask.shape == (2, u, u)
    np.testing.assert_array_equal(np.asarray(top.mask[0, 4:, :]), np.eye(u, dtype=bool)[4:])  # unused: self only
    np.testing.assert_array_equal(np.asarray(top.depth[0]), [0, 1, 2, 3] + [0] * (u - 4))
    assert int(top.num_children[0, 0]) == 1  # unused slots are nobody's children
    np.testing.assert_array_equal(np.asarray(top.mask[1]), small.mask)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 16, (2, u)).astype(np.int32)
    logits = rng.normal(size=(2, u, 16)).astype(np.float32)
    for i in (1, 2):  # row 0: the chain's first two drafts match, so 2 are accepted
        logits[0, i - 1, tokens[0, i]] += 10
    logits[0, 3, :] = 0
    logits[0, 2, (tokens[0, 3] + 1) % 16] += 20  # the third draft is wrong
    res = verify.greedy_accept(jnp.asarray(tokens), jnp.asarray(logits), top)
    alone = verify.greedy_accept(jnp.asarray(tokens[:1, :4]), jnp.asarray(logits[:1, :4]), chain)
    assert int(res.num_accepted[0]) == 2 == int(alone.num_accepted[0])
    np.testing.assert_array_equal(np.asarray(res.accepted_nodes[0, :4]), np.asarray(alone.accepted_nodes[0]))
    assert int(res.next_token[0]) == int(alone.next_token[0])
    row1 = verify.greedy_accept(jnp.asarray(tokens[1:]), jnp.asarray(logits[1:]), small)
    assert int(res.num_accepted[1]) == int(row1.num_accepted[0])


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="parent and rank"):
        topology_from_parents(np.zeros(4, np.int32), np.zeros(5, np.int32), 2, 2)


def test_dynamic_tree_policy_names_and_limits():
    from clover_jax.decoding.tree import DynamicTree, TreeSpecError

    t = get_tree("dynamic-26")
    assert isinstance(t, DynamicTree) and (t.num_nodes, t.max_depth, t.top_k) == (26, 5, 8)
    assert get_tree("dynamic-12-d3-k4") == DynamicTree(12, depth=3, top_k=4)
    with pytest.raises(TreeSpecError, match="budget 30 needs 29 drafts.*proposes only 20"):
        DynamicTree(30, depth=2, top_k=4)
    with pytest.raises(TreeSpecError, match="unknown tree"):
        get_tree("dynamic-x")


@pytest.mark.slow  # compiles a dynamic drafter against a reference
def test_dynamic_drafter_keeps_the_best_candidates_as_a_tree():
    """One proposal of the Clover-2 dynamic drafter: U nodes, every kept node's parent kept (no unused slot),
    depth within the bound, siblings distinct and one level below their parent."""
    from flax import nnx

    from clover_jax.heads.registry import drafter_for
    from clover_jax.heads.clover2.model import Clover2Config, Clover2Head, init_from_base
    from clover_jax.models.config import LlamaConfig
    from clover_jax.models.llama import init_llama

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    base = init_llama(cfg, seed=0)
    head = init_from_base(base, Clover2Config(num_heads=4, num_aug_layers=1), seed=1)
    nnx.update(head, {"fcout_w": jax.random.normal(jax.random.key(2), head.fcout_w.shape) * 0.3})
    drafter = drafter_for(Clover2Head, "dynamic-14-d4-k3")
    state = drafter.init_state(head, base, 2, 64)
    state = state.replace(s0=jax.random.normal(jax.random.key(5), state.s0.shape))
    prop = drafter.propose(head, base, state, jnp.asarray([7, 9]), jax.random.key(0))
    top = prop.buffers
    assert prop.tokens.shape == (2, 14) and top.mask.shape == (2, 14, 14)
    parent, depth = np.asarray(top.parent), np.asarray(top.depth)
    assert np.all(parent[:, 1:] >= 0) and np.all(depth[:, 1:] >= 1) and depth.max() <= 4
    tokens = np.asarray(prop.tokens)
    for r in range(2):
        for p in range(14):
            kids = [c for c in range(1, 14) if parent[r, c] == p]
            assert len({tokens[r, c] for c in kids}) == len(kids)  # distinct siblings
            assert all(depth[r, c] == depth[r, p] + 1 for c in kids)
