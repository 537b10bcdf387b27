"""tau and per-depth acceptance from acceptance histograms: the one place this arithmetic lives.

`hist[..., n]` counts the decoding steps that accepted n drafts (n = 0..Dmax, the last axis); each such step
yields n + 1 tokens, the bonus token (the base model's own next token) included. tau is the mean number of
tokens per step (per base forward in the decode phase); the acceptance rate of depth d is the share of the steps
that accepted at least d - 1 drafts that accepted at least d (the n-alpha of the EAGLE papers).
"""

from __future__ import annotations

import numpy as np


def tokens_and_steps(hist) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, steps)` summed over the last axis of `hist [..., Dmax+1]` (int64 arrays of its leading shape)."""
    h = np.asarray(hist, np.int64)  # [..., Dmax+1]
    return (h * np.arange(1, h.shape[-1] + 1)).sum(-1), h.sum(-1)


def tau(hist) -> float:
    """Tokens per step over every step counted in `hist [..., Dmax+1]`; NaN where it counts no step."""
    tokens, steps = tokens_and_steps(hist)
    tokens, steps = int(tokens.sum()), int(steps.sum())
    return tokens / steps if steps else float("nan")


def row_tau(hist) -> list[float]:
    """tau of each row of `hist [B, Dmax+1]`; 0.0 for a row with no step (it finished at its first token)."""
    tokens, steps = tokens_and_steps(hist)  # [B], [B]
    return (tokens / np.maximum(steps, 1)).tolist()


def accept_rates(hist) -> list[float]:
    """P(depth d accepted | depth d - 1 accepted) for d = 1..Dmax, over every step counted in `hist [..., Dmax+1]`
    (NaN for a depth no step reached)."""
    h = np.asarray(hist, np.int64).reshape(-1, np.shape(hist)[-1]).sum(0)  # [Dmax+1]
    reach = h[::-1].cumsum()[::-1]  # [Dmax+1] steps that accepted >= n drafts
    return [float(reach[d] / reach[d - 1]) if reach[d - 1] else float("nan") for d in range(1, len(reach))]
