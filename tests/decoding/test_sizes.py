"""The fixed set of decoding programs: prompt buckets and cache sizes from short ladders (`decoding.sizes`)."""

import numpy as np
import pytest

from clover_jax.decoding.sizes import (LoopShape, PREFILL_CHUNK, bucket_length, cache_for_bucket, cache_rung,
                                       loop_shapes, plan_cache)
from clover_jax.models.cache import CacheOverflowError
from clover_jax.models.llama import CACHE_BLOCK


def test_the_cache_ladder():
    rungs = sorted({cache_rung(n) for n in range(1, 20000)})
    assert rungs == [256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576]
    assert all(r % CACHE_BLOCK == 0 for r in rungs)  # the blocked cache attention reads whole blocks
    for n in range(1, 20000, 7):
        r = cache_rung(n)
        assert r >= n and (r == 256 or r == 512 or r <= 1.5 * n)
        assert not [x for x in rungs if n <= x < r]  # the smallest rung that holds n


def test_buckets_are_powers_of_two_and_long_ones_whole_prefill_blocks():
    assert [bucket_length(n) for n in (1, 32, 33, 64, 65, 300, 1000)] == [32, 32, 64, 64, 128, 512, 1024]
    for n in range(PREFILL_CHUNK + 1, 5000, 13):
        assert bucket_length(n) % PREFILL_CHUNK == 0


@pytest.mark.parametrize("extra", [0, 4, 26])
def test_one_cache_size_per_bucket_whatever_the_prompt_lengths_inside_it(extra):
    """The default cache comes from the bucket: every prompt length of a bucket gets the same size, and it holds
    the longest prompt of the bucket plus the new tokens and the tree."""
    for mnt in (1, 100, 128, 230, 256, 1000):
        for bucket in (32, 64, 128, 256, 512, 1024):
            lengths = range(bucket // 2 + 1, bucket + 1) if bucket > 32 else range(1, 33)
            sizes = {plan_cache(np.array([n]), mnt, extra, None, None) for n in lengths}
            assert sizes == {cache_for_bucket(bucket, mnt, extra)}
            assert sizes.pop() >= bucket + mnt + extra


def test_before_the_ladder_one_bucket_needed_two_caches():
    """What the ladder fixes: 5 and 30 tokens share bucket 32, and with 230 new tokens the prompt's own length put
    them in caches of 256 and 512 slots (two programs)."""
    assert bucket_length(5) == bucket_length(30) == 32
    assert plan_cache(np.array([5]), 230, 0, None, None) == plan_cache(np.array([30]), 230, 0, None, None) == 512


def test_a_given_cache_size_is_kept_or_refused():
    assert plan_cache(np.array([10, 20]), 8, 4, 64, None) == 64
    with pytest.raises(CacheOverflowError, match="needs 80 cache slots but cache_size=64"):
        plan_cache(np.array([10, 60]), 16, 4, 64, None)


def test_loop_shapes_lists_each_program_once_in_order():
    lens = [40, 50, 100, 200, 45, 300, 120]
    assert loop_shapes(lens, 128) == [LoopShape(1, 64, 256), LoopShape(1, 128, 256), LoopShape(1, 256, 512),
                                      LoopShape(1, 512, 768)]
    assert loop_shapes(lens, 128, extra=26) == [LoopShape(1, 64, 256), LoopShape(1, 128, 512),
                                                LoopShape(1, 256, 512), LoopShape(1, 512, 768)]
    # batches of 2 in order: (40, 50) (100, 200) (45, 300) (120,): the last batch has one row
    assert loop_shapes(lens, 128, batch_size=2) == [LoopShape(2, 64, 256), LoopShape(2, 256, 512),
                                                    LoopShape(2, 512, 768), LoopShape(1, 128, 256)]
    # every shape is what plan_cache gives the batch
    for batch in (lens[0:2], lens[2:4], lens[4:6], lens[6:]):
        shape = loop_shapes(batch, 128, extra=9, batch_size=2)[0]
        assert shape.cache_size == plan_cache(np.array(batch), 128, 9, None, None)
        assert shape.bucket == bucket_length(max(batch))
