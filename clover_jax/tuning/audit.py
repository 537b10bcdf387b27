"""Exactness audit: tell a rounding tie from a bug, for every greedy output of speculative decoding.

Greedy speculative decoding emits, at every position, the base model's argmax given the tokens before it. Two
programs that compute the same logits in different orders (a U-token verification and a one-token decode step,
say) round differently, so where the top two logits are within rounding of each other they may pick different
tokens, and the outputs then diverge from there on. Anything else is a bug. This module decides which:

* `replay_logits` re-runs the base model in float32 with float32 products (`precision="highest"`), teacher-forced
  over prompt + output: the logits every emitted token was chosen from, independent of either decoding loop.
* `near_tie_bound` is how far apart two logits can be and still be swapped by rounding (derivation below).
* `audit_divergence` classifies the first position where a speculative output differs from the autoregressive
  one: the two tokens, the replayed logits of both and the top-1 / top-2 margin there, in absolute terms and in
  ulps of the logit's magnitude in the compute dtype, and a verdict, "near-tie" or "unexplained".
* `replay_check` certifies one output on its own: every emitted token is the replay's argmax, or within the
  near-tie bound of it.

The bound. A logit is `z_v = h . w_v` (h: the final-normed hidden state `[D]`, w_v: token v's output row). Two
programs differ only by rounding, in two places. (1) Every reduction (attention and MLP products, norms, the
output projection) accumulates in float32, in an order that depends on the program's shapes; under the usual
random-rounding model a length-n sum carries an error of standard deviation about `u32 * sqrt(n) * |terms|_2`.
(2) Activations are stored in the compute dtype between stages, each store a relative error of at most `u`, the
dtype's unit roundoff (2^-24 float32, 2^-8 bfloat16, 2^-11 float16). With R = 2L + 1 stages (attention and MLP of
each of L layers, then the output projection), each of width about n = D, the errors of independent stages add in
quadrature and reach the logit through the terms `h_i w_v,i`, so for the difference of two logits a and b

    |delta(z_a - z_b)|  <~  k * (u32 * sqrt(R * D) + u * sqrt(R)) * (|h * w_a|_2 + |h * w_b|_2)

with k = 4 (four standard deviations). This is a model of rounding, not a worst-case bound: a divergence whose
replayed margin exceeds it is reported as unexplained, to be chased as a bug.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.models.llama import Llama, rms_norm

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
SIGMAS = 4.0  # k in the bound: standard deviations of the random-rounding model
NEAR_TIE, UNEXPLAINED = "near-tie", "unexplained"


def unit_roundoff(dtype) -> float:
    name = jnp.dtype(dtype).name
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff known for dtype {name!r} (known: {', '.join(UNIT_ROUNDOFF)})")
    return UNIT_ROUNDOFF[name]


def ulp(x: float, dtype) -> float:
    """The spacing of the compute dtype's numbers at |x| (2 u 2^floor(log2 |x|))."""
    x = abs(float(x))
    return 2.0 * unit_roundoff(dtype) * (2.0 ** math.floor(math.log2(x)) if x > 0 else 1.0)


def near_tie_bound(h: np.ndarray, w_a: np.ndarray, w_b: np.ndarray, *, dtype, num_layers: int) -> float:
    """How far apart logits `h . w_a` and `h . w_b` may be and still be swapped by rounding (module docstring)."""
    h, w_a, w_b = (np.asarray(x, np.float64) for x in (h, w_a, w_b))
    stages, width = 2 * int(num_layers) + 1, h.shape[-1]
    per_unit = UNIT_ROUNDOFF["float32"] * math.sqrt(stages * width) + unit_roundoff(dtype) * math.sqrt(stages)
    return SIGMAS * per_unit * float(np.linalg.norm(h * w_a) + np.linalg.norm(h * w_b))


REPLAY_BUCKET = 128  # replay lengths are padded up to a multiple of this: one compile per bucket, not per output


@functools.partial(jax.jit, static_argnums=0)
def _replay(graphdef, state, tokens):
    """The teacher-forced forward: tokens `[1, T]` -> (normed hidden states `[T, D]`, logits `[T, V]`), all in
    float32 with float32 products. The weights are an argument (not constants baked into the program): compiled
    once per model structure and length bucket."""
    m = nnx.merge(graphdef, state)
    with jax.default_matmul_precision("highest"):
        _, hidden, _, _ = m(tokens)
        h = rms_norm(hidden.astype(jnp.float32), m.final_norm[...].astype(jnp.float32), m.config.rms_norm_eps)
        w = m.lm_head_matrix().astype(jnp.float32)  # [D, V]
        return h[0], jnp.einsum("TD,DV->TV", h[0], w, preferred_element_type=jnp.float32)


def float32_copy(model: Llama) -> Llama:
    """The model with float32 compute (its weights as they are): the replay's reference."""
    if jnp.dtype(model.dtype) == jnp.float32:
        return model
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float32) if hasattr(x, "astype") else x, state))
    copy.dtype = jnp.float32
    copy.layers.dtype = jnp.float32
    return copy


