"""Evaluation prompts from JSONL files: MT-Bench / Spec-Bench questions or plain {"prompt": ...} lines."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: str | Path, category: str | None = None, limit: int | None = None,
                 turn: int = 0) -> list[str]:
    """First-turn (or `turn`-th) questions of an MT-Bench-format file, optionally one category."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if category and rec.get("category") != category:
            continue
        if "turns" in rec:
            text = rec["turns"][turn] if turn < len(rec["turns"]) else None
        else:
            text = rec.get("prompt") or rec.get("text")
        if not text:
            raise ValueError(f"{path}:{n}: no 'turns'[{turn}] / 'prompt' / 'text' field")
        out.append(text)
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no prompts" + (f" in category {category!r}" if category else ""))
    return out
