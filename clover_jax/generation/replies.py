"""The base model's replies to message lists, as the training data of self-distillation asks for them
(`clover_jax.training.self_distill.build_self_distill`'s `generate_fn`)."""

from __future__ import annotations

from clover_jax.generation.api import run_request
from clover_jax.generation.request import check_request


def make_generate_fn(loaded, temperature: float = 0.0, seed: int = 0, mesh=None):
    """`generate_fn(list of message lists, max_new_tokens) -> list of reply strings` for build_self_distill,
    decoding on `mesh` (a `jax.sharding.Mesh`, a string like "tp=8", or None for one device)."""

    def generate_fn(message_lists, max_new_tokens: int = 256):
        res = run_request(check_request(loaded, [list(m) for m in message_lists], max_new_tokens=max_new_tokens,
                       temperature=temperature, seed=seed, mesh=mesh))
        return res.texts

    return generate_fn