def replay_logits(model: Llama, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(normed hidden states `[N, D]`, logits `[N, V]`) that predicted each of the `N = len(tokens)` emitted tokens,
    from one float32 teacher-forced forward over prompt + tokens."""
    seq = list(prompt) + list(tokens)
    padded = np.zeros((1, -(-len(seq) // REPLAY_BUCKET) * REPLAY_BUCKET), np.int32)  # [1, T]: causal, so the
    padded[0, :len(seq)] = seq  #                                    padding after the sequence changes nothing before it
    h, logits = _replay(*nnx.split(model), jnp.asarray(padded))
    p = len(prompt)
    return np.asarray(h[p - 1: p - 1 + len(tokens)]), np.asarray(logits[p - 1: p - 1 + len(tokens)])


def _rows(model: Llama, ids: Sequence[int]) -> np.ndarray:
    return np.asarray(model.lm_head_rows(jnp.asarray(list(ids), jnp.int32)), np.float64)  # [n, D]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first position where two greedy outputs of one prompt differ, and why."""

    position: int  # index into the generated tokens
    reference_token: int  # the autoregressive output's token there
    token: int  # the speculative output's token there
    reference_logit: float  # replayed (float32) logits of the two tokens
    logit: float
    top1: int  # the replay's argmax and runner-up there, and their margin
    top2: int
    top_margin: float
    margin: float  # |reference_logit - logit|
    margin_ulps: float  # margin in ulps of the compute dtype at the larger logit
    bound: float  # near_tie_bound of the two tokens
    verdict: str  # NEAR_TIE or UNEXPLAINED

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the token lists differ (a shorter one ends there); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def audit_divergence(model: Llama, prompt: Sequence[int], reference: Sequence[int], output: Sequence[int], *,
                     dtype=None, replay_model: Llama | None = None) -> Divergence | None:
    """The first divergence of `output` from `reference` (greedy outputs of one prompt), classified; None when they
    are equal. `dtype`: the compute dtype the outputs were decoded in (default: the model's); the replay runs in
    float32 (`replay_model`, default `float32_copy(model)`)."""
    i = first_difference(reference, output)
    if i is None:
        return None
    dtype = jnp.dtype(dtype or model.dtype)
    ref = replay_model or float32_copy(model)
    if i >= min(len(reference), len(output)):  # one stopped (EOS, length) where the other went on
        a = reference[i] if i < len(reference) else output[i]
        return Divergence(i, int(a), int(a), 0.0, 0.0, int(a), int(a), 0.0, 0.0, 0.0, 0.0, UNEXPLAINED)
    h, logits = replay_logits(ref, prompt, list(reference[:i + 1]))
    h, z = h[i], logits[i]
    a, b = int(reference[i]), int(output[i])
    top2 = np.argsort(z)[-2:][::-1]
    wa, wb = _rows(ref, [a, b])
    bound = near_tie_bound(h, wa, wb, dtype=dtype, num_layers=ref.config.num_hidden_layers)
    margin = abs(float(z[a]) - float(z[b]))
    return Divergence(position=i, reference_token=a, token=b, reference_logit=float(z[a]), logit=float(z[b]),
                      top1=int(top2[0]), top2=int(top2[1]), top_margin=float(z[top2[0]] - z[top2[1]]),
                      margin=margin, margin_ulps=margin / ulp(max(abs(z[a]), abs(z[b])), dtype), bound=bound,
                      verdict=NEAR_TIE if margin <= bound else UNEXPLAINED)


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """`replay_check` of one output: the positions whose token is not the replay's argmax, by verdict."""

    tokens: int  # emitted tokens checked
    near_ties: list[int]  # positions where another token led, within the near-tie bound
    violations: list[dict[str, Any]]  # positions where another token led by more: {position, token, argmax, margin,
    #                                   bound}

    @property
    def ok(self) -> bool:
        return not self.violations


def replay_check(model: Llama, prompt: Sequence[int], output: Sequence[int], *, dtype=None,
                 replay_model: Llama | None = None) -> ReplayResult:
    """Certifies a greedy output on its own: each emitted token is the float32 replay's argmax of its prefix, up to
    a near-tie. A token after an end-of-sequence token is not checked (the output ends there)."""
    dtype = jnp.dtype(dtype or model.dtype)
    ref = replay_model or float32_copy(model)
    if not len(output):
        return ReplayResult(0, [], [])
    h, z = replay_logits(ref, prompt, list(output))
    best = z.argmax(axis=-1)  # [N]
    near, bad = [], []
    for i in np.flatnonzero(best != np.asarray(output)):
        a, b = int(best[i]), int(output[i])
        wa, wb = _rows(ref, [a, b])
        bound = near_tie_bound(h[i], wa, wb, dtype=dtype, num_layers=ref.config.num_hidden_layers)
        margin = float(z[i, a] - z[i, b])
        if margin <= bound:
            near.append(int(i))
        else:
            bad.append({"position": int(i), "token": b, "argmax": a, "margin": margin, "bound": bound})
    return ReplayResult(len(output), near, bad)


__all__ = ["Divergence", "NEAR_TIE", "ReplayResult", "UNEXPLAINED", "audit_divergence", "first_difference",
           "float32_copy", "near_tie_bound", "replay_check", "replay_logits", "ulp", "unit_roundoff"]
