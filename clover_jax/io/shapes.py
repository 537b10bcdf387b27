"""A base model's shapes without its weights: from a local folder, GGUF file or known name, else from the shapes of
the models the shipped configs name (`KNOWN_SHAPES`), so memory plans and compile-only runs download nothing.

    config = plan_base_config("/path/to/Meta-Llama-3-8B-Instruct")   # KNOWN_SHAPES by the last part of the path
"""

from __future__ import annotations

from pathlib import Path

from clover_jax.io.loader import base_config_of
from clover_jax.models.config import LlamaConfig, RopeScaling
from clover_jax.validation import InputError

# The shapes of the base models the shipped configs name, from each model's Hugging Face config.json:
#   meta-llama/Meta-Llama-3-8B-Instruct: vocab_size 128256, hidden_size 4096, intermediate_size 14336,
#     num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8, rms_norm_eps 1e-5, rope_theta 500000,
#     max_position_embeddings 8192, tie_word_embeddings false, bos 128000, eos 128009;
#   lmsys/vicuna-7b-v1.5: vocab_size 32000, hidden_size 4096, intermediate_size 11008, num_hidden_layers 32,
#     num_attention_heads 32, num_key_value_heads 32, rms_norm_eps 1e-5, rope_theta 10000,
#     max_position_embeddings 4096, tie_word_embeddings false, bos 1, eos 2;
#   Qwen/Qwen3-8B: vocab_size 151936, hidden_size 4096, intermediate_size 12288, num_hidden_layers 36,
#     num_attention_heads 32, num_key_value_heads 8, head_dim 128, rms_norm_eps 1e-6, rope_theta 1000000,
#     max_position_embeddings 40960, tie_word_embeddings false, bos 151643, eos 151645, q/k norms.
KNOWN_SHAPES = {
    "meta-llama-3-8b-instruct": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(), max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128009,)),
    "vicuna-7b-v1.5": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        bos_token_id=1, eos_token_ids=(2,)),
    "qwen3-8b": LlamaConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_ids=(151645,), qk_norm=True, model_type="qwen3"),
}


def plan_base_config(name_or_path: str) -> LlamaConfig:
    """The base's config: read from a local folder, GGUF file or known name, else `KNOWN_SHAPES` by the last part
    of the path or hub id (`/data/Meta-Llama-3-8B-Instruct`, `meta-llama/Meta-Llama-3-8B-Instruct`)."""
    key = Path(str(name_or_path).split("@")[0].rstrip("/")).name.lower()
    if Path(name_or_path).expanduser().exists() or key not in KNOWN_SHAPES:
        try:
            return base_config_of(name_or_path)
        except FileNotFoundError as e:
            if key not in KNOWN_SHAPES:
                raise InputError(f"model.name_or_path: {name_or_path!r}: no local config.json to read the shapes "
                                 f"from ({e}); pass --base with a local model folder, or a model whose shapes are "
                                 f"known: {', '.join(KNOWN_SHAPES)}") from None
    return KNOWN_SHAPES[key]


__all__ = ["KNOWN_SHAPES", "plan_base_config"]
