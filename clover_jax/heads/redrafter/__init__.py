"""The Recurrent Drafter (ReDrafter; Zhang et al. 2024, arXiv 2403.09919; reference `apple/ml-recurrent-drafter`):
a recurrent drafter whose beam search is merged into a tree. `head.py` holds the module, its beam drafter, loss
and the reference's names; this module registers the type as "redrafter"."""

from __future__ import annotations

import dataclasses

from clover_jax.decoding.tree import BeamTree
from clover_jax.heads import registry
from clover_jax.heads.options import HeadOptions
from clover_jax.heads.redrafter.head import (
    BeamDrafter,
    ReDrafterConfig,
    ReDrafterHead,
    check_compatible,
    config_dict,
    from_reference,
    init_from_base,
    loss_from_features,
    to_reference,
)


@dataclasses.dataclass(frozen=True)
class ReDrafterOptions(HeadOptions):
    """The `head:` section of a ReDrafter experiment (`num_heads`: the steps unrolled in training, the reference's
    drafter_predict_n_tokens)."""

    config_cls = ReDrafterConfig
    type: str = "redrafter"
    num_layers: int = 1  # residual blocks (num_draft_layers; the reference's recipes: 2)
    rnn: bool = True  # the recurrent state update (False: a running sum of embeddings)

    def _validate(self):
        super()._validate()
        self._need(self.num_layers >= 0, "num_layers", "must be >= 0")

    def config_kwargs(self):
        return {"num_steps": self.num_heads, "num_layers": self.num_layers, "rnn": self.rnn}


REDRAFTER = registry.register(registry.HeadType(
    name="redrafter", config_cls=ReDrafterConfig, module_cls=ReDrafterHead, options_cls=ReDrafterOptions,
    fields=("num_steps", "num_layers", "rnn"), init_from_base=init_from_base, drafters={BeamTree: BeamDrafter},
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible,
    sharding_rules={"rnn_w": ("fsdp", "tp"), "rnn_u": ("fsdp", "tp"), "rnn_b": (None,),  # [D, D], [D]
                    "block_w": ("fsdp", "tp"), "block_b": (None,), "vocab_proj": ("fsdp", "tp")},  # [I, I], [I, V]
    description="ReDrafter: a recurrent drafter with beam search merged into a tree (Zhang et al. 2024, "
                "arXiv 2403.09919)",
    default_tree="beam-4x5"))

__all__ = ["REDRAFTER", "ReDrafterConfig", "ReDrafterHead", "ReDrafterOptions", "init_from_base"]
