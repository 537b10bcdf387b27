"""A block drafter: a small transformer over the base's recent features that proposes the next `block_size`
tokens in one forward (our own parallel drafter, after DFlash, arXiv 2602.06036, and PARD, arXiv 2504.18583).
`head.py` holds the module and its loss, `drafter.py` the tree drafter, `export.py` the folder's tensor names;
this module registers the type as "block"."""

from __future__ import annotations

import dataclasses

from clover_jax.decoding.tree import TreeSpec
from clover_jax.heads import registry
from clover_jax.heads.block.drafter import BlockDrafter, BlockState
from clover_jax.heads.block.export import (
    WEIGHTS_FILE,
    config_dict,
    from_reference,
    to_reference,
)
from clover_jax.heads.block.head import (
    INIT_LAYERS,
    BlockConfig,
    BlockHead,
    check_compatible,
    distinct_indices,
    init_from_base,
    loss_from_features,
)
from clover_jax.heads.options import HeadOptions


@dataclasses.dataclass(frozen=True)
class BlockOptions(HeadOptions):
    """The `head:` section of a block experiment (`num_heads`: the block size, the tokens drafted per forward)."""

    config_cls = BlockConfig
    type: str = "block"
    num_heads: int = 8  # the block size
    num_layers: int = 2  # decoder layers of the block
    window: int = 16  # accepted positions whose base features the block attends to
    init_layers: str = "random"  # the block's layers at init: "random" or "base" (copies of the base's last layers)
    feature_layers: tuple[int, ...] = ()  # base layers whose outputs the context reads besides the last layer's

    def _validate(self):
        super()._validate()
        self._need(self.num_layers >= 1, "num_layers", "must be >= 1")
        self._need(self.window >= 1, "window", "must be >= 1")
        self._need(self.init_layers in INIT_LAYERS, "init_layers", f"must be one of {INIT_LAYERS}")
        self._need(distinct_indices(self.feature_layers), "feature_layers",
                   "must be a list of distinct layer indices >= 0")

    def config_kwargs(self):
        return {"block_size": self.num_heads, "num_layers": self.num_layers, "window": self.window,
                "init_layers": self.init_layers, "feature_layers": tuple(self.feature_layers)}


BLOCK = registry.register(registry.HeadType(
    name="block", config_cls=BlockConfig, module_cls=BlockHead, options_cls=BlockOptions,
    fields=("block_size", "num_layers", "window", "feature_layers"), optional_fields={"feature_layers": []},
    feature_layers=lambda config: config.feature_layers,
    init_from_base=init_from_base, drafters={TreeSpec: BlockDrafter},
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible,
    # [(n + 2) D, D], [D, D], [C, D], [n, D]; the block's decoder layers: the base's rules
    sharding_rules={"ctx_w": ("fsdp", "tp"), "root_w": ("fsdp", "tp"), "mask_emb": (None, None),
                    "tap_norm": (None, None)},
    description="a block drafter: one forward over the base's recent features drafts the next block_size tokens "
                "(after DFlash, arXiv 2602.06036, and PARD, arXiv 2504.18583)",
    default_tree="chain-4", weights_file=WEIGHTS_FILE))

__all__ = ["BLOCK", "BlockConfig", "BlockDrafter", "BlockHead", "BlockOptions", "BlockState", "init_from_base"]
