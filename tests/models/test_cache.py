"""KV cache: incremental decoding equals one full forward; writes never land past the end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.models.cache import CacheOverflowError, KVCache, causal_mask, check_room, prefix_mask
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA


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


@pytest.mark.slow  # a forward per token
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
    np.testing.assert_array_equal(np.asarray(out.k[0, 0, 0, :, 0]), [0, 0, 0, 1])


def test_write_places_each_layer_head_and_dim_at_its_slot():
    """The cache is `[L, B, K, S, H]` while new keys come as `[L, B, T, K, H]`: every entry lands where it
    belongs (a swapped axis would put another head's or layer's value there)."""
    l, b, t, k, h, s = 2, 2, 3, 3, 4, 8
    new_k = jnp.arange(l * b * t * k * h, dtype=jnp.float32).reshape(l, b, t, k, h)
    cache = KVCache.init(l, b, s, k, h).replace(lengths=jnp.array([1, 4]))
    out = cache.append(new_k, -new_k)
    assert out.k.shape == (l, b, k, s, h)
    got, want = np.asarray(out.k), np.asarray(new_k)
    for row, start in enumerate([1, 4]):
        np.testing.assert_array_equal(got[:, row, :, start:start + t].transpose(0, 2, 1, 3), want[:, row])
        np.testing.assert_array_equal(np.asarray(out.v)[:, row, :, start:start + t].transpose(0, 2, 1, 3),
                                      -want[:, row])
    assert not got[:, 0, :, 4:].any() and not got[:, 1, :, :4].any()  # nothing else written


def test_check_room_raises_before_running():
    with pytest.raises(CacheOverflowError, match="row 1 holds 7 positions and needs 2 more"):
        check_room(np.array([3, 7]), 2, 8)
    check_room(np.array([3, 6]), 2, 8)  # fits exactly


def test_gather_to_prefix_compacts_rows_independently():
    l, b, s = 1, 2, 8
    k = jnp.arange(l * b * s, dtype=jnp.float32).reshape(l, b, 1, s, 1)  # [L, B, K, S, H]
    cache = KVCache(k=k, v=-k, lengths=jnp.array([2, 3]))
    out = cache.gather_to_prefix(jnp.array([[5, 7], [4, 6]]), jnp.array([2, 1]))
    np.testing.assert_array_equal(np.asarray(out.lengths), [4, 4])
    np.testing.assert_array_equal(np.asarray(out.k[0, 0, 0, :4, 0]), [0, 1, 5, 7])
    np.testing.assert_array_equal(np.asarray(out.k[0, 1, 0, :4, 0]), [8, 9, 10, 12])
    np.testing.assert_array_equal(np.asarray(out.v[0, 1, 0, :4, 0]), [-8, -9, -10, -12])


def test_jit_with_traced_lengths():
    model = init_llama(CFG, seed=1)
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 64, (2, 6)))

    @jax.jit
    def run(ids):
        out, _ = _incremental_logits(model, ids, None, [3, 3], cache_size=8)
        return out

    full, _, _, _ = model(ids)
    np.testing.assert_allclose(np.asarray(run(ids)), np.asarray(full), atol=2e-5)


@pytest.mark.parametrize("cache_size", [  # a multiple of CACHE_BLOCK (blocked reads), and not (one block: slow, a
    512, pytest.param(40, marks=pytest.mark.slow)])  # second compile)
def test_reading_the_cache_block_by_block_equals_one_softmax(cache_size):
    """`cache_extent` makes attention read the cache in CACHE_BLOCK-slot blocks up to it with a running softmax;
    the logits equal one full forward's, and the same chunks fed without it."""
    model = init_llama(CFG, seed=5)
    ids = jnp.asarray(np.random.RandomState(4).randint(0, 64, (2, 12)))
    full, _, _, _ = model(ids)
    b = ids.shape[0]
    cache = KVCache.init(CFG.num_hidden_layers, b, cache_size, CFG.num_key_value_heads, CFG.head_dim)
    out = []
    for start, n in [(0, 5), (5, 1), (6, 6)]:
        pos = cache.lengths[:, None] + jnp.arange(n)[None]
        hidden, nk, nv = model.forward_hidden(ids[:, start:start + n], pos, causal_mask(jnp.ones((b, n), bool)),
                                              cache, prefix_mask(cache.lengths, n, cache_size),
                                              cache_extent=jnp.max(cache.lengths))
        cache = cache.append(nk, nv)
        out.append(model.logits(hidden))
    np.testing.assert_allclose(np.asarray(jnp.concatenate(out, axis=1)), np.asarray(full), atol=2e-5)


def test_per_layer_cache_writes_and_compacts_like_the_stacked_one():
    """The per-layer form (one `[B, K, S, H]` buffer per layer, for unrolled decoding) holds after `append`,
    a second `write` and `gather_to_prefix` exactly what the stacked `[L, B, K, S, H]` cache holds, drops
    writes past the end the same way, and reports the same size and batch."""
    l, b, k, s, h = 3, 2, 2, 8, 4
    rng = np.random.RandomState(0)
    new = jnp.asarray(rng.randn(l, b, 3, k, h), jnp.float32)
    new2 = jnp.asarray(rng.randn(l, b, 2, k, h), jnp.float32)
    out = {}
    for per_layer in (False, True):
        cache = KVCache.init(l, b, s, k, h, per_layer=per_layer).replace(lengths=jnp.array([1, 4]))
        assert cache.per_layer == per_layer and cache.size == s and cache.batch == b
        cache = cache.append(new, -new)
        cache = cache.write(new2, 2 * new2, jnp.array([[7, 8], [0, 5]]))  # slot 8 is past the end: dropped
        cache = cache.gather_to_prefix(jnp.array([[2, 0], [6, 5]]), jnp.array([2, 1]))
        stack = (lambda x: jnp.stack(x)) if per_layer else (lambda x: x)
        out[per_layer] = (np.asarray(stack(cache.k)), np.asarray(stack(cache.v)), np.asarray(cache.lengths))
    for a, c in zip(out[False], out[True]):
        np.testing.assert_array_equal(a, c)
    assert out[True][2].tolist() == [6, 8]
