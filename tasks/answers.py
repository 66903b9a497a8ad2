"""Are two math answers equal? The checker behind data.math_reward: exact decimals for plain numbers,
exact rationals or a 1e-9 relative tolerance for other numbers, math-verify for everything else, under a
timeout and a size guard, never raising and never hanging.

  equivalent(gold, pred) -> bool   "025" == 25 == 25.0 == "2.5e1", "1,000" == 1000; plain numbers compare
                                   exactly as decimals: 2024 != 2024.001, 1000000 != 1000000.9;
                                   "\\frac{1}{2}" == "0.5" == "1/2" through math-verify's LaTeX parser.
  boxed_span(text) -> (start, end)  the content of the last closed, non-empty \\boxed{} (one linear pass)
  last_boxed(text) -> str|None     that content; answer_text(a): a ground truth as a string (27.0 -> "27")
  find_answer_span(text, pattern)  (start, end) of the final answer, eq. 2's sink: the last \\boxed{}, else
                                   <answer>...</answer>, or the last match of grpo.py's --answer-pattern
  pattern_problem(pattern)         why an --answer-pattern cannot be used (one sentence), or None
  answer_token_range(tok, ids, pattern)  the tokens [k0, k1) of that answer in a response (bisection)
  option_letter(pred) -> str|None  the one option a choice answer names ("(B)" -> "B"; "B or C" -> None)
Numbers (the rule, both directions tested in tests/tasks/test_answers_exact.py):
  - two plain numbers ("2,125", "25.0", "\\$5", "4.5e33", "12\\%"): equal as exact decimals;
  - two parsed numbers (\\frac{1}{3}, 10^{6}, 1.5 \\times 10^{-5}, \\sqrt{2}): rational ones (integers,
    fractions, decimals as written) compare exactly, so 0.333333 != \\frac{1}{3}; when either is irrational,
    |g - p| <= REL_TOL * max(|g|, |p|) at 30 digits (\\pi == 3.14159265358979, \\pi != 3.14159). This replaces
    math-verify's default rounding to 6 decimals (which accepts 1000000 == 1000000.0000004, 1/3 == 0.333333);
    inside tuples, sets, intervals and equations math-verify compares floats to FLOAT_DIGITS decimals;
  - not a number is never correct: the words nan / inf / infinity (either side), and a parse that is NaN or
    1/0 (zoo), not even against the same string. The symbol \\infty is mathematics and compares as such
    ((2, \\infty) == (2, \\infty));
  - spaces: "1 2" is not 12 and "1, 100" (a list) is not 1100; only ",", "\\," and "{,}" group thousands;
  - an equation between two different numbers answers nothing: \\boxed{5 = 6} is not 6 (x = 6 is).
The same spelling (normal_form) is equal at every length, before any symbolic work: spaces are dropped
except where they part two tokens ("1 2", "\\pi r"); SPACING (\\left, \\right, \\, \\! \\quad, $, ...) is
space; \\dfrac and \\tfrac are \\frac. math-verify ignores all of these too: short answers are judged alike.
Why the guards (departure 5 of data.py): math-verify's timeout uses signal.alarm, which works in the main
thread only, so elsewhere the check runs in a daemon thread that is abandoned after the timeout; and no
timeout can interrupt sympy evaluating 9^{9^{9}} or (10^{10})!, so a size bound on the parsed expression
rejects those first; an answer longer than MAX_ANSWER_CHARS is never parsed (compare). No guard makes an
answer wrong by itself: stopped, the check still counts the same normal form as equal, and only that. A
parse that comes back empty (math-verify's answer to a timeout, as to an unparseable string) is never
cached: one slow moment under load must not zero a problem for the rest of a run.

A user's --answer-pattern is matched by the `regex` module (re's syntax) under PATTERN_TIMEOUT_S per search
of one response (README, "Your own task"): a pattern whose backtracking grows exponentially with the text,
('(a|aa)+$'), is a PatternError naming it, never a hang; the built-in patterns here are linear.

Run the tests: python -m pytest -q tests/tasks/test_answer*.py
"""

import bisect
import functools
import math
import re
import threading
from decimal import Decimal

import regex

