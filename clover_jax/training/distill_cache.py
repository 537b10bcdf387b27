"""The self-distillation cache: base model replies to first-turn prompts, in a resumable JSONL file.

`build_self_distill` replaces the first assistant reply of each conversation by the base model's own
(from a `generate_fn`), cached in a `SelfDistillCache`; `clover_jax.training.self_distill` supplies the
model and the command line.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from clover_jax.training.sources import Conversation, DataError
from tqdm import tqdm

log = logging.getLogger(__name__)


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


def generation_order(todo: Sequence[tuple[str, Sequence[dict[str, str]]]], batch_size: int,
                     window: int = 8, seed: int = 0) -> list[tuple[str, Sequence[dict[str, str]]]]:
    """The order `(id, prompt)` items are generated in: shuffled by a hash of each prompt and `seed` (fixed, and new
    prompts interleave with old ones as the set grows), then sorted by length within windows of `window` batches, so
    a batch pads little while any prefix of the order is an even sample of the prompts' lengths and topics.

    (Sorting the whole set by length pads least, but a run stopped early then holds only the shortest prompts,
    greetings and one-liners, and a head trained on their replies drafts worse for real questions.) A run stopped
    early with another seed (a second sampled reply per prompt, `data.seed`) starts on other prompts, so two short
    runs cover more of the set; seed 0 keeps the order of the replies generated before the seed took part."""
    def rank(item) -> str:
        key = prompt_key(item[1])
        return hashlib.sha1(f"{seed}:{key}".encode()).hexdigest() if seed else key

    items = sorted(todo, key=rank)
    span = max(1, batch_size * window)
    out = []
    for s in range(0, len(items), span):
        out += sorted(items[s: s + span], key=lambda item: sum(len(m["content"]) for m in item[1]))
    return out


def build_self_distill(conversations: Sequence[Conversation], generate_fn: Callable[..., list[str]],
                       out_path: str | Path, batch_size: int = 8, max_new_tokens: int = 512, resume: bool = True,
                       progress: bool = True, seed: int = 0) -> list[Conversation]:
    """Conversations whose (only) assistant turn is the base model's reply to their first-turn prompt.

    `generate_fn(list_of_message_lists) -> list[str]` generates the replies (it also gets
    `max_new_tokens=` when its signature takes it). Replies are cached in `out_path` (JSONL); with `resume`,
    prompts already there are not generated again, so a killed run continues where it stopped.
    Each distinct prompt is generated once, in `generation_order` (by `seed`): a run stopped early (the generation
    is the slow part) leaves a sample of the whole set, not its shortest prompts.
    """
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
    todo = generation_order(todo, batch_size, seed=seed)
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
