"""What the head tests share: a tiny Llama config, prompts, a speculative run and the check against greedy decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.decoding.autoregressive import ar_generate
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.speculative import spec_generate
from clover_jax.heads.registry import drafter_for
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA
NO_EOS = ()


def prompts(b=2, t=8, seed=0):
    """`(prompt [b, t], lengths [b])`: random tokens of CFG's vocabulary, the second row 3 shorter."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(3, CFG.vocab_size, (b, t)), jnp.int32), jnp.asarray([t, t - 3][:b], jnp.int32)


def spec(base, head, tree, prompt, lens, n=24, eos=NO_EOS, cache_size=160):
    """Greedy speculative decoding: `(output, stats)`."""
    out, stats, _ = spec_generate(base, head, prompt, lens, max_new_tokens=n, cache_size=cache_size,
                                  sampling=SamplingParams(), key=jax.random.key(0),
                                  drafter=drafter_for(type(head), tree), eos_ids=eos)
    return out, stats


def same_as_greedy(base, out, prompt, lens, n, eos, cache_size=160):
    """Asserts that `out` equals autoregressive greedy decoding, lengths and tokens."""
    ar = ar_generate(base, prompt, lens, max_new_tokens=n, cache_size=cache_size, eos_ids=eos)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ar.lengths))
    for r in range(prompt.shape[0]):
        k = int(ar.lengths[r])
        np.testing.assert_array_equal(np.asarray(out.tokens)[r, :k], np.asarray(ar.tokens)[r, :k])


def ranked_medusa(ranks):
    """`(base, head)`: a tiny base whose logits are all 0 (greedy emits token 0 forever) and a Medusa head whose
    head i ranks token 0 at `ranks[i]` (tokens 1..r score above it, the rest below). Every step then accepts
    exactly the path of child ranks `ranks`, and nothing off it."""
    from flax import nnx

    from clover_jax.heads.medusa.head import MedusaConfig, init_from_base

    base = init_llama(CFG, seed=0)
    base.final_norm[...] = jnp.zeros_like(base.final_norm[...])
    head = init_from_base(base, MedusaConfig(num_heads=len(ranks)), seed=1)
    proj = np.full(head.proj.shape, -1.0, np.float32)  # [n, D, V]; with h = 0 and b = 1, x = SiLU(1) > 0
    for i, r in enumerate(ranks):
        proj[i, :, 0] = 0.5
        proj[i, :, 1:r + 1] = 1.0 + np.arange(r)[None, ::-1] * 0.1
    nnx.update(head, {"res_b": jnp.ones_like(head.res_b[...]), "proj": jnp.asarray(proj)})
    return base, head
