"""The statistics of eval.py: pass@k of a benchmark (Tables 2-4 of the paper, `eval.py bench`), and whether
a gain is real or one credit arm beats another (`eval.py learn`).

  pass_at_k(n, c, k)                       unbiased pass@k of one problem with c of n samples correct
  problem_rows(name, recs, samples, greedy, n)   one row per problem: its samples, greedy response, verdicts
  summary(rows, n, ks, style, samples, greedy)   one benchmark's pass@k, greedy accuracy, answerless counts
  table(results, n, ks)                    the markdown table of every benchmark

Formula:
  pass@k  = mean over problems of 1 - C(n - c, k) / C(n, k)   (n samples, c correct; Chen et al. 2021),
            computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i): no huge binomials.

Correct means reward 1; a response with no final answer is wrong, and counted (bench.py's departure 1).

Is a gain real, and does one credit arm beat another? The replicated unit is the training run (the seed):
the questions of one run share its weights, so every interval and p-value of a comparison is over seeds
("Deep RL at the Edge of the Statistical Precipice", Agarwal et al., NeurIPS 2021; "A Sober Look at Progress
in Language Model Reasoning", Hochlehnert et al., 2025):
  t_interval        mean +- t_{0.975, n-1} sd / sqrt(n) over n seeds (scipy.stats.t); none for n = 1
  seed_test         paired by seed, d_s = a_s - b_s: the mean, its 95% t interval and p (scipy ttest_rel),
                    and the exact sign-flip test over the 2^S sign patterns (scipy.stats.permutation_test);
                    its smallest attainable two-sided p is 2 / 2^S (0.125 at S = 4)
  two_level         a two-level bootstrap of the mean paired difference: resample seeds, then questions
                    within each drawn seed (percentile 95% interval); it widens when seeds disagree
  seeds_needed      seeds per arm for a t interval of half-width h, and for 80% power at alpha = 0.05 to
                    detect a difference delta (the noncentral t, scipy.stats.nct), given the seed-level sd
  variance_parts    the seed-level variance of an accuracy split into the binomial noise of Q questions,
                    mean p (1 - p) / Q, and the rest: training (the run itself)
  fmt_p             a resampled p of 0 is printed "< 1/B", not 0
Conditional on the trained models (not a test of the method: questions of one run are not independent runs),
over (seed, question) pairs:
  paired_bootstrap  resample questions (one draw shared by every seed): Delta, its 95% CI, p
  sign_test         the exact two-sided sign test (McNemar's exact test) over the paired outcomes

Run: python -c "from evaluation import stats; print(stats.sign_test([1] * 8 + [0] * 2, [0] * 8 + [1] * 2))"
"""

import math

import numpy as np
from scipy import stats as sps

import data
from evaluation import probes
from tasks.answers import find_answer_span


def t_interval(xs):
    """(mean, half-width of the 95% t interval); the half-width is None for fewer than two values."""
    xs = np.asarray(xs, dtype=float)
    if len(xs) < 2:
        return float(xs.mean()), None
    return float(xs.mean()), float(sps.t.ppf(0.975, len(xs) - 1) * xs.std(ddof=1) / math.sqrt(len(xs)))


