"""tasks/answers.py, the math reward: hand cases, nested braces, hostile answers that stay wrong and fast in
any thread, and a property that no reward ever raises; wrong answers that scored 1.0 and an exponent of any
size (hardening findings 5-7); no input is slow (linear patterns, timed on inputs that took seconds to
minutes). Exact scores: tests/tasks/test_answers_exact.py; long answers: tests/tasks/test_answers_long.py.

Run: pytest -x -q tests/tasks/test_answers.py"""

import threading
import time

import pytest
from conftest import timed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import data
from data import (
    choice_reward,
    countdown_reward,
    math_reward,
    reward,
)
from tasks import answers
from tasks.answers import find_answer_span


# ----------------------------------------------------------------------------- math reward
@pytest.mark.parametrize(
    "text,gold,expected",
    [
        ("\\boxed{25}", "025", 1.0),
        ("\\boxed{025}", 25, 1.0),
        ("\\boxed{25.0}", "25", 1.0),
        ("\\boxed{25}", 25.0, 1.0),
        ("\\boxed{26}", "025", 0.0),
        ("\\boxed{2,125}", "2125", 1.0),
        ("\\boxed{1450001}", "1450000", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{14}{3}}", "4\\frac{2}{3}", 1.0),
        ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
        ("first \\boxed{4} then \\boxed{3}", "4", 0.0),
        ("\\boxed{4} and an unclosed \\boxed{3", "4", 1.0),
        ("\\boxed{\\boxed{4}}", "4", 1.0),
        ("the answer is 4", "4", 0.0),
        ("\\boxed{}", "4", 0.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{\\$18}", "18", 1.0),
        ("\\boxed{4.5 \\times 10^{33}}", "4.5e33", 1.0),
    ],
)
def test_math_reward_cases(text, gold, expected):
    assert math_reward(text, gold) == expected


def test_last_boxed_balances_nested_braces():
    assert data.last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert data.last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert data.last_boxed("} \\boxed{1} }} \\boxed{") == "1"
    assert data.last_boxed("no box") is None


HOSTILE = [
    "9**9**9",
    "9^{9^{9}}",
    "9^{9^{9^{9}}}",
    "(10^{10})!",
    "9!!!!!!",
    "\\prod_{n=1}^{10^{9}} n",
    "(x+1)^{1000000000}",
    "1e999999999999",
    "__import__('os').system('echo hi')",
    "{" * 3000,
]


@pytest.mark.parametrize("in_thread", [False, True])
def test_hostile_answers_are_wrong_and_fast_in_any_thread(in_thread):
    out = []

    def run():
        for h in HOSTILE:
            t = time.perf_counter()
            out.append((math_reward(f"\\boxed{{{h}}}", "25"), time.perf_counter() - t))
        out.append((math_reward("\\boxed{\\frac{50}{2}}", "25"), 0.0))

    if in_thread:
        th = threading.Thread(target=run)
        th.start()
        th.join(60)
    else:
        run()
    assert [r for r, _ in out] == [0.0] * len(HOSTILE) + [1.0]
    assert max(s for _, s in out) < 4 * answers.TIMEOUT_S + 1


FRAGMENTS = [
    "\\boxed{",
    "}",
    "{",
    "\\frac{",
    "^{",
    "9**9**9",
    "9^{9^{9}}",
    "__import__('os')",
    "<answer>",
    "</answer>",
    "(",
    ")",
    "!",
    "1e9999",
    "0",
    "25",
    " ",
    "\\",
    "$",
    "\\left(",
    "\\sqrt{",
    ",",
    "/",
    "-",
    "×",
    "÷",
    "\x00",
    "\x0c",
]


messy = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=30).map("".join)


