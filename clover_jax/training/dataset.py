"""The tokenized dataset: conversations -> `Example`s (token ids + loss mask) in a `TokenizedDataset`.

    train, heldout = build_datasets(cfg.data, tokenizer, convs)   # TokenizedDataset x 2

Conversations are split into train / held-out by conversation (seeded), tokenized with
`clover_jax.training.chat_masks`, and those with too few assistant tokens dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np

from clover_jax.training.chat_masks import _tokenize
from clover_jax.training.config import DataConfig
from clover_jax.training.sources import Conversation, DataError, load_conversations
from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class Example:
    id: str
    tokens: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] int32
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def pad_token_id(tokenizer) -> int:
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(tid, int):
            return tid
    return 0


class TokenizedDataset:
    """Tokenized examples with their loss masks (a list in memory) and statistics."""

    def __init__(self, examples: Sequence[Example], pad_id: int, max_length: int, stats: dict | None = None):
        self.examples = list(examples)
        self.pad_id = int(pad_id)
        self.max_length = int(max_length)
        self.lengths = np.asarray([len(e) for e in self.examples], dtype=np.int64)  # [num_examples]
        self.stats = dict(stats or {})
        self.stats.update(self._length_stats())
        self._fingerprint: str | None = None

    @classmethod
    def from_conversations(cls, conversations: Sequence[Conversation], tokenizer, max_length: int,
                           min_assistant_tokens: int = 1, progress: bool = False) -> "TokenizedDataset":
        """Tokenizes every conversation; drops those with fewer than `min_assistant_tokens` loss tokens."""
        examples, few, truncated = [], 0, 0
        for conv in tqdm(conversations, desc="tokenizing", disable=not progress, unit="conv"):
            ids, mask, cut = _tokenize(tokenizer, conv.messages, max_length)
            if mask.sum() < max(min_assistant_tokens, 1):
                few += 1
                continue
            truncated += cut
            examples.append(Example(conv.id, ids, mask, cut))
        stats = {"conversations": len(conversations), "dropped_few_assistant_tokens": few, "truncated": truncated}
        return cls(examples, pad_token_id(tokenizer), max_length, stats)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def _length_stats(self) -> dict[str, Any]:
        n = len(self.examples)
        loss = sum(e.num_loss_tokens for e in self.examples)
        out = {"examples": n, "tokens": int(self.lengths.sum()), "loss_tokens": int(loss)}
        if n:
            out.update(mean_length=float(self.lengths.mean()), p50_length=int(np.percentile(self.lengths, 50)),
                       p90_length=int(np.percentile(self.lengths, 90)), max_length=int(self.lengths.max()))
        return out

    def fingerprint(self) -> str:
        """Hash of every example's ids and token ids/masks: a resumed batcher checks it sees the same data."""
        if self._fingerprint is None:
            h = hashlib.sha1()
            for e in self.examples:
                h.update(e.id.encode())
                h.update(e.tokens.tobytes())
                h.update(e.loss_mask.astype(np.int8).tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint


def split_conversations(conversations: Sequence[Conversation], heldout_fraction: float, seed: int = 0,
                        shuffle: bool = True, by: str = "shuffle") -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out), split by conversation.

    by="shuffle": after a seeded shuffle (or none), the held-out part is the tail. by="id_hash": a conversation
    is held out when a hash of (seed, its id) falls below `heldout_fraction`, so it stays on the same side as the
    data grows (the training order is then the shuffle of the rest, or the file order). An id `X/variant` (another
    reply to conversation X, e.g. a sampled one) is hashed as `X`: both replies fall on the same side."""
    n = len(conversations)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    if by == "id_hash":
        held_ids = {i for i, c in enumerate(conversations)
                    if _unit_hash(f"{seed}:{c.id.split('/', 1)[0]}") < heldout_fraction}
        return ([conversations[i] for i in order if i not in held_ids],
                [conversations[i] for i in range(n) if i in held_ids])
    if by != "shuffle":
        raise ValueError(f"by: expected 'shuffle' or 'id_hash', got {by!r}")
    n_held = int(round(heldout_fraction * n))
    if heldout_fraction > 0 and n >= 2:
        n_held = min(max(n_held, 1), n - 1)
    train = [conversations[i] for i in order[: n - n_held]]
    held = [conversations[i] for i in order[n - n_held:]]
    return train, held


def _unit_hash(text: str) -> float:
    """A number in [0, 1) fixed by `text` (the first 52 bits of its SHA-1)."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:13], 16) / 16 ** 13


def build_datasets(cfg: DataConfig, tokenizer, conversations: Sequence[Conversation] | None = None,
                   progress: bool = False) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(train, held-out) datasets from `conversations` (default: `load_conversations(cfg)`)."""
    conversations = load_conversations(cfg) if conversations is None else list(conversations)
    train_c, held_c = split_conversations(conversations, cfg.heldout_fraction, cfg.seed, cfg.shuffle,
                                          by=cfg.heldout_split)
    train = TokenizedDataset.from_conversations(train_c, tokenizer, cfg.max_length, cfg.min_assistant_tokens,
                                                progress)
    held = TokenizedDataset.from_conversations(held_c, tokenizer, cfg.max_length, cfg.min_assistant_tokens,
                                               progress)
    if not len(train):
        raise DataError(f"no training examples left after filtering: {len(train_c)} conversations, none with "
                        f">= data.min_assistant_tokens={cfg.min_assistant_tokens} assistant tokens within "
                        f"data.max_length={cfg.max_length}")
    return train, held
