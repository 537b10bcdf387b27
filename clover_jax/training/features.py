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

With a `cache_dir` (`train.feature_cache_dir`) the features also go to disk, one `.npy` per data set named by a
hash of the base model's weights, the storage dtype and the examples' tokens: a later run on the same model and
data (another head type, a restart) loads them instead of running the base. A file that does not match the
data set's lengths is an error naming it, never silently reused.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

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


log = logging.getLogger(__name__)


def cache_key(base, dataset, dtype) -> str:
    """A hex digest of everything the features depend on: every base parameter, the storage dtype, the tokens."""
    h = hashlib.sha256(jnp.dtype(dtype).name.encode())
    for leaf in jax.tree.leaves(nnx.state(base, nnx.Param)):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    for i in range(len(dataset)):
        h.update(np.asarray(dataset[i].tokens, np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:24]


def _flat_to_list(flat: np.ndarray, lengths) -> list[np.ndarray]:
    ends = np.cumsum(lengths)
    return [flat[e - n:e] for e, n in zip(ends, lengths)]


def attach_features(batcher, base, batch_size: int = 8, dtype=jnp.bfloat16, progress: bool = True,
                    cache_dir: str | os.PathLike | None = None):
    """Computes the base features of `batcher.dataset` (or loads them from `cache_dir`, see the module docstring)
    and makes the batcher's batches carry them."""
    dataset = batcher.dataset
    lengths = [int(n) for n in dataset.lengths]
    file = None
    if cache_dir is not None:
        file = Path(cache_dir) / f"features-{cache_key(base, dataset, dtype)}.npy"
        if file.is_file():
            stored = np.dtype(jnp.dtype(dtype))
            flat = np.load(file, mmap_mode="r")
            if flat.shape[0] != sum(lengths) or flat.shape[1] != base.config.hidden_size:
                raise ValueError(f"{file}: holds {flat.shape} features, the data set needs "
                                 f"({sum(lengths)}, {base.config.hidden_size}); delete the file to recompute it")
            log.info("base features of %d examples loaded from %s", len(lengths), file)
            batcher.features = _flat_to_list(np.asarray(flat).view(stored), lengths)
            return batcher
    batcher.features = compute_features(base, dataset, batcher.boundaries, batch_size, dtype, progress)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        flat = np.concatenate(batcher.features) if lengths else np.zeros((0, base.config.hidden_size), dtype)
        tmp = file.with_suffix(f".tmp{os.getpid()}.npy")
        # bfloat16 has no numpy file format: stored as its raw 16-bit words, viewed back on load
        np.save(tmp, flat.view(np.uint16) if flat.dtype.itemsize == 2 else flat)
        os.replace(tmp, file)  # atomic: a reader never sees half a file
        log.info("base features written to %s (%.0f MB)", file, file.stat().st_size / 1e6)
    return batcher


__all__ = ["attach_features", "compute_features"]
