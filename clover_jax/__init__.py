"""clover_jax: speculative decoding with Clover-2 draft heads for Llama-family models, in JAX / Flax NNX."""

from clover_jax.api import GenerationResult, generate, stream_text
from clover_jax.io.loader import load_model, load_tokenizer
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama

__version__ = "0.1.0"
__all__ = ["GenerationResult", "Llama", "LlamaConfig", "generate", "load_model", "load_tokenizer", "stream_text"]
