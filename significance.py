"""The statistics of the learning experiment (learn.py): is a gain real, and is one arm better than another?

  t_interval        mean +- t_{0.975, n-1} sd / sqrt(n): the 95% t interval of a mean over n seeds
                    (sd with n - 1; no interval for n = 1)
  paired_bootstrap  two arms' 0/1 outcomes x (S seeds, Q questions), paired by seed and question:
                    d_q = mean_s (a_sq - b_sq), Delta = mean_q d_q. B resamples of the Q questions with
                    replacement (one draw shared by every seed) give Delta*_1..B; the 95% CI is their 2.5 and
                    97.5 percentiles, p = min(1, 2 min(P(Delta* <= 0), P(Delta* >= 0))) (percentile method)
  sign_test         the exact two-sided sign test (McNemar's exact test) over the paired outcomes:
                    b = a right and b wrong, c = the reverse,
                    p = min(1, 2 sum_{i <= min(b, c)} C(b + c, i) / 2^(b + c))

Departure: the sign test counts every (seed, question) pair as an independent pair (the bootstrap
resamples questions only, keeping a question's seeds together).

Run: python -c "import significance as s; print(s.sign_test([1] * 8 + [0] * 2, [0] * 8 + [1] * 2))"
"""
import math

import numpy as np
from scipy import stats


def t_interval(xs):
    """(mean, half-width of the 95% t interval); the half-width is None for fewer than two values."""
    n, m = len(xs), sum(xs) / len(xs)
    if n < 2:
        return m, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)


def paired_bootstrap(a, b, n_boot=10_000, seed=0):
    """(Delta, CI low, CI high, two-sided p) for a - b; a, b: (S, Q) outcomes, resampled over questions."""
    diff = np.asarray(a) - np.asarray(b)
    d = diff.reshape(-1, diff.shape[-1]).sum(0)                     # (Q,) S d_q: exact for 0/1 outcomes
    n = diff.size                                                   # S Q
    idx = np.random.default_rng(seed).integers(0, d.shape[0], size=(n_boot, d.shape[0]))    # (B, Q)
    tot = d[idx].sum(1)                                             # (B,) S Q Delta*: its sign is exact
    lo, hi = np.percentile(tot / n, [2.5, 97.5])
    p = min(1.0, 2 * min(float((tot <= 0).mean()), float((tot >= 0).mean())))
    return float(d.sum() / n), float(lo), float(hi), p


def sign_test(a, b):
    """(b, c, p): the pairs where only a is right, where only b is right, the exact two-sided p-value."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    wins, losses = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n = wins + losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return wins, losses, 1.0 if n == 0 else min(1.0, 2 * tail / 2 ** n)
