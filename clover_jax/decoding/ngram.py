"""An n-gram draft table: what the base model usually writes next, learnt from its own replies.

Prompt lookup (`clover_jax.decoding.lookup`) copies tokens from the sequence itself and has nothing to offer
where the sequence's last token never occurred before in it. Retrieval drafting (REST, He et al. 2024, arXiv
2311.08252) looks the last tokens up in a datastore of other text instead. This module keeps the datastore small
and jittable: a back-off n-gram model over the base model's own replies (the self-distilled training data of
its head), stored as one sorted array of 32-bit context hashes and the most frequent next token of each context.
A chain is drafted greedily from it: at each of `k` steps the longest context of up to `max_order` tokens found
in the table gives the next token.

Only contexts seen at least `min_count` times are kept, and a context whose most frequent next token equals the
one its shorter suffix context predicts is left out (the back-off then gives the same token), which keeps
the table of a chat model's replies small (docs/trees.md has the shipped table's size).

Hash collisions are possible (two contexts, one 32-bit hash): they can only propose a wrong token, which
verification rejects, so output is unaffected, as for every draft.

    table = build_ngram_table(token_lists, vocab_size=49152)       # from the base model's replies
    save_ngram_table(table, "head_dir/ngram_table.npz")
    generate(model, prompts, mode="speculative", head="head_dir", tree="fit-5-411aab+lookup-4-table")

CLI: `python -m clover_jax.cli.ngram --model smollm2-135m-instruct --data replies.jsonl.gz --out DIR`.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import zipfile
import zlib
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.io.files import atomic_write_bytes
from clover_jax.validation import InputError

NGRAM_FILE = "ngram_table.npz"  # its name in an exported head folder
MAX_ORDER = 4
MIN_COUNT = 2
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193
_ORDER_SALT = 0x9E3779B9


def context_hash(xp, ctx, order: int):
    """32-bit hash of the `order` tokens `ctx [..., order]` (oldest first), salted by the order: FNV-1a over
    token ids, then MurmurHash3's finaliser. `xp` is numpy or jax.numpy; both give the same bits."""
    u32 = xp.uint32
    h = xp.full(ctx.shape[:-1], (_FNV_OFFSET ^ (order * _ORDER_SALT)) & 0xFFFFFFFF, u32)  # [...]
    for i in range(order):
        h = (h ^ ctx[..., i].astype(u32)) * u32(_FNV_PRIME)
    h = h ^ (h >> u32(16))
    h = h * u32(0x85EBCA6B)
    h = h ^ (h >> u32(13))
    h = h * u32(0xC2B2AE35)
    return h ^ (h >> u32(16))


@dataclasses.dataclass(frozen=True, eq=False)
class NgramTable:
    """`keys [M]` uint32 sorted context hashes, `tokens [M]` int32 the next token of each; hashable by identity
    (a drafter holding it is cached per table object)."""

    keys: np.ndarray
    tokens: np.ndarray
    max_order: int
    vocab_size: int  # the tokenizer's vocabulary the table was built with
    source: str = ""

    def __post_init__(self):
        if self.keys.ndim != 1 or self.keys.shape != self.tokens.shape or self.keys.size == 0:
            raise InputError(f"n-gram table: keys {self.keys.shape} and tokens {self.tokens.shape} must be the "
                             f"same non-empty 1-D length")
        if not 1 <= self.max_order <= 8:
            raise InputError(f"n-gram table: max_order must be in [1, 8], got {self.max_order}")

    @property
    def size(self) -> int:
        return int(self.keys.size)

    def chain(self, ctx: Sequence[int], k: int) -> tuple[list[int], bool]:
        """`ngram_chain` for one row on the host (numpy): `(k tokens, found)` after the tokens `ctx` (root last)."""
        ctx, root, out = [int(t) for t in ctx], int(ctx[-1]), []
        for _ in range(k):
            nxt = None
            for n in range(min(self.max_order, len(ctx)), 0, -1):
                q = context_hash(np, np.asarray([ctx[-n:]], np.uint32), n)[0]
                i = min(int(np.searchsorted(self.keys, q)), self.size - 1)
                if self.keys[i] == q:
                    nxt = int(self.tokens[i])
                    break
            if nxt is None:
                break
            out.append(nxt)
            ctx.append(nxt)
        return out + [root] * (k - len(out)), bool(out)


