"""The tiny random Llama configuration most unit tests build their base model from (GQA 4/2, 2 layers, 64 tokens,
EOS id 2): one definition instead of a copy per test file."""

import numpy as np

from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

TINY_LLAMA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))


def random_prompt(n: int, seed: int) -> list[int]:
    """`n` token ids of the tiny vocabulary (none of them EOS), reproducible by `seed`."""
    return np.random.RandomState(seed).randint(3, TINY_LLAMA.vocab_size, n).tolist()


def tiny_base_and_clover2():
    """The tiny base model and a fresh Clover-2 head for it."""
    base = init_llama(TINY_LLAMA, seed=0)
    return base, init_from_base(base, Clover2Config())
