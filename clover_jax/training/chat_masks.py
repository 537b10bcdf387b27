"""Chat-template loss masks: a conversation -> chat-templated token ids + assistant loss mask.

    ids, mask = tokenize_conversation(tokenizer, conv.messages, max_length)   # [T] int32 each

The loss mask is 1 exactly on the tokens of assistant content and on the assistant's end-of-turn
special token (`<|im_end|>` for ChatML), found by rendering the tokenizer's own chat template
(`assistant_spans`), so it works for any template whose renders of growing prefixes extend each other.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from clover_jax.training.sources import DataError

_PLACEHOLDER = "\u27e6clover-jax-content\u27e7"


def _render(tokenizer, messages) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(list(messages), tokenize=False)


def _special_strings(tokenizer) -> list[str]:
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok))
    return sorted((s for s in out if s), key=len, reverse=True)


def _end_of_turn_length(trailer: str, specials: list[str]) -> int:
    """Chars at the start of `trailer` made of special tokens (and whitespace between them): the end-of-turn."""
    i = end = 0
    while i < len(trailer):
        if trailer[i].isspace():
            i += 1
            continue
        hit = next((s for s in specials if trailer.startswith(s, i)), None)
        if hit is None:
            break
        i = end = i + len(hit)
    return end


def assistant_spans(tokenizer, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Renders `messages` with the chat template; returns (text, [(start, end)] char spans to learn).

    Each span covers one assistant turn's content plus its end-of-turn special token(s). Renders of the
    prefix before and after every assistant turn must extend each other, or a DataError says so.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template; add one (`chat_template` in tokenizer_config.json, "
                        "e.g. FastChat's vicuna_v1.1 for Vicuna) so conversations can be rendered")
    messages = list(messages)
    n = len(messages)
    cuts = sorted({k for i, m in enumerate(messages) if m["role"] == "assistant" for k in (i, i + 1)} | {n})
    renders = {k: _render(tokenizer, messages[:k]) for k in cuts}
    for a, b in zip(cuts, cuts[1:]):
        if not renders[b].startswith(renders[a]):
            raise DataError(f"the chat template's render of the first {a} messages is not a prefix of the render "
                            f"of the first {b}; cannot find the assistant tokens for this template")
    specials = _special_strings(tokenizer)
    spans = []
    frame: tuple[str, str] | None = None  # (header, trailer) around the last assistant content
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = renders[i]
        seg = renders[i + 1][len(before):]
        header, trailer = frame or ("", "")
        if not (frame and seg == header + m["content"] + trailer):
            # Where the template puts the content: render a placeholder in its place.
            probe = _render(tokenizer, messages[:i] + [{"role": "assistant", "content": _PLACEHOLDER}])
            k = probe.find(_PLACEHOLDER, len(before)) if probe.startswith(before) else -1
            frame = (probe[len(before):k], probe[k + len(_PLACEHOLDER):]) if k >= 0 else None
            header, trailer = frame or ("", "")
        if frame and seg.startswith(header) and seg.endswith(trailer) and len(header) + len(trailer) <= len(seg):
            lo, hi = len(header), len(seg) - len(trailer)
        else:  # the template changes with the content; look for the (stripped) content itself
            content = m["content"].strip()
            lo = seg.rfind(content) if content else -1
            if lo < 0:
                raise DataError(f"cannot find assistant message {i} in the chat template's output")
            hi = lo + len(content)
            trailer = seg[hi:]
        hi += _end_of_turn_length(trailer, specials)
        spans.append((len(before) + lo, len(before) + hi))
    return renders[n], spans


_SLACK = 32  # extra tokens a prefix must yield beyond max_length before its first max_length tokens are trusted


def _word_cut(text: str, start: int) -> int:
    """First ' ' at or after `start` between two letters (a pre-token boundary for byte-level/metaspace BPE)."""
    cut = text.find(" ", start)
    while 0 < cut < len(text) - 1 and not (text[cut - 1].isalpha() and text[cut + 1].isalpha()):
        cut = text.find(" ", cut + 1)
    return cut if 0 < cut < len(text) - 1 else -1


def _encode(tokenizer, text: str, max_length: int | None) -> tuple[list[int], np.ndarray, int]:
    """Token ids and char offsets [n, 2] of the first `max_length` tokens of `text`, and how many tokens
    the encoded piece held (>= max_length + _SLACK, or the whole text's count).

    Long texts are encoded up to a word boundary past 6x, 18x, ... `max_length` chars, and whole only
    when those pieces yield too few tokens, so a 100k-char conversation costs what its first
    `max_length` tokens cost.
    """
    def enc(t):
        e = tokenizer(t, add_special_tokens=False, return_offsets_mapping=True)
        return list(e["input_ids"]), np.asarray(e["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    budget = 6 * max_length if max_length is not None else len(text)
    while budget < len(text):
        cut = _word_cut(text, budget)
        if cut < 0:
            break
        ids, offsets = enc(text[:cut])
        if len(ids) >= max_length + _SLACK:
            return ids[:max_length], offsets[:max_length], len(ids)
        budget *= 3
    ids, offsets = enc(text)
    return ids[:max_length], offsets[:max_length], len(ids)


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, str]], max_length: int | None = None,
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Chat-templated token ids [T] int32 and loss mask [T] int32 (1 on assistant content + end-of-turn).

    A token is learned when its char span overlaps an assistant span (`assistant_spans`); system and user
    turns, the assistant header (`<|im_start|>assistant\\n`) and the newline after `<|im_end|>` are 0.
    Truncated to `max_length` tokens. Needs a fast tokenizer (for offsets).
    """
    ids, mask, _ = _tokenize(tokenizer, messages, max_length)
    return ids, mask


def _tokenize(tokenizer, messages, max_length):
    """(ids, mask, truncated). Only the leading messages that can reach `max_length` tokens are rendered:
    a prefix of messages renders to a prefix of the text (checked in `assistant_spans`)."""
    if not getattr(tokenizer, "is_fast", True):
        raise DataError("tokenize_conversation needs a fast tokenizer (return_offsets_mapping)")
    messages = list(messages)
    n = len(messages)
    chars = np.cumsum([len(m["content"]) for m in messages])  # [n]
    budget = 6 * max_length if max_length is not None else None
    while True:
        k = n if budget is None else min(n, int(np.searchsorted(chars, budget)) + 1)
        text, spans = assistant_spans(tokenizer, messages[:k])
        ids, offsets, seen = _encode(tokenizer, text, max_length)
        if k == n or seen >= max_length + _SLACK:
            break
        budget *= 3
    truncated = k < n or seen > len(ids)
    starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)  # [T]
    mask = np.zeros(len(ids), dtype=bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    return np.asarray(ids, dtype=np.int32), mask.astype(np.int32), truncated
