"""EAGLE-1 (Li et al. 2024, arXiv 2401.15077; reference `SafeAILab/EAGLE`, v1), a baseline: one decoder layer
autoregressive over the base model's features. `head.py` holds the module (a member of the recurrent family,
`clover_jax.heads.recurrent`: its node step drafts with the family's drafters), loss and the reference's names; this module registers the type as "eagle"."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from clover_jax.decoding.tree import DynamicTree, TreeSpec
from clover_jax.heads import registry
from clover_jax.heads.clover2.model import REFERENCE_ROPE_THETA
from clover_jax.heads.eagle.head import (
    EagleConfig,
    EagleDrafter,
    EagleDynamicDrafter,
    EagleHead,
    check_compatible,
    config_dict,
    from_reference,
    init_from_base,
    loss_from_features,
    recognizes,
    to_reference,
)
from clover_jax.heads.options import HeadOptions


@dataclasses.dataclass(frozen=True)
class EagleOptions(HeadOptions):
    """The `head:` section of an EAGLE experiment (`num_heads`: the depths trained per position)."""

    config_cls = EagleConfig
    type: str = "eagle"
    rope_theta: Optional[float] = REFERENCE_ROPE_THETA  # the draft layer's RoPE base (null: the base model's)
    # "reference" (torch Linear defaults, as its training script) or "base_layer" (the decoder layer a copy of the
    # base's last one, FC = [0; identity]: a cheaper start for short budgets)
    init: Literal["reference", "base_layer"] = "reference"

    def _validate(self):
        super()._validate()
        self._need(self.rope_theta is None or self.rope_theta > 0, "rope_theta", "must be > 0")

    def config_kwargs(self):
        return {"rope_theta": self.rope_theta, "init": self.init}  # drafts as deep as the tree asks


EAGLE = registry.register(registry.HeadType(
    name="eagle", config_cls=EagleConfig, module_cls=EagleHead, options_cls=EagleOptions, fields=("rope_theta",),
    init_from_base=init_from_base, drafters={TreeSpec: EagleDrafter, DynamicTree: EagleDynamicDrafter},
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible,
    sharding_rules={"fc_w": ("fsdp", "tp"), "fc_b": (None,)},  # [2D, D], [D]; the layer: the base's rules
    description="EAGLE-1: one decoder layer autoregressive over the base's features (Li et al. 2024, "
                "arXiv 2401.15077)",
    default_tree="clover2-26", feature_noise=True, recognizes=recognizes))

__all__ = ["EAGLE", "EagleConfig", "EagleHead", "EagleOptions", "init_from_base"]
