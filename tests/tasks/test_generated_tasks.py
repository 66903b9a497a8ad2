"""Tests for the generated tasks: countdown.py (its reward with exact fractions and answers only as decimal
integers, the solver against brute force, the generator, the splits, the prompt and the hub layout) and the
arithmetic task.

Run: pytest -x -q tests/tasks/test_generated_tasks.py"""

import json
import re
from fractions import Fraction

import pytest

from data import (
    DataError,
    countdown_reward,
    load_task,
    make_prompt,
    reward,
)
from tasks import arithmetic, countdown


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- countdown
@pytest.mark.parametrize(
    "text,expected",
    [
        ("<answer>(25 - 9) * 4 + 27</answer>", 0.1),  # 27 is not a given number
        ("<answer>25 * 4 - 9</answer>", 1.0),
        ("<answer> 4*25-9 </answer>", 1.0),
        ("<answer>4 × 25 − 9</answer>", 1.0),
        ("<answer>4 × 25 - 9</answer>", 1.0),
        ("<answer>25 * 4 + 9</answer>", 0.1),
        ("<answer>25 * 4</answer>", 0.1),
        ("<answer>25 * 4 - 9 + 9 - 9</answer>", 0.1),
        ("<answer>25 * 4 - 9 = 91</answer>", 0.1),
        ("<think>hm</think> 25*4-9", 0.0),
        ("<answer>25*4-9", 0.0),
        ("", 0.0),
        ("<answer>25*4-9/(9-9)</answer>", 0.1),
        ("<answer>(25*4-9)/(4-4)</answer>", 0.1),
        ("<answer>__import__('os').system('x')</answer>", 0.1),
        ("<answer>9**9**9</answer>", 0.1),
        ("<answer>-(9 - 25 * 4)</answer>", 0.1),
        ("<answer>25.0 * 4 - 9</answer>", 0.1),
        ("<answer>1+1</answer> then <answer>25 * 4 - 9</answer>", 1.0),
        ("<answer>25 * 4 - 9</answer> then <answer>1+1</answer>", 0.1),
        ("<answer>" + "(" * 500 + "25*4-9" + ")" * 500 + "</answer>", 0.1),
    ],
)
def test_countdown_reward_cases(text, expected):
    assert countdown_reward(text, {"nums": [25, 4, 9], "target": 91}) == expected


def test_countdown_reward_uses_exact_fractions():
    assert countdown_reward("<answer>8 / (3 - 8 / 3)</answer>", {"nums": [3, 3, 8, 8], "target": 24}) == 1.0
    assert countdown_reward("<answer>6 / (1 - 3 / 4)</answer>", {"nums": [1, 3, 4, 6], "target": 24}) == 1.0
    assert countdown_reward("<answer>7 / 2</answer>", {"nums": [7, 2], "target": 3}) == 0.1


def brute_force_values(nums):
    """Every value reachable with all of nums, by subsets (independent of countdown.solve)."""

    def values(ms):
        if len(ms) == 1:
            return {Fraction(ms[0])}
        out = set()
        for mask in range(1, 2 ** len(ms) - 1):
            left = [m for i, m in enumerate(ms) if mask >> i & 1]
            right = [m for i, m in enumerate(ms) if not mask >> i & 1]
            for a in values(left):
                for b in values(right):
                    out |= {a + b, a - b, a * b} | ({a / b} if b else set())
        return out

    return values(list(nums))


def test_solver_matches_brute_force():
    for nums in ([2, 3, 4], [3, 3, 8, 8], [1, 1, 1], [7, 11, 13], [5, 5, 5, 1]):
        reach = brute_force_values(nums)
        for target in range(0, 101):
            sol = countdown.solve(nums, target)
            assert (sol is not None) == (Fraction(target) in reach), (nums, target)
            if sol is not None:
                assert countdown_reward(f"<answer>{sol}</answer>", {"nums": nums, "target": target}) == 1.0


def test_generated_countdown_problems_are_valid_and_solvable():
    recs = load_task("countdown", "test", seed=0)
    assert len(recs) == countdown.SIZES["test"] == 5000
    assert {len(r["nums"]) for r in recs} == {3, 4}
    for r in recs[:1000]:  # the generator already ran `solve` on all; check 1000 independently via the reward
        assert all(1 <= n <= 99 for n in r["nums"]) and 10 <= r["target"] <= 100
        sol = countdown.solve(r["nums"], r["target"])
        assert reward(f"<think>...</think> <answer>{sol}</answer>", r) == 1.0
    assert reward("<answer>1 + 2</answer>", recs[0]) == 0.1


def test_countdown_is_deterministic_and_splits_are_disjoint():
    a, b = (
        load_task("countdown", "train", limit=300, seed=0),
        load_task("countdown", "train", limit=300, seed=0),
    )
    assert a == b
    assert load_task("countdown", "train", limit=300, seed=1) != a
    test = load_task("countdown", "test", limit=300, seed=0)
    key = lambda r: (tuple(sorted(r["nums"])), r["target"])  # noqa: E731
    assert not {key(r)[0] for r in a} & {key(r)[0] for r in test}  # not even a set of numbers is shared
    assert len({key(r) for r in a}) == 300
    assert load_task("countdown", "train", limit=50, seed=0) == a[:50]


