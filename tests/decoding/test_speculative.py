"""Speculative decoding: exactness (greedy), losslessness (sampling), compilation, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax import generate
from clover_jax import prepare_generate
from homogeneity import chi2_homogeneity
from clover_jax.decoding import speculative
from clover_jax.decoding.tree import TreeSpecError
from clover_jax.heads import registry
from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.models.cache import CacheOverflowError
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA


@pytest.fixture(scope="module")
def tiny():
    base = init_llama(CFG, seed=0)
    return base, init_from_base(base, Clover2Config())


def _prompts(n, seed=0, lo=2, hi=20):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 64, rng.randint(lo, hi)).tolist() for _ in range(n)]


# chain-4 in the fast tier; a loop each for the rest (dynamic-4: fewer nodes than top-k children)
@pytest.mark.parametrize("tree", ["chain-4", *(pytest.param(t, marks=pytest.mark.slow) for t in (
    "clover2-26", "medusa-63", "dynamic-10", "dynamic-26", "dynamic-12-d3-k4", "dynamic-4"))])
def test_greedy_equals_autoregressive_tiny(tiny, tree):
    base, head = tiny
    prompts = _prompts(4)
    ar = generate(base, prompts, max_new_tokens=40, cache_size=160)
    sp = generate(base, prompts, max_new_tokens=40, cache_size=160, mode="speculative", head=head, tree=tree)
    assert sp.token_ids == ar.token_ids
    assert sp.steps <= ar.steps




@pytest.mark.parametrize("tree", ["chain-4", "dynamic-10"])
@pytest.mark.slow  # compiles each loop twice (scan and unrolled layers)
def test_unrolled_layers_equal_the_scan(tiny, tree):
    """The speculative loop with unrolled layers (per-layer weight buffers and KV cache; `auto` picks it on a
    GPU) decodes what the scanned loop and autoregressive decoding decode, with the same
    acceptance."""
    base, head = tiny
    prompts = _prompts(3, seed=2)
    n = max(len(p) for p in prompts)
    prompt = np.zeros((3, n), np.int32)
    for r, p in enumerate(prompts):
        prompt[r, :len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    from clover_jax.decoding.sampling import SamplingParams

    runs = {layers: speculative.spec_generate(base, head, prompt, lens, max_new_tokens=30, cache_size=n + 60,
                                              sampling=SamplingParams(), key=jax.random.key(0),
                                              drafter=registry.drafter_for(type(head), tree),
                                              layers=layers) for layers in ("scan", "unrolled")}
    (scan, scan_stats, _), (unrolled, unrolled_stats, _) = runs["scan"], runs["unrolled"]
    np.testing.assert_array_equal(np.asarray(scan.tokens), np.asarray(unrolled.tokens))
    assert scan_stats["accept_hist"] == unrolled_stats["accept_hist"]
    ar = generate(base, prompts, max_new_tokens=30, cache_size=n + 60)
    for r, p in enumerate(prompts):
        got = np.asarray(unrolled.tokens[r, len(p):int(unrolled.lengths[r])]).tolist()
        assert got == ar.token_ids[r]


@pytest.mark.slow  # compiles each head's loop twice (scan and unrolled layers)
@pytest.mark.parametrize("head_type", ["clover2", "clover1", "eagle"])
def test_head_layers_unrolled_draft_what_the_scan_drafts(head_type):
    """The loop runs a Clover head's Augmenting Block unrolled (`head_layers`: per-layer weights taken once by
    `unroll_layers`) on a CPU or GPU without a mesh: the drafts equal those of the scanned block, after the prompt
    and after a commit. EAGLE's draft layer keeps its scan."""
    from clover_jax.heads import registry
    from clover_jax.parallel import make_mesh

    assert speculative.head_layers() == "unrolled"  # this CPU
    assert speculative.head_layers(make_mesh(data=1, tp=1, devices=jax.devices()[:1])) == "scan"
    base = init_llama(CFG, seed=0)
    ht = registry.get(head_type)
    head = ht.module_cls(CFG, ht.config_cls(), rngs=nnx.Rngs(3))
    head = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(4), x.shape, x.dtype), head)
    drafter = registry.drafter_for(type(head), "small-10")
    b, t = 2, 9
    rng = np.random.RandomState(5)
    f = jnp.asarray(rng.randn(b, t, CFG.hidden_size), jnp.float32)
    y = jnp.asarray(rng.randint(3, 64, (b, t)), jnp.int32)
    lens = jnp.asarray([9, 6])
    root = jnp.asarray([7, 11])

    unrolled_state = []

    @functools.partial(jax.jit, static_argnums=2)
    def run(head, base, unroll):
        st = drafter.init_state(head, base, b, 32)
        st = drafter.start(head, base, drafter.unroll_layers(head, st) if unroll else st, f, y, lens)
        unrolled_state.append(st.layer_weights is not None)
        first = drafter.propose(head, base, st, root, jax.random.key(0)).tokens  # [B, U]
        st = drafter.commit(head, base, st, f[:, :3], y[:, :3], jnp.asarray([3, 2]))
        return first, drafter.propose(head, base, st, root, jax.random.key(0)).tokens

    scan = run(head, base, False)
    unrolled = run(head, base, True)
    assert unrolled_state == [False, head_type != "eagle"]
    for a, c in zip(scan, unrolled):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert len(set(np.asarray(scan[0]).ravel().tolist())) > 2  # real drafts, not one repeated id
    # the per-layer copy is counted in the memory plan (Clover heads)
    plan = prepare_generate(base, _prompts(2), max_new_tokens=4, cache_size=64, mode="speculative", head=head,
                            tree="small-10")
    copy = plan.memory.get("per-layer copy of the draft head's layers", 0)
    assert copy == (0 if head_type == "eagle" else sum(x.nbytes for x in jax.tree.leaves(head.aug.layer_params())))


