"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840; reference `SafeAILab/EAGLE`): one decoder layer over the fused low,
middle and high features of the base, trained with training-time test, drafting over a draft vocabulary of its own.
It is the format vLLM, SGLang and TensorRT-LLM load; here it drafts static, fitted and dynamic trees.

  head.py     the module (`Eagle3Head`), its config, training-time test and loss
  drafter.py  its drafters (the recurrent family's, `clover_jax.heads.recurrent`, with EAGLE-3's node step)
  export.py   the published layout (names, `d2t` / `t2d`, config.json), both ways
This module registers the type as "eagle3".
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from clover_jax.decoding.tree import DynamicTree, TreeSpec
from clover_jax.heads import registry
from clover_jax.heads.eagle3.drafter import Eagle3Drafter, Eagle3DynamicDrafter
from clover_jax.heads.eagle3.export import (config_dict, folder_vocab, from_reference, recognizes, to_reference,
                                            vocab_tensors)
from clover_jax.heads.eagle3.head import (Eagle3Config, Eagle3Head, check_compatible, default_feature_layers,
                                          init_from_base, loss_from_features)
from clover_jax.heads.options import HeadOptions
from clover_jax.validation import ConfigError

FIELDS = ("feature_layers", "draft_vocab_size", "num_heads", "rope_theta")


@dataclasses.dataclass(frozen=True)
class Eagle3Options(HeadOptions):
    """The `head:` section of an EAGLE-3 experiment (`num_heads`: the training-time-test steps, 7 in the reference)."""

    config_cls = Eagle3Config
    type: str = "eagle3"
    num_heads: int = 7
    # the 3 base layers (0-based) whose outputs are fused: EAGLE-3's default is the inputs of layers 2, L//2 and L-3,
    # i.e. [1, L//2 - 1, L - 4] (SmolLM2-135M, L = 30: [1, 14, 26])
    feature_layers: tuple[int, ...] = ()
    # Q, the head's output columns: the draft vocabulary it is trained on (loss.draft_vocab with
    # train.draft_vocab_size = Q); 0 = the base's whole vocabulary
    draft_vocab_size: int = 0
    rope_theta: Optional[float] = None  # the layer's RoPE: null the base's own, a number plain RoPE with that base

    def _validate(self):
        super()._validate()
        self._need(len(self.feature_layers) == 3 and len(set(self.feature_layers)) == 3, "feature_layers",
                   "must name 3 distinct base layers (EAGLE-3's default: [1, L//2 - 1, L - 4])")
        self._need(self.draft_vocab_size >= 0, "draft_vocab_size", "must be >= 0 (0 = the whole vocabulary)")
        self._need(self.rope_theta is None or self.rope_theta > 0, "rope_theta", "must be > 0")

    def check_experiment(self, cfg) -> None:
        q = self.draft_vocab_size
        if q and not (cfg.loss.draft_vocab and cfg.train.draft_vocab_size == q):
            raise ConfigError(f"head.draft_vocab_size={q}: an EAGLE-3 head's {q} output columns are its draft "
                              f"vocabulary; set loss.draft_vocab: true and train.draft_vocab_size: {q}")
        if not q and cfg.loss.draft_vocab:
            raise ConfigError("loss.draft_vocab: an EAGLE-3 head drafts over its own vocabulary; set "
                              "head.draft_vocab_size to train.draft_vocab_size")

    def config_kwargs(self):
        return {"feature_layers": tuple(self.feature_layers), "draft_vocab_size": self.draft_vocab_size,
                "num_heads": self.num_heads, "rope_theta": self.rope_theta}


EAGLE3 = registry.register(registry.HeadType(
    name="eagle3", config_cls=Eagle3Config, module_cls=Eagle3Head, options_cls=Eagle3Options, fields=FIELDS,
    init_from_base=init_from_base, drafters={TreeSpec: Eagle3Drafter, DynamicTree: Eagle3DynamicDrafter},
    loss_from_features=loss_from_features, to_reference=to_reference, from_reference=from_reference,
    config_dict=config_dict, check_compatible=check_compatible,
    sharding_rules={"fc_w": ("fsdp", "tp"), "head_w": ("fsdp", "tp"), "input_norm": (None,),  # [3D, D], [D, Q]
                    "hidden_norm": (None,), "out_norm": (None,)},  # the layer's others: the base's rules
    description="EAGLE-3: one decoder layer over fused low, middle and high base features, trained with "
                "training-time test (Li et al. 2025, arXiv 2503.01840)",
    default_tree="dynamic-10", recognizes=recognizes, feature_layers=lambda config: config.feature_layers,
    vocab_tensors=vocab_tensors, folder_vocab=folder_vocab))

__all__ = ["EAGLE3", "Eagle3Config", "Eagle3Head", "Eagle3Options", "default_feature_layers", "init_from_base"]
