"""Prompts: user input (strings, message lists, token ids) encoded to token ids, and evaluation prompts from JSONL
files (MT-Bench / Spec-Bench questions or plain {"prompt": ...} lines).

Three question sets ship with the package (`clover_jax/data/`, see its SOURCES.md) and can be named:
`read_prompts("mt_bench")`, `read_prompts("spec_bench", category="math_reasoning")`, `read_prompts("sharegpt_heldout")`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from clover_jax.io.files import text_lines
from clover_jax.validation import InputError, PromptError, check_token_ids

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
QUESTION_SETS = {"mt_bench": DATA_DIR / "mt_bench.jsonl", "spec_bench": DATA_DIR / "spec_bench.jsonl",
                 "sharegpt_heldout": DATA_DIR / "sharegpt_heldout.jsonl"}


def questions_path(name_or_path: str | Path) -> Path:
    """The file of a shipped question set ('mt_bench', 'spec_bench', 'sharegpt_heldout') or `name_or_path` itself."""
    key = str(name_or_path)
    return QUESTION_SETS.get(key.lower(), Path(key).expanduser())


def read_prompts(path: str | Path, category: str | None = None, limit: int | None = None,
                 turn: int = 0) -> list[str]:
    """First-turn (or `turn`-th) questions of an MT-Bench-format file (or a shipped set's name), optionally
    one category."""
    path = questions_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path} (shipped question sets: {', '.join(QUESTION_SETS)})")
    out = []
    for n, line in text_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise InputError(f"{path}:{n}: expected a JSON object with 'turns' (a list of strings), 'prompt' or "
                             f"'text', got {type(rec).__name__} {line.strip()[:60]!r}")
        if category and rec.get("category") != category:
            continue
        if "turns" in rec:
            turns = rec["turns"]
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise InputError(f"{path}:{n}: 'turns' must be a list of strings, got {turns!r:.60}")
            text = turns[turn] if turn < len(turns) else None
        else:
            text = rec.get("prompt") or rec.get("text")
        if text is not None and not isinstance(text, str):
            raise InputError(f"{path}:{n}: the prompt must be a string, got {type(text).__name__} {text!r:.60}")
        if not text or not text.strip():
            raise InputError(f"{path}:{n}: no 'turns'[{turn}] / 'prompt' / 'text' field, or it is empty")
        out.append(text)
        if limit and len(out) >= limit:
            break
    if not out:
        raise InputError(f"{path}: no prompts" + (f" in category {category!r}" if category else ""))
    return out


def encode_prompts(tokenizer, prompts: Sequence[Any], chat: bool = True, system: str | None = None,
                   vocab_size: int | None = None) -> list[list[int]]:
    """Strings (chat-templated when `chat`), message lists, or token-id lists -> token-id lists.

    Token ids, given or from the tokenizer, are checked against `vocab_size` when it is given."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise PromptError(f"prompts[{i}]: prompt {i} is empty")
            if tokenizer is None:
                raise PromptError(f"prompts[{i}]: text prompts need a tokenizer (pass tokenizer=...)")
            if chat and getattr(tokenizer, "chat_template", None):
                msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
                ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer.encode(p, add_special_tokens=True)
            where = f"prompts[{i}] (as tokenized)"
        elif isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            if tokenizer is None:
                raise PromptError(f"prompts[{i}]: message lists need a tokenizer (pass tokenizer=...)")
            bad = [m for m in p if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m]
            if bad:
                raise PromptError(f"prompts[{i}]: every message must be a dict with 'role' and a string 'content', "
                                  f"got {bad[0]!r}")
            ids = tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            where = f"prompts[{i}] (as tokenized)"
        elif isinstance(p, (list, tuple, np.ndarray)) or hasattr(p, "__array__"):
            ids = check_token_ids(f"prompts[{i}]", p if isinstance(p, (list, tuple)) else np.asarray(p),
                                  vocab_size if vocab_size is not None else 2 ** 31)
            where = f"prompts[{i}]"
        else:
            raise PromptError(f"prompts[{i}]: expected a string, a list of messages or a list of token ids, got "
                              f"{type(p).__name__} {p!r:.80}")
        if len(ids) == 0:
            raise PromptError(f"prompts[{i}]: prompt {i} is empty after tokenization")
        if vocab_size is not None:
            check_token_ids(where, list(ids), vocab_size)
        out.append(list(ids))
    return out
