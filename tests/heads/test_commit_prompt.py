"""A draft head's pass over a long prompt runs in blocks (`clover_jax.decoding.drafter.commit_prompt`), as the base
model's prefill does: the drafting state and the head's cache equal one pass over the whole prompt, for every head
type that caches the prompt, with rows ending in different blocks; and speculative decoding from a long prompt
still equals greedy decoding."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.decoding.autoregressive import PREFILL_CHUNK as CHUNK  # the prefill's block, 256
from clover_jax.decoding.drafter import commit_prompt
from clover_jax.heads import registry
from clover_jax.models.llama import CACHE_BLOCK

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spec_helpers
from spec_helpers import CFG, NO_EOS, same_as_greedy, spec  # noqa: E402

D = CFG.hidden_size


def _perturbed_head(name, base, seed=1):
    """A head of type `name` with noise on every parameter (identity-like inits would hide a wiring bug)."""
    ht = registry.get(name)
    head = ht.init_from_base(base, ht.config_cls(), seed=seed)
    rng = np.random.RandomState(seed)
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + 0.3 * rng.randn(*x.shape), x.dtype), head)


@pytest.fixture(scope="module")
def base():
    from clover_jax.models.llama import init_llama

    return init_llama(CFG, seed=0)


@pytest.mark.parametrize("name", [*(pytest.param(n, marks=pytest.mark.slow) for n in ("clover2", "clover1")),
                                  "eagle"])  # the blocked pass of each head: eagle's in the fast tier
def test_blocked_prompt_pass_equals_one_pass(base, name):
    head = _perturbed_head(name, base)
    b, t, size = 3, 3 * CHUNK, 4 * CACHE_BLOCK
    rng = np.random.RandomState(0)
    lengths = jnp.asarray([700, 300, 40], jnp.int32)  # rows ending in the third, second and first block
    f = jnp.asarray(rng.randn(b, t, D), jnp.float32)  # [B, T, D]
    y = jnp.asarray(rng.randint(0, CFG.vocab_size, (b, t)), jnp.int32)  # [B, T]

    def commit(cache, f_blk, y_blk, num, fresh, extent):
        return head.commit(base, cache, f_blk, y_blk, num, fresh=fresh, cache_extent=extent)

    blocked = jax.jit(lambda c, f, y, n: commit_prompt(commit, c, f, y, n, CHUNK))
    whole = jax.jit(lambda c, f, y, n: commit(c, f, y, n, True, None))  # one pass, [T, T] scores
    s_blk, c_blk = blocked(head.init_cache(b, size), f, y, lengths)
    s_one, c_one = whole(head.init_cache(b, size), f, y, lengths)
    assert np.asarray(c_blk.lengths).tolist() == [700, 300, 40]
    np.testing.assert_allclose(np.asarray(s_blk), np.asarray(s_one), atol=3e-5, rtol=3e-5)
    for r, n in enumerate(np.asarray(lengths)):
        for kv in ("k", "v"):
            np.testing.assert_allclose(np.asarray(getattr(c_blk, kv)[:, r, :, :n]),
                                       np.asarray(getattr(c_one, kv)[:, r, :, :n]), atol=3e-5, rtol=3e-5)
    # the state is each row's last position, not a later block's padding: a row of the first block alone differs
    # from what a pass over its first 39 positions gives
    s_short, _ = whole(head.init_cache(b, size), f, y, lengths - 1)
    assert not np.allclose(np.asarray(s_short[2]), np.asarray(s_blk[2]), atol=1e-3)


@pytest.mark.parametrize("name", ["clover2", "eagle"])
@pytest.mark.slow  # long prompts, a loop per head
def test_speculative_from_a_long_prompt_equals_greedy(base, name):
    head = _perturbed_head(name, base, seed=2)
    rng = np.random.default_rng(3)
    prompt = jnp.asarray(rng.integers(3, CFG.vocab_size, (2, 2 * CHUNK)), jnp.int32)  # a blocked prefill
    lens = jnp.asarray([2 * CHUNK - 5, CHUNK - 20], jnp.int32)
    out, _ = spec(base, head, "chain-3", prompt, lens, n=16, cache_size=768)
    same_as_greedy(base, out, prompt, lens, 16, NO_EOS, cache_size=768)
