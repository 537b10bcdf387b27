"""The Clover-2 entry of the head registry (Xiao et al. 2024, arXiv 2408.00264; reference `XiaoBin1992/clover`).

The pieces live where they belong (the module in `clover2`, the drafter in `clover2_draft`, the loss in
`clover_jax.training.loss`, the reference name table in `clover_jax.io.export`); this module ties them to the
name "clover2".
"""

from __future__ import annotations

import jax.numpy as jnp

from clover_jax.heads import registry
from clover_jax.heads.clover2 import Clover2Config, Clover2Head, check_compatible, init_from_base
from clover_jax.decoding.tree import BeamTree, DynamicTree
from clover_jax.validation import InputError
from clover_jax.heads.clover2_draft import Clover2Drafter, Clover2DynamicDrafter

FIELDS = ("num_heads", "num_aug_layers", "embed_source", "rope_theta")

SHARDING_RULES = {  # attention decoders AD1/AD2 (output dim split into heads), FC0, FCout
    "ad1_wq": ("fsdp", "tp"), "ad1_wk": ("fsdp", "tp"), "ad1_wv": ("fsdp", "tp"),  # [D, D]
    "ad2_wq": ("fsdp", "tp"), "ad2_wk": ("fsdp", "tp"), "ad2_wv": ("fsdp", "tp"),  # [D, D]
    "fc0_w": ("fsdp", "tp"),  # [D, D]
    "fcout_w": ("fsdp", "tp"),  # [2D, D]
}  # the Augmenting Block is a DecoderStack: the base model's layer rules apply


def from_experiment(cfg) -> Clover2Config:
    """The head's config from an `ExperimentConfig` (params fp32; compute dtype train.compute_dtype)."""
    from clover_jax.training.steps import DTYPES

    return Clover2Config(num_heads=cfg.head.num_heads, num_aug_layers=cfg.head.num_aug_layers,
                         embed_source=cfg.head.embed_source, rope_theta=cfg.head.rope_theta,
                         dtype=DTYPES[cfg.train.compute_dtype], param_dtype=jnp.float32, remat=cfg.train.remat)


def tree_drafter_factory(static_cls, dynamic_cls, what: str):
    """`make_drafter(spec, draft_vocab)` for heads that draft through Clover-2's tree drafters: `static_cls` for a
    static tree, `dynamic_cls` for a `DynamicTree` policy, a clear error for a beam policy."""
    def make_drafter(spec, draft_vocab=None):
        if isinstance(spec, BeamTree):
            raise InputError(f"{spec.name!r} is a beam-search policy (ReDrafter); {what} draft static trees "
                             "(clover2-26, chain-N, ...) or dynamic ones (dynamic-N, dynamic-N-pP)")
        if isinstance(spec, DynamicTree):
            return dynamic_cls(spec, draft_vocab=draft_vocab)
        return static_cls(spec, draft_vocab=draft_vocab)

    return make_drafter


make_drafter = tree_drafter_factory(Clover2Drafter, Clover2DynamicDrafter, "Clover-2 and Clover-1")


def loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, *, index=None, vocab_ids=None):
    from clover_jax.training.loss import clover2_loss_from_features

    return clover2_loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, index=index,
                                      vocab_ids=vocab_ids)


def to_reference(head, base=None, include_frozen: bool = True, include_lm_head: bool | None = None) -> dict:
    from clover_jax.io.export import head_to_reference

    return head_to_reference(head, base, include_frozen, include_frozen if include_lm_head is None
                             else include_lm_head)


def from_reference(folder, meta, base, dtype=None) -> Clover2Head:
    from clover_jax.io.export import clover2_from_reference

    return clover2_from_reference(folder, meta, base, dtype=dtype)


def config_dict(head, base_name=None, extra=None) -> dict:
    from clover_jax.io.export import head_config_dict

    return head_config_dict(head, base_name, extra)


CLOVER2 = registry.register(registry.HeadType(
    name="clover2", config_cls=Clover2Config, module_cls=Clover2Head, fields=FIELDS,
    from_experiment=from_experiment, init_from_base=init_from_base, make_drafter=make_drafter,
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible, sharding_rules=SHARDING_RULES,
    description="Clover-2: an RNN draft head with an Augmenting Block (Xiao et al. 2024, arXiv 2408.00264)"))
