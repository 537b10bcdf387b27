"""Checks of user input at the API boundary, run before anything is compiled.

Every entry point (`generate`, `load_model`, `load_head`, the configs, and through them `infer.py`,
`train.py`, `python -m clover_jax.cli.export` and `bench/`) goes through these. Each failure is an `InputError`
(a `ValueError`) whose message names the argument, the value given and the limit it broke, e.g.
`max_new_tokens: expected an integer >= 1, got 0`. The command-line tools print such errors as one
`error: ...` line and exit with status 2 (`clover_jax.cli`).

What a call will allocate is checked against free memory in `clover_jax.decoding.memory`.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Any, Sequence

import numpy as np


class InputError(ValueError):
    """Bad user input; the message names the argument, the value and the limit."""


class ConfigError(InputError):
    """A bad configuration value (a model config, an experiment config's section); the message starts with the
    dotted key."""


class PromptError(InputError):
    """A prompt that cannot be generated from (empty, too long, wrong type)."""


class InsufficientMemoryError(InputError):
    """The estimated memory of a call exceeds what the device has free."""


class WeightFileError(InputError):
    """A weight file (safetensors, GGUF) that cannot be read: truncated, corrupt or not that format."""


# ------------------------------------------------------------------------------------------- scalars
def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False) -> int | None:
    """`value` as an int within [minimum, maximum]; bools, floats (also 2.0) and strings are refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name}: expected an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise InputError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})") from None
    _check_range(name, out, minimum, maximum, "an integer")
    return int(out)


def check_float(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
                above: float | None = None, allow_none: bool = False) -> float | None:
    """`value` as a finite float within [minimum, maximum] (and > `above`); NaN and infinities are refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InputError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out):
        raise InputError(f"{name}: expected a finite number, got {out!r}")
    if above is not None and not out > above:
        limit = f"> {above}" + (f" and <= {maximum}" if maximum is not None else "")
        raise InputError(f"{name}: expected a number {limit}, got {out!r}")
    _check_range(name, out, minimum, maximum, "a number")
    return out


def _check_range(name, value, minimum, maximum, what: str) -> None:
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            limit = f"in [{minimum}, {maximum}]"
        elif minimum is not None:
            limit = f">= {minimum}"
        else:
            limit = f"<= {maximum}"
        raise InputError(f"{name}: expected {what} {limit}, got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise InputError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


# ------------------------------------------------------------------------------------------- tokens
def check_token_ids(name: str, ids: Any, vocab_size: int) -> list[int]:
    """A 1-D sequence of integer token ids in [0, vocab_size) as a list; `name` is the argument (e.g.
    'prompts[2]'). Floats (NaN too), bools and nested lists are refused, naming the position."""
    arr = np.asarray(ids, dtype=object) if not isinstance(ids, np.ndarray) else ids
    if arr.ndim != 1:
        raise InputError(f"{name}: expected a flat list of token ids, got an array of shape {arr.shape}")
    if isinstance(ids, np.ndarray) and np.issubdtype(ids.dtype, np.integer):
        out = ids.astype(np.int64).tolist()
    else:
        out = []
        for j, x in enumerate(arr.tolist()):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise InputError(f"{name}[{j}]: token ids must be integers, got {x!r} ({type(x).__name__})")
            out.append(int(x))
    for j, x in enumerate(out):
        if not 0 <= x < vocab_size:
            raise InputError(f"{name}[{j}]: token id {x} is outside the model's vocabulary [0, {vocab_size})")
    return out


def check_draft_vocab(ids, vocab_size: int) -> np.ndarray:
    """`ids` as a sorted, duplicate-free int32 array of valid token ids, or an `InputError` naming the problem.
    A file name is refused with the way to read the file (`clover_jax.heads.draft_vocab.load_draft_vocab`)."""
    if isinstance(ids, (str, bytes, os.PathLike)):
        raise InputError(f"draft_vocab: expected token ids (a list or 1-D array of ints), got the path {str(ids)!r}; "
                         "read a draft_vocab.json file with clover_jax.heads.draft_vocab.load_draft_vocab(path) and "
                         "pass what it returns")
    try:
        a = np.asarray(ids)
    except (ValueError, TypeError):  # ragged nesting
        a = np.asarray(None)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        got = (f"{type(ids).__name__} {ids!r}"[:80] if a.ndim == 0 or a.dtype == object else
               f"shape {a.shape} of {a.dtype}")
        raise InputError(f"draft_vocab: expected a non-empty 1-D list or array of token ids (ints), got {got}")
    if a.min() < 0 or a.max() >= vocab_size:
        raise InputError(f"draft vocabulary holds token id {int(a.min() if a.min() < 0 else a.max())} outside "
                         f"the model's vocabulary [0, {vocab_size})")
    if len(np.unique(a)) != len(a):
        raise InputError("draft vocabulary holds duplicate token ids")
    return np.sort(a).astype(np.int32)


# ------------------------------------------------------------------------------------------- memory
__all__ = ["ConfigError", "InputError", "InsufficientMemoryError", "PromptError", "WeightFileError", "check_bool",
           "check_choice", "check_draft_vocab", "check_float", "check_int", "check_token_ids"]
