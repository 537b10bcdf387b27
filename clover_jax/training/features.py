"""Cached base features: the frozen base model's last hidden states, computed once per training example.

Training a draft head runs the frozen base over every batch only to read its pre-final-norm hidden
states f (the reference stores them on disk: `hidden_state_onnorm` in `XiaoBin1992/clover`'s `ge_data` scripts). Over several
epochs of a small data set that forward is repeated for nothing; on a 2-core CPU it is about half of a
SmolLM2 step. `attach_features` runs it once per example, in length-bucketed batches, and hands the
states to the batcher, whose batches then carry `features [B, T, D]`; the train step uses them in place
of the base forward (`steps.make_loss_fn`). The teacher distribution is still computed from them in the
step (P = softmax(W_lm RMSNorm(f))), so nothing V-sized is stored.

Memory: T x D values per example (bfloat16 by default): 0.4 GB for 1,000 SmolLM2 examples of 384 tokens,
but 16 GB for 1,000 Llama-3-8B examples of 2,048; meant for small models on one host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.training.loss import base_features


def compute_features(base, dataset, boundaries, batch_size: int = 8, dtype=jnp.bfloat16,
                     progress: bool = True) -> list[np.ndarray]:
    """`[len_i, D]` base features of every example of `dataset` (a `TokenizedDataset`), in its order.

    Examples go through the base in batches of `batch_size`, shortest first, each batch right-padded to
    the smallest of `boundaries` that holds it (one compile per boundary used)."""
    from tqdm import tqdm

    graphdef, state = nnx.split(base)

    @jax.jit
    def forward(state, tokens, valid):
        return base_features(nnx.merge(graphdef, state), tokens, valid).astype(dtype)

    bounds = np.asarray(sorted(boundaries))
    lengths = np.asarray(dataset.lengths)
    if len(lengths) and lengths.max() > bounds[-1]:
        raise ValueError(f"an example of {int(lengths.max())} tokens is longer than the largest bucket "
                         f"boundary {int(bounds[-1])}")
    order = np.argsort(lengths, kind="stable")
    out: list[np.ndarray | None] = [None] * len(lengths)
    with tqdm(total=len(order), desc="base features", unit="ex", disable=not progress) as bar:
        for s in range(0, len(order), batch_size):
            rows = order[s: s + batch_size]
            t = int(bounds[np.searchsorted(bounds, lengths[rows].max())])
            tokens = np.full((batch_size, t), dataset.pad_id, np.int32)
            valid = np.zeros((batch_size, t), bool)
            for r, i in enumerate(rows):
                n = int(lengths[i])
                tokens[r, :n], valid[r, :n] = dataset[int(i)].tokens, True
            f = np.asarray(forward(state, tokens, valid))
            for r, i in enumerate(rows):
                out[int(i)] = f[r, : int(lengths[i])]
            bar.update(len(rows))
    return out


def attach_features(batcher, base, batch_size: int = 8, dtype=jnp.bfloat16, progress: bool = True):
    """Computes the base features of `batcher.dataset` and makes the batcher's batches carry them."""
    batcher.features = compute_features(base, batcher.dataset, batcher.boundaries, batch_size, dtype, progress)
    return batcher


__all__ = ["attach_features", "compute_features"]
