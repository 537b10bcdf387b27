"""tau and per-depth acceptance from histograms (`clover_jax.decoding.acceptance_stats`), against counts made by
hand from lists of accepted lengths."""

import math

import numpy as np

from clover_jax.decoding import acceptance_stats


def _hist(accepted, dmax):
    """Histogram [Dmax+1] of a list of per-step accepted-draft counts."""
    return np.bincount(accepted, minlength=dmax + 1)


def test_tau_rates_and_rows_from_accepted_lengths():
    rows = [[0, 3, 1, 1, 2], [3, 3], []]  # accepted drafts per step, three rows (the last took no step)
    hist = np.stack([_hist(r, 3) for r in rows])  # [B, Dmax+1]
    steps = sum(len(r) for r in rows)
    tokens = sum(n + 1 for r in rows for n in r)  # each step adds its accepted drafts and the bonus token
    assert acceptance_stats.tau(hist) == tokens / steps == 20 / 7
    assert acceptance_stats.row_tau(hist) == [12 / 5, 4.0, 0.0]
    t, s = acceptance_stats.tokens_and_steps(hist)
    assert t.tolist() == [12, 8, 0] and s.tolist() == [5, 2, 0]
    # depth d accepted given d - 1 accepted: steps reaching >= 1, 2, 3 drafts over those reaching the depth before
    flat = [n for r in rows for n in r]
    reach = [sum(n >= d for n in flat) for d in range(4)]  # [7, 6, 4, 3]
    assert acceptance_stats.accept_rates(hist) == [reach[d] / reach[d - 1] for d in (1, 2, 3)]
    assert acceptance_stats.accept_rates(hist.sum(0)) == acceptance_stats.accept_rates(hist)  # [Dmax+1] alone


def test_no_steps_gives_nan_not_an_error():
    empty = np.zeros((2, 4), np.int64)
    assert math.isnan(acceptance_stats.tau(empty))
    assert acceptance_stats.row_tau(empty) == [0.0, 0.0]
    assert all(math.isnan(x) for x in acceptance_stats.accept_rates(empty))
    only_rejections = _hist([0, 0, 0], 2)
    assert acceptance_stats.tau(only_rejections) == 1.0
    assert acceptance_stats.accept_rates(only_rejections)[0] == 0.0 and math.isnan(
        acceptance_stats.accept_rates(only_rejections)[1])
