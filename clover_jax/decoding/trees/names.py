"""The tree-name grammar: `get_tree` tries a registry of parsers in order, after the trees a caller knows by name
(a head's fitted trees).

`GRAMMAR` holds one entry per name form, tried in this order (the first parser that returns a policy wins):

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
from typing import Callable, Mapping

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


def get_tree(name_or_path: str | os.PathLike | TreePolicy, known: Mapping[str, TreePolicy] | None = None
             ) -> TreePolicy:
    """Resolve "clover2-26", "medusa-63", "chain-N", "dynamic-N[-dD][-kK]" (a `DynamicTree` policy),
    "beam-WxL[-uN]" (a `BeamTree` policy), "lookup-K[-nN][-table]" or "TREE+lookup-K[-nN][-table]" (a
    `LookupTree`: a prompt lookup chain alone or beside TREE, with an n-gram table's chain where lookup finds no
    match), or a JSON file path (a policy object passes through). `known`: trees named elsewhere, tried first by
    exact name (a head's fitted trees, `clover_jax.heads.bundle.HeadBundle.trees`), TREE of `TREE+lookup-K`
    included."""
    if isinstance(name_or_path, TreePolicy):
        return name_or_path
    key = os.fspath(name_or_path)
    known = known or {}
    if key in known:
        return known[key]
    resolve = (lambda inner: get_tree(inner, known)) if known else get_tree
    for entry in GRAMMAR:
        policy = entry.parse(key, resolve)
        if policy is not None:
            return policy
    forms = ", ".join(form for entry in GRAMMAR for form in entry.listed())
    if FITTED_NAME.fullmatch(key):
        raise TreeSpecError(f"tree {key!r} is a calibration's fitted tree, not one of this head's: name the head "
                            "whose calibration fitted it (head=...), or save it as JSON (TreeSpec.to_json)")
    raise TreeSpecError(f"unknown tree {key!r}; known names: {forms}, or a path to a .json file")


register_grammar(parse_preset, listed=lambda: list(PRESETS))
register_grammar(parse_chain, "chain-N")
register_grammar(DynamicTree.parse, "dynamic-N")
register_grammar(BeamTree.parse, "beam-WxL")
register_grammar(LookupTree.parse, "lookup-K", "TREE+lookup-K")
register_grammar(TreeSpec.parse)  # last: it claims any existing file


FITTED_NAME = re.compile(r"(fit|probe)-[0-9a-f-]+")  # a calibration's fitted tree: fit-N-<hash>, probe-W1-W2-...


def names_fitted_tree(name) -> bool:
    """Whether a tree name is a calibration's fitted tree (`fit-N-<hash>`, `probe-...`), alone or as the TREE of
    `TREE+lookup-K`: the names a head's fitted trees (`known` of `get_tree`) are read for."""
    return isinstance(name, str) and FITTED_NAME.fullmatch(name.strip().split("+", 1)[0]) is not None


def is_lookup_only(policy: TreePolicy | None) -> bool:
    """Whether `policy` is a prompt-lookup chain alone (`lookup-K`, `lookup-K-table`), which drafts without a
    head."""
    return isinstance(policy, LookupTree) and policy.inner is None


def is_table_tree(policy: TreePolicy | None) -> bool:
    """Whether `policy` is a prompt-lookup chain with an n-gram table's fallback (`...lookup-K-table`)."""
    return isinstance(policy, LookupTree) and policy.table
