"""The user-facing generation call: prompts in, text and statistics out.

`generate(model, prompts, tokenizer=...)` handles chat templating, validation, length buckets and
batching; the jitted loops live in `clover_jax.decoding`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from clover_jax.decoding.autoregressive import ar_generate
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.models.cache import CacheOverflowError


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, too long, wrong type)."""


def bucket_length(n: int, minimum: int = 32) -> int:
    """Prompt length bucket: the next power of two (>= minimum), so similar prompts share a compile."""
    b = minimum
    while b < n:
        b *= 2
    return b


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per prompt (EOS included when emitted)
    texts: list[str] | None
    prompt_lengths: list[int]
    steps: int  # decode-phase base forwards for the whole batch
    row_steps: list[int]  # decode-phase base forwards per row
    seconds: float  # wall time of the jitted call (compile excluded if warmed up)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else float("nan")


def encode_prompts(tokenizer, prompts: Sequence[Any], chat: bool = True, system: str | None = None) -> list[list[int]]:
    """Strings (chat-templated when `chat`), message lists, or token-id lists -> token-id lists."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise PromptError(f"prompt {i} is empty")
            if tokenizer is None:
                raise PromptError("text prompts need a tokenizer (pass tokenizer=...)")
            if chat and getattr(tokenizer, "chat_template", None):
                msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
                ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer.encode(p, add_special_tokens=True)
        elif isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            ids = tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = [int(x) for x in np.asarray(p).reshape(-1)]
        if len(ids) == 0:
            raise PromptError(f"prompt {i} is empty after tokenization")
        out.append(list(ids))
    return out


def pad_prompts(ids: list[list[int]], pad_id: int, bucket: int | None = None):
    lens = np.array([len(x) for x in ids], np.int32)
    t = bucket or bucket_length(int(lens.max()))
    arr = np.full((len(ids), t), pad_id, np.int32)
    for i, x in enumerate(ids):
        arr[i, : len(x)] = x
    return arr, lens


def plan_cache(prompt_lens: np.ndarray, max_new_tokens: int, extra: int, cache_size: int | None,
               max_positions: int | None) -> int:
    """The static cache size, or a clear error if the given one cannot hold prompt + new tokens + extra."""
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
    if max_positions is not None and need > max_positions:
        raise PromptError(f"prompt + max_new_tokens = {need} exceeds the model's context ({max_positions})")
    return cache_size


def resolve_head(source, model, tree=None, draft_vocab=None):
    """(head module, tree, draft vocabulary) for a head given by name or path (see `generate`): the tree
    defaults to the registered head's, the draft vocabulary to the one the head was trained on."""
    from clover_jax import pretrained
    from clover_jax.heads.draft_vocab import head_draft_vocab
    from clover_jax.heads.loading import load_head

    head = load_head(source, model)
    tree = tree if tree is not None else pretrained.default_tree(source)
    draft_vocab = draft_vocab if draft_vocab is not None else head_draft_vocab(source)
    return head, tree, draft_vocab


def generate(model, prompts: Sequence[Any], *, tokenizer=None, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = True, system: str | None = None,
             cache_size: int | None = None, mode: str = "ar", head=None, tree=None, draft_vocab=None,
             decode_text: bool = True) -> GenerationResult:
    """Generates for a batch of prompts.

    Args:
      model: a `Llama` or the `LoadedModel` returned by `load_model` (then its tokenizer is used).
      prompts: strings (chat template applied when `chat`), message lists, or token-id lists.
      mode: "ar" (plain autoregressive) or "speculative" (needs `head`, optionally `tree`).
      head: a draft head module, or where to load one: a registered name (`clover_jax.pretrained`, e.g.
        "smollm2-135m-instruct-clover2"), an exported head folder or a training run directory.
      tree: a tree name or JSON file; None: the registered head's default tree, else "clover2-26".
      draft_vocab: token ids the drafts are drawn from (`clover_jax.heads.draft_vocab`); None: all, or, for
        a head given by name or path, the vocabulary it was trained on (if any).
    """
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        tokenizer = tokenizer or model.tokenizer
        model = model.model
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise PromptError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ids = encode_prompts(tokenizer, prompts, chat=chat, system=system)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    arr, lens = pad_prompts(ids, pad_id)
    key = jax.random.key(seed)
    if mode == "ar":
        cache_size = plan_cache(lens, max_new_tokens, 0, cache_size, None)
        t0 = time.perf_counter()
        out = ar_generate(model, arr, lens, max_new_tokens=max_new_tokens, cache_size=cache_size,
                          sampling=sampling, key=key)
        out = jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        stats = {}
    elif mode == "speculative":
        from clover_jax.decoding.speculative import spec_generate

        if head is None:
            raise ValueError("mode='speculative' needs a draft head (head=...)")
        if isinstance(head, (str, os.PathLike)):
            head, tree, draft_vocab = resolve_head(head, model, tree, draft_vocab)
        out, stats, seconds = spec_generate(model, head, arr, lens, max_new_tokens=max_new_tokens,
                                            cache_size=cache_size, sampling=sampling, key=key, tree=tree,
                                            draft_vocab=draft_vocab)
    else:
        raise ValueError(f"mode must be 'ar' or 'speculative', got {mode!r}")
    tokens = np.asarray(out.tokens)
    lengths = np.asarray(out.lengths)
    gen = [tokens[i, lens[i]: lengths[i]].tolist() for i in range(len(ids))]
    texts = [tokenizer.decode(g, skip_special_tokens=True) for g in gen] if (decode_text and tokenizer) else None
    return GenerationResult(token_ids=gen, texts=texts, prompt_lengths=lens.tolist(), steps=int(out.steps),
                            row_steps=np.asarray(out.row_steps).tolist(), seconds=seconds, stats=stats)