def seed_test(a, b):
    """a, b: one number per seed (paired). {diff, ci95, p_t, p_signflip, p_signflip_min, seeds}: the mean
    difference with its t interval and ttest_rel p, and the exact sign-flip test over seeds."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d, S = a - b, len(a)
    out = {
        "seeds": S,
        "diff": float(d.mean()),
        "ci95": None,
        "p_t": None,
        "p_signflip": None,
        "p_signflip_min": min(1.0, 2 / 2**S),
    }
    if S < 2:
        return out
    if d.std(ddof=1) > 0:
        t = sps.ttest_rel(a, b)
        out["ci95"], out["p_t"] = [float(x) for x in t.confidence_interval(0.95)], float(t.pvalue)
    else:  # every seed the same difference: no spread
        out["ci95"] = [float(d.mean())] * 2
    flip = sps.permutation_test(
        (d,), np.mean, permutation_type="samples", n_resamples=np.inf, alternative="two-sided"
    )  # exact: all 2^S sign patterns
    out["p_signflip"] = float(flip.pvalue)
    return out


def two_level(a, b, n_boot=10_000, seed=0):
    """a, b: (S, Q) outcomes of two arms, paired by seed and question. (Delta, low, high): the mean paired
    difference and the 2.5/97.5 percentiles of B two-level resamples (seeds with replacement, then questions
    with replacement within each drawn seed)."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)  # (S, Q)
    S, Q = d.shape
    rng, boot = np.random.default_rng(seed), []
    for n in [1000] * (n_boot // 1000) + [n_boot % 1000]:  # chunks: (1000, S, Q) ints
        s_idx = rng.integers(0, S, size=(n, S))  # (n, S) seeds drawn
        q_idx = rng.integers(0, Q, size=(n, S, Q))  # (n, S, Q) questions drawn
        boot.append(d[s_idx[..., None], q_idx].mean(axis=(1, 2)))  # (n,)
    boot = np.concatenate(boot)  # (B,)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(d.mean()), float(lo), float(hi)


def seeds_needed(sd, half_width=0.05, delta=None, power=0.8, alpha=0.05, cap=10_000):
    """Seeds per arm (paired differences of seed-level sd) for a 95% t interval of half-width <= half_width,
    or, given delta, for `power` to detect delta two-sided at `alpha` (noncentral t). None past `cap`."""
    for n in range(2, cap + 1):
        t = sps.t.ppf(1 - alpha / 2, n - 1)
        if delta is None and t * sd / math.sqrt(n) <= half_width:
            return n
        if delta is not None:
            nc = abs(delta) * math.sqrt(n) / sd
            if sps.nct.sf(t, n - 1, nc) + sps.nct.cdf(-t, n - 1, nc) >= power:
                return n
    return None


def variance_parts(acc, n_questions):
    """acc: one accuracy per seed over n_questions questions. {sd, binomial_sd, training_sd}: the seeds' sd;
    the sd that Q-question binomial noise alone gives, sqrt(mean p (1 - p) / Q); the remainder (training)."""
    acc = np.asarray(acc, dtype=float)
    var = float(acc.var(ddof=1)) if len(acc) > 1 else float("nan")
    binom = float(np.mean(acc * (1 - acc)) / n_questions)
    return {
        "sd": math.sqrt(var),
        "binomial_sd": math.sqrt(binom),
        "training_sd": math.sqrt(max(0.0, var - binom)),
    }


def fmt_p(p, n_boot=None):
    """A p-value for a table: '< 1/B' for a resampled 0, 'n/a' for None, else 3 significant digits."""
    if p is None:
        return "n/a"
    return f"< 1/{n_boot}" if p == 0 and n_boot else f"{p:.3g}"


def paired_bootstrap(a, b, n_boot=10_000, seed=0):
    """(Delta, CI low, CI high, two-sided p) for a - b; a, b: (S, Q) outcomes, resampled over questions."""
    diff = np.asarray(a) - np.asarray(b)
    d = diff.reshape(-1, diff.shape[-1]).sum(0)  # (Q,) S d_q: exact for 0/1 outcomes
    n = diff.size  # S Q
    idx = np.random.default_rng(seed).integers(0, d.shape[0], size=(n_boot, d.shape[0]))  # (B, Q)
    tot = d[idx].sum(1)  # (B,) S Q Delta*: its sign is exact
    lo, hi = np.percentile(tot / n, [2.5, 97.5])
    p = min(1.0, 2 * min(float((tot <= 0).mean()), float((tot >= 0).mean())))
    return float(d.sum() / n), float(lo), float(hi), p


def sign_test(a, b):
    """(b, c, p): the pairs where only a is right, where only b is right, the exact two-sided p-value."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    wins, losses = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n = wins + losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return wins, losses, 1.0 if n == 0 else min(1.0, 2 * tail / 2**n)


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
        texts = samples.texts[i * n : (i + 1) * n]
        rows.append(
            dict(
                benchmark=name,
                id=r["id"],
                correct=[data.reward(t, r) >= 1.0 for t in texts],
                greedy=data.reward(greedy.texts[i], r) >= 1.0,
                no_answer=sum(map(no_answer, texts)),
                greedy_no_answer=no_answer(greedy.texts[i]),
                texts=texts,
                greedy_text=greedy.texts[i],
            )
        )
    return rows


def summary(rows, n, ks, style, samples, greedy):
    """One benchmark's numbers: pass@k for each k in ks (the mean over problems), greedy accuracy, and the
    responses without an answer or cut at the token budget."""
    pass_k = {f"pass@{k}": sum(pass_at_k(n, sum(x["correct"]), k) for x in rows) / len(rows) for k in ks}
    return {
        "n_problems": len(rows),
        "n": n,
        "style": style,
        **pass_k,
        "greedy": sum(x["greedy"] for x in rows) / len(rows),
        "no_answer_samples": sum(x["no_answer"] for x in rows),
        "no_answer_greedy": sum(x["greedy_no_answer"] for x in rows),
        "truncated_samples": sum(samples.truncated),
        "truncated_greedy": sum(greedy.truncated),
    }


def table(results, n, ks):
    """Markdown: a line per benchmark of {name: summary}."""
    header = [
        "benchmark",
        "problems",
        "n",
        *(f"pass@{k}" for k in ks),
        "greedy",
        "no answer (samples)",
        "no answer (greedy)",
    ]
    return probes.markdown(
        header,
        [
            [
                b,
                r["n_problems"],
                n,
                *(r[f"pass@{k}"] for k in ks),
                r["greedy"],
                f"{r['no_answer_samples']}/{r['n_problems'] * n}",
                f"{r['no_answer_greedy']}/{r['n_problems']}",
            ]
            for b, r in results.items()
        ],
    )
