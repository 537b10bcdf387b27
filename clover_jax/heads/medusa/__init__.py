"""Medusa-1 (Cai et al. 2024, arXiv 2401.10774; reference `FasterDecoding/Medusa`), a baseline: residual blocks
on the base's last hidden state, one vocabulary projection per depth. `head.py` holds the module, its drafter,
loss and the reference's names; this module registers the type as "medusa"."""

from __future__ import annotations

import dataclasses

from clover_jax.decoding.tree import TreeSpec
from clover_jax.heads import registry
from clover_jax.heads.medusa.head import (
    WEIGHTS_FILE,
    MedusaConfig,
    MedusaDrafter,
    MedusaHead,
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
class MedusaOptions(HeadOptions):
    """The `head:` section of a Medusa experiment (`num_heads`: the reference's medusa_num_heads)."""

    config_cls = MedusaConfig
    type: str = "medusa"
    num_layers: int = 1  # residual blocks per head (medusa_num_layers)

    def _validate(self):
        super()._validate()
        self._need(self.num_layers >= 1, "num_layers", "must be >= 1")


MEDUSA = registry.register(registry.HeadType(
    name="medusa", config_cls=MedusaConfig, module_cls=MedusaHead, options_cls=MedusaOptions,
    fields=("num_heads", "num_layers"), init_from_base=init_from_base, drafters={TreeSpec: MedusaDrafter},
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible,
    sharding_rules={"res_w": ("fsdp", "tp"), "res_b": (None,), "proj": ("fsdp", "tp")},  # [D, D], [D], [D, V]
    description="Medusa-1 heads: residual blocks on the base's last hidden state (Cai et al. 2024, "
                "arXiv 2401.10774)",
    weights_file=WEIGHTS_FILE, recognizes=recognizes))

__all__ = ["MEDUSA", "MedusaConfig", "MedusaHead", "MedusaOptions", "init_from_base"]
