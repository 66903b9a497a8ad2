"""data.py: its loaders (the offline copies: counts, record shape, quirks; the hub out of reach; bad input
located by file, line and field; the DAPO and CrossThinkQA layouts), the choice reward, the one reward path
(data.reward against each task's verifier on every shared record), and build_batch's layout and answer tokens
(the default rule and --answer-pattern's). Bad data as one line: tests/test_data_errors.py.

Run: pytest -x -q tests/test_data.py"""

import json
import re

import pytest
import torch

import data
import grpo
from data import (
    DataError,
    build_batch,
    choice_reward,
    load_task,
    math_reward,
    reward,
)
from tasks import answers, arithmetic, prompts
from training.usercode import reward_code

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
    n = answers.plain_number(gold)
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
        is_number = answers.plain_number(r["answer"]) is not None
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


# ----------------------------------------------------------------------------- an answer naming two options
CHOICE = [
    ("B or C", 0),
    ("B and C", 0),
    ("(B) (C)", 0),
    ("B, C", 0),
    ("(B) or (C)", 0),
    ("B/C", 0),
    ("B, and C", 0),
    (r"\text{B} or \text{C}", 0),
    ("B OR C", 0),
    ("B", 1),
    ("(B)", 1),
    ("B. A cat", 1),
    ("B) Vitamin A and C", 1),
    ("B: blue", 1),
    ("b", 1),
]


@pytest.mark.parametrize("pred, want", CHOICE)
def test_an_answer_naming_two_options_is_wrong(pred, want):
    assert data.choice_reward(f"\\boxed{{{pred}}}", "B") == want


# ----------------------------------------------------------------------------- build_batch
class CharTokenizer:
    """Minimal tokenizer: one token per character, id = ord(c); 0 = pad, 1 = BOS (special)."""

    pad_token_id, eos_token_id, all_special_ids = 0, 2, [0, 1, 2]

    def encode(self, s):
        return [ord(c) for c in s]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (skip_special_tokens and i < 3) else ("<s>" if i == 1 else chr(i)) for i in ids)


def test_build_batch_layout_and_answer_tokens():
    tok = CharTokenizer()
    prompts = [[1] + tok.encode("Q: 2+3?"), [1] + tok.encode("Q?")]
    responses = [tok.encode(r"so \boxed{5}"), tok.encode("none")]
    r = build_batch(tok, prompts, responses)
    P = r.prompt_width
    assert P == 8 and r.input_ids.shape == (2, 8 + 12)
    assert r.question_mask[0].sum() == 7 and not r.question_mask[0, 0]  # BOS excluded
    assert r.question_mask[1, :P].tolist() == [False] * 5 + [False, True, True]
    assert r.response_mask[1].sum() == 4 and r.attention_mask[1].sum() == 3 + 4
    ans = r.input_ids[0][r.answer_mask[0]].tolist()
    assert tok.decode(ans) == "5" and not r.answer_mask[1].any()


def test_build_batch_marks_the_pattern_s_tokens(tok):
    prompt = tok("What is 3 + 4?").input_ids
    resp = tok("I think ANSWER: 12, no, ANSWER: 7 for sure", add_special_tokens=False).input_ids
    boxed, mine = (
        build_batch(tok, [prompt], [resp], answer_pattern=p).answer_mask[0] for p in (None, r"ANSWER: (\d+)")
    )
    P = len(prompt)
    assert not boxed.any()  # no \boxed{}: no sink
    assert tok.decode(torch.tensor(resp)[mine[P:]]).strip() == "7"


# ----------------------------------------------------------------------------- the one reward path
def test_builtin_rewards_equal_the_task_rewards_on_every_shared_record(shared_data, monkeypatch):
    """data.reward (the one reward path) and the run's reward without --reward give every record of the
    offline data what its task's verifier (math_reward / choice_reward / countdown_reward, called as before:
    (completion, answer)) gives: the boxed ground truth, an empty completion, and (every 20th) a wrong box."""
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    run_reward = reward_code.load(grpo.Config(), None)
    assert run_reward is data.reward
    n = 0
    for name in data.TASKS:
        for split in data.SPLITS[name]:
            local = shared_data / data.TASKS[name].local
            if (
                not any((local / f"{split}{ext}").is_file() for ext in (".jsonl", ".parquet"))
                or data.TASKS[name].generator is not None
            ):
                continue
            for i, r in enumerate(data.load_task(name, split)):
                verify = {
                    "math": data.math_reward,
                    "choice": data.choice_reward,
                    "countdown": data.countdown_reward,
                }[r["task"]]
                wrong = ["\\boxed{\\frac{7919}{104729}}"] * (i % 20 == 0)  # math-verify: ~10 ms a call
                for text in (f"so \\boxed{{{r['answer']}}}", "", *wrong):
                    assert run_reward(text, r) == verify(text, r["answer"]), (r["id"], text)
                n += 1
    assert n > 10000  # gsm8k's 8,792 and the others
