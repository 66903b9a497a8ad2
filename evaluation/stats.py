"""The statistics of eval.py: pass@k of a benchmark (Tables 2-4 of the paper, `eval.py bench`), and whether
a gain is real or one credit arm beats another (`eval.py learn`).

  pass_at_k(n, c, k)                       unbiased pass@k of one problem with c of n samples correct
  problem_rows(name, recs, samples, greedy, n)   one row per problem: its samples, greedy response, verdicts
  summary(rows, n, ks, style, samples, greedy)   one benchmark's pass@k, greedy accuracy, answerless counts
  table(results, n, ks)                    the markdown table of every benchmark

Formula:
  pass@k  = mean over problems of 1 - C(n - c, k) / C(n, k)   (n samples, c correct; Chen et al. 2021),
            computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i): no huge binomials.

Correct means reward 1; a response with no final answer is wrong, and counted (eval.py departure 2).

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

Run: python -c "from evaluation import stats; print(stats.sign_test([1] * 8 + [0] * 2, [0] * 8 + [1] * 2))"
"""
import math

import numpy as np
from scipy import stats

import data
from evaluation import probes
from training.rollout import find_answer_span


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


# ----------------------------------------------------------------------------- pass@k
def pass_at_k(n, c, k):
    """Unbiased pass@k for one problem: 1 - C(n - c, k) / C(n, k), in product form."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def no_answer(text):
    """True when a response has no final answer to score."""
    return find_answer_span(text) is None


def problem_rows(name, recs, samples, greedy, n):
    """One row per record: its n sampled responses (samples.texts[i * n:(i + 1) * n]) and its greedy one,
    each correct when its reward is 1."""
    rows = []
    for i, r in enumerate(recs):
        texts = samples.texts[i * n:(i + 1) * n]
        rows.append(dict(benchmark=name, id=r["id"], correct=[data.score(r, t) >= 1.0 for t in texts],
                         greedy=data.score(r, greedy.texts[i]) >= 1.0, no_answer=sum(map(no_answer, texts)),
                         greedy_no_answer=no_answer(greedy.texts[i]), texts=texts,
                         greedy_text=greedy.texts[i]))
    return rows


def summary(rows, n, ks, style, samples, greedy):
    """One benchmark's numbers: pass@k for each k in ks (the mean over problems), greedy accuracy, and the
    responses without an answer or cut at the token budget."""
    pass_k = {f"pass@{k}": sum(pass_at_k(n, sum(x["correct"]), k) for x in rows) / len(rows) for k in ks}
    return {"n_problems": len(rows), "n": n, "style": style, **pass_k,
            "greedy": sum(x["greedy"] for x in rows) / len(rows),
            "no_answer_samples": sum(x["no_answer"] for x in rows),
            "no_answer_greedy": sum(x["greedy_no_answer"] for x in rows),
            "truncated_samples": sum(samples.truncated), "truncated_greedy": sum(greedy.truncated)}


def table(results, n, ks):
    """Markdown: a line per benchmark of {name: summary}."""
    header = ["benchmark", "problems", "n", *(f"pass@{k}" for k in ks), "greedy", "no answer (samples)",
              "no answer (greedy)"]
    return probes.markdown(header, [[b, r["n_problems"], n, *(r[f"pass@{k}"] for k in ks), r["greedy"],
                                     f"{r['no_answer_samples']}/{r['n_problems'] * n}",
                                     f"{r['no_answer_greedy']}/{r['n_problems']}"]
                                    for b, r in results.items()])
