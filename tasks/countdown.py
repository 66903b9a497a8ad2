"""The Countdown task (paper Table 3, App. B and C.3): generator, solver, prompt and reward.

A problem is a list of 3-4 numbers in 1..99 and a target in 10..100; the model must write an arithmetic
expression that uses every number exactly once with + - * / and equals the target. We follow the data
construction protocol of TinyZero (Pan et al., 2025) that the paper cites:
  - `problems(n, split, seed)`: a seeded generator. It draws the numbers, combines them in a random order with
    random operations (a random expression tree), and keeps the problem when the value is an integer in
    10..100.
    The small exhaustive `solve` then verifies every kept problem. Splits are disjoint by construction: a
    multiset of numbers belongs to "test" when its hash is 0 mod 5, else to "train" (`split_of`).
    App. C.3 sizes: 20,000 train and 5,000 test (`SIZES`). `rows(split, seed, limit)`: the same problems as
    data.py's records hold them, each with its question and answer.
  - `reward(completion, answer)`: TinyZero's rule. 1.0 when the last <answer>...</answer> holds a correct
    expression, 0.1 when an <answer> tag is there but the expression is wrong (a wrong value, a number used
    the wrong number of times, an unparsable or disallowed expression, a division by zero), 0.0 when there
    is no <answer>...</answer> at all.
  - The expression is parsed with `ast` and evaluated by walking a whitelist of nodes (integer literals,
    + - * /, parentheses) in exact `Fraction` arithmetic. Nothing is ever `eval`ed. Before parsing, the text
    must consist of decimal digits, + - * /, parentheses and spaces only (`LITERALS`), so Python's other
    integer spellings (0x3, 0b100, 0o5, 1_0), exponents (1e3, **) and a trailing "# comment" score 0.1.
  - Problems are integers: a non-integer target or number (17.9, [3.7, 4, 5]) is a DataError when a file is
    loaded (rows.countdown_row). `reward` itself never truncates: it compares exactly, so a target of 17.9 is
    never met by an expression worth 17.
  - `question(nums, target)` and `frame(text)`: TinyZero's request wording and its base-model frame, a
    User/Assistant conversation that ends with the assistant opening a <think> block.

Departures (numbered):
  1. TinyZero's own answer check accepts any string of digits, operators, dots, spaces and brackets and
     evaluates it with Python's eval; here only integer literals and the four binary operators are allowed.
     A unary minus (-3) or a decimal (2.5) is not one of the allowed moves, so it scores 0.1 (format only).
  2. The Unicode signs ×, ÷ and − are read as *, / and -, which TinyZero would score 0.1.
  3. The paper's text says "four numbers"; TinyZero's data (Countdown-Tasks-3to4) and this generator use 3-4.

Run: python -m tasks.countdown   (prints a few generated problems with a solution each)
"""

import ast
import hashlib
import itertools
import random
import re
from fractions import Fraction

SIZES = {"train": 20_000, "test": 5_000}  # App. C.3: 20,000 training and 5,000 held-out problems
NUM_RANGE = (1, 99)  # each given number is in 1..99
TARGET_RANGE = (10, 100)  # the target is an integer in 10..100
COUNTS = (3, 4)  # how many numbers a problem has
MAX_EXPR_CHARS = 1000  # longer <answer> contents are scored as wrong without parsing
FORMAT_SCORE, CORRECT_SCORE = 0.1, 1.0  # TinyZero's format_score and score


def question(nums, target):
    """The user's request, with TinyZero's <think>/<answer> format instructions."""
    return (
        f"Using the numbers {list(nums)}, create an equation that equals {target}. You can use basic "
        "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
        "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
        "<answer> (1 + 2) / 3 </answer>."
    )


def frame(text):
    """TinyZero's plain-text frame for base models: the model continues inside an opened <think> block."""
    return (
        "A conversation between User and Assistant. The user asks a question, and the Assistant "
        "solves it. The assistant first thinks about the reasoning process in the mind and then provides "
        f"the user with the answer.\nUser: {text}\nAssistant: Let me solve this step by step.\n<think>"
    )


# ----------------------------------------------------------------------------- safe evaluation

LITERALS = re.compile(r"[0-9+\-*/()\s]*")  # decimal integers, + - * /, parentheses: no 0x3, 1_0, # ..., 1e3


def exact_value(expr):
    """The exact value of an arithmetic expression, and the integer literals it uses; None if not allowed.

    Allowed nodes: integer literals, the binary operators + - * /, and parentheses (which `ast` drops).
    A division by zero gives a value of None (a wrong answer), never an exception.
    """
    tree = ast.parse(expr.strip(), mode="eval")  # SyntaxError / RecursionError are caught by `reward`
    used = []

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = walk(node.left), walk(node.right)
            if a is None or b is None:
                return None
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            return None if b == 0 else a / b
        raise ValueError(f"disallowed syntax: {type(node).__name__}")

    value = walk(tree.body)
    return value, used


