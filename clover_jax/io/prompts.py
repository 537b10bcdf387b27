"""Evaluation prompts from JSONL files: MT-Bench / Spec-Bench questions or plain {"prompt": ...} lines.

Three question sets ship with the package (`clover_jax/data/`, see its SOURCES.md) and can be named:
`read_prompts("mt_bench")`, `read_prompts("spec_bench", category="math_reasoning")`, `read_prompts("sharegpt_heldout")`.
"""

from __future__ import annotations

import json
from pathlib import Path

from clover_jax.validation import InputError

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
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e})") from None
        if category and rec.get("category") != category:
            continue
        if "turns" in rec:
            text = rec["turns"][turn] if turn < len(rec["turns"]) else None
        else:
            text = rec.get("prompt") or rec.get("text")
        if not text:
            raise InputError(f"{path}:{n}: no 'turns'[{turn}] / 'prompt' / 'text' field")
        out.append(text)
        if limit and len(out) >= limit:
            break
    if not out:
        raise InputError(f"{path}: no prompts" + (f" in category {category!r}" if category else ""))
    return out
