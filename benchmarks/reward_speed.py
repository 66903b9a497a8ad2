"""Benchmark: the time the rewards take to grade 1,000 completions on the CPU (budget: under 10 s).

The completions are built from real ground truths, so that the slow path (math-verify on LaTeX answers) is
exercised as often as in training: MATH500 and GSM8K from the offline copies (../shared/data), falling back
to the generated arithmetic task where they are absent. Each completion is ~1,500 characters of reasoning
(with braces and a decoy \\boxed{} early on) and then one of:
  30% the ground truth as written, 20% the same value written differently (25 -> 25.0, \\frac{a}{b} -> a/b),
  35% another problem's answer (a wrong answer, often symbolic), 15% no final \\boxed{} (a truncated answer).
The parse caches are cleared and math-verify is imported before the clock starts, so the time is that of
1,000 cold gradings. Countdown and multiple-choice completions are timed the same way for reference.

Run: python benchmarks/reward_speed.py [--n 1000] [--budget 10] [--seed 0]
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
from tasks import answers, countdown  # noqa: E402

ap = argparse.ArgumentParser(
    prog="reward_speed.py",
    description=__doc__.splitlines()[0],
    allow_abbrev=False,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
)
ap.add_argument("--n", type=int, default=1000, help="completions per reward")
ap.add_argument("--budget", type=float, default=10.0, help="seconds allowed for n math completions")
ap.add_argument("--seed", type=int, default=0, help="which completions are drawn")
args = ap.parse_args()
if args.n < 1 or not args.budget > 0:
    ap.error("--n must be >= 1 and --budget > 0")
rng = random.Random(args.seed)


def records():
    try:
        return data.load_task("math500") + data.load_task("gsm8k")[:500]
    except data.DataError as e:
        print(f"offline copies not found ({e}); using the arithmetic task")
        return data.load_task("arithmetic")


def reasoning():
    words = [
        "Let",
        "x",
        "be",
        "the",
        "number",
        "so",
        "$x^{2} + \\frac{1}{2}$",
        "=",
        "then",
        "we",
        "get",
        "\\left(a + b\\right)",
        "Step",
        "1.",
        "{",
        "}",
        "therefore",
        "$\\sqrt{3}$",
        "is",
        "not",
        "\\boxed{7}",
    ]
    text = " ".join(rng.choice(words) for _ in range(300))
    return text[:1500]


def rewrite(gold):
    """The same value in another notation where one is easy to write; else the ground truth itself."""
    n = answers.plain_number(gold)
    if n is not None:
        return f"{n[0]}.0" if n[1] else f"{n[0]}0"
    if gold.startswith("\\frac{") and gold.count("{") == 2:
        a, b = gold[len("\\frac{") : -1].split("}{")
        return f"{a}/{b}"
    return gold


recs = records()
math_cases = []
for _ in range(args.n):
    r, u = rng.choice(recs), rng.random()
    if u < 0.30:
        tail = f"The final answer is \\boxed{{{r['answer']}}}."
    elif u < 0.50:
        tail = f"The final answer is \\boxed{{{rewrite(r['answer'])}}}."
    elif u < 0.85:
        tail = f"The final answer is \\boxed{{{rng.choice(recs)['answer']}}}."
    else:
        tail = "and so the answer is"
    math_cases.append((r, reasoning() + " " + tail))
cd_recs = data.load_task("countdown", "test", limit=200)
cd_cases = []
for r in (rng.choice(cd_recs) for _ in range(args.n)):
    text = reasoning()  # the rng draws in the same order as before
    expr = countdown.solve(r["nums"], r["target"]) if rng.random() < 0.5 else "1+2"  # right, or wrong
    cd_cases.append((r, text + f"<answer>{expr}</answer>"))
ch_cases = [
    ({"task": "choice", "answer": "B"}, reasoning() + f"\\boxed{{{rng.choice('ABCD')}}}")
    for _ in range(args.n)
]

data.math_reward("\\boxed{\\frac{1}{3}}", "x^2")  # import math-verify and sympy before the clock starts
answers.kept_parse.cache_clear()  # start with an empty parse cache
results = {}
for name, cases in (("math", math_cases), ("countdown", cd_cases), ("choice", ch_cases)):
    t = time.perf_counter()
    rewards = [data.reward(c, r) for r, c in cases]
    results[name] = (time.perf_counter() - t, sum(rewards) / len(rewards))
for name, (secs, mean) in results.items():
    print(
        f"{name:9s}: {len(math_cases)} completions in {secs:6.2f} s ({1000 * secs / args.n:6.2f} ms each), "
        f"mean reward {mean:.3f}"
    )
ok = results["math"][0] < args.budget
print(f"math grading {'within' if ok else 'OVER'} the {args.budget:.0f} s budget for {args.n} completions")
sys.exit(0 if ok else 1)
