"""The one place that knows the draft-head types.

A head type is one package, `clover_jax/heads/<type>/`, whose `__init__` registers a `HeadType`: its module and
config classes, its experiment-config section (`HeadOptions`), its initialisation from the base model, the
drafter it builds for each tree policy it can draft, its training loss, its export / import under the reference
project's parameter names and its sharding rules. The trainer, checkpoints, export, `load_head` and the generation
API look a type up here and never import a head package themselves; the speculative loop takes the drafter this
module builds. A new built-in head is one package plus one line in `BUILTIN`; a head defined elsewhere (a user's
own package, a test) calls `register(...)` when it is imported.

  ht = registry.get("medusa")            # by the name an experiment config or checkpoint uses
  ht = registry.of_head(head)            # by a head module instance (or its class)
  drafter = registry.drafter_for(type(head), "fit-5-411aab+lookup-4-table", draft_vocab, ngram_table)  # cached,
                                         # prompt lookup and n-gram tables included: what the speculative loop takes
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

import jax.numpy as jnp

from clover_jax import parallel
from clover_jax.decoding.lookup import LookupDrafter, NoHead
from clover_jax.decoding.tree import LookupTree, get_tree, policy_kind
from clover_jax.validation import InputError

# name -> the package whose import registers it (imported on first lookup)
BUILTIN = {
    "block": "clover_jax.heads.block",
    "clover1": "clover_jax.heads.clover1",
    "clover2": "clover_jax.heads.clover2",
    "eagle": "clover_jax.heads.eagle",
    "eagle3": "clover_jax.heads.eagle3",
    "medusa": "clover_jax.heads.medusa",
    "redrafter": "clover_jax.heads.redrafter",
}

_TYPES: dict[str, "HeadType"] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class HeadType:
    """Everything the rest of the library needs to know about one kind of draft head.

    Classes: `module_cls` the head (an `nnx.Module`), `config_cls` its architecture config, `options_cls` the
    `head:` section of an experiment config (`clover_jax.heads.options.HeadOptions`; `.head_config(dtype, remat)`).
    `drafters` maps each tree-policy type the head can draft (`clover_jax.decoding.tree`: `TreeSpec`,
    `DynamicTree`, `BeamTree`) to its drafter class, called as `cls(spec, draft_vocab=...)`; a prompt-lookup chain
    (`LookupTree`) wraps any of them.
    Callables (all pure Python; the model pieces run under `jax.jit` where the caller jits):
      init_from_base(base, config, seed)   a fresh head for a base model (the reference's initialisation)
      loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, *, index, vocab_ids)
                                           -> (loss, metrics) of `clover_jax.heads.losses.kd_loss`'s keys
      to_reference(head, base, include_frozen) -> {reference name: numpy array}
      from_reference(folder, meta, base, dtype) -> head   (meta: the folder's config.json)
      config_dict(head, base_name) -> the exported config.json (with `head_type`)
      check_compatible(head, base_config)  raises a clear error if the head does not fit the base
      recognizes(meta, folder) -> bool     (optional) whether a folder published by the reference project,
                                           whose config.json has no `head_type`, holds a head of this type
    `weights_file` is the file an export writes (the reference project's name). `fields` are the config fields that fix the architecture: saved in checkpoints, compared on resume and
    warm start; `optional_fields` maps those of them added after heads were saved to the value such heads have. `sharding_rules` extend `clover_jax.parallel`'s rules for this head's parameter names.
    """

    name: str
    config_cls: type
    module_cls: type
    options_cls: type
    fields: tuple[str, ...]
    init_from_base: Callable[..., Any]
    drafters: dict[type, Callable[..., Any]]
    loss_from_features: Callable[..., Any]
    to_reference: Callable[..., dict]
    from_reference: Callable[..., Any]
    config_dict: Callable[..., dict]
    check_compatible: Callable[[Any, Any], None]
    sharding_rules: dict = dataclasses.field(default_factory=dict)
    description: str = ""
    weights_file: str = "model.safetensors"  # the safetensors file name of an exported folder
    default_tree: str = "clover2-26"  # the tree (or tree policy) used when none is asked for
    # loss_from_features takes `rng` and applies `LossConfig.feature_noise` to the head's input features
    feature_noise: bool = False
    recognizes: Callable[[dict, Any], bool] | None = None
    optional_fields: dict = dataclasses.field(default_factory=dict)
    # head config -> base layers (below the last) whose outputs the head reads besides the last layer's
    feature_layers: Callable[[Any], tuple[int, ...]] | None = None
    # a head whose output columns are a draft vocabulary of its own (EAGLE-3): (head, ids or None) -> the tensors
    # an export writes for it, and folder -> the ids a published folder's tensors give (None: all, or none there)
    vocab_tensors: Callable[[Any, Any], dict] | None = None
    folder_vocab: Callable[[Any], Any] | None = None

    def make_drafter(self, spec, draft_vocab=None):
        """The drafter of this head type for a tree policy (an error naming the policies it drafts otherwise)."""
        cls = next((c for kind, c in self.drafters.items() if isinstance(spec, kind)), None)
        if cls is None:
            can = " or a ".join(policy_kind(kind) for kind in self.drafters)
            raise InputError(f"{spec.name!r} is a {policy_kind(type(spec))}; {self.name} heads draft a {can}")
        return cls(spec, draft_vocab=draft_vocab)

    def base_feature_layers(self, config) -> tuple[int, ...]:
        """The base layers whose outputs a head of `config` reads besides the last layer's (its features, in
        training as in drafting, are `[..., (n + 1) D]`: those layers' outputs, then the last layer's)."""
        return tuple(self.feature_layers(config)) if self.feature_layers is not None else ()

    def config_to_meta(self, config) -> dict[str, Any]:
        """The JSON-able architecture fields of `config` plus its dtypes (checkpoint metadata)."""
        out = {k: list(v) if isinstance(v, tuple) else v for k in self.fields for v in [getattr(config, k)]}
        out["dtype"] = jnp.dtype(config.dtype).name
        out["param_dtype"] = jnp.dtype(config.param_dtype).name
        return out

    def config_from_meta(self, meta: dict[str, Any], dtype=None, remat: bool = False):
        """The config written by `config_to_meta` (`dtype` overrides the saved compute dtype)."""
        meta = {**self.optional_fields, **meta}
        missing = [k for k in self.fields if k not in meta]
        if missing:
            raise InputError(f"{self.name} head metadata lacks {missing}")
        return self.config_cls(**{k: meta[k] for k in self.fields},
                               dtype=jnp.dtype(dtype or meta.get("dtype", "float32")),
                               param_dtype=jnp.dtype(meta.get("param_dtype", "float32")), remat=remat)


def register(head_type: HeadType) -> HeadType:
    """Adds a head type (its package calls this at import) and its parameters' sharding rules. Registering a name
    twice with different classes is an error; re-importing the same module is not."""
    old = _TYPES.get(head_type.name)
    if old is not None and old.module_cls is not head_type.module_cls:
        raise ValueError(f"head type {head_type.name!r} is already registered ({old.module_cls.__name__})")
    parallel.add_rules(head_type.sharding_rules)
    _TYPES[head_type.name] = head_type
    return head_type


def names() -> tuple[str, ...]:
    """Every known head type name (built-in ones included, whether imported yet or not)."""
    return tuple(sorted(set(BUILTIN) | set(_TYPES)))


def get(name: str) -> HeadType:
    """The head type called `name`; an `InputError` listing the known ones otherwise."""
    if name not in _TYPES and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in _TYPES:
        raise InputError(f"unknown head type {name!r}; known: {', '.join(names())}")
    return _TYPES[name]


def load_all() -> dict[str, HeadType]:
    for name in BUILTIN:
        get(name)
    return dict(_TYPES)


def recognize(meta: dict, folder) -> HeadType | None:
    """The head type of a folder whose config.json has no `head_type` (a head published by its reference
    project), when exactly one registered type recognizes it; None when none does; an error when several do."""
    hits = [ht for ht in load_all().values() if ht.recognizes is not None and ht.recognizes(meta, folder)]
    if len(hits) > 1:
        raise InputError(f"{folder}: looks like a head of each of {[h.name for h in hits]}; add "
                         '"head_type" to its config.json')
    return hits[0] if hits else None


def of_head(head_or_class) -> HeadType:
    """The head type of a head module (or of its class)."""
    cls = head_or_class if isinstance(head_or_class, type) else type(head_or_class)
    for ht in load_all().values():
        if issubclass(cls, ht.module_cls):
            return ht
    raise InputError(f"{cls.__name__} is not a registered draft head type (known: {', '.join(names())})")


def of_config(config) -> HeadType:
    """The head type whose config class `config` is an instance of."""
    for ht in load_all().values():
        if isinstance(config, ht.config_cls):
            return ht
    raise InputError(f"{type(config).__name__} is not the config of a registered draft head type")


def drafter_for(head_type: type, tree_key, draft_vocab=None, ngram_table=None) -> object:
    """The (cached) drafter of a head type for a tree, an optional draft vocabulary (token ids) and, for trees
    named `...-table`, an n-gram table (`clover_jax.decoding.ngram.NgramTable`; ignored by other trees): equal
    arguments give the same drafter object, so the jitted loop is reused."""
    vocab = None if draft_vocab is None else tuple(int(i) for i in draft_vocab)
    spec = get_tree(tree_key)  # a name and the policy it names give one drafter: cached by the policy
    table = ngram_table if isinstance(spec, LookupTree) and spec.table else None
    return _drafter_for(head_type, spec, vocab, table)


@functools.lru_cache(maxsize=32)
def _drafter_for(head_type: type, spec, draft_vocab, ngram_table) -> object:
    if isinstance(spec, LookupTree):  # a prompt-lookup chain beside the head's tree (or alone)
        if spec.inner is not None and issubclass(head_type, NoHead):
            raise InputError(f"tree {spec.name!r} drafts {spec.inner.name!r} with a head: give head=..., or "
                             f"use {spec.name.rsplit('+', 1)[-1]!r} (prompt lookup alone)")
        if spec.table and ngram_table is None:
            raise InputError(f"tree {spec.name!r} falls back to an n-gram table, and none was given: use a head "
                             f"that ships one (ngram_table.npz beside it), pass ngram_table=... (--ngram-table), "
                             f"build one with python -m clover_jax.cli.ngram, or drop '-table' from the tree name")
        inner = None if spec.inner is None else of_head(head_type).make_drafter(spec.inner, draft_vocab)
        return LookupDrafter(inner, spec, ngram_table)
    return of_head(head_type).make_drafter(spec, draft_vocab)
