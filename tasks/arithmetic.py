"""The arithmetic task: generated 1-3 step word problems, offline, the default task of the embedded
SmolLM2-135M-Instruct (data.TASKS["arithmetic"]; not a task of the paper).

  rows(split, seed, limit) -> rows {"question", "answer", "steps"}: SIZES[split] of them unless `limit`
  problem(rng)                 -> (question, answer, steps): a start count, then 1-3 steps that add to it
                                  or take away from it

Measured with the few-shot prompt at T = 1.0, top-k 100, 128 new tokens (100 test problems x 4 samples):
SmolLM2-135M-Instruct is 14.8% right overall (1 step 19.8%, 2 steps 7.5%, 3 steps 0%); 41 of 100 problems
had both right and wrong samples, i.e. GRPO signal. Hence STEP_WEIGHTS: mostly one-step problems.
The names and items never include prompts.EXTRA_EXEMPLAR's (Mia, stickers), so no problem repeats it.

Run: python data.py --task arithmetic --split test --limit 3
"""

import random
import zlib

NAMES = [
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ben", "he"),
    ("Lily", "she"),
    ("Sam", "he"),
    ("Emma", "she"),
    ("Jack", "he"),
    ("Zoe", "she"),
    ("Leo", "he"),
    ("Nora", "she"),
    ("Max", "he"),
    ("Ella", "she"),
]
ITEMS = ["apples", "marbles", "pencils", "cookies", "books", "shells", "cards", "balloons", "coins", "eggs"]
SIZES = {"train": 10_000, "test": 1_000}
STEP_WEIGHTS = (0.6, 0.25, 0.15)  # P(1, 2, 3 steps): SmolLM2 solves ~20% of 1-step, few longer problems


def problem(rng):
    """One word problem: a start count in 2..9, then 1-3 steps that each add 2..6 or take away 2 or more.
    Returns (question, answer, steps)."""
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    steps, v = rng.choices((1, 2, 3), STEP_WEIGHTS)[0], rng.randint(2, 9)
    text = [f"{name} has {v} {item}."]
    for s in range(steps):
        who = he.capitalize() if s == 0 else f"Then {he}"
        if v > 2 and rng.random() < 0.5:
            n = rng.randint(2, v - 1)  # 2 or more, so that the item's plural is right
            v -= n
            text.append(f"{who} {rng.choice(['gives', 'sells'])} {n} {item} to a friend.")
        else:
            n = rng.randint(2, 6)
            v += n
            text.append(f"{who} {rng.choice(['buys', 'finds', 'gets'])} {n} more {item}.")
    text.append(f"How many {item} does {name} have now?")
    return " ".join(text), str(v), steps


def rows(split, seed, limit):
    """Deterministic for a seed; train and test are disjoint (a question's split is a hash of its text)."""
    n, rng, seen, out = limit or SIZES[split], random.Random(f"arithmetic-{seed}"), set(), []
    while len(out) < n:
        q, a, steps = problem(rng)
        if q in seen or ("test" if zlib.crc32(q.encode()) % 10 == 0 else "train") != split:
            continue
        seen.add(q)
        out.append({"question": q, "answer": a, "steps": steps})
    return out
