"""Explicit KV cache pytree with per-row lengths, and the masks built from it.

The cache holds every layer stacked: `k, v: [L, B, K, S, H]`, or (`per_layer`) one `[B, K, S, H]` array per layer,
plus `lengths: [B]`, the number of valid positions of each row. The per-layer form is what the decoding loops use
with unrolled layers (`clover_jax.decoding.autoregressive.decode_layers`): a layer then reads its own buffer, where
slicing a stacked cache copies every layer's slice at every step. Positions sit next to the head dim, so a layer's
`[B, K, S, H]` slice enters the attention products as it is (batch dims B, K leading): with `[B, S, K, H]` XLA
would transpose every layer's slice at every decode step, a cost that grows with the cache size, not with the tokens
held. The model never mutates it: a forward returns the new tokens' keys/values `[L, B, T, K, H]`
and `write` places them at explicit per-row slots. Slots at or past `S` are dropped rather than clamped, and
`check_room` raises before anything runs when a concrete write would not fit (JAX's `dynamic_update_slice` would
otherwise silently move the write).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from clover_jax.validation import InputError


class CacheOverflowError(InputError):
    """Raised when a write would go past the end of a KV cache."""


@struct.dataclass
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, K, S, H], or L arrays [B, K, S, H] (per_layer)
    v: jax.Array | tuple[jax.Array, ...]  # like k
    lengths: jax.Array  # [B] int32: valid positions per row

    @classmethod
    def init(cls, num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32, per_layer: bool = False) -> "KVCache":
        lengths = jnp.zeros((batch,), jnp.int32)
        if per_layer:
            shape = (batch, num_kv_heads, size, head_dim)
            return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                       v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)), lengths=lengths)
        shape = (num_layers, batch, num_kv_heads, size, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=lengths)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def size(self) -> int:
        return self.k[0].shape[2] if self.per_layer else self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0] if self.per_layer else self.k.shape[1]

    def write(self, new_k: jax.Array, new_v: jax.Array, slots: jax.Array) -> "KVCache":
        """Writes `new_k/new_v [L, B, T, K, H]` at cache slots `slots [B, T]`; lengths are unchanged.

        Out-of-range slots are dropped (never clamped onto valid entries).
        """
        num_layers, batch, t = new_k.shape[:3]
        b_idx = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, t))  # [B, T]
        if self.per_layer:  # per layer: the indexed block is [B, T, K, H], as new_k[i] is
            k = tuple(c.at[b_idx, :, slots].set(new_k[i].astype(c.dtype), mode="drop") for i, c in enumerate(self.k))
            v = tuple(c.at[b_idx, :, slots].set(new_v[i].astype(c.dtype), mode="drop") for i, c in enumerate(self.v))
            return self.replace(k=k, v=v)
        # indices split by a slice: the indexed block is [B, T, L, K, H]
        k = self.k.at[:, b_idx, :, slots].set(jnp.transpose(new_k, (1, 2, 0, 3, 4)).astype(self.k.dtype),
                                              mode="drop")
        v = self.v.at[:, b_idx, :, slots].set(jnp.transpose(new_v, (1, 2, 0, 3, 4)).astype(self.v.dtype),
                                              mode="drop")
        return self.replace(k=k, v=v)

    def append(self, new_k: jax.Array, new_v: jax.Array, num_valid: jax.Array | None = None) -> "KVCache":
        """Writes T new positions right after each row's length and advances lengths by `num_valid` (default T)."""
        t = new_k.shape[2]
        slots = self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        out = self.write(new_k, new_v, slots)
        inc = jnp.full_like(self.lengths, t) if num_valid is None else num_valid.astype(jnp.int32)
        return out.replace(lengths=self.lengths + inc)

    def gather_to_prefix(self, src_slots: jax.Array, num: jax.Array) -> "KVCache":
        """Compacts per-row entries: copies slots `src_slots [B, A]` to `lengths .. lengths+A-1`.

        Only the first `num[b]` entries of row b are meaningful; the rest are copied too (they land
        beyond the new length and are never attended to). Lengths advance by `num`.
        """
        batch, a = src_slots.shape
        b_idx = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, a))
        src = jnp.clip(src_slots, 0, self.size - 1)
        dst = self.lengths[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]
        if self.per_layer:  # [B, A, K, H] per layer
            k = tuple(c.at[b_idx, :, dst].set(c[b_idx, :, src], mode="drop") for c in self.k)
            v = tuple(c.at[b_idx, :, dst].set(c[b_idx, :, src], mode="drop") for c in self.v)
        else:
            k_sel = self.k[:, b_idx, :, src]  # [B, A, L, K, H]
            v_sel = self.v[:, b_idx, :, src]
            k = self.k.at[:, b_idx, :, dst].set(k_sel, mode="drop")
            v = self.v.at[:, b_idx, :, dst].set(v_sel, mode="drop")
        return self.replace(k=k, v=v, lengths=self.lengths + num.astype(jnp.int32))


def check_room(lengths, num_new: int, cache_size: int, what: str = "write") -> None:
    """Raises CacheOverflowError if `lengths + num_new` exceeds `cache_size` for any row.

    Works on concrete values only (host side, before a jitted call); traced values are skipped.
    """
    if isinstance(lengths, jax.core.Tracer):
        return
    lengths = np.asarray(lengths)
    worst = int(lengths.max()) + int(num_new) if lengths.size else int(num_new)
    if worst > cache_size:
        row = int(lengths.argmax())
        raise CacheOverflowError(
            f"KV cache overflow on {what}: row {row} holds {int(lengths[row])} positions and needs "
            f"{int(num_new)} more, but the cache has {cache_size} slots; allocate a larger cache "
            f"(cache_size >= {worst})"
        )


def causal_mask(valid: jax.Array) -> jax.Array:
    """Causal self-attention mask `[B, T, T]` from a validity mask `[B, T]` (right padding)."""
    t = valid.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    return causal[None] & valid[:, None, :] & valid[:, :, None]


def prefix_mask(lengths: jax.Array, num_queries: int, cache_size: int) -> jax.Array:
    """Mask `[B, T, S]` that lets every query see the first `lengths[b]` cache slots of its row."""
    visible = jnp.arange(cache_size)[None, :] < lengths[:, None]  # [B, S]
    return jnp.broadcast_to(visible[:, None, :], (lengths.shape[0], num_queries, cache_size))


def attended_cache(cache: KVCache, num_queries: int, fresh: bool) -> tuple[KVCache | None, jax.Array | None]:
    """`(cache, mask [B, T, S])` for `num_queries` new positions that see each row's filled slots, or
    `(None, None)` when the cache is known to be empty (`fresh`, a static bool: the prompt's first commit).

    Skipping an empty cache saves a `[T, S]` block of scores per head, and keeps XLA from constant-folding the
    all-masked block of a freshly initialised cache (seconds of compile time for a 256-token prompt)."""
    if fresh:
        return None, None
    return cache, prefix_mask(cache.lengths, num_queries, cache.size)