def _positions(sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """All sequences end to end `[T]` int64, and each token's index within its sequence `[T]`."""
    lens = np.asarray([len(s) for s in sequences], np.int64)
    flat = np.concatenate([np.asarray(s, np.int64) for s in sequences]) if len(sequences) else np.zeros(0, np.int64)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return flat, np.arange(flat.size, dtype=np.int64) - starts


def _order_hashes(flat: np.ndarray, pos: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions `[T_n]` whose `order` preceding tokens lie in their own sequence, and those contexts' hashes."""
    at = np.flatnonzero(pos >= order)
    ctx = np.stack([flat[at - order + j] for j in range(order)], axis=-1)  # [M, O]: one row per n-gram
    return at, context_hash(np, ctx, order)


def build_ngram_table(sequences: Iterable[Sequence[int]], vocab_size: int, max_order: int = MAX_ORDER,
                      min_count: int = MIN_COUNT, source: str = "") -> NgramTable:
    """The back-off n-gram table of `sequences` (token id lists; see the module docstring)."""
    seqs = [list(s) for s in sequences]
    if min_count < 1:
        raise InputError(f"n-gram table: min_count must be >= 1, got {min_count}")
    flat, pos = _positions(seqs)
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        bad = int(flat.min()) if flat.min() < 0 else int(flat.max())
        raise InputError(f"n-gram table: token id {bad} outside the vocabulary [0, {vocab_size})")
    if not np.any(pos >= 1):
        raise InputError(f"n-gram table: the {len(seqs)} sequences hold no pair of consecutive tokens")
    per_order = {}  # order -> (keys [M_n] sorted, tokens [M_n], representative position [M_n])
    hashes = {}  # order -> (positions [T_n], context hashes [T_n])
    for n in range(1, max_order + 1):
        at, h = hashes[n] = _order_hashes(flat, pos, n)
        if at.size == 0:
            break
        nxt = flat[at]
        pair = (h.astype(np.uint64) << np.uint64(32)) | nxt.astype(np.uint64)
        uniq, first, counts = np.unique(pair, return_index=True, return_counts=True)  # sorted by (hash, token)
        uh = (uniq >> np.uint64(32)).astype(np.uint32)
        ut = (uniq & np.uint64(0xFFFFFFFF)).astype(np.int64)
        starts = np.flatnonzero(np.r_[True, uh[1:] != uh[:-1]])  # each context's first pair
        total = np.add.reduceat(counts, starts)
        best = np.lexsort((ut, -counts, uh))  # by context, most frequent next token first, then smaller id
        head = best[np.r_[True, uh[best][1:] != uh[best][:-1]]]  # [contexts] the winning pair of each context
        keep = total >= min_count
        per_order[n] = (uh[head][keep], ut[head][keep].astype(np.int32), at[first[head]][keep])
    keys, tokens = [per_order[1][0]], [per_order[1][1]]
    for n in range(2, max(per_order) + 1 if per_order else 1):
        k, t, rep = per_order[n]
        lk, lt, _ = per_order[n - 1]
        at_lower, lower = hashes[n - 1]  # [T_{n-1}] by position
        suffix = lower[np.searchsorted(at_lower, rep)]  # the shorter context at the same position
        i = np.clip(np.searchsorted(lk, suffix), 0, max(lk.size - 1, 0))
        same = (lk.size > 0) & (lk[i] == suffix) & (lt[i] == t)
        keys.append(k[~same])
        tokens.append(t[~same])
    keys, tokens = np.concatenate(keys), np.concatenate(tokens)
    order = np.argsort(keys, kind="stable")
    keys, tokens = keys[order], tokens[order]
    dup = np.r_[False, keys[1:] == keys[:-1]]  # a hash shared by two orders: keep one
    if not keys.size:
        raise InputError(f"n-gram table: no context occurs {min_count} times in {len(seqs)} sequences")
    return NgramTable(keys[~dup], tokens[~dup], max_order, int(vocab_size), source)


def save_ngram_table(table: NgramTable, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix != ".npz":
        path = path / NGRAM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tok_dtype = np.uint16 if table.vocab_size <= 1 << 16 else np.int32
    buf = io.BytesIO()
    np.savez_compressed(buf, keys=table.keys, tokens=table.tokens.astype(tok_dtype),
                        max_order=np.int32(table.max_order), vocab_size=np.int64(table.vocab_size),
                        source=np.asarray(table.source))
    return atomic_write_bytes(path, buf.getvalue())  # a reader never sees half a table


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> NgramTable:
    try:
        with np.load(path) as z:
            return NgramTable(np.asarray(z["keys"], np.uint32), np.asarray(z["tokens"], np.int32),
                              int(z["max_order"]), int(z["vocab_size"]), str(z["source"]))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # missing, cut, garbled
        raise InputError(f"n-gram table {path}: unreadable, not a whole table written by save_ngram_table "
                         f"({type(e).__name__}: {e})") from None


def load_ngram_table(path: str | os.PathLike) -> NgramTable:
    """A table file (or a folder holding `ngram_table.npz`); the same object while the file is unchanged."""
    path = Path(path)
    if path.is_dir():
        path = path / NGRAM_FILE
    if not path.is_file():
        raise InputError(f"n-gram table: no file {path}")
    return _load(str(path.resolve()), path.stat().st_mtime)


def resolve_ngram_table(table) -> NgramTable | None:
    """`table` as an `NgramTable`: the table itself, read from its path (a file or a folder holding
    `ngram_table.npz`), or None for None. A head's own table comes with its folder
    (`clover_jax.heads.folder.HeadFolder.ngram_table`)."""
    if table is None or isinstance(table, NgramTable):
        return table
    return load_ngram_table(table)


def ngram_chain(keys: jax.Array, tokens: jax.Array, history: jax.Array, length: jax.Array, k: int,
                max_order: int) -> tuple[jax.Array, jax.Array]:
    """`k` tokens drafted greedily from the table after each row's last tokens.

    Args:
      keys: `[M]` uint32 sorted context hashes; tokens: `[M]` int32 their next tokens.
      history: `[B, S]` int32 tokens; length: `[B]` how many are valid (the last one is the root).
      k: chain length; max_order: the longest context tried.
    Returns:
      `(chain [B, Z] int32, found [B] bool)`: `found` is False where not even the root alone is in the table;
      from the first step with no context found on, the chain repeats the root (verified and rejected).
    """
    b, s = history.shape
    m = keys.shape[0]
    length = length.astype(jnp.int32)
    rows = jnp.arange(b)[:, None]
    at = length[:, None] - max_order + jnp.arange(max_order, dtype=jnp.int32)[None, :]  # [B, O] the last O slots
    window = jnp.where(at >= 0, history[rows, jnp.clip(at, 0, s - 1)], 0)  # [B, O]
    root = history[jnp.arange(b), jnp.clip(length - 1, 0, s - 1)]  # [B]
    buf = jnp.concatenate([window, jnp.zeros((b, k), jnp.int32)], axis=1)  # [B, O + Z]
    orders = jnp.arange(1, max_order + 1, dtype=jnp.int32)  # [O]
    alive = jnp.ones((b,), bool)
    found = None
    for step in range(k):
        ctx = buf[:, step:max_order + step]  # [B, O] the last O tokens, oldest first
        q = jnp.stack([context_hash(jnp, ctx[:, max_order - n:], n) for n in range(1, max_order + 1)], axis=1)  # [B, O]
        # every order in one search; "scan_unrolled": a fixed sequence of gathers, no `while` loop. With the default
        # method's 16 searches a step (~300 loop iterations, each likely a host round trip on a GPU), a tree with the
        # table would run slower than autoregressive decoding on a GPU where the head's tree alone runs faster
        i = jnp.searchsorted(keys, q.reshape(-1), method="scan_unrolled").reshape(b, max_order)  # [B, O] in [0, M]
        i = jnp.clip(i, 0, m - 1)  # (M, past the last key: clipped, then rejected by the equality)
        hit = (keys[i] == q) & (length[:, None] + step >= orders[None, :])  # [B, O]
        longest = max_order - 1 - jnp.argmax(hit[:, ::-1], axis=1)  # [B] the longest context found
        best = jnp.where(hit.any(axis=1), jnp.take_along_axis(tokens[i], longest[:, None], axis=1)[:, 0], -1)  # [B]
        alive = alive & (best >= 0)
        found = alive if found is None else found
        buf = buf.at[:, max_order + step].set(jnp.where(alive, best, root))
    return buf[:, max_order:], found
