"""pass@k and greedy accuracy per benchmark: the numbers of the paper's Tables 2-4 (`eval.py bench`).

  pass_at_k(n, c, k)                       unbiased pass@k of one problem with c of n samples correct
  problem_rows(name, recs, samples, greedy, n)   one row per problem: its samples, greedy response, verdicts
  summary(rows, n, ks, style, samples, greedy)   one benchmark's pass@k, greedy accuracy, answerless counts
  table(results, n, ks)                    the markdown table of every benchmark

Formula:
  pass@k  = mean over problems of 1 - C(n - c, k) / C(n, k)   (n samples, c correct; Chen et al. 2021),
            computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i): no huge binomials.

Correct means reward 1; a response with no final answer is wrong, and counted (eval.py departure 2).

Run: python eval.py bench --benchmarks gsm8k math500 --n-problems 50 --n 4
"""
import math

import data
import probes
from regions import find_answer_span


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
