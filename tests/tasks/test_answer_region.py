"""The answer region (eq. 2): tasks/answers.py's find_answer_span, by the default rule (the last \\boxed{},
else <answer>...</answer>) and by --answer-pattern (the last match, or its first group); a pattern that
backtracks without end stops within its bound naming the pattern, one line in grpo.py (the last step saved),
eval.py plot and the TRL plug-in (hardening finding 13)."""

import json
import time
from pathlib import Path

import pytest
from conftest import last_line, your_task

import eval as ev
import grpo
from tasks import answers
from tasks.answers import find_answer_span
from training.model.load import load_model


# ----------------------------------------------------------------------------- the answer region (eq. 2)
@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{a{b}c} and \boxed{unclosed", "a{b}c"),
        ("<answer>3 + 4</answer> x <answer>(1+2)*3</answer>", "(1+2)*3"),
        (r"\boxed{}", None),
        ("no answer here", None),
    ],
)
def test_find_answer_span(text, expected):
    span = find_answer_span(text)
    assert (text[span[0] : span[1]] if span else None) == expected


@pytest.mark.parametrize(
    "text, pattern, want",
    [
        ("so ANSWER: 12 and ANSWER: 7.", r"ANSWER: (\d+)", "7"),  # the last match, its first group
        ("so ANSWER: 12 and ANSWER: 7.", r"ANSWER: \d+", "ANSWER: 7"),  # no group: the whole match
        ("the total is 41", r"(-?\d+)\D*$", "41"),
        ("no number", r"(-?\d+)\D*$", None),
        ("a: x", r"a:(\s*)", None),  # empty content: no answer
        ("ab", r"a|(b)", "b"),  # the last match's group
        ("ba", r"a|(b)", None),  # the last match left it out
        ("\\boxed{3} then <answer>4</answer>", None, "3"),  # the default rule, unchanged
        ("<answer>4</answer>", "", "4"),
    ],
)
def test_the_answer_region_is_the_last_match_or_its_first_group(text, pattern, want):
    span = find_answer_span(text, pattern)
    assert (None if span is None else text[span[0] : span[1]]) == want


# ----------------------------------------------------------------------------- 13. a pattern that backtracks
CATASTROPHIC = r"([\s\S]|[\s\S][\s\S])+(?=\Z)(?<=\d\d\d)"  # Fibonacci-many ways to split any text


def test_a_backtracking_pattern_stops_within_its_bound_naming_the_pattern():
    """README: one search of one response runs at most answers.PATTERN_TIMEOUT_S of CPU time; past it a
    PatternError naming the pattern and its backtracking, from find_answer_span and so from the batch
    builder and the TRL plug-in's token range (both call it). re would run this for ages."""
    from data import build_batch

    text = "the answer is " * 4 + "x"
    t = time.process_time()
    with pytest.raises(answers.PatternError, match="backtracking") as e:
        find_answer_span(text, CATASTROPHIC)
    assert time.process_time() - t < answers.PATTERN_TIMEOUT_S + 0.5 and repr(CATASTROPHIC) in str(e.value)
    model_tok = load_model("tiny-qwen3", device="cpu")[1]
    ids = model_tok(text, add_special_tokens=False).input_ids
    for call in (
        lambda: build_batch(model_tok, [[1, 2]], [ids], answer_pattern=CATASTROPHIC),
        lambda: answers.answer_token_range(model_tok, ids, CATASTROPHIC),
    ):
        with pytest.raises(answers.PatternError):
            call()
    assert find_answer_span("so 12 then 7", r"(\d+)\D*$") == (11, 12)  # a linear one: as before
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"searches each response within {answers.PATTERN_TIMEOUT_S:g} s of CPU time" in readme


def test_a_backtracking_pattern_stops_the_run_with_one_line_and_the_last_step_saved(
    tmp_path, monkeypatch, capsys
):
    """grpo.py: the pattern's search past its bound on step 2 stops the run with one line, step 1 saved;
    on step 1 (the real pattern: every response is long enough), one line and no checkpoint yet."""
    argv = your_task(tmp_path)
    with pytest.raises(SystemExit) as e:
        grpo.main(
            [
                *argv,
                "--max-new-tokens",
                "48",
                "--steps",
                "2",
                "--answer-pattern",
                CATASTROPHIC,
                "--out-dir",
                str(tmp_path / "first"),
            ]
        )
    line = last_line(capsys)
    assert e.value.code == 2 and "backtracking" in line and "no checkpoint was written yet" in line, line
    calls, real = [], answers.regex.finditer

    def slow_on_step_2(pattern, text, timeout=None):
        calls.append(1)
        if len(calls) > 16:  # step 1: 8 answers/missing + 8 build_batch searches
            raise TimeoutError("regex timed out")
        return real(pattern, text, timeout=timeout)

    monkeypatch.setattr(answers.regex, "finditer", slow_on_step_2)
    with pytest.raises(SystemExit) as e:
        grpo.main([*argv, "--steps", "2", "--answer-pattern", r"(\S+)\s*$", "--out-dir", str(tmp_path / "r")])
    line = last_line(capsys)
    assert e.value.code == 2 and "did not finish searching" in line and "step 1 is saved (" in line, line
    assert (tmp_path / "r" / "ckpt" / "COMPLETE").read_text() == "1"


def test_a_backtracking_pattern_is_one_line_in_eval_plot(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"question": "1 + 1?", "answer": "2", "response": "it is " * 8 + "two", "task": "math"})
        + "\n"
    )
    with pytest.raises(SystemExit) as e:
        ev.main(
            [
                "plot",
                "--model",
                "tiny-qwen3",
                "--device",
                "cpu",
                "--responses",
                str(path),
                "--style",
                "plain",
                "--figures",
                "heatmap",
                "--answer-pattern",
                CATASTROPHIC,
                "--out",
                str(tmp_path / "o"),
            ]
        )
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("eval.py: error: --answer-pattern"), line
    assert "backtracking" in line


def test_a_backtracking_pattern_is_one_line_in_the_trl_plug_in(tmp_path, capsys):
    pytest.importorskip("trl")
    import flowtracer_trl

    with pytest.raises(SystemExit) as e:
        flowtracer_trl.main(
            [
                "--model",
                "tiny-qwen3",
                "--use-cpu",
                "--bf16",
                "false",
                "--answer-pattern",
                CATASTROPHIC,
                "--max-steps",
                "1",
                "--num-generations",
                "4",
                "--per-device-train-batch-size",
                "8",
                "--max-completion-length",
                "48",
                "--output-dir",
                str(tmp_path / "t"),
            ]
        )
    line = last_line(capsys)
    assert e.value.code == 2 and "flowtracer_trl.py: error: --answer-pattern" in line, line  # after a bar
    assert "backtracking" in line