PATTERN_TIMEOUT_S = 1.0  # seconds for one --answer-pattern search of one response (README): then PatternError
MAX_ANSWER_CHARS = 512  # a longer answer is never parsed: equal only as a plain number or a normal form
TIMEOUT_S = 2  # seconds for one math-verify parse or comparison (signal.alarm takes whole seconds)
MAX_DIGITS = 10_000  # the size guard: reject expressions whose value could have more digits than this
REL_TOL = 1e-9  # two numbers, either irrational: equal when |g - p| <= REL_TOL * max(|g|, |p|)
FLOAT_DIGITS = 12  # math-verify's float_rounding in tuples, sets, intervals, equations (default: 6)
# Every pattern below is linear in its input (no two quantifiers can trade the same characters): they run
# on answers of any length (tests/tasks/test_answers.py times 20,000 digits and 60,000 spaces).
NOT_FINITE = re.compile(r"[-+]?\s*(nan|inf|infinity)", re.I)  # words, not answers (\infty is one)
THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
DECIMAL = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)(e[-+]?\d+)?")
LAST_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # learn.py's lenient score
SEPARATOR = re.compile(r"(?<=\d)(\\[!,;]|\{,\})(?=\d{3})")  # LaTeX thousands separators: 1\,000, 1{,}000
TEX_TOKEN = re.compile(r"\\\\|\\[a-zA-Z]+|\\.|\$", re.DOTALL)  # a line break \\ first: in \\, a comma
GAP = re.compile(r"(\\[a-zA-Z]+ (?=[^\W\d_])|\d (?=\d))| ")  # a space parting tokens ("\pi r", "1 2"), or not
SPACING = frozenset(
    {"\\left", "\\right", "\\,", "\\:", "\\;", "\\!", "\\quad", "\\qquad", "\\displaystyle", "\\$", "$"}
)  # only space in math mode; \left( is (, \$5 is 5 (as answer_text)


def not_finite(s):
    """The words nan / inf / infinity, signed or not, with spaces around: not a number (\\infty is one)."""
    return NOT_FINITE.fullmatch(s.strip()) is not None


def plain_number(s):
    """(Decimal, is an integer) for a plain number ("025", "2,125", "1\\,000", "25.0", "\\$5", "4.5e33",
    "12\\%"), or None. A space inside the digits makes it no plain number: "1 2" is not 12."""
    s = SEPARATOR.sub(",", s)
    s = re.sub(r"\\[!,;]|\\?[$%]|\{,\}", "", s).strip().rstrip(".").lower()
    s = re.sub(r"^([-+])\s+", r"\1", s)  # "- 5" is -5
    if THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if not DECIMAL.fullmatch(s):
        return None
    try:
        return Decimal(s), s.lstrip("+-").isdigit()
    except ArithmeticError:  # an exponent beyond Decimal's range: 1e99999999999999999999
        return None


def last_number_equal(text, gold):
    """The lenient score of learn.py: the last number written in the text equals the gold answer, both plain
    numbers compared as exact decimals ("...so 12 apples." == "12"); False when either is not a number."""
    found, g = LAST_NUMBER.findall(text), plain_number(str(gold))
    p = plain_number(found[-1]) if found else None
    return g is not None and p is not None and p[0] == g[0]


def magnitude(e):
    """An upper bound on log10|e| for a parsed sympy expression; math.inf for towers like 9^{9^{9}}."""
    import sympy

    if isinstance(e, sympy.MatrixBase):
        return max((magnitude(x) for x in e), default=0.0)
    if isinstance(e, sympy.Rational):
        return math.log10(abs(e.p) + 1)
    if isinstance(e, sympy.Float):
        return math.log10(abs(float(e)) + 1)
    if isinstance(e, sympy.Pow):
        x = magnitude(e.exp)
        return math.inf if x > 6 else max(magnitude(e.base), 1.0) * 10**x
    if isinstance(e, (sympy.factorial, sympy.factorial2, sympy.binomial, sympy.subfactorial, sympy.gamma)):
        x = max(magnitude(a) for a in e.args)
        return math.inf if x > 6 else 10**x * (x + 1)
    if isinstance(e, (sympy.Sum, sympy.Product)):  # \prod_{n=1}^{10^9} n would be multiplied out
        x = max((magnitude(b) for lim in e.limits for b in lim[1:]), default=0.0)
        return math.inf if x > 3 else magnitude(e.function) * 10**x
    if not getattr(e, "args", ()):
        return 1.0  # symbols, constants, booleans
    sizes = [magnitude(a) for a in e.args]
    return sum(sizes) if isinstance(e, sympy.Mul) else max(sizes) + 1


class EmptyParse(Exception):
    """math-verify parsed nothing: the answer to a timeout too, so it is not cached."""


