"""What a speculative request drafts with, resolved once: `Draft` (the head, the tree policy, its drafter, the draft
vocabulary and the n-gram table), from a checked `Request` whose tree is decided (named or the head's default).

The head is read once (`clover_jax.heads.bundle.open_head`: module, default tree, draft vocabulary, n-gram table and
fitted trees from one folder) and the tree name parsed once, against the head's fitted trees. Choosing a tree by
measuring (`tree=None` at the public API, `tree="auto"`) is a policy of the layer above
(`clover_jax.tuning`): it hands this module a request whose tree is named.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from clover_jax import pretrained
from clover_jax.decoding.drafter import check_drafter
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.ngram import NgramTable, resolve_ngram_table
from clover_jax.decoding.tree import TreePolicy, TreeSpecError, get_tree, is_lookup_only, is_table_tree
from clover_jax.generation.request import AUTO, DEFAULT, NAMED, Request
from clover_jax.heads.bundle import HeadBundle
from clover_jax.heads.folder import open_folder
from clover_jax.heads.registry import drafter_for
from clover_jax.training.loading import open_head_or_run
from clover_jax.validation import InputError


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    """A speculative request's drafting, resolved."""

    bundle: HeadBundle  # the head (NoHead for prompt lookup and n-gram chains) and what its folder holds
    policy: TreePolicy  # the tree
    drafter: Any  # `clover_jax.decoding.drafter.Drafter` of the head's type for the policy
    draft_vocab: np.ndarray | None  # [V'] token ids drafts are drawn from, or None (all)
    ngram_table: NgramTable | None  # the table of `...-table` trees, or None
    notes: tuple[str, ...] = ()  # what was taken that the request did not name

    @property
    def head(self):
        return self.bundle.module

    @property
    def tree_name(self) -> str:
        return self.policy.name


def shipped_head(model_source: str | None) -> str:
    """The model's first shipped head (`clover_jax.pretrained`), for a speculative request that names none."""
    shipped = pretrained.default_head(model_source) if model_source else None
    if shipped is None:
        raise InputError("head: mode='speculative' needs a draft head (head=...; shipped heads: "
                         f"{', '.join(pretrained.HEADS)}), or a prompt-lookup tree that needs none (tree='lookup-4')")
    return shipped


def resolve_draft(request: Request) -> Draft | None:
    """The `Draft` of a speculative request (None for plain decoding). The request's tree is named or the head's
    default (`tree_rule` NAMED or DEFAULT; FASTEST, a choice nobody made, drafts the default tree and says so);
    `tree_rule` AUTO is an error here: the calibration that resolves it is a layer above (`clover_jax.generate`). A
    head given by name or path is opened once (a training run directory included: `open_head_or_run`)."""
    if not request.speculative:
        return None
    if request.tree_rule == AUTO:
        raise InputError("tree='auto' is resolved by a calibration (clover_jax.generate, infer.py --tree auto), "
                         "before the draft is resolved")
    notes: list[str] = []
    head, policy = request.head, None
    if head is None:
        # no head named: a prompt-lookup chain drafts without one; any other tree with the model's shipped head
        if request.tree_rule == NAMED:
            try:
                policy = get_tree(request.tree)
            except TreeSpecError:
                policy = None  # perhaps a fitted tree of the shipped head: resolved against it below
        if not is_lookup_only(policy):
            head, policy = shipped_head(request.model_source), None
            notes.append(f"drafting with the shipped head {head}")
        else:
            head = NoHead()
    bundle = open_head_or_run(head, request.model)
    if policy is None:
        if request.tree_rule == NAMED:
            policy = bundle.tree(request.tree)
        else:
            name = bundle.default_tree
            if name is None:
                raise InputError("tree: a head-less draft needs a tree (lookup-4, lookup-4-table)")
            policy = bundle.tree(name)
    draft_vocab = request.draft_vocab
    if draft_vocab is None and bundle.draft_vocab is not None:
        draft_vocab = bundle.draft_vocab
        notes.append(f"drafting from the head's {len(draft_vocab)}-token training vocabulary")
    ngram_table = None
    if is_table_tree(policy):
        ngram_table = resolve_ngram_table(request.ngram_table) or bundle.ngram_table
        if ngram_table is None and bundle.headless and request.model_source:
            shipped = pretrained.default_head(request.model_source)  # a lookup-K-table chain: the shipped head's table
            if shipped:
                ngram_table = open_folder(shipped).ngram_table
                notes.append(f"n-gram table of the shipped head {shipped}")
    drafter = drafter_for(type(bundle.module), policy, draft_vocab, ngram_table)
    check_drafter(drafter)
    drafter.check(bundle.module, request.model)
    return Draft(bundle=bundle, policy=policy, drafter=drafter, draft_vocab=draft_vocab, ngram_table=ngram_table,
                 notes=tuple(notes))


__all__ = ["DEFAULT", "Draft", "resolve_draft", "shipped_head"]
