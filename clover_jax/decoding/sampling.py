"""Logit warping (temperature, top-k, top-p) and sampling, shared by autoregressive decoding and
speculative verification, so both draw from exactly the same distribution.

All sampling parameters are traced arrays (a new temperature does not recompile); only `greedy`
(a Python bool) changes the program.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from clover_jax.validation import check_float, check_int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "temperature", check_float("temperature", self.temperature, minimum=0.0))
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, minimum=0))
        object.__setattr__(self, "top_p", check_float("top_p", self.top_p, above=0.0, maximum=1.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def arrays(self) -> dict[str, jax.Array]:
        return {"temperature": jnp.asarray(max(self.temperature, 1e-6), jnp.float32),
                "top_k": jnp.asarray(self.top_k, jnp.int32),
                "top_p": jnp.asarray(self.top_p, jnp.float32)}


def warp_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Probabilities `[..., V]` (float32) after temperature, top-k and top-p (nucleus) filtering.

    Ties at the top-k / top-p boundary are all kept (a threshold on the value), which keeps the
    result a deterministic function of the logits.
    """
    x = logits.astype(jnp.float32) / temperature
    # The filters need a sort of the vocabulary; skip it when both are off (plain temperature sampling).
    filtered = (top_k > 0) | (top_p < 1.0)
    return jax.lax.cond(filtered, lambda x: _filter_softmax(x, top_k, top_p), lambda x: jax.nn.softmax(x, axis=-1), x)


def _filter_softmax(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    v = x.shape[-1]
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_x, jnp.broadcast_to(k - 1, x.shape[:-1])[..., None].astype(jnp.int32), -1)
    x = jnp.where(x >= kth, x, -jnp.inf)
    sorted_x = jnp.where(jnp.arange(v) < k, sorted_x, -jnp.inf)
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    cum_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each sorted entry
    keep_sorted = cum_before < top_p  # always keeps the first
    # the smallest kept value is the threshold
    thresh = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x >= thresh, x, -jnp.inf)
    return jax.nn.softmax(x, axis=-1)


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row from `probs [..., V]` by inverse CDF on a single uniform per row."""
    u = jax.random.uniform(key, probs.shape[:-1], jnp.float32)
    return sample_with_uniform(u, probs)


def sample_with_uniform(u: jax.Array, probs: jax.Array) -> jax.Array:
    """Inverse-CDF sample with explicit uniforms `u [...]` in [0, 1); probs need not be normalised."""
    cdf = jnp.cumsum(probs.astype(jnp.float32), axis=-1)
    total = cdf[..., -1:]
    idx = jnp.sum(cdf <= u[..., None] * total, axis=-1)
    # never pick a zero-probability token past the end because of rounding
    last_nonzero = probs.shape[-1] - 1 - jnp.argmax(jnp.flip(probs > 0, -1), axis=-1)
    return jnp.minimum(idx, last_nonzero).astype(jnp.int32)


def argmax_last(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32, computed as the first index holding the maximum.

    The same index wherever the row holds no NaN (ties: the first); in a row holding a NaN, the first index that
    holds a NaN or the largest number (jnp.argmax: the first NaN). Two plain reductions instead of one variadic
    (value, index) reduction, which XLA:CPU does not vectorise: several times faster over a verify's logits on a
    CPU (measured: `bench/bench_products.py`), and the speculative loop takes it over every verified node's
    logits at every step.
    """
    m = jnp.max(x, axis=-1, keepdims=True)  # [..., 1]
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)  # [..., V]
    return jnp.min(jnp.where((x == m) | jnp.isnan(x), idx, x.shape[-1]), axis=-1)


def next_token(key: jax.Array, logits: jax.Array, params: dict[str, jax.Array] | None, greedy: bool) -> jax.Array:
    """Greedy argmax, or a sample from the warped distribution."""
    if greedy:
        return argmax_last(logits)
    probs = warp_probs(logits, params["temperature"], params["top_k"], params["top_p"])
    return sample_from_probs(key, probs)


# the mesh whose "tp" axis splits the vocabulary of the logits drafting takes the top k of (`vocab_split_over`)
_VOCAB_MESH: contextvars.ContextVar = contextvars.ContextVar("clover_jax_vocab_mesh", default=None)


