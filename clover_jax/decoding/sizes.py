"""The static sizes of a decoding call, chosen on the host before anything compiles: the prompt-length bucket
and the KV cache's number of slots, with a clear error where the asked lengths cannot fit the cache or the model's
context.

A decoding loop compiles once per (batch, prompt bucket, cache size) for a given model, head, tree and dtype
(`max_new_tokens` is traced). Both sizes come from short fixed ladders, so any set of prompts needs a small, known
set of programs, and prompts of different lengths inside one bucket share one:

  * prompt buckets (`bucket_length`): powers of two from 32 (32, 64, 128, 256, 512, 1024, ...). A bucket above
    `PREFILL_CHUNK` is a multiple of it, and its prefill runs block by block in a `lax.while_loop` up to the
    longest row's last block (`decoding.autoregressive.prefill`), so its padding is never computed.
  * cache sizes (`cache_rung`): 256, 512, 768, 1024, 1536, 2048, 3072, 4096, ... (256, then 2^k and 1.5 x 2^k
    times 256: two rungs per octave, every one a multiple of the attention's cache block), the smallest rung
    holding bucket + max_new_tokens + the draft tree's nodes (`cache_for_bucket`). The bucket, not the prompt's
    own length, sets it: a longer prompt of the same bucket gets the same cache. At most 1.5x the slots the bucket
    needs, past 512.

`loop_shapes` lists the (batch, bucket, cache size) combinations a set of prompt lengths needs: the programs a
warm-up compiles. Below `clover_jax.generation.api` and the decoding loops alike: both plan with it, neither
imports the other for it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from clover_jax.models.cache import CacheOverflowError
from clover_jax.models.llama import CACHE_BLOCK
from clover_jax.validation import PromptError

PREFILL_CHUNK = 256  # prompt tokens per prefill block (a prompt bucket above it is a multiple of it)
MIN_BUCKET = 32  # the smallest prompt bucket
MIN_CACHE = CACHE_BLOCK  # 256: the cache ladder's first rung; every rung is a multiple of the attention's block


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """Prompt length bucket: the next power of two (>= minimum), so similar prompts share a compile."""
    b = minimum
    while b < n:
        b *= 2
    return b


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cache_rung(n: int) -> int:
    """The smallest cache size on the ladder that holds `n` slots: 256, 512, 768, 1024, 1536, 2048, 3072, ..."""
    rung = MIN_CACHE
    while rung < n:
        if rung >= 2 * MIN_CACHE and rung * 3 // 2 >= n:
            return rung * 3 // 2
        rung *= 2
    return rung


def cache_for_bucket(bucket: int, max_new_tokens: int, extra: int = 0) -> int:
    """The cache size of a prompt bucket: the rung holding the bucket, `max_new_tokens` and `extra` slots (the
    draft tree's nodes), whatever the prompts' own lengths inside the bucket."""
    return cache_rung(int(bucket) + int(max_new_tokens) + int(extra))


class LoopShape(NamedTuple):
    """The shapes one compiled decoding loop is specialised to (besides the model, head, tree and dtype)."""

    batch: int  # rows
    bucket: int  # padded prompt length
    cache_size: int  # KV-cache slots per row


def loop_shapes(prompt_lengths: Sequence[int], max_new_tokens: int, extra: int = 0,
                batch_size: int = 1) -> list[LoopShape]:
    """The distinct (batch, bucket, cache size) a workload needs, in order: `prompt_lengths` taken in consecutive
    batches of `batch_size` rows (the last may be smaller), each padded to its longest prompt's bucket and given
    `cache_for_bucket`'s cache (`extra`: the draft tree's nodes; 0 for autoregressive decoding)."""
    lens = [int(n) for n in prompt_lengths]
    out: list[LoopShape] = []
    for start in range(0, len(lens), max(int(batch_size), 1)):
        rows = lens[start:start + max(int(batch_size), 1)]
        bucket = bucket_length(max(rows))
        shape = LoopShape(len(rows), bucket, cache_for_bucket(bucket, max_new_tokens, extra))
        if shape not in out:
            out.append(shape)
    return out


def plan_cache(prompt_lens: np.ndarray, max_new_tokens: int, extra: int, cache_size: int | None,
               max_positions: int | None) -> int:
    """The static cache size (none given: `cache_for_bucket` of the longest prompt's bucket), or a clear error if
    the given one cannot hold prompt + new tokens + extra (and, when `max_positions` is given, if prompt + new
    tokens run past the model's context)."""
    if max_positions is not None:
        check_context(prompt_lens, max_new_tokens, max_positions)
    need = int(prompt_lens.max()) + int(max_new_tokens) + int(extra)
    if cache_size is None:
        cache_size = cache_for_bucket(bucket_length(int(prompt_lens.max())), max_new_tokens, extra)  # >= need
    if need > cache_size:
        row = int(prompt_lens.argmax())
        raise CacheOverflowError(
            f"prompt {row} has {int(prompt_lens[row])} tokens; with max_new_tokens={max_new_tokens}"
            + (f" and {extra} slots for the draft tree" if extra else "")
            + f" it needs {need} cache slots but cache_size={cache_size}"
        )
    return cache_size


def check_context(prompt_lens: np.ndarray, max_new_tokens: int, max_positions: int | None,
                  tree_depth: int = 0) -> None:
    """PromptError when the longest prompt + max_new_tokens (+ the deepest draft past the last token) would
    run past the model's context (`max_position_embeddings`)."""
    if not max_positions:
        return
    row = int(np.asarray(prompt_lens).argmax())
    longest = int(prompt_lens[row])
    need = longest + int(max_new_tokens) + max(int(tree_depth) - 1, 0)
    if need > max_positions:
        room = max_positions - longest - max(int(tree_depth) - 1, 0)
        raise PromptError(
            f"max_new_tokens: prompt {row} has {longest} tokens; with max_new_tokens={max_new_tokens}"
            + (f" and drafts {tree_depth} deep" if tree_depth else "")
            + f" it reaches position {need}, past the model's context max_position_embeddings={max_positions}"
            + (f"; use max_new_tokens <= {room}" if room >= 1 else "; shorten the prompt"))


def pad_prompts(ids: list[list[int]], pad_id: int, bucket: int | None = None):
    lens = np.array([len(x) for x in ids], np.int32)
    t = bucket or bucket_length(int(lens.max()))
    arr = np.full((len(ids), t), pad_id, np.int32)
    for i, x in enumerate(ids):
        arr[i, : len(x)] = x
    return arr, lens
