"""The tiny random Llama configuration most unit tests build their base model from (GQA 4/2, 2 layers, 64 tokens,
EOS id 2): one definition instead of a copy per test file."""

from clover_jax.models.config import LlamaConfig

TINY_LLAMA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))