def last_answer(text):
    """The content of the last complete <answer>...</answer> in text, or None."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len("<answer>") : end]


def reward(completion, answer):
    """TinyZero's Countdown reward: 1.0 correct, 0.1 answer tag but wrong, 0.0 no answer. Never raises."""
    try:
        expr = last_answer(str(completion))
        if expr is None:
            return 0.0
        nums, target = [Fraction(str(x)) for x in answer["nums"]], Fraction(str(answer["target"]))  # exact
        expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-")
        if len(expr) > MAX_EXPR_CHARS or "**" in expr or not LITERALS.fullmatch(expr):
            return FORMAT_SCORE
        value, used = exact_value(expr)
        if sorted(used) != sorted(nums) or value is None:  # each given number exactly once
            return FORMAT_SCORE
        return CORRECT_SCORE if value == target else FORMAT_SCORE
    except Exception:  # SyntaxError, ValueError, RecursionError, MemoryError, a malformed `answer` ...
        return FORMAT_SCORE if isinstance(completion, str) and last_answer(completion) is not None else 0.0


# ----------------------------------------------------------------------------- solver and generator

OPS = ("+", "-", "*", "/")


def combine(a, b, op):
    """a op b, exact: ints stay ints, a division that is not exact gives a Fraction; None for a / 0."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        return None
    q = Fraction(a) / b
    return q.numerator if q.denominator == 1 else q


def solve(nums, target):
    """An expression that uses every number once and equals target, or None (exhaustive search)."""

    def search(pool):  # pool: list of (value: int | Fraction, expression: str)
        if len(pool) == 1:
            return pool[0][1] if pool[0][0] == target else None
        for i, j in itertools.permutations(range(len(pool)), 2):  # ordered pairs: a - b and b - a both tried
            rest = [p for k, p in enumerate(pool) if k not in (i, j)]
            (a, ea), (b, eb) = pool[i], pool[j]
            for op in OPS:
                if op in "+*" and i > j:
                    continue  # commutative: one order is enough
                v = combine(a, b, op)
                if v is not None:
                    found = search(rest + [(v, f"({ea} {op} {eb})")])
                    if found:
                        return found
        return None

    expr = search([(n, str(n)) for n in nums])
    return None if expr is None else (expr[1:-1] if expr.startswith("(") else expr)


def split_of(nums):
    """'test' for about 1 in 5 multisets of numbers, 'train' for the rest: a fixed hash, so the splits never
    share a problem (nor even a set of numbers)."""
    key = ",".join(map(str, sorted(nums))).encode()
    return "test" if int(hashlib.sha256(key).hexdigest(), 16) % 5 == 0 else "train"


def random_value(nums, rng):
    """The value of a random expression tree over nums (each used once), or None.

    Integer arithmetic: a division is kept only when it is exact, so intermediate values stay integers
    (fast; the solver still searches rational intermediates).
    """
    pool = list(nums)
    while len(pool) > 1:
        rng.shuffle(pool)  # combine the last two: a random pair, in a random order
        b, a, op = pool.pop(), pool.pop(), OPS[int(rng.random() * 4)]
        if op == "/" and (b == 0 or a % b):
            return None
        pool.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b)
    return pool[0]


def problems(n, split="train", seed=0):
    """n Countdown problems of one split, deterministic for a seed; each verified by `solve`.

    Half of the problems have 3 numbers and half 4 (the count is drawn first, then candidates are drawn
    until one lands in the target range; drawing them jointly would favour 3 numbers about 2:1).
    """
    if split not in SIZES:
        raise ValueError(f"countdown has splits {sorted(SIZES)}, not {split!r}")
    rng, seen, out = random.Random(f"countdown-{seed}"), set(), []
    while len(out) < n:
        k, v = rng.choice(COUNTS), None
        while v is None:
            nums = [NUM_RANGE[0] + int(rng.random() * (NUM_RANGE[1] - NUM_RANGE[0] + 1)) for _ in range(k)]
            if split_of(nums) != split:
                continue
            for _ in range(20):  # a few random expression trees over these numbers
                v = random_value(nums, rng)
                if v is not None and TARGET_RANGE[0] <= v <= TARGET_RANGE[1]:
                    break
                v = None
        key = (tuple(sorted(nums)), v)
        if key in seen:
            continue
        seen.add(key)
        solution = solve(nums, v)
        if solution is None:  # cannot happen for a value built from the numbers; kept as the verification
            raise AssertionError(f"generated an unsolvable problem {nums} -> {v}")
        out.append({"nums": nums, "target": v, "solution": solution})
    return out


def rows(split, seed, limit):
    """data.py's generated rows (data.Dataset.generator): `limit` problems of `split` (all of SIZES' without
    one), each with its question and its answer as a record holds them (as rows.countdown_row reads a
    file's)."""
    made = problems(limit or SIZES[split], split, seed)
    return [
        {
            **p,
            "question": question(p["nums"], p["target"]),
            "answer": {"nums": p["nums"], "target": p["target"]},
        }
        for p in made
    ]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m tasks.countdown",
        allow_abbrev=False,
        description="Print generated Countdown problems, a solution, its reward.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--n", type=int, default=5, help="how many problems")
    ap.add_argument("--split", default="test", choices=["train", "test"], help="which split")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed")
    args = ap.parse_args()
    if args.n < 1:
        ap.error("--n must be >= 1")
    for p in problems(args.n, args.split, seed=args.seed):
        print(
            p["nums"], "->", p["target"], ":", p["solution"], reward(f"<answer>{p['solution']}</answer>", p)
        )
