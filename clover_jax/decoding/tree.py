"""Draft trees and tree policies: the one import point of the package `clover_jax.decoding.trees`.

  trees/base.py      `TreePolicy` (the interface every tree policy derives from: kind, name, num_nodes, max_depth,
                     top_k, parse), `TreeSpecError`, `MAX_DEPTH`, `DEFAULT_TOP_K`
  trees/spec.py      `TreeSpec` (a static tree: sorted paths of child ranks) and `from_json`
  trees/buffers.py   `TreeBuffers`, `build_buffers` (a static tree's index arrays), `stack_buffers` (per row)
  trees/presets.py   `clover2_26`, `medusa_63`, `small_10`, `chain`, `PRESETS` and the parsers of their names
  trees/policies.py  per-step policies `DynamicTree` (EAGLE-2), `BeamTree` (ReDrafter) and `LookupTree` (a
                     prompt-lookup chain beside any tree), each parsing its own names
  trees/topology.py  `TreeTopology`: a tree's index arrays built on device from parent pointers (per-step trees)
  trees/fit.py       trees fitted to a head's measured acceptance and a machine's step cost (after Sequoia)
  trees/names.py     the name grammar (`get_tree` over the parsers of `GRAMMAR`, `register_grammar`; trees a caller
                     knows by name first: a head's fitted trees), `policy_kind`, `is_lookup_only`, `is_table_tree`
"""

from __future__ import annotations

from clover_jax.decoding.trees.base import DEFAULT_TOP_K, MAX_DEPTH, TreePolicy, TreeSpecError
from clover_jax.decoding.trees.buffers import TreeBuffers, build_buffers, stack_buffers
from clover_jax.decoding.trees.names import (GRAMMAR, get_tree, is_lookup_only, is_table_tree, policy_kind,
                                             register_grammar)
from clover_jax.decoding.trees.policies import BeamTree, DynamicTree, LookupTree
from clover_jax.decoding.trees.presets import (CLOVER2_26, MEDUSA_63, PRESETS, SMALL_10, chain, clover2_26, medusa_63,
                                               small_10)
from clover_jax.decoding.trees.spec import TreeSpec, from_json

__all__ = [
    "BeamTree", "CLOVER2_26", "DEFAULT_TOP_K", "DynamicTree", "GRAMMAR", "LookupTree", "MAX_DEPTH", "MEDUSA_63",
    "PRESETS", "SMALL_10", "TreeBuffers", "TreePolicy", "TreeSpec", "TreeSpecError", "build_buffers", "chain",
    "clover2_26", "from_json", "get_tree", "is_lookup_only", "is_table_tree", "medusa_63", "policy_kind",
    "register_grammar", "small_10", "stack_buffers",
]

