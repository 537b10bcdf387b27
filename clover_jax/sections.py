"""Frozen configuration sections: every field type-checked from its annotation, then `_validate()`.

A section is a frozen dataclass that mixes in `Section`; building one (from YAML or in Python) coerces each field
to its annotated type (int -> float, list -> tuple) or raises a `ConfigError` naming the dotted key, e.g.
`optim.lr: expected float, got 'abc'`. The experiment config (`clover_jax.training.config`) and each head type's
`head:` section (`clover_jax.heads.options`) are built from these.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from clover_jax.validation import ConfigError

__all__ = ["ConfigError", "Section", "coerce", "type_name"]


def type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp, key: str):
    """Returns `value` as type `tp` (int -> float, list -> tuple) or raises ConfigError naming `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise bad
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for member in args:
            if member is type(None):
                continue
            try:
                return coerce(value, member, key)
            except ConfigError:
                pass
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise TypeError(f"{key}: unsupported annotation {tp!r}")  # a bug in this file, not in the user's config


class Section:
    """Mixin for the frozen section dataclasses: type-check every field, then `_validate()`."""

    _name: typing.ClassVar[str] = ""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = coerce(getattr(self, f.name), hints[f.name], f"{self._name}.{f.name}")
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self):
        pass

    def _need(self, ok: bool, field: str, message: str):
        if not ok:
            raise ConfigError(f"{self._name}.{field}: {message}, got {getattr(self, field)!r}")
