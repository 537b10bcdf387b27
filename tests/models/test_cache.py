"""KV cache: incremental decoding equals one full forward; writes never land past the end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.models.cache import CacheOverflowError, KVCache, causal_mask, check_room, prefix_mask
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)


def _incremental_logits(model, ids, lengths, chunks, cache_size):
    """Feeds `ids [B, T]` through the cache in chunks of the given sizes; returns logits [B, T, V]."""
    b, t = ids.shape
    cache = KVCache.init(CFG.num_hidden_layers, b, cache_size, CFG.num_key_value_heads, CFG.head_dim)
    out, start = [], 0
    for n in chunks:
        x = ids[:, start:start + n]
        pos = cache.lengths[:, None] + jnp.arange(n)[None]
        hidden, nk, nv = model.forward_hidden(x, pos, causal_mask(jnp.ones((b, n), bool)), cache,
                                              prefix_mask(cache.lengths, n, cache_size))
        cache = cache.append(nk, nv)
        out.append(model.logits(hidden))
        start += n
    return jnp.concatenate(out, axis=1), cache


def test_one_token_at_a_time_equals_full_forward():
    model = init_llama(CFG, seed=3)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 12)))
    full, _, _, _ = model(ids)
    step, cache = _incremental_logits(model, ids, None, [1] * 12, cache_size=16)
    np.testing.assert_allclose(np.asarray(step), np.asarray(full), atol=2e-5)
    mixed, _ = _incremental_logits(model, ids, None, [5, 1, 4, 2], cache_size=16)
    np.testing.assert_allclose(np.asarray(mixed), np.asarray(full), atol=2e-5)
    assert np.asarray(cache.lengths).tolist() == [12, 12]


def test_write_past_end_is_dropped_not_clamped():
    cache = KVCache.init(1, 1, 4, 1, 2)
    cache = cache.replace(lengths=jnp.array([3]))
    new = jnp.ones((1, 1, 2, 1, 2))
    out = cache.append(new, new * 2)
    # slot 3 written, slot 4 (past the end) dropped; slots 0..2 untouched (a clamp would overwrite 2)
    np.testing.assert_array_equal(np.asarray(out.k[0, 0, :, 0, 0]), [0, 0, 0, 1])


def test_check_room_raises_before_running():
    with pytest.raises(CacheOverflowError, match="row 1 holds 7 positions and needs 2 more"):
        check_room(np.array([3, 7]), 2, 8)
    check_room(np.array([3, 6]), 2, 8)  # fits exactly


def test_gather_to_prefix_compacts_rows_independently():
    l, b, s = 1, 2, 8
    k = jnp.arange(l * b * s, dtype=jnp.float32).reshape(l, b, s, 1, 1)
    cache = KVCache(k=k, v=-k, lengths=jnp.array([2, 3]))
    out = cache.gather_to_prefix(jnp.array([[5, 7], [4, 6]]), jnp.array([2, 1]))
    np.testing.assert_array_equal(np.asarray(out.lengths), [4, 4])
    np.testing.assert_array_equal(np.asarray(out.k[0, 0, :4, 0, 0]), [0, 1, 5, 7])
    np.testing.assert_array_equal(np.asarray(out.k[0, 1, :4, 0, 0]), [8, 9, 10, 12])
    np.testing.assert_array_equal(np.asarray(out.v[0, 1, :4, 0, 0]), [-8, -9, -10, -12])


def test_jit_with_traced_lengths():
    model = init_llama(CFG, seed=1)
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 64, (2, 6)))

    @jax.jit
    def run(ids):
        out, _ = _incremental_logits(model, ids, None, [3, 3], cache_size=8)
        return out

    full, _, _, _ = model(ids)
    np.testing.assert_allclose(np.asarray(run(ids)), np.asarray(full), atol=2e-5)
