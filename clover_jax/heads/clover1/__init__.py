"""Clover (Xiao et al. 2024, arXiv 2405.00263): Medusa-style heads with a regressive connection, attention decoders
and an Augmenting Block. `head.py` holds the module, its loss and the reference's names; it drafts with Clover-2's
drafters (the module offers the interface they call). This module registers the type as "clover1"."""

from __future__ import annotations

import dataclasses

from clover_jax.decoding.tree import DynamicTree, TreeSpec
from clover_jax.heads import registry
from clover_jax.heads.clover1.head import (
    Clover1Config,
    Clover1Head,
    check_compatible,
    config_dict,
    from_reference,
    init_from_base,
    loss_from_features,
    to_reference,
)
from clover_jax.heads.clover2 import Clover2Options
from clover_jax.heads.recurrent.drafter import RecurrentDrafter, RecurrentDynamicDrafter


@dataclasses.dataclass(frozen=True)
class Clover1Options(Clover2Options):
    """The `head:` section of a Clover experiment: Clover-2's keys."""

    config_cls = Clover1Config
    type: str = "clover1"


CLOVER1 = registry.register(registry.HeadType(
    name="clover1", config_cls=Clover1Config, module_cls=Clover1Head, options_cls=Clover1Options,
    fields=("num_heads", "num_aug_layers", "embed_source", "rope_theta"),
    init_from_base=init_from_base, drafters={TreeSpec: RecurrentDrafter, DynamicTree: RecurrentDynamicDrafter},
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible,
    sharding_rules={"ad_wq": ("fsdp", "tp"), "ad_wk": ("fsdp", "tp"), "ad_wv": ("fsdp", "tp"),  # [n, D, D]
                    "ad_bq": (None,), "ad_bk": (None,), "ad_bv": (None,), "ad_norm": (None,),
                    "fc_w": ("fsdp", "tp"), "fc_b": (None,)},  # the Augmenting Block: the base's layer rules
    description="Clover: Medusa-style heads with a regressive connection, attention decoders and an Augmenting "
                "Block (Xiao et al. 2024, arXiv 2405.00263)",
    default_tree="dynamic-10-p0.8"))

__all__ = ["CLOVER1", "Clover1Config", "Clover1Head", "Clover1Options", "init_from_base"]
