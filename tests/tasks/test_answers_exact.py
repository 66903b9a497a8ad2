"""tasks/answers.py scores exactly: no silent wrong answer. Table-driven: math answers scored too loosely (a
near miss scores 1) or too strictly (an equal value 0), fractions against their exact decimals, a timeout
never cached, and guards that never fail the same string. Countdown's answers:
tests/tasks/test_generated_tasks.py."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import data
from tasks import answers

# ----------------------------------------------------------------------------- silent wrong answers
MATH = [  # (gold, \boxed{} content, reward): too loose (a near miss scores 1), too strict (an equal value 0)
    ("2024", "2024.001", 0),
    ("1000000", "1000000.9", 0),
    ("2024", "2024.0", 1),
    ("25", "025", 1),
    ("1000", "1,000", 1),
    ("1,000", "1000", 1),
    ("0.1", "0.1000000001", 0),
    ("0.5", r"\frac{1}{2}", 1),
    (r"\frac{1}{2}", "0.5", 1),
    ("0.5", "1/2", 1),
    (r"x=\frac{1}{2}", "x=0.5", 1),
    ("10^{6}", "1000000.9", 0),
    ("10^{12}", "1000000000001", 0),
    (r"\frac{1}{3}", "0.333333", 0),
    (r"\frac{3}{7}", "0.428571", 0),  # math-verify's 6 decimals: 1
    (r"2\sqrt{2}", "2.828427", 0),
    (r"\pi", "3.14159", 0),  # irrational: 1e-9 relative
    (r"\pi", "3.141592653589793", 1),
    (r"\sqrt{8}", r"2\sqrt{2}", 1),
    (r"1.5 \times 10^{-5}", "0.000015", 1),
    (r"1.5 \times 10^{-5}", "0.0000151", 0),
    (r"1 \times 10^{-12}", r"2 \times 10^{-12}", 0),
    (r"(\frac{1}{3}, 2)", "(0.333333, 2)", 0),
    (r"\$18.90", "18.9", 1),
    (r"9\%", "9", 1),
    ("3", "nan", 0),
    ("nan", "nan", 0),
    ("3", "-NaN", 0),
    ("inf", "inf", 0),
    (r"\infty", "Infinity", 0),
    (r"\frac{1}{0}", r"\frac{2}{0}", 0),
    ("0", "0/0", 0),
    (r"\infty", r"\infty", 1),
    (r"(2,\infty)", r"(2, \infty)", 1),  # the symbol \infty is mathematics
]


@pytest.mark.parametrize("gold, pred, want", MATH)
def test_math_reward_exact(gold, pred, want):
    assert data.math_reward(f"so \\boxed{{{pred}}}", gold) == want


def test_a_nonfinite_gold_scores_nothing():
    for gold in (float("nan"), float("inf"), -float("inf")):
        for pred in ("nan", "inf", "-inf", "\\infty"):
            assert data.math_reward(f"\\boxed{{{pred}}}", gold) == 0.0


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 999), d=st.sampled_from([2, 4, 5, 8, 16, 20, 25, 40, 3, 6, 7, 9, 11]))
def test_a_fraction_equals_its_exact_decimal_and_no_neighbour(n, d):
    """\\frac{n}{d} vs decimals: the exact one (d | 10^k) scores 1; one cut to 6, 10 or 12 places, or moved by
    1e-12 relative, scores 0 (math-verify's own 6-decimal rounding says 1 to most of them)."""
    q, gold = Fraction(n, d), f"\\frac{{{n}}}{{{d}}}"
    for places in (6, 10, 12):
        cut = f"{float(q):.{places}f}"
        exact = Fraction(cut) == q
        assert data.math_reward(f"\\boxed{{{cut}}}", gold) == float(exact), cut
    assert data.math_reward(f"\\boxed{{{float(q) + 1e-12 * max(1, float(q)):.15g}}}", gold) == 0.0


def test_a_timeout_is_never_cached(monkeypatch):
    import math_verify

    real, calls = math_verify.parse, []

    def slow_once(text, *a, **k):  # the first parse of the gold "times out": math-verify returns []
        calls.append(text)
        return [] if len(calls) == 1 else real(text, *a, **k)

    monkeypatch.setattr(math_verify, "parse", slow_once)
    answers.kept_parse.cache_clear()
    gold = "\\frac{3}{7}"
    assert not answers.equivalent(gold, "\\frac{6}{14}")  # the timed-out comparison scores 0 ...
    assert answers.equivalent(gold, "\\frac{6}{14}")  # ... but the next one parses again: 1


# ------------------------------------------------------------------------- guards never fail the same string
LONG = " + ".join(f"x_{{{i}}}" for i in range(100))[:600]  # ~600 characters with spaces


def test_identical_long_answers_are_equal():
    from tasks import answers

    assert len(LONG) > answers.MAX_ANSWER_CHARS and " " in LONG
    assert answers.equivalent(LONG, LONG) and answers.equivalent(LONG, LONG.replace(" ", "  "))
    assert not answers.equivalent(LONG, LONG[:-1] + "9")  # a guard never proves different ones


def test_a_stopped_check_keeps_the_same_string_equal(monkeypatch):
    """Whatever stops the check (a timeout in this thread or in the worker thread, a parser error), the same
    string stays equal and a different one is not proven equal."""
    import threading

    from tasks import answers

    s = LONG[:400]
    monkeypatch.setattr(answers, "false_equation", lambda e: (_ for _ in ()).throw(TimeoutError("slow")))
    assert answers.equivalent(s, s) and not answers.equivalent(s, s + "+1")
    monkeypatch.setattr(answers, "TIMEOUT_S", 1e-4)  # the worker thread's wait runs out
    out = []
    t = threading.Thread(
        target=lambda: out.append((answers.equivalent(s, s), answers.equivalent(s, s + "+1")))
    )
    t.start()
    t.join()
    assert out == [(True, False)]
    monkeypatch.setattr(answers, "compare", lambda g, p: 1 / 0)  # an error anywhere in the check
    assert answers.equivalent(s, s) and not answers.equivalent(s, s + "+1")
