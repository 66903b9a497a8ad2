"""answers.equivalent judges a long answer by the rule of a short one: the cheap exact comparisons
(plain numbers, the same normal form) run at every length, and the length guard stops only what would be
parsed. The normal form is checked against math-verify itself on short answers, where it still parses.

Run: python -m pytest -q tests/tasks/test_answers_long.py
"""

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import answers

TERMS = " + ".join(f"\\frac{{{i}}}{{x_{{{i}}} + {i}}}" for i in range(400))  # a long sum, spaces around +
LONG = TERMS[: TERMS.index(" + ", 5000)]  # whole terms, 5,000 characters


def respaced(s):
    """s spelled otherwise, the same in math mode: no spaces at all, \\dfrac, thin spaces, a \\quad."""
    return s.replace(" ", "").replace("\\frac", "\\dfrac").replace("+", "\\,+\\;") + "\\quad"


def test_long_answers_ignore_spaces_as_short_ones_do():
    assert answers.equivalent("xx y y", "xxyy")
    assert answers.equivalent("x" * 200 + " y" * 100, "x" * 200 + "y" * 100)  # 400 vs 300 characters
    assert answers.equivalent("x" * 300 + " y" * 150, "x" * 300 + "y" * 150)  # 600 vs 450: was False
    assert 5000 <= len(LONG) < 5100 and len(respaced(LONG)) > 5000
    assert answers.equivalent(LONG, respaced(LONG)) and answers.equivalent(respaced(LONG), LONG)
    assert answers.equivalent(f"\\left({LONG}\\right)", f"({respaced(LONG)})")


def test_long_plain_numbers_compare_as_numbers():
    digits = "1234567" * 100  # 700 digits
    grouped = f"{int(digits):,}"
    assert len(grouped) > answers.MAX_ANSWER_CHARS
    assert answers.equivalent(grouped, digits) and answers.equivalent(digits + ".0", grouped)
    assert not answers.equivalent(grouped, digits[:-1] + "8")


def test_a_long_answer_needing_symbolic_work_is_not_parsed(monkeypatch):
    """The documented verdict past MAX_ANSWER_CHARS: equal only as a plain number or in normal form; the
    parser is never reached, in this thread or in a worker thread."""
    reordered = " + ".join(reversed(LONG.split(" + ")))  # the same sum, other order
    assert answers.equivalent(LONG, reordered) is False and answers.equivalent(LONG, LONG + "+1") is False

    def parsed(*a, **k):
        raise AssertionError("a long answer reached math-verify")

    monkeypatch.setattr(answers, "math_verify_equal", parsed)
    out = []
    t = threading.Thread(
        target=lambda: out.append([answers.equivalent(LONG, x) for x in (reordered, respaced(LONG), "1")])
    )
    t.start()
    t.join()
    assert out == [[False, True, False]]
    assert [answers.equivalent(LONG, x) for x in (reordered, respaced(LONG), "1")] == [False, True, False]


NOT_THE_SAME = [  # a normal form keeps the spaces and signs that change the meaning, at every length
    ("1 2", "12"),
    ("\\pi r", "\\pir"),
    ("x - y", "x + y"),
    ("\\text{ab} c", "\\text{abc}"),
    ("1, 2", "12"),
    ("\\cdot x", "\\cdotx"),
    ("x\\\\, y", "x\\\\y"),  # \\ is a line break: in \\, the comma stays
]


@pytest.mark.parametrize("a, b", NOT_THE_SAME)
def test_normal_form_keeps_what_parts_tokens(a, b):
    assert answers.normal_form(a) != answers.normal_form(b)
    pad = " + z" * answers.MAX_ANSWER_CHARS  # the same pair, long
    assert not answers.equivalent(a + pad, b + pad)


def test_a_list_is_not_a_grouped_number_at_any_length():
    """A plain number is compared in one spelling without separators: "1,000,...,000" (10^120) is not the
    list "1, 000, ..., 000", whose normal form has the same characters; before, both scored 1."""
    number = "1" + ",000" * 40
    assert not answers.equivalent(number, "1" + ", 000" * 40)
    assert not answers.equivalent("1" + ", 000" * 200, "1" + ",000" * 200)
    assert answers.equivalent("10^{120}", number) and answers.equivalent("10^{200}", "1e200")
    assert answers.equivalent("1.5 \\times 10^{-200}", "1.5e-200")
    assert not answers.equivalent("10^{200}", "2e200")
    assert answers.written(answers.plain_number("-1.50e200")[0]) == "-1.5 \\times 10^{200}"


# ----------------------------------------------------------------------------- against math-verify
atom = st.sampled_from(["x", "y", "2", "13", "\\pi", "\\sqrt{x}", "\\frac{1}{x}", "\\frac{3}{4}", "x^{2}"])
term = st.lists(atom, min_size=1, max_size=3).map(" \\cdot ".join)
expr = st.lists(term, min_size=1, max_size=4).map(" + ".join)
SPELLINGS = [
    ("(", "\\left("),
    (")", "\\right)"),
    ("\\frac", "\\dfrac"),
    (" + ", "+"),
    ("+", "\\,+\\;"),
    (" \\cdot ", "\\cdot "),
    ("\\cdot", " \\cdot  "),
    ("\\pi", "\\pi\\!"),
    ("x", " x "),
    (")", ")\\quad"),
]


@settings(max_examples=30, deadline=None)
@given(
    e=expr.map(lambda s: f"({s})"),
    changes=st.lists(st.sampled_from(SPELLINGS), min_size=1, max_size=4, unique=True),
)
def test_one_normal_form_is_one_value_for_math_verify(e, changes):
    """Every respelling that normal_form undoes is one math-verify ignores too: both parse to expressions
    that math-verify's verify finds equal (its verdict, not ours: the reference of the short path)."""
    from math_verify import verify

    s = e
    for old, new in changes:
        s = s.replace(old, new)
    assert answers.normal_form(s) == answers.normal_form(e)
    g, p = answers.parse_boxed(e, answers.TIMEOUT_S), answers.parse_boxed(s, answers.TIMEOUT_S)
    assert g and p and verify(g, p, timeout_seconds=answers.TIMEOUT_S), (e, s)
