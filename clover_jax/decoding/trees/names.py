"""The tree-name grammar: `get_tree` tries a registry of parsers in order; fitted trees registered at run time.

`GRAMMAR` holds one entry per name form, tried in this order (the first parser that returns a policy wins):

  a registered tree   the fitted trees of a calibration (`register_tree`), exact names (first: `register_tree`
                      admits a name other entries read only for an equal tree)
  presets             clover2-26, medusa-63, small-10 (`presets.parse_preset`)
  chain-N             `presets.parse_chain`
  dynamic-N...        `DynamicTree.parse`
  beam-WxL...         `BeamTree.parse`
  [TREE+]lookup-K...  `LookupTree.parse` (TREE resolved by `get_tree`)
  a JSON file         `TreeSpec.parse`: a name ending in .json, or any existing file

Each parser is `parse(name, resolve) -> policy | None` (`base.TreePolicy.parse`; `resolve` is `get_tree`). A new
policy type is a `TreePolicy` subclass with a `parse` classmethod and one `register_grammar` line (with the forms
it reads, listed when a name is unknown).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable

from clover_jax.decoding.trees.base import TreePolicy, TreeSpecError
from clover_jax.decoding.trees.policies import BeamTree, DynamicTree, LookupTree
from clover_jax.decoding.trees.presets import PRESETS, parse_chain, parse_preset
from clover_jax.decoding.trees.spec import TreeSpec

Parser = Callable[[str, Callable[[str], TreePolicy]], "TreePolicy | None"]


@dataclasses.dataclass(frozen=True)
class NameForm:
    """One entry of the grammar: a parser, and `listed()`: the names it reads as the "unknown tree" message lists
    them (computed when a message needs them: the presets' names are `PRESETS`' keys at that time)."""

    parse: Parser
    listed: Callable[[], list[str]]


GRAMMAR: list[NameForm] = []


def register_grammar(parse: Parser, *forms: str, listed: Callable[[], list[str]] | None = None) -> None:
    """Adds a parser to the end of `GRAMMAR` (after the JSON-file parser, which only claims names ending in .json
    and existing files). `forms`, or `listed()` where they change at run time, are the names it reads."""
    GRAMMAR.append(NameForm(parse, listed if listed is not None else lambda: list(forms)))


def policy_kind(policy_type: type) -> str:
    """What a tree-policy type is called in messages ("a static tree (clover2-26, ...)"), with the names that give
    one."""
    kind = getattr(policy_type, "kind", None)
    return kind if isinstance(kind, str) else policy_type.__name__


# trees named at run time (the fitted trees of a calibration, `clover_jax.decoding.tree_fit`): name -> spec
_REGISTERED: dict[str, TreeSpec] = {}


def register_tree(spec: TreeSpec) -> TreeSpec:
    """Makes `get_tree(spec.name)` return `spec` in this process (how a calibration's fitted trees are reached
    by name). Re-registering the same tree is a no-op; another tree under a taken name is an error."""
    if not isinstance(spec, TreeSpec):
        raise TreeSpecError(f"only static trees can be registered, got {type(spec).__name__}")
    try:
        taken = get_tree(spec.name)
    except TreeSpecError:
        taken = None
    if taken is not None and taken != spec:
        raise TreeSpecError(f"tree name {spec.name!r} is already taken by another tree")
    _REGISTERED[spec.name] = spec
    return spec


def parse_registered(name: str, resolve: Callable[[str], TreePolicy]) -> TreeSpec | None:
    """A tree registered under `name` in this process (`register_tree`), or None."""
    return _REGISTERED.get(name)


def get_tree(name_or_path: str | os.PathLike | TreePolicy) -> TreePolicy:
    """Resolve "clover2-26", "medusa-63", "chain-N", "dynamic-N[-dD][-kK]" (a `DynamicTree` policy),
    "beam-WxL[-uN]" (a `BeamTree` policy), "lookup-K[-nN][-table]" or "TREE+lookup-K[-nN][-table]" (a
    `LookupTree`: a prompt lookup chain alone or beside TREE, with an n-gram table's chain where lookup finds no
    match), or a JSON file path (a policy object passes through)."""
    if isinstance(name_or_path, TreePolicy):
        return name_or_path
    key = os.fspath(name_or_path)
    for entry in GRAMMAR:
        policy = entry.parse(key, get_tree)
        if policy is not None:
            return policy
    known = ", ".join(form for entry in GRAMMAR for form in entry.listed())
    if re.fullmatch(r"(fit|probe)-[0-9a-f-]+", key):
        raise TreeSpecError(f"tree {key!r} is a calibration's fitted tree, not known in this process: ask for "
                            "tree='auto' (it loads the calibration's trees), or save it as JSON (TreeSpec.to_json)")
    raise TreeSpecError(f"unknown tree {key!r}; known names: {known}, or a path to a .json file")


register_grammar(parse_registered)
register_grammar(parse_preset, listed=lambda: list(PRESETS))
register_grammar(parse_chain, "chain-N")
register_grammar(DynamicTree.parse, "dynamic-N")
register_grammar(BeamTree.parse, "beam-WxL")
register_grammar(LookupTree.parse, "lookup-K", "TREE+lookup-K")
register_grammar(TreeSpec.parse)  # last: it claims any existing file


def is_lookup_only(tree) -> bool:
    """Whether `tree` is a prompt-lookup chain alone (`lookup-K`, `lookup-K-table`), which drafts without a head.
    False for None, "auto" and a name that cannot be resolved here (a calibration's fitted tree, known once its head
    is given; a bad name is reported when the tree is resolved with the head)."""
    if tree is None or (isinstance(tree, str) and tree.strip().lower() == "auto"):
        return False
    try:
        spec = get_tree(tree)
    except TreeSpecError:
        return False
    return isinstance(spec, LookupTree) and spec.inner is None


def is_table_tree(tree) -> bool:
    """Whether `tree` names a prompt-lookup chain with an n-gram table's fallback (`...lookup-K-table`)."""
    if tree is None or (isinstance(tree, str) and tree.strip().lower() == "auto"):
        return False
    try:
        spec = get_tree(tree)
    except TreeSpecError:
        return False
    return isinstance(spec, LookupTree) and spec.table