golds = st.sampled_from(["25", "025", "\\frac{1}{2}", "x=5", "1, 2", "A", 25, 25.0, "B"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=300), messy), gold=golds)
def test_rewards_never_raise(text, gold):
    assert math_reward(text, gold) in (0.0, 1.0)
    assert choice_reward(text, gold) in (0.0, 1.0)
    assert countdown_reward(text, {"nums": [25, 4, 9], "target": 91}) in (0.0, 0.1, 1.0)
    assert countdown_reward(text, "malformed answer") in (0.0, 0.1)
    for task in ("math", "choice"):
        assert reward(text, {"task": task, "answer": gold}) in (0.0, 1.0)


def test_rewards_of_non_strings_are_zero_and_reward_rejects_unknown_tasks():
    assert math_reward(None, "1") == 0.0 and choice_reward(b"\\boxed{A}", "A") == 0.0
    assert countdown_reward(None, {"nums": [1], "target": 1}) == 0.0
    with pytest.raises(ValueError, match="task 'poetry'"):
        reward("\\boxed{1}", {"id": "x", "task": "poetry", "answer": "1"})


# ----------------------------------------------------------------------------- 5-7. rewards
MATH = [  # (gold, \boxed{} content, reward): wrong answers a probe found, then neighbours that stay right
    ("1, 100", "1100", 0),
    ("12", "1 2", 0),
    ("6", "5 = 6", 0),
    (r"\frac{0}{0}", r"\frac{0}{0}", 0),
    ("6", "y = 5 = 6", 0),
    ("1", "1e99999999999999999999", 0),
    ("1e99999999999999999999", "1", 0),
    ("0", r"\frac{1}{0}", 0),
    ("1100", "1 100", 0),
    ("1, 100", "1, 100", 1),
    ("1, 100", "100, 1", 1),
    ("1100", "1,100", 1),
    ("1000", r"1\,000", 1),
    ("1000", "1{,}000", 1),
    ("6", "x = 6", 1),
    ("5", "2+3=5", 1),
    ("12", " 12 ", 1),
    ("-5", "- 5", 1),
    (r"x=\frac{1}{2}", "x = 0.5", 1),
    ("\\$5", "5", 1),
]


@pytest.mark.parametrize("gold, pred, want", MATH)
def test_math_reward(gold, pred, want):
    assert data.math_reward(f"so \\boxed{{{pred}}}", gold) == want


@settings(max_examples=40, deadline=None)
@given(
    exp=st.integers(-(10**30), 10**30),
    mant=st.sampled_from(["1", "-2.5", "0", ".5"]),
    gold=st.sampled_from(["1", "0", "1e5", r"\frac{1}{2}"]),
)
def test_equivalent_never_raises_on_any_exponent(exp, mant, gold):
    assert answers.equivalent(gold, f"{mant}e{exp}") in (True, False)
    assert answers.equivalent(f"{mant}e{exp}", gold) in (True, False)


# ----------------------------------------------------------------------------- 8. slow input
SLOW = [  # inputs that took seconds to minutes before (quadratic patterns): each well under a second now
    ("decimal digits", lambda: answers.equivalent("1", "1" * 20_000 + "x")),
    ("digits, gold side", lambda: answers.equivalent("1" * 20_000 + "x", "1")),
    ("spaces around a word", lambda: answers.not_finite(" " * 60_000 + "x")),
    ("spaces, through equivalent", lambda: answers.equivalent(" " * 60_000 + "x", "1")),
    (
        "DAPO wrapper",
        lambda: data.dapo_row(
            {
                "prompt": "Solve the following math problem" + "\n\n" * 30_000,
                "reward_model": {"ground_truth": "1"},
            }
        ),
    ),
    ("open boxes", lambda: find_answer_span("\\boxed{" * 8_000)),
    ("open tags", lambda: find_answer_span("<answer>" * 8_000)),
    ("choice", lambda: data.choice_reward("\\boxed{B" + " " * 60_000 + "x}", "B")),
]


@pytest.mark.parametrize("name, work", SLOW, ids=[s[0] for s in SLOW])
def test_no_input_is_slow(name, work):
    assert timed(work) < 1.0