@pytest.mark.slow  # loops up to the end of the cache
def test_greedy_equals_autoregressive_up_to_cache_end(tiny):
    base, head = tiny
    prompts = _prompts(3, seed=5)
    u = 26
    longest = max(len(p) for p in prompts)
    size = longest + 24 + u  # exactly what prompt + max_new + tree needs
    ar = generate(base, prompts, max_new_tokens=24, cache_size=size)
    sp = generate(base, prompts, max_new_tokens=24, cache_size=size, mode="speculative", head=head)
    assert sp.token_ids == ar.token_ids
    with pytest.raises(CacheOverflowError, match="slots for the draft tree"):
        generate(base, prompts, max_new_tokens=24, cache_size=size - 1, mode="speculative", head=head)


@pytest.mark.slow  # compiles a loop per prompt bucket
def test_one_compile_per_bucket(tiny):
    base, head = tiny
    prompts = _prompts(2, seed=1)
    generate(base, prompts, max_new_tokens=8, cache_size=96, mode="speculative", head=head)
    drafter = registry.drafter_for(type(head), "clover2-26")
    fn = speculative.jitted_loop(base, head, drafter, 96, True)  # the cached loop generate ran
    n = fn._cache_size()
    assert n >= 1
    generate(base, _prompts(2, seed=2), max_new_tokens=17, cache_size=96, mode="speculative", head=head)
    assert fn._cache_size() == n


def test_bad_input(tiny):
    base, head = tiny
    with pytest.raises(TreeSpecError):
        generate(base, [[5, 6, 7]], max_new_tokens=4, mode="speculative", head=head, tree="chain-0")
    with pytest.raises(TreeSpecError, match="known"):
        generate(base, [[5, 6, 7]], max_new_tokens=4, mode="speculative", head=head, tree="no-such-tree")
    for tree in (None, "fit-5-411aab+lookup-6-table"):  # a fitted tree is known only with its head
        with pytest.raises(ValueError, match="needs a draft head"):
            generate(base, [[5, 6, 7]], max_new_tokens=4, mode="speculative", tree=tree)
    other = init_llama(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12), seed=0)
    with pytest.raises(ValueError, match="hidden_size"):
        generate(other, [[5, 6, 7]], max_new_tokens=4, mode="speculative", head=head)
    with pytest.raises(ValueError, match="drafts deep"):
        generate(base, [[5, 6, 7]], max_new_tokens=4, mode="speculative", head=head, tree="chain-7")


def _first_tokens(result, n):
    return np.array([t[:n] for t in result.token_ids])


@pytest.mark.slow  # sampling loops over many rows
@pytest.mark.parametrize("top_p,tree,temperature", [(1.0, "chain-2", 1.0), (0.8, "chain-2", 1.0),
                                                    (1.0, "dynamic-6-d2-k3", 1.0), (1.0, "dynamic-6-d2-k3", 0.7)])
def test_sampling_is_lossless(top_p, tree, temperature):
    """Distribution of generated tokens 2..3 (which pass through tree acceptance) under speculative
    sampling vs plain sampling, over many rows with independent randomness: chi-square homogeneity. The
    dynamic tree is built per row from the head's scores (each row its own tree)."""
    cfg = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, eos_token_ids=(99,))
    base = init_llama(cfg, seed=1)
    base.embed[...] = base.embed[...] * 40  # a peaked but not degenerate distribution
    head = init_from_base(base, Clover2Config(num_heads=3))
    rows = 3000
    prompts = [[3, 5, 7]] * rows
    kw = dict(max_new_tokens=3, cache_size=64, temperature=temperature, top_p=top_p)
    ar = _first_tokens(generate(base, prompts, seed=11, **kw), 3)
    sp_res = generate(base, prompts, seed=12, mode="speculative", head=head, tree=tree, **kw)
    sp = _first_tokens(sp_res, 3)
    assert sp_res.stats["accept_hist"][1] + sp_res.stats["accept_hist"][2] > rows // 10, "too few drafts accepted"
    for pos in (1, 2):
        chi2, dof, pval, a, s = chi2_homogeneity(ar[:, pos], sp[:, pos], 12)
        assert pval > 1e-3, f"position {pos}: chi2={chi2:.1f} dof={dof} p={pval:.2e}\nar={a}\nsp={s}"


@pytest.mark.parametrize("head_type,tree", [("clover2", "chain-3"), ("clover2", "dynamic-10"), ("medusa", "chain-3"),
                                            ("redrafter", "beam-2x3"), ("block", "chain-3")])
def test_drafter_arrays_first_built_inside_a_trace_are_concrete(head_type, tree):
    """A drafter caches its arrays on itself, and `drafter_for` shares drafters between calls: built first inside
    a jit trace (a caller jitting `init_state` without passing `arrays()`), they must still be concrete arrays; a
    cached tracer would leak into every later loop with that tree."""
    from clover_jax.decoding.tree import get_tree
    from clover_jax.heads import registry

    drafter = registry.get(head_type).make_drafter(get_tree(tree), tuple(range(40)))  # fresh, not the shared one
    traced = jax.jit(lambda x: x + jax.tree.leaves(drafter.arrays())[0].sum())(jnp.int32(1))
    leaves = jax.tree.leaves(drafter.arrays())
    assert leaves and not any(isinstance(x, jax.core.Tracer) for x in leaves)
    assert int(traced) == 1 + int(np.asarray(leaves[0]).sum())
