"""Chi-square homogeneity of two samples of tokens (the sampling losslessness tests' statistic)."""

import jax
import numpy as np


def chi2_homogeneity(a_tokens: np.ndarray, s_tokens: np.ndarray, vocab: int):
    """`(chi2, dof, p-value, a counts, s counts)` for the hypothesis that both token samples `[N]` come from one
    distribution over `vocab` ids (ids seen in neither sample are dropped)."""
    a = np.bincount(a_tokens, minlength=vocab)
    s = np.bincount(s_tokens, minlength=vocab)
    keep = (a + s) > 0
    a, s = a[keep], s[keep]
    exp_a = (a + s) * a.sum() / (a.sum() + s.sum())
    exp_s = (a + s) * s.sum() / (a.sum() + s.sum())
    chi2 = ((a - exp_a) ** 2 / exp_a).sum() + ((s - exp_s) ** 2 / exp_s).sum()
    dof = keep.sum() - 1
    return chi2, dof, float(jax.scipy.special.gammaincc(dof / 2, chi2 / 2)), a, s
