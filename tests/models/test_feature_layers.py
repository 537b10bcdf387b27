"""The base model's hidden states of chosen layers (`taps`), which a draft head may read besides the last layer's."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.models.cache import causal_mask
from clover_jax.models.llama import first_layers, init_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_llama import TINY_LLAMA  # noqa: E402

CFG = dataclasses.replace(TINY_LLAMA, num_hidden_layers=4)
D = CFG.hidden_size


def _inputs(b=2, t=6):
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, (b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = jnp.arange(t)[None, :] < jnp.asarray([[t], [t - 2]])
    return tokens, positions, causal_mask(valid)


@pytest.mark.slow  # a forward per tapped layer, scanned and unrolled
@pytest.mark.parametrize("unrolled", [False, True])
def test_tapped_layers_are_the_outputs_of_the_models_first_layers(unrolled):
    model = init_llama(CFG, seed=1)
    tokens, positions, mask = _inputs()
    lw = model.layers.per_layer_weights() if unrolled else None
    h, k, v = model.forward_hidden(tokens, positions, mask, layer_weights=lw, taps=(2, 0))
    plain, k0, v0 = model.forward_hidden(tokens, positions, mask, layer_weights=lw)
    assert h.shape == (2, 6, 3 * D) and k.shape == k0.shape
    for j, layer in enumerate((2, 0)):  # in the order asked: layer 2's output, then layer 0's
        part, _, _ = first_layers(model, layer + 1).forward_hidden(tokens, positions, mask)
        np.testing.assert_allclose(np.asarray(h[..., j * D:(j + 1) * D]), np.asarray(part), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(h[..., -D:]), np.asarray(plain))  # the last layer's, unchanged
    np.testing.assert_array_equal(np.asarray(k), np.asarray(k0))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(v0))


@pytest.mark.parametrize("taps", [(3,), (1, 1), (-1,)])
def test_bad_feature_layers_are_named(taps):
    model = init_llama(CFG, seed=1)
    with pytest.raises(ValueError, match=r"feature layers .*distinct indices of layers 0\.\.2"):
        model.forward_hidden(*_inputs(), taps=taps)
