"""Cached base features: the frozen base model's last hidden states, computed once per training example.

Training a draft head runs the frozen base over every batch only to read its pre-final-norm hidden
states f (the reference stores them on disk: `hidden_state_onnorm` in `XiaoBin1992/clover`'s `ge_data` scripts). Over several
epochs of a small data set that forward is repeated for nothing; on a CPU it is a large part of a
SmolLM2 step. `attach_features` runs it once per example, in length-bucketed batches, and hands the
states to the batcher, whose batches then carry `features [B, T, D]`; the train step uses them in place
of the base forward (`steps.make_loss_fn`). The teacher distribution is still computed from them in the
step (P = softmax(W_lm RMSNorm(f))), so nothing V-sized is stored.

Memory: T x D values per example (bfloat16 by default): 0.4 GB for 1,000 SmolLM2 examples of 384 tokens,
but 16 GB for 1,000 Llama-3-8B examples of 2,048; meant for small models on one host. A pass of the base holds
`[rows, N, T, T]` float32 attention scores, so long rows go through it fewer at a time (`feature_rows`: at most
`FEATURE_TOKENS` padded tokens per pass, at least one row): one 9,000-token row instead of eight.

With a `cache_dir` (`train.feature_cache_dir`) the features also go to disk, cached **per example**: a folder
per base model and storage dtype (`features-<digest of every base parameter and the dtype>/`) holds shards, each a
`.npy` of stacked features and a `.json` index of its examples (a digest of each example's tokens, its length).
A run loads every example some shard holds and runs the base only over the rest, written as a new shard, so a
data set that grows (more self-distilled replies, another source appended) costs only its new examples, and runs
on other heads, restarts and held-out splits share the work. A shard whose size does not match its index is an
error naming it, never silently reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.heads.losses import base_features
from tqdm import tqdm


FEATURE_TOKENS = 4096  # padded tokens per pass of the base over the data (rows x length), at least one row


def feature_rows(length: int, batch_size: int = 8) -> int:
    """Rows per pass of the base over examples padded to `length`: `batch_size`, fewer where they would pass
    `FEATURE_TOKENS` tokens (a pass's attention scores grow with rows x length^2), at least one."""
    return max(1, min(int(batch_size), FEATURE_TOKENS // max(int(length), 1)))


def feature_program(base, dtype=jnp.bfloat16, taps: tuple[int, ...] = ()):
    """(the jitted pass `forward(state, tokens [R, T], valid [R, T]) -> [R, T, (n + 1) D]` features in `dtype` (n
    `taps`: those layers' outputs, then the last layer's), the base's state to pass it)."""
    graphdef, state = nnx.split(base)

    @jax.jit
    def forward(state, tokens, valid):
        return base_features(nnx.merge(graphdef, state), tokens, valid, taps).astype(dtype)

    return forward, state


def compute_features(base, dataset, boundaries, batch_size: int = 8, dtype=jnp.bfloat16,
                     progress: bool = True, indices=None, taps: tuple[int, ...] = ()) -> list[np.ndarray]:
    """`[len_i, (n + 1) D]` base features (n `taps`) of every example of `dataset` (a `TokenizedDataset`), in its
    order, or of the examples at `indices` only, in that order.

    Examples go through the base in batches of `batch_size`, shortest first, each batch right-padded to
    the smallest of `boundaries` that holds it (one compile per boundary used); a batch of long rows goes in
    passes of `feature_rows(boundary, batch_size)` rows."""
    forward, state = feature_program(base, dtype, taps)
    bounds = np.asarray(sorted(boundaries))
    indices = np.arange(len(dataset)) if indices is None else np.asarray(indices, np.int64)  # [M]
    lengths = np.asarray(dataset.lengths)[indices]  # [M]
    if len(lengths) and lengths.max() > bounds[-1]:
        raise ValueError(f"an example of {int(lengths.max())} tokens is longer than the largest bucket "
                         f"boundary {int(bounds[-1])}")
    order = np.argsort(lengths, kind="stable")
    out: list[np.ndarray | None] = [None] * len(lengths)
    with tqdm(total=len(order), desc="base features", unit="ex", disable=not progress) as bar:
        for s in range(0, len(order), batch_size):
            group = order[s: s + batch_size]
            t = int(bounds[np.searchsorted(bounds, lengths[group].max())])
            per = feature_rows(t, batch_size)
            for g in range(0, len(group), per):
                rows = group[g: g + per]
                tokens = np.full((per, t), dataset.pad_id, np.int32)
                valid = np.zeros((per, t), bool)
                for r, i in enumerate(rows):
                    n = int(lengths[i])
                    tokens[r, :n], valid[r, :n] = dataset[int(indices[i])].tokens, True
                f = np.asarray(forward(state, tokens, valid))
                for r, i in enumerate(rows):
                    out[int(i)] = f[r, : int(lengths[i])]
                bar.update(len(rows))
    return out


log = logging.getLogger(__name__)


def model_key(base, dtype) -> str:
    """A hex digest of what every example's features depend on besides its tokens: each base parameter, the dtype."""
    h = hashlib.sha256(jnp.dtype(dtype).name.encode())
    for leaf in jax.tree.leaves(nnx.state(base, nnx.Param)):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:24]


def example_key(tokens) -> str:
    """A hex digest of one example's token ids (its features depend on nothing else for a given base)."""
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:32]


class FeatureStore:
    """The per-example feature cache of one base model and storage dtype: a folder of shards (see the module
    docstring). `get(keys)` -> the features it holds for those keys; `put(keys, features)` adds a shard."""

    def __init__(self, folder: str | os.PathLike, hidden_size: int, dtype):
        self.folder, self.hidden_size = Path(folder), int(hidden_size)
        self.stored = np.dtype(jnp.dtype(dtype))
        self.index: dict[str, tuple[Path, int, int]] = {}  # example key -> (shard .npy, first row, length)
        for meta in sorted(self.folder.glob("shard-*.json")):
            entry = json.loads(meta.read_text())
            data = meta.with_suffix(".npy")
            rows = int(np.sum(entry["lengths"]))
            shape = np.load(data, mmap_mode="r").shape if data.is_file() else None
            if shape != (rows, self.hidden_size):
                raise ValueError(f"{data}: holds {shape} features, its index {meta.name} says "
                                 f"({rows}, {self.hidden_size}); delete both files to recompute them")
            start = 0
            for key, n in zip(entry["keys"], entry["lengths"]):
                self.index[key] = (data, start, int(n))
                start += int(n)

    def get(self, keys: list[str]) -> dict[str, np.ndarray]:
        """{key: [len, D] features} for the keys some shard holds (copied out of the memory-mapped shards)."""
        maps: dict[Path, np.ndarray] = {}
        out = {}
        for key in keys:
            if key in self.index and key not in out:
                data, start, n = self.index[key]
                if data not in maps:
                    maps[data] = np.load(data, mmap_mode="r")
                # bfloat16 has no numpy file format: stored as its raw 16-bit words, viewed back here
                out[key] = np.array(maps[data][start:start + n]).view(self.stored)
        return out

    def put(self, keys: list[str], feats: list[np.ndarray]) -> Path:
        """Writes one shard of these examples' features; returns its `.npy` path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        name = "shard-" + hashlib.sha256("|".join(keys).encode()).hexdigest()[:16]
        data, meta = self.folder / f"{name}.npy", self.folder / f"{name}.json"
        flat = np.concatenate(feats) if feats else np.zeros((0, self.hidden_size), self.stored)
        tmp = data.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, flat.view(np.uint16) if flat.dtype.itemsize == 2 else flat)
        os.replace(tmp, data)  # atomic, and before the index: a listed shard is always a whole file
        tmp = meta.with_suffix(f".tmp{os.getpid()}.json")
        tmp.write_text(json.dumps({"keys": keys, "lengths": [int(len(f)) for f in feats]}))
        os.replace(tmp, meta)
        start = 0
        for key, f in zip(keys, feats):
            self.index[key] = (data, start, len(f))
            start += len(f)
        return data


def attach_features(batcher, base, batch_size: int = 8, dtype=jnp.bfloat16, progress: bool = True,
                    cache_dir: str | os.PathLike | None = None, taps: tuple[int, ...] = ()):
    """Computes the base features of `batcher.dataset` (those `cache_dir` does not hold, see the module docstring)
    and makes the batcher's batches carry them. `taps`: base layers whose outputs the features hold before the
    last layer's (a folder of their own in `cache_dir`)."""
    dataset = batcher.dataset
    if cache_dir is None:
        batcher.features = compute_features(base, dataset, batcher.boundaries, batch_size, dtype, progress,
                                            taps=taps)
        return batcher
    folder = f"features-{model_key(base, dtype)}" + "".join(f"-layer{i}" for i in taps)
    store = FeatureStore(Path(cache_dir) / folder, (len(taps) + 1) * base.config.hidden_size, dtype)
    keys = [example_key(dataset[i].tokens) for i in range(len(dataset))]
    found = store.get(keys)
    missing, seen = [], set()
    for i, key in enumerate(keys):
        if key not in found and key not in seen:
            missing.append(i)
            seen.add(key)
    if missing:
        computed = compute_features(base, dataset, batcher.boundaries, batch_size, dtype, progress, indices=missing,
                                    taps=taps)
        data = store.put([keys[i] for i in missing], computed)
        found.update({keys[i]: f for i, f in zip(missing, computed)})
        log.info("base features of %d examples computed and written to %s (%.0f MB)", len(missing), data,
                 data.stat().st_size / 1e6)
    log.info("base features: %d of %d examples loaded from %s", len(keys) - len(missing), len(keys), store.folder)
    batcher.features = [found[key] for key in keys]
    for i, f in enumerate(batcher.features):
        if len(f) != dataset.lengths[i]:  # a digest collision or a hand-edited index
            raise ValueError(f"{store.folder}: the cached features of example {i} hold {len(f)} positions, the "
                             f"example has {int(dataset.lengths[i])}; delete the folder to recompute it")
    return batcher


__all__ = ["FEATURE_TOKENS", "FeatureStore", "attach_features", "compute_features", "feature_program",
           "feature_rows"]