def parse_boxed(text, timeout):
    """math-verify's parse of \\boxed{text}; non-empty parses are memoized (kept_parse), empty ones are not:
    one slow moment under load must not zero a problem for the rest of a run."""
    try:
        return kept_parse(text, timeout)
    except EmptyParse:
        return []


@functools.lru_cache(maxsize=8192)
def kept_parse(text, timeout):
    from math_verify import LatexExtractionConfig, parse

    out = parse("\\boxed{" + text + "}", [LatexExtractionConfig()], parsing_timeout=timeout)
    if not out:
        raise EmptyParse  # an exception is not cached by lru_cache
    return out


def value(e):
    """A finite number parsed by math-verify (exact when rational, decimals as written), else None."""
    import sympy

    if not isinstance(e, sympy.Expr) or not e.is_number or e.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return None
    e = e.xreplace({f: sympy.Rational(str(f)) for f in e.atoms(sympy.Float)})  # 0.333333 is 333333/10^6
    return e.doit()


def numbers_equal(g, p):
    """Two parsed numbers: exact for two rationals, else a REL_TOL relative tolerance at 30 digits; None when
    either is not a finite number (a symbol, a set, an equation, \\infty: math-verify's to compare)."""
    g, p = value(g), value(p)
    if g is None or p is None:
        return None
    if g.is_Rational and p.is_Rational:
        return g == p
    x, y = g.evalf(30), p.evalf(30)
    return bool(abs(x - y) <= REL_TOL * max(abs(x), abs(y)))


def false_equation(e):
    """An equation between two numbers that differ (5 = 6, also inside y = 5 = 6): its right side answers
    nothing."""
    import sympy

    return isinstance(e, sympy.Basic) and any(numbers_equal(q.lhs, q.rhs) is False for q in e.atoms(sympy.Eq))


def respell(m):
    """One TeX token (a TEX_TOKEN match) as normal_form writes it."""
    t = m.group()
    if t in ("\\dfrac", "\\tfrac"):
        return "\\frac"
    return " " if t in SPACING or t[1:].isspace() else t  # "\\ " is a space too


def normal_form(s):
    """s as it reads in math mode, one spelling per meaning: "x y = 6" -> "xy=6", "\\left( x \\right)" ->
    "(x)", "\\dfrac{1}{2}\\," -> "\\frac{1}{2}". A space stays only where it parts two tokens: two digits
    ("1 2" is not 12, a list), or a command and a letter ("\\pi r" is not "\\pir"). Linear in len(s)."""
    s = re.sub(r"\s+", " ", TEX_TOKEN.sub(respell, s)).strip()
    return GAP.sub(lambda m: m.group(1) or "", s)


def math_verify_equal(gold, pred, timeout):
    import sympy
    from math_verify import verify
    from math_verify.errors import TimeoutException
    from math_verify.utils import timeout as alarm

    g, p = parse_boxed(gold, timeout), parse_boxed(pred, timeout)
    exprs = [x for x in g + p if isinstance(x, (sympy.Basic, sympy.MatrixBase))]
    if any(magnitude(x) > MAX_DIGITS for x in exprs):
        return same_string(gold, pred)  # too big to evaluate: only the same string is equal
    undefined = [x for x in exprs if x.has(sympy.nan, sympy.zoo)]  # 0/0, 1/0; or a misparse (\gamma^{2})
    try:  # sympy's evaluations under the timeout
        if any(alarm(timeout)(false_equation)(x) for x in exprs):
            return False  # \boxed{5 = 6} does not answer 6
        if same_string(gold, pred):  # the same normal form: equal, unless it is a number that is not one
            return not any(getattr(x, "is_number", False) for x in undefined)  # \frac{0}{0}
        if undefined:
            return False
        same = None
        if g and p and "%" not in gold + pred:  # (percentages: math-verify's rule, 9\% == 9 == 0.09)
            same = alarm(timeout)(numbers_equal)(g[0], p[0])  # two numbers: ours, not 6 decimals
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return same_string(gold, pred)  # unchecked: only the same string is equal
    if same is not None:
        return same
    return verify(g, p, float_rounding=FLOAT_DIGITS, timeout_seconds=timeout)


def equivalent(gold, pred):
    """gold == pred as math: decimals for plain numbers, math-verify otherwise, under a timeout. Never raises.
    The guards (length, size, timeout, an error of the parser or of Decimal) only decline to prove different
    strings equal: the same string (up to spelling, normal_form) stays equal whatever stops the check."""
    try:
        return compare(gold, pred)
    except Exception:
        return same_string(gold, pred)


