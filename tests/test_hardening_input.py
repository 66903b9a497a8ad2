"""Hardening against hostile or malformed input: one clear line and exit 2, never a traceback, a hang or a
wrong score. One section per finding; each test failed before its fix.

  5-7   rewards: wrong answers that scored 1.0, and an answer that made the checker raise
  8-10  slow or malformed input: linear patterns (timed on inputs that took seconds to minutes), a FIFO as a
        data file, a lone surrogate
  11-12 eval.py and grpo.py flags refused before any model loads"""

import json
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import data
import eval as ev
import grpo
from evaluation import harness, probes
from tasks import answers
from tasks.answers import find_answer_span
from training.model import trainable


def last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def no_model(monkeypatch):
    """Any model load fails the test: the error must come first."""
    for module in (trainable, harness):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))


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


@settings(max_examples=40, deadline=None)
@given(
    exp=st.integers(-(10**30), 10**30),
    mant=st.sampled_from(["1", "-2.5", "0", ".5"]),
    gold=st.sampled_from(["1", "0", "1e5", r"\frac{1}{2}"]),
)
def test_equivalent_never_raises_on_any_exponent(exp, mant, gold):
    assert answers.equivalent(gold, f"{mant}e{exp}") in (True, False)
    assert answers.equivalent(f"{mant}e{exp}", gold) in (True, False)


# ----------------------------------------------------------------------------- 8-10. slow or malformed input
def timed(fn, *a):
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


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


def test_the_loader_reads_60000_spaces_at_once(tmp_path):
    path = tmp_path / "spaces.jsonl"
    row = {"question": " " * 60_000 + "What is 1 + 1?", "answer": " " * 60_000 + "2"}
    path.write_text(json.dumps(row) + "\n")
    assert timed(data.load_task, "arithmetic", "train", str(path)) < 2.0


def in_thread(fn, *a):
    """(finished, error) of fn(*a) given 20 s: a hang fails the test instead of hanging it."""
    box = []

    def work():
        try:
            fn(*a)
            box.append(None)
        except Exception as e:
            box.append(e)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(20)
    return bool(box), box[0] if box else None


def test_a_fifo_as_the_data_file_is_refused_at_once(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    done, err = in_thread(data.load_task, "arithmetic", "train", str(fifo))
    assert done and isinstance(err, data.DataError) and "not a regular file" in str(err)
    done, err = in_thread(probes.load_responses, str(fifo), None, "plain")  # eval's --responses
    assert done and isinstance(err, data.DataError)
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        grpo.main(["--data-path", str(fifo), "--out-dir", str(tmp_path / "run")])
    assert e.value.code == 2 and "data.jsonl: not a regular file" in last_line(capsys)


SURROGATES = [  # (row, the field the error names)
    ({"question": "What is \ud800 1 + 1?", "answer": "2"}, "question"),
    ({"question": "What is 1 + 1?", "answer": "2\udfff"}, "answer"),
]


@pytest.mark.parametrize("row, field", SURROGATES)
def test_a_lone_surrogate_names_the_record(tmp_path, monkeypatch, capsys, row, field):
    path = tmp_path / "s.jsonl"
    path.write_text('{"question": "fine", "answer": "1"}\n' + json.dumps(row) + "\n")  # \ud800 escapes
    with pytest.raises(data.DataError, match=rf"s\.jsonl, line 2: field '{field}' holds a lone surrogate"):
        data.load_task("arithmetic", "train", str(path))
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        grpo.main(["--data-path", str(path), "--out-dir", str(tmp_path / "run")])
    assert e.value.code == 2 and "line 2" in last_line(capsys)
    path.write_text(json.dumps({**row, "response": "\\boxed{2}"}) + "\n")
    with pytest.raises(data.DataError, match="line 1: field .* lone surrogate"):
        probes.load_responses(str(path), None, "plain")


# ----------------------------------------------------------------------------- 11. eval.py
EVAL_BAD = [  # (argv, a word of the one line); each before any model loads
    (["bench", "--device", "cuda:99"], "--device"),
    (["bench", "--device", "tpu"], "--device"),
    (["plot", "--answer-pattern", "("], "--answer-pattern: '(' does not compile"),
    (["bench", "--seed", str(2**70)], "--seed"),
    (["intervene", "--seed", "-1"], "--seed"),
    (["bench", "--out", "{file}"], "is a file"),
    (["plot", "--out", "{file}/sub"], "is a file"),
    (["recall", "--out", "{file}"], "--out"),
    (["bench", "--threads", str(10**20)], "--threads"),
]


@pytest.mark.parametrize("argv, word", EVAL_BAD)
def test_eval_refuses_bad_flags_before_the_model(tmp_path, monkeypatch, capsys, argv, word):
    (tmp_path / "file").write_text("x")
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        ev.main([a.replace("{file}", str(tmp_path / "file")) for a in argv])
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("eval.py: error: ") and word in line, line


def test_cuda_without_a_gpu_is_refused_by_eval():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit):
        ev.parse(["bench", "--device", "cuda"])


@pytest.mark.parametrize("task", ["poetry", ["math"], "countdown"])
def test_eval_responses_with_an_unknown_task_is_one_line(tmp_path, capsys, task):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"question": "1 + 1?", "answer": "2", "response": "\\boxed{2}", "task": task}))
    with pytest.raises(SystemExit) as e:
        ev.main(
            [
                "intervene",
                "--model",
                "tiny-llama",
                "--responses",
                str(path),
                "--style",
                "fewshot",
                "--n-problems",
                "1",
                "--max-new-tokens",
                "2",
                "--out",
                str(tmp_path / "o"),
            ]
        )
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("eval.py: error: ") and "line 1: task" in line, line


# ----------------------------------------------------------------------------- 12. grpo.py flags, up front
GRPO_BAD = [
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--seed", str(2**70)], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--prompt-style", "countdown"], "--prompt-style"),
    (["--dataset", "countdown", "--prompt-style", "fewshot"], "--prompt-style"),
    (["--top-k", str(2**70)], "--top-k"),
    (["--max-new-tokens", str(2**64)], "--max-new-tokens"),
]


@pytest.mark.parametrize("argv, word", GRPO_BAD)
def test_grpo_refuses_bad_flags_before_the_model(tmp_path, monkeypatch, capsys, argv, word):
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        grpo.main([*argv, "--out-dir", str(tmp_path / "run")])
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("grpo.py: error: ") and word in line, line
    assert not (tmp_path / "run").exists()
