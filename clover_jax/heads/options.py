"""The `head:` section of an experiment config, one dataclass per head type.

Each head package defines a `HeadOptions` subclass with the fields its YAML section may hold and registers it
(`HeadType.options_cls`); `clover_jax.training.config` builds the section with the class of its `type`, so a key
another head type takes (say `num_layers` in a Clover-2 section) is an error naming the type's keys.
`head_config(dtype, remat)` turns the options into the head module's own config: by default every option but
`type` passes to the config class under its own name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from clover_jax.sections import Section


@dataclasses.dataclass(frozen=True)
class HeadOptions(Section):
    """What every head type's section holds: its `type` and how many depths it drafts."""

    _name = "head"
    config_cls: ClassVar[Any] = None  # the head module's config class (set by each subclass)
    type: str = ""
    num_heads: int = 5  # depths drafted per step (trained per position), for every type

    def _validate(self):
        self._need(self.num_heads >= 1, "num_heads", "must be >= 1")

    def check_experiment(self, cfg) -> None:
        """A `ConfigError` where the rest of an experiment config (`cfg`) does not suit this head (none by default)."""

    def config_kwargs(self) -> dict[str, Any]:
        """The head config's architecture fields, from the options (by name; a type whose names differ says so)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "type"}

    def head_config(self, dtype: Any = jnp.float32, remat: bool = False):
        """The head module's config: parameters stored in float32, computed in `dtype`."""
        return self.config_cls(**self.config_kwargs(), dtype=jnp.dtype(dtype), param_dtype=jnp.float32, remat=remat)
