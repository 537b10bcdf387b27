"""Length-bucketed, fixed-shape, resumable batches over a `TokenizedDataset`.

    batcher = BucketedBatcher(train, cfg.data.batch_size, cfg.data.bucket_boundaries, seed=cfg.data.seed)
    batch = next(batcher)   # {"tokens": [B,T] int32, "loss_mask": [B,T] int32, "valid": [B,T] bool}

Everything is deterministic given the seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from clover_jax.training.sources import DataError

if TYPE_CHECKING:
    from clover_jax.training.dataset import TokenizedDataset

def auto_boundaries(max_length: int, smallest: int = 64) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_length`, then `max_length`."""
    out, b = [], smallest
    while b < max_length:
        out.append(b)
        b *= 2
    return tuple(out) + (max_length,)


class BucketedBatcher:
    """Length-bucketed, fixed-shape batches over a TokenizedDataset, in a seeded per-epoch order.

    Each example goes to the smallest bucket boundary >= its length and is right-padded to it. Per
    epoch, examples are shuffled within buckets, cut into batches of `batch_size` (a last partial batch
    is filled with empty rows, `valid` all False, unless `drop_remainder`), and the batches shuffled.
    `state_dict()` (epoch, index) restores the exact position. With several processes, each yields its
    `batch_size / process_count` rows of every global batch.
    """

    def __init__(self, dataset: TokenizedDataset, batch_size: int, boundaries: Sequence[int] | str = "auto",
                 seed: int = 0, *, shuffle: bool = True, drop_remainder: bool = False,
                 process_index: int = 0, process_count: int = 1):
        if len(dataset) == 0:
            raise DataError("BucketedBatcher: the dataset is empty")
        if batch_size < 1 or batch_size % process_count:
            raise DataError(f"batch_size={batch_size} must be >= 1 and divisible by process_count={process_count}")
        self.dataset, self.batch_size, self.seed = dataset, int(batch_size), int(seed)
        self.shuffle, self.drop_remainder = shuffle, drop_remainder
        self.process_index, self.process_count = process_index, process_count
        max_len = max(dataset.max_length, int(dataset.lengths.max()))
        if isinstance(boundaries, str):
            if boundaries != "auto":
                raise DataError(f"boundaries must be 'auto' or a list of lengths, got {boundaries!r}")
            bounds = auto_boundaries(max_len)
        else:
            bounds = tuple(sorted(int(b) for b in boundaries if int(b) < max_len)) + (max_len,)
        self.boundaries = bounds
        self.bucket_of = np.searchsorted(np.asarray(bounds), dataset.lengths, side="left")  # [num_examples]
        self.epoch, self.index = 0, 0
        self._plan_epoch, self._plan = -1, []
        # per-example base features [len, D] (`clover_jax.training.features.attach_features`), or None
        self.features: list[np.ndarray] | None = None
        if not self.epoch_plan(0):
            raise DataError(f"no full batch of {batch_size} in {len(dataset)} examples with drop_remainder=True")

    # ---- order
    def epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """[(padded length T, example indices [batch_size], -1 for an empty row)] for one epoch."""
        if epoch == self._plan_epoch:
            return self._plan
        rng = np.random.default_rng([self.seed, epoch])
        plan = []
        for b, length in enumerate(self.boundaries):
            idx = np.flatnonzero(self.bucket_of == b)
            if self.shuffle:
                idx = rng.permutation(idx)
            for s in range(0, len(idx), self.batch_size):
                rows = idx[s: s + self.batch_size]
                if len(rows) < self.batch_size:
                    if self.drop_remainder:
                        continue
                    rows = np.concatenate([rows, np.full(self.batch_size - len(rows), -1, dtype=rows.dtype)])
                plan.append((length, rows))
        if self.shuffle:
            plan = [plan[i] for i in rng.permutation(len(plan))]
        self._plan_epoch, self._plan = epoch, plan
        return plan

    def longest_length(self) -> int:
        """The length of the longest bucket that holds rows: the step's largest shape."""
        return int(self.boundaries[int(self.bucket_of.max())]) if len(self.bucket_of) else int(self.boundaries[0])

    @property
    def batches_per_epoch(self) -> int:
        return len(self.epoch_plan(0))

    def make_batch(self, length: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """This process's rows of one global batch, right-padded to `length`."""
        per = self.batch_size // self.process_count
        rows = rows[self.process_index * per: (self.process_index + 1) * per]
        tokens = np.full((per, length), self.dataset.pad_id, dtype=np.int32)  # [B, T]
        loss_mask = np.zeros((per, length), dtype=np.int32)  # [B, T]
        valid = np.zeros((per, length), dtype=bool)  # [B, T]
        for r, i in enumerate(rows):
            if i < 0:
                continue
            ex = self.dataset[int(i)]
            n = len(ex)
            tokens[r, :n], loss_mask[r, :n], valid[r, :n] = ex.tokens, ex.loss_mask, True
        batch = {"tokens": tokens, "loss_mask": loss_mask, "valid": valid}
        if self.features is not None:
            f0 = self.features[0]
            feats = np.zeros((per, length, f0.shape[-1]), f0.dtype)  # [B, T, D]
            for r, i in enumerate(rows):
                if i >= 0:
                    feats[r, : len(self.features[int(i)])] = self.features[int(i)]
            batch["features"] = feats
        return batch

    def epoch_batches(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """One epoch's batches, without moving the resumable position (e.g. for evaluation)."""
        for length, rows in self.epoch_plan(epoch):
            yield self.make_batch(length, rows)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        plan = self.epoch_plan(self.epoch)
        if self.index >= len(plan):
            self.epoch, self.index = self.epoch + 1, 0
            plan = self.epoch_plan(self.epoch)
        length, rows = plan[self.index]
        self.index += 1
        return self.make_batch(length, rows)

    # ---- resumable position
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": int(self.epoch), "index": int(self.index), "seed": self.seed, "batch_size": self.batch_size,
                "boundaries": list(self.boundaries), "fingerprint": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "boundaries", "fingerprint"):
            theirs = list(state[key]) if isinstance(state.get(key), (list, tuple)) else state.get(key)
            if key in state and theirs != mine[key]:
                raise DataError(f"cannot resume the batcher: {key} was {state[key]!r}, now {mine[key]!r} "
                                "(a resumed run would see different batches)")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    # ---- statistics
    def padding_waste(self, epoch: int = 0) -> float:
        """Padded tokens / all tokens in the batches of one epoch (empty filler rows count as padding)."""
        total = real = 0
        for length, rows in self.epoch_plan(epoch):
            total += length * len(rows)
            real += int(self.dataset.lengths[rows[rows >= 0]].sum())
        return 1.0 - real / total if total else 0.0

    def stats(self) -> dict[str, Any]:
        counts = np.bincount(self.bucket_of, minlength=len(self.boundaries))
        return {"boundaries": list(self.boundaries), "examples_per_bucket": counts.tolist(),
                "batches_per_epoch": self.batches_per_epoch, "padding_waste": self.padding_waste()}
