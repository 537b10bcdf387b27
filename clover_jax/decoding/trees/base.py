"""What every tree policy is: the `TreePolicy` interface, its error type and the depth limit.

A tree policy says which tokens a speculative step verifies: a static tree (`spec.TreeSpec`), a tree the
drafter builds per step and per row (`policies.DynamicTree`, `policies.BeamTree`) or a prompt-lookup chain
beside one of them (`policies.LookupTree`). Each is a frozen dataclass deriving from `TreePolicy`; heads declare
which types they draft (`HeadType.drafters`, keyed by these types).
"""

from __future__ import annotations

import abc
from typing import Callable

from clover_jax.validation import InputError

MAX_DEPTH = 32  # deeper trees are rejected: no drafter is useful that far out
DEFAULT_TOP_K = 10  # Medusa / EAGLE / Clover TOPK, used for bare-list JSON files


class TreeSpecError(InputError):
    """An invalid tree spec; the message names the offending path."""


class TreePolicy(abc.ABC):
    """One kind of tree a head can draft. Subclasses are frozen dataclasses; `name` is a field (not compared) and
    the sizes below are fields or properties.

      kind       (class attribute) what the type is called in messages, with the names that give one
      name       the name `names.get_tree` resolves to an equal policy
      num_nodes  U: the verified tokens per step, root included (a budget where the tree varies per step)
      max_depth  the deepest draft node (the root is depth 0)
      top_k      the most children a node can have (a static tree's candidates per expanded node)

    `parse(name, resolve)` reads the type's own names (its regex) and returns a policy, or None for a name it does
    not own; `names.get_tree` tries the registered parsers in order (`names.register_grammar`).
    """

    @property
    @abc.abstractmethod
    def kind(self) -> str: ...

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    @property
    @abc.abstractmethod
    def num_nodes(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_depth(self) -> int: ...

    @property
    @abc.abstractmethod
    def top_k(self) -> int: ...

    @classmethod
    def parse(cls, name: str, resolve: Callable[[str], TreePolicy]) -> TreePolicy | None:
        """The policy `name` gives, or None where `name` is not one of this type's names. `resolve` is
        `names.get_tree`, for names that contain another tree's name."""
        return None
