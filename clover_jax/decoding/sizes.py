"""The static sizes of a decoding call, chosen on the host before anything compiles: the prompt-length bucket
(similar prompts share a compiled loop) and the KV cache's number of slots, with a clear error where the asked
lengths cannot fit the cache or the model's context.

Below `clover_jax.generation.api` and the decoding loops alike: both plan with it, neither imports the other for it.
"""

from __future__ import annotations

import numpy as np

from clover_jax.models.cache import CacheOverflowError
from clover_jax.validation import PromptError

PREFILL_CHUNK = 256  # prompt tokens per prefill block (a prompt bucket above it is a multiple of it)


def bucket_length(n: int, minimum: int = 32) -> int:
    """Prompt length bucket: the next power of two (>= minimum), so similar prompts share a compile."""
    b = minimum
    while b < n:
        b *= 2
    return b


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_cache(prompt_lens: np.ndarray, max_new_tokens: int, extra: int, cache_size: int | None,
               max_positions: int | None) -> int:
    """The static cache size, or a clear error if the given one cannot hold prompt + new tokens + extra
    (and, when `max_positions` is given, if prompt + new tokens run past the model's context)."""
    if max_positions is not None:
        check_context(prompt_lens, max_new_tokens, max_positions)
    need = int(prompt_lens.max()) + int(max_new_tokens) + int(extra)
    if cache_size is None:
        cache_size = round_up(max(need, bucket_length(int(prompt_lens.max())) + 1), 256)
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
