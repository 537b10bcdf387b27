"""clover_jax: speculative decoding with Clover-2, Clover, ReDrafter, Medusa and EAGLE draft heads for Llama-family
models, in JAX / Flax NNX. The public names: `load_model`, `load_head`, `generate`, `stream_text`,
`prepare_generate`, `warmup`, `GenerationResult`.

Importing the package turns on JAX's persistent compilation cache first, before any array exists
(`clover_jax.compile_cache`; `CLOVER_JAX_COMPILE_CACHE=off` leaves it off)."""

from clover_jax import compile_cache as _compile_cache

_compile_cache.enable_compile_cache()
from clover_jax.generation.api import GenerationResult  # noqa: E402
from clover_jax.io.loader import load_model, load_tokenizer  # noqa: E402
from clover_jax.models.config import LlamaConfig  # noqa: E402
from clover_jax.models.llama import Llama  # noqa: E402
from clover_jax.training.loading import load_head  # noqa: E402
from clover_jax.api import generate, prepare_generate, stream_text, warmup  # noqa: E402

__version__ = "0.1.0"
__all__ = ["GenerationResult", "Llama", "LlamaConfig", "generate", "load_head", "load_model", "load_tokenizer",
           "prepare_generate", "stream_text", "warmup"]
