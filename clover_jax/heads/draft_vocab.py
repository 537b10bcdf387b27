"""A reduced drafting vocabulary: the draft head scores only the most frequent tokens.

Each draft depth multiplies the head's output by the `[D, V]` lm_head: for SmolLM2 (V = 49,152, D = 576)
that is 28M weights read per depth, about a fifth of the whole base model, so on a memory-bound device
the drafts of a chain of 4 cost nearly as much as the verification. Scoring only the N most frequent
tokens of the base model's own outputs (FR-Spec, Zhao et al. 2025, arXiv 2502.14856, does this for
EAGLE-2 drafters) cuts that to N/V of it. Output is unchanged: the base model verifies every draft, so a
token missing from the set can only cost acceptance, never correctness (greedy and sampled).

    ids = frequent_tokens(token_lists, 8192)        # from the training replies, say
    save_draft_vocab("runs/x/draft_vocab.json", ids, source="runs/sd_chat_all.jsonl")
    generate(model, prompts, mode="speculative", head=head, draft_vocab=load_draft_vocab(path))

CLI: `python -m clover_jax.cli.draft_vocab --data chat.jsonl --size 8192 --out draft_vocab.json`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from clover_jax import pretrained
from clover_jax.heads import registry
from clover_jax.io.files import atomic_write_text
from clover_jax.validation import InputError, check_draft_vocab  # noqa: F401  (re-exported)


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The `size` most frequent token ids over `sequences` (ties: the smaller id first), sorted by id,
    always including `always` (end-of-sequence ids, say). int32 `[size]`."""
    if size < 1:
        raise InputError(f"draft vocabulary size must be >= 1, got {size}")
    counts = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    keep = [int(t) for t in dict.fromkeys(always)]
    if len(keep) > size:
        raise InputError(f"draft vocabulary size {size} is smaller than the {len(keep)} ids it must include")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = set(keep)
    for tok, _ in ranked:
        if len(chosen) >= size:
            break
        chosen.add(tok)
    return np.asarray(sorted(chosen), np.int32)


def pad_draft_vocab(ids, size: int, vocab_size: int) -> np.ndarray:
    """`ids` grown to `size` with the smallest token ids it lacks (sorted int32): for a head whose output columns are
    its draft vocabulary (EAGLE-3), when the data holds fewer distinct tokens than the columns it was given."""
    ids = np.asarray(ids, np.int32)
    if size > vocab_size:
        raise InputError(f"draft vocabulary size {size} exceeds the vocabulary ({vocab_size})")
    missing = size - len(ids)
    if missing <= 0:
        return ids
    extra = np.setdiff1d(np.arange(vocab_size, dtype=np.int32), ids)[:missing]
    return np.sort(np.concatenate([ids, extra])).astype(np.int32)


DRAFT_VOCAB_FILE = "draft_vocab.json"  # its name in a training run directory and in an exported head folder


def head_draft_vocab(head_path) -> np.ndarray | None:
    """The draft vocabulary a head was trained on (`loss.draft_vocab`), or None: `folder_draft_vocab` of a head
    given by registered name (`clover_jax.pretrained`) or folder."""
    return folder_draft_vocab(pretrained.head_path(head_path))


def folder_draft_vocab(folder: Path, meta: dict | None = None) -> np.ndarray | None:
    """The draft vocabulary a head in `folder` was trained on (`loss.draft_vocab`), or None.

    Such a head's cross-entropy only ever saw those tokens, so it must draft from them: a training run
    directory or an exported head folder then holds `draft_vocab.json` with `"head_trained_on_it": true`.
    A draft vocabulary written only as an inference option (the flag false or absent) gives None."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return _published_vocab(Path(folder), meta)
    meta = _read_draft_vocab(path)
    return np.asarray(meta["ids"], np.int32) if meta.get("head_trained_on_it") else None


def _published_vocab(folder: Path, meta: dict | None = None) -> np.ndarray | None:
    """The draft vocabulary a published head folder's own tensors give (EAGLE-3's `d2t`), or None: a head type that
    drafts over a vocabulary of its own reads it (`HeadType.folder_vocab`). `meta`: the folder's config.json where
    the caller has read it."""
    if meta is None:
        cfg = folder / "config.json"
        if not cfg.is_file():
            return None
        try:
            meta = json.loads(cfg.read_text())
        except (OSError, json.JSONDecodeError):
            return None
    if not isinstance(meta, dict):
        return None
    kind = meta.get("head_type")
    ht = registry.get(kind) if kind in registry.names() else None if kind else registry.recognize(meta, folder)
    return ht.folder_vocab(folder) if ht is not None and ht.folder_vocab is not None else None


def save_draft_vocab(path, ids, **meta) -> Path:
    # whole or not at all, under a name of its own (several writers at once cannot collide on a temporary file)
    return atomic_write_text(path, json.dumps({"size": int(len(ids)), **meta, "ids": [int(i) for i in ids]}))


def _read_draft_vocab(path: Path) -> dict:
    """The file's JSON object, which must hold an 'ids' list (a ValueError naming the file otherwise)."""
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta["ids"], list):
            raise TypeError("'ids' is not a list")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise InputError(f"{path}: not a draft vocabulary file (a JSON object with an 'ids' list): {e}") from None
    return meta


def load_draft_vocab(path) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"draft vocabulary file not found: {path}")
    return np.asarray(_read_draft_vocab(path)["ids"], np.int32)


def coverage(ids, sequences: Iterable[Sequence[int]]) -> float:
    """Share of the tokens of `sequences` that are in the draft vocabulary `ids`."""
    s = set(int(i) for i in ids)
    total = hit = 0
    for seq in sequences:
        total += len(seq)
        hit += sum(int(t) in s for t in seq)
    return hit / total if total else float("nan")