def same_string(gold, pred):
    return isinstance(gold, str) and isinstance(pred, str) and normal_form(gold) == normal_form(pred)


def written(n):
    """A plain number in LaTeX, one spelling: "4.5e33" -> 4500...0 (e is not Euler's number), "1,000" -> 1000;
    past 10^{+-100} "1.5 \\times 10^{200}" (exact: from the digits, no rounding). Never "1,000": that is also
    the normal form of the list "1, 000"."""
    if abs(n.adjusted()) <= 100:
        return format(n, "f")
    sign, digits, _ = n.as_tuple()
    d = "".join(map(str, digits)).rstrip("0") or "0"
    mantissa = d[0] + ("." + d[1:] if d[1:] else "")  # d.ddd: 1.5e200 -> 1.5, 1e200 -> 1
    return f"{'-' * sign}{mantissa} \\times 10^{{{n.adjusted()}}}"


def compare(gold, pred):
    """The cheap exact comparisons first, at every length: not a number, two plain numbers (any number of
    digits), the same normal form. The length guard applies only to what would reach math-verify and sympy:
    an answer longer than MAX_ANSWER_CHARS (512 characters; the longest gold answer of the eval sets has
    198, in OlympiadBench) is never parsed, so it equals only its own normal form (an equal value spelled
    otherwise scores 0, and the 5 = 6 and 0/0 checks, which need the parse, are skipped). Why: parse and
    simplify time grow with the expression; outside the main thread nothing interrupts them (the worker is
    abandoned at the timeout and keeps its core as long as the call runs), and in it signal.alarm cannot
    stop work in C (big integers). Below the limit the normal form is compared in math_verify_equal, after
    the parse has looked for 5 = 6 and 0/0."""
    if not_finite(gold) or not_finite(pred):  # not a number: equals nothing, not itself
        return False
    g, p = plain_number(gold), plain_number(pred)
    if g is not None and p is not None:  # two plain numbers: equal as exact decimals ("025" == 25 == 25.0)
        return g[0] == p[0]
    gold, pred = (s if n is None else written(n[0]) for s, n in ((gold, g), (pred, p)))
    if max(len(gold), len(pred)) > MAX_ANSWER_CHARS:  # the guard, after the numbers: the normal form only
        return same_string(gold, pred)
    if threading.current_thread() is threading.main_thread():
        return math_verify_equal(gold, pred, TIMEOUT_S)  # math-verify's own signal.alarm timeouts
    box = []  # departure 5: no signals in this thread, so run in a daemon thread; stop waiting at the timeout

    def work():
        try:
            box.append(math_verify_equal(gold, pred, None))
        except Exception:  # leaves box empty: the same string only
            pass

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(4 * TIMEOUT_S)  # one parse each for gold and pred, the comparison, and slack
    return bool(box[0]) if box else same_string(gold, pred)  # timed out: only the same string is equal


# ----------------------------------------------------------------------------- where the answer is
BRACES = re.compile(r"\\boxed\s*\{|\{|\}")


def boxed_span(text):
    """(start, end) of the content of the last closed, non-empty \\boxed{...} (the one opening last; nested
    braces balanced), or None: last_boxed's answer, find_answer_span's span. One pass over
    the braces: linear in len(text), however many are left open."""
    stack, best = [], None
    for m in BRACES.finditer(text):  # an open brace: (content start, is a \boxed{)
        if m.group() != "}":
            stack.append((m.end(), m.group() != "{"))
        elif stack:
            start, boxed = stack.pop()
            if boxed and text[start : m.start()].strip() and (best is None or start > best[0]):
                best = (start, m.start())
    return best


def last_boxed(text):
    """The content of the last closed, non-empty \\boxed{...} (boxed_span), or None."""
    span = boxed_span(text)
    return None if span is None else text[span[0] : span[1]]


def answer_text(a):
    """A ground truth as a string: 27.0 -> "27", ["$1$", "$2$"] -> "1, 2", " $x$ " -> "x", "\\$5" -> "5"."""
    if isinstance(a, float) and a.is_integer():
        return str(int(a))
    if isinstance(a, (list, tuple)):
        return ", ".join(answer_text(x) for x in a)
    return re.sub(r"\\?\$", "", str(a)).strip()  # math-mode $ and the dollar sign \$ (not "\18.90")


class PatternError(ValueError):
    """An --answer-pattern that cannot be used: it does not compile, or one search ran past PATTERN_TIMEOUT_S.
    The message names the pattern; grpo.py stops on it with the last checkpoint standing."""