def test_countdown_prompt_and_hub_layout(tmp_path):
    r = load_task("countdown", "test", limit=1)[0]
    p = make_prompt(r, None, "countdown")
    assert p.endswith("Assistant: Let me solve this step by step.\n<think>") and str(r["nums"]) in p
    assert make_prompt(r, None, "plain") == p and "<answer>" in make_prompt(r, None, "chat")
    with pytest.raises(ValueError, match="fewshot"):
        make_prompt(r, None, "fewshot")
    f = write_jsonl(
        tmp_path / "cd.jsonl", [{"target": 91, "nums": [25, 4, 9]}, {"target": 10, "nums": [5, 2]}]
    )
    recs = load_task("countdown-3to4", "train", path=f)
    assert [r["answer"] for r in recs] == [{"nums": [25, 4, 9], "target": 91}, {"nums": [5, 2], "target": 10}]
    with pytest.raises(DataError, match="no rows"):  # TinyZero's test rows come after the first 20,000
        load_task("countdown-3to4", "test", path=f)
    with pytest.raises(DataError, match=r"line 1: field 'nums'"):
        load_task("countdown", path=write_jsonl(tmp_path / "b.jsonl", [{"target": 3, "nums": "1 2"}]))


def test_countdown_3to4_follows_tinyzero_split(tmp_path):
    rows = [{"target": 10 + i % 90, "nums": [i % 97 + 1, 2, 3]} for i in range(25_010)]
    f = write_jsonl(tmp_path / "cd.jsonl", rows)
    train, test = load_task("countdown-3to4", "train", path=f), load_task("countdown-3to4", "test", path=f)
    assert len(train) == 20_000 and len(test) == 5_000
    assert train[-1]["target"] == rows[19_999]["target"] and test[0]["nums"] == rows[20_000]["nums"]
    assert load_task("countdown-3to4", "test", path=f, limit=3) == test[:3]


# ----------------------------------------------------------------------------- arithmetic task
def recompute(question):
    """Evaluate an arithmetic-task question by reading its sentences (independent of the generator)."""
    v = None
    for s in re.split(r"(?<=[.?])\s+", question):
        if m := re.match(r"\w+ has (\d+) ", s):
            v = int(m.group(1))
        elif m := re.search(r"(?:buys|finds|gets) (\d+) more", s):
            v += int(m.group(1))
        elif m := re.search(r"(?:gives|sells) (\d+) ", s):
            v -= int(m.group(1))
        else:
            assert s.startswith("How many"), s
    return v


def test_arithmetic_task():
    test, train = load_task("arithmetic", "test"), load_task("arithmetic", "train", limit=3000)
    assert len(test) == arithmetic.SIZES["test"]
    assert test == load_task("arithmetic", "test") and load_task("arithmetic", "test", seed=1) != test
    assert not {r["question"] for r in test} & {r["question"] for r in train}
    steps = [r["steps"] for r in test]
    assert {1, 2, 3} == set(steps) and steps.count(1) > steps.count(2) > steps.count(3)  # STEP_WEIGHTS
    for r in test + train:
        assert r["task"] == "math" and int(r["answer"]) == recompute(r["question"]) >= 0
        assert r["question"].count(".") == r["steps"] + 1
        assert reward(f"\\boxed{{{r['answer']}}}", r) == 1.0


# ----------------------------------------------------------------------------- countdown's decimal answers
COUNTDOWN = [  # (completion, answer, reward): 1 correct, 0.1 answer but wrong, 0 no answer
    ("<answer>3*4+5</answer>", {"nums": [3, 4, 5], "target": 17}, 1.0),
    ("<answer>0x3*0b100+0o5</answer>", {"nums": [3, 4, 5], "target": 17}, 0.1),
    ("<answer>3*4+5 # comment</answer>", {"nums": [3, 4, 5], "target": 17}, 0.1),
    ("<answer>3*4+5</answer>", {"nums": [3, 4, 5], "target": 17.9}, 0.1),
    ("<answer>4*5-3</answer>", {"nums": [3.7, 4, 5], "target": 17}, 0.1),
    ("<answer>1_0+7</answer>", {"nums": [10, 7], "target": 17}, 0.1),
    ("<answer>1e1+7</answer>", {"nums": [10, 7], "target": 17}, 0.1),
    ("<answer>3**2+8</answer>", {"nums": [3, 2, 8], "target": 17}, 0.1),
    ("<answer>07+10</answer>", {"nums": [7, 10], "target": 17}, 0.1),
    ("<answer>(3 × 4) + 5</answer>", {"nums": [3, 4, 5], "target": 17}, 1.0),
    ("<answer>34 / 2</answer>", {"nums": [34, 2], "target": 17}, 1.0),
    ("<answer>35 // 2</answer>", {"nums": [35, 2], "target": 17}, 0.1),
    ("no tag", {"nums": [3, 4, 5], "target": 17}, 0.0),
]


@pytest.mark.parametrize("completion, answer, want", COUNTDOWN)
def test_countdown_reward_only_decimal_integers(completion, answer, want):
    assert countdown.reward(completion, answer) == want
