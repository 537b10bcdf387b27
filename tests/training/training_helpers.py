"""Tiny random base model, small experiment configs and a deterministic synthetic batcher for trainer tests."""

from __future__ import annotations

import numpy as np

from clover_jax.training.config import load_config
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# 3 query heads / 3 kv heads, D=24, F=36: tp=2 divides neither the heads nor the head dim axis used.
ODD = LlamaConfig(vocab_size=66, hidden_size=24, intermediate_size=36, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=3, head_dim=8)
# a tiny base with SmolLM2's vocabulary: the logits are what grows with the batch
WIDE_VOCAB = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def tiny_base(config: LlamaConfig = TINY, seed: int = 0):
    return init_llama(config, seed=seed)


def make_cfg(*overrides: str, output_dir: str = "runs/test"):
    """A tiny experiment; a Clover head gets one Augmenting-Block layer (other head types have no such key)."""
    head_type = next((o.split("=", 1)[1] for o in overrides if o.startswith("head.type=")), "clover2")
    aug = ["head.num_aug_layers=1"] if head_type in ("clover2", "clover1") else []
    base = ["model.name_or_path=tiny", "head.num_heads=3", *aug, "optim.lr=1e-2",
            "optim.warmup_steps=2", "optim.total_steps=0", "train.steps=6", "train.log_every=2",
            "train.eval_every=0", "data.batch_size=8", "checkpoint.save_every=2", "checkpoint.keep=2",
            "mesh.data=1", f"train.output_dir={output_dir}"]
    return load_config(None, [o for o in overrides if o.startswith("head.type=")] + base + list(overrides))


class SyntheticBatcher:
    """Random token batches (a repeated-pattern language so heads can learn), resumable by index."""

    def __init__(self, vocab: int = 64, batch_size: int = 8, length: int = 16, seed: int = 0):
        self.vocab, self.batch_size, self.length, self.seed = vocab, batch_size, length, seed
        self.index = 0

    def batch(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, i])
        b, t = self.batch_size, self.length
        start = rng.integers(0, self.vocab, size=(b, 1))
        step = rng.integers(1, 4, size=(b, 1))
        tokens = ((start + step * np.arange(t)[None]) % self.vocab).astype(np.int32)  # [B, T]
        lengths = rng.integers(t // 2, t + 1, size=b)
        valid = np.arange(t)[None] < lengths[:, None]
        loss_mask = (valid & (np.arange(t)[None] >= 3)).astype(np.int32)
        return {"tokens": np.where(valid, tokens, 0).astype(np.int32), "loss_mask": loss_mask, "valid": valid}

    def longest_length(self) -> int:
        return self.length

    def __iter__(self):
        return self

    def __next__(self):
        out = self.batch(self.index)
        self.index += 1
        return out

    def state_dict(self):
        return {"index": self.index, "seed": self.seed}

    def load_state_dict(self, state):
        assert state["seed"] == self.seed
        self.index = int(state["index"])