def pattern_problem(pattern):
    """Why `pattern` (an --answer-pattern) does not compile, as one sentence naming it, or None ("" and None:
    the default rule). Every script that takes the flag asks before anything loads."""
    try:
        regex.compile(pattern or "")
    except (regex.error, TypeError, ValueError, OverflowError, RecursionError) as e:
        return f"--answer-pattern {pattern!r} does not compile: {e}"
    return None


def last_match(pattern, text):
    """The last match of `pattern` in `text` (regex, re's syntax) or None, the whole search under
    PATTERN_TIMEOUT_S: past it, a PatternError naming the pattern (its backtracking is what is slow)."""
    m = None
    try:
        for m in regex.finditer(pattern, text, timeout=PATTERN_TIMEOUT_S):  # to the last match
            pass
    except TimeoutError:
        raise PatternError(
            f"--answer-pattern {pattern!r} did not finish searching one {len(text)}-character "
            f"response in {PATTERN_TIMEOUT_S:g} s: its backtracking grows exponentially "
            f"(nested or overlapping quantifiers such as (a|aa)+ or (x+)+); write it so that "
            f"no two quantifiers can take the same characters"
        ) from None
    except regex.error as e:
        raise PatternError(pattern_problem(pattern) or f"--answer-pattern {pattern!r}: {e}") from None
    return m


def find_answer_span(text: str, pattern: str | None = None) -> tuple[int, int] | None:
    """Character span (start, end) of the final answer, the sink of eq. 2, or None. Empty content is None.
    pattern None (the default rule): the content of the last closed \\boxed{...} (nested braces allowed;
    boxed_span), else of the last <answer>...</answer>; linear in len(text), however many braces or
    tags are left open. pattern (grpo.py --answer-pattern, a regular expression): the span of its last match
    in the text, or of that match's first group when it has groups (a group that took no part: no answer),
    found under PATTERN_TIMEOUT_S (last_match: a PatternError past it).
    answer_token_range matches it on the response decoded with its special tokens (an EOS's text ends it)."""
    if pattern:
        m = last_match(pattern, text)  # bounded: PATTERN_TIMEOUT_S
        start, end = m.span(1 if m.re.groups else 0) if m else (-1, -1)
        return (start, end) if start >= 0 and text[start:end].strip() else None
    best, tag, pos = boxed_span(text), None, 0
    while best is None and (i := text.find("<answer>", pos)) >= 0 and (j := text.find("</answer>", i)) >= 0:
        tag, pos = (i + 8, j) if text[i + 8 : j].strip() else tag, j + 9
    return best or tag


def answer_token_range(tokenizer, ids: list[int], pattern: str | None = None) -> tuple[int, int] | None:
    """Token positions [k0, k1) of the answer (find_answer_span, with `pattern`) in a response, or None.

    Token k spans characters [c_k, c_{k+1}) of the decoded text, with c_k = len(decode(ids[:k])); this
    follows the generated ids exactly (re-tokenising the text could split it differently). c_k is
    monotone, so the two boundary tokens are found by bisection: O(log T) decodes, not T.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    span = find_answer_span(text, pattern)
    if span is None:
        return None
    c = lambda k: len(tokenizer.decode(ids[:k], skip_special_tokens=False))  # noqa: E731
    k0 = bisect.bisect_right(range(len(ids) + 1), span[0], key=c) - 1  # token holding the first char
    k1 = bisect.bisect_left(range(len(ids) + 1), span[1], key=c)  # first token at/after the end
    return (max(k0, 0), k1) if k1 > max(k0, 0) else None


# ----------------------------------------------------------------------------- multiple choice
SECOND_OPTION = re.compile(
    r"\)?\s*(?:[,/&;]\s*(?:(?i:or|and)\s+)?\(?[A-P]\b"  # right after the letter:
    r"|(?i:or|and)\s+\(?[A-P]\b|\([A-P]\))"
)  # , C  or C  and (C)  (C)


def option_letter(pred):
    """The option letter a \\boxed{} content names ("B", "(B)", "\\text{B}", "B. text", "B) text" -> "B"), or
    None: no letter, or two options ("B or C", "B and C", "(B) (C)", "B, C"), which is a wrong answer."""
    pred = re.sub(r"\\text(?:bf)?\{([^{}]*)\}", r"\1", pred).strip()
    m = re.match(r"\(?([A-Za-z])\)?(?:$|[.:)\s])", pred)
    return None if m is None or SECOND_OPTION.match(pred, m.end(1)) else m.group(1).upper()