@contextlib.contextmanager
def vocab_split_over(mesh: Mesh | None):
    """Traced inside, `top_k_ids` takes the top k of each chip's share of the vocabulary (`mesh`'s "tp" axis splits
    the output projection's vocabulary, `clover_jax.parallel`), then the top k of the chips' candidates: each chip
    keeps its share of the projection, and only k candidates per row cross between chips. Without it the compiler
    partitions the top-k as it sees fit: for the blocks of `top_k_ids` that straddle the chips' shares it gathers
    the whole projection to every chip, and the TPU compiler (libtpu 0.0.42) compiles a `lax.top_k` whose
    indices alone are used, over a split axis, into zeros. Identity without a mesh or with tp = 1."""
    token = _VOCAB_MESH.set(mesh if mesh is not None and dict(mesh.shape).get("tp", 1) > 1 else None)
    try:
        yield
    finally:
        _VOCAB_MESH.reset(token)


def top_k_ids(logits: jax.Array, k: int, block: int = 128) -> jax.Array:
    """Top-k token ids over the last (vocabulary) axis, exact, without sorting the vocabulary (split over chips
    inside `vocab_split_over`).

    XLA:CPU lowers many `lax.top_k` calls over a 49k-128k vocabulary to a full sort, and the top-k calls
    would dominate a draft's cost. Two small steps instead: the k blocks of `block` logits with the
    largest maxima must hold the global top k (a block with a top-k element has a max at least that large,
    and fewer than k blocks can have a larger max), then top-k inside those k * block candidates.
    """
    *lead, v = logits.shape
    flat = logits.reshape(-1, v)  # [rows, V]
    if k == 1:
        return argmax_last(flat).reshape(*lead, 1)
    mesh = _VOCAB_MESH.get()
    if mesh is not None and v % mesh.shape["tp"] == 0 and v // mesh.shape["tp"] >= k:
        return _split_top_k(flat, k, block, mesh).reshape(*lead, k)
    return _top_k(flat, k, block).reshape(*lead, k)


def top_k(logits: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """`(values, ids)` of the top k over the last (vocabulary) axis, as `top_k_ids` finds them."""
    ids = top_k_ids(logits, k, block)  # [..., k]
    return jnp.take_along_axis(logits, ids, axis=-1), ids


def _top_k(flat: jax.Array, k: int, block: int) -> jax.Array:
    """`top_k_ids` of `flat [rows, V]` on one device: [rows, k]."""
    rows, v = flat.shape
    nblk = -(-v // block)
    if nblk <= k:
        return jax.lax.top_k(flat, k)[1].astype(jnp.int32)
    x = jnp.pad(flat, ((0, 0), (0, nblk * block - v)), constant_values=-jnp.inf).reshape(-1, nblk, block)
    top_blocks = jax.lax.top_k(x.max(axis=-1), k)[1]  # [rows, k]
    cand = jnp.take_along_axis(x, top_blocks[..., None], axis=1).reshape(-1, k * block)  # [rows, k * block]
    pos = jax.lax.top_k(cand, k)[1]  # [rows, k]
    ids = top_blocks[jnp.arange(rows)[:, None], pos // block] * block + pos % block
    return ids.astype(jnp.int32)


def _split_top_k(flat: jax.Array, k: int, block: int, mesh: Mesh) -> jax.Array:
    """`top_k_ids` of `flat [rows, V]` with V split over `mesh`'s "tp" axis: [rows, k]. Ties: the lower id first."""

    def per_chip(x):  # [rows, V / tp]: this chip's share
        ids = _top_k(x, k, block)  # [rows, k] within the share
        vals = jnp.take_along_axis(x, ids, axis=1)  # [rows, k]
        ids = ids + jax.lax.axis_index("tp") * x.shape[1]  # vocabulary ids
        vals = jax.lax.all_gather(vals, "tp", axis=1, tiled=True)  # [rows, tp * k], the chips in order
        ids = jax.lax.all_gather(ids, "tp", axis=1, tiled=True)  # [rows, tp * k]
        best = jax.lax.top_k(vals, k)[1]  # [rows, k]
        return jnp.take_along_axis(ids, best, axis=1)

    return jax.shard_map(per_chip, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(), axis_names={"tp"},
                         check_vma=False)(flat)
