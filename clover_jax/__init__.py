"""clover_jax: speculative decoding with Clover-2, Clover, ReDrafter, Medusa and EAGLE draft heads for Llama-family
models, in JAX / Flax NNX. The public names: `load_model`, `generate`, `stream_text`, `GenerationResult`."""

from clover_jax import tuning as _tuning  # noqa: F401 (installs the calibration behind generate(tree="auto"))
from clover_jax.generation.api import GenerationResult, generate, stream_text
from clover_jax.io.loader import load_model, load_tokenizer
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama

__version__ = "0.1.0"
__all__ = ["GenerationResult", "Llama", "LlamaConfig", "generate", "load_model", "load_tokenizer", "stream_text"]
