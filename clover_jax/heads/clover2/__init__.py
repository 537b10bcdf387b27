"""Clover-2 (Xiao et al. 2024, arXiv 2408.00264; reference `XiaoBin1992/clover`): an RNN draft head with an
Augmenting Block over the base model's hidden states.

  model.py    the head module (`Clover2Head`) and its config
  export.py   the reference project's parameter names, export and import
It drafts and trains as a member of the recurrent family (`clover_jax.heads.recurrent`: its drafters and loss).
This module registers the type under the name "clover2".
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from clover_jax.decoding.tree import DynamicTree, TreeSpec
from clover_jax.heads import registry
from clover_jax.heads.recurrent.drafter import RecurrentDrafter, RecurrentDynamicDrafter
from clover_jax.heads.clover2.export import config_dict, from_reference, to_reference
from clover_jax.heads.recurrent.loss import loss_from_features
from clover_jax.heads.clover2.model import (
    REFERENCE_ROPE_THETA,
    Clover2Config,
    Clover2Head,
    check_compatible,
    init_from_base,
)
from clover_jax.heads.options import HeadOptions

FIELDS = ("num_heads", "num_aug_layers", "embed_source", "rope_theta")

SHARDING_RULES = {  # attention decoders AD1/AD2 (output dim split into heads), FC0, FCout
    "ad1_wq": ("fsdp", "tp"), "ad1_wk": ("fsdp", "tp"), "ad1_wv": ("fsdp", "tp"),  # [D, D]
    "ad2_wq": ("fsdp", "tp"), "ad2_wk": ("fsdp", "tp"), "ad2_wv": ("fsdp", "tp"),  # [D, D]
    "fc0_w": ("fsdp", "tp"),  # [D, D]
    "fcout_w": ("fsdp", "tp"),  # [2D, D]
}  # the Augmenting Block is a DecoderStack: the base model's layer rules apply


@dataclasses.dataclass(frozen=True)
class Clover2Options(HeadOptions):
    """The `head:` section of a Clover-2 experiment (defaults: the reference recipe)."""

    config_cls = Clover2Config
    type: str = "clover2"
    num_aug_layers: int = 2  # decoder layers in the Augmenting Block
    embed_source: Literal["lm_head", "input"] = "lm_head"  # reference: E = copy(W_lm)
    # Augmenting-Block RoPE: a number = plain RoPE with that base; the default is the reference's 10000 (its layers
    # ignore the base's rope_theta), so exported heads compute the same function in the reference code. null: the
    # base model's own RoPE (rope_theta and rope_scaling).
    rope_theta: Optional[float] = REFERENCE_ROPE_THETA

    def _validate(self):
        super()._validate()
        self._need(self.num_aug_layers >= 1, "num_aug_layers", "must be >= 1")
        self._need(self.rope_theta is None or self.rope_theta > 0, "rope_theta", "must be > 0")


CLOVER2 = registry.register(registry.HeadType(
    name="clover2", config_cls=Clover2Config, module_cls=Clover2Head, options_cls=Clover2Options, fields=FIELDS,
    init_from_base=init_from_base, drafters={TreeSpec: RecurrentDrafter, DynamicTree: RecurrentDynamicDrafter},
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible, sharding_rules=SHARDING_RULES,
    description="Clover-2: an RNN draft head with an Augmenting Block (Xiao et al. 2024, arXiv 2408.00264)"))

__all__ = ["CLOVER2", "Clover2Config", "RecurrentDrafter", "RecurrentDynamicDrafter", "Clover2Head", "Clover2Options",
           "init_from_base"]
