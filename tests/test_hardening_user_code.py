"""Hardening against the code a user hands us: a --reward that exits, returns past float32 or never returns;
an --answer-pattern that backtracks without end. Each is one line, or a stop at the first signal with the last
step saved. Each test failed before its fix (section 13 of the hardening findings)."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN

import eval as ev
import grpo
from tasks import answers
from tasks.answers import find_answer_span
from training.model.load import load_model
from training.usercode import guard, reward_code


def last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- 13. your code
TASK_ROWS = [
    {"q": "What is 3 + 4?", "a": 7},
    {"q": "What is 10 - 2?", "a": 8},
    {"q": "What is 6 * 2?", "a": 12},
]
RUN = [*TINY_RUN, "--device", "cpu"]  # the CPU: a resume equals bit for bit
# A reward that varies in every group (rows train); {act} runs on the call numbered AT: 1 is setup's check,
# 2-9 step 1's rows, 10-17 step 2's.
REWARD = """import os, sys, time, zlib
CALLS = []
AT = int(os.environ.get("REWARD_AT", "0"))


def score(completion, record):
    CALLS.append(1)
    if len(CALLS) == AT:
        {act}
    return zlib.crc32((completion + record['id']).encode()) % 4 / 3
"""


def your_task(tmp_path, act="pass", at=0, monkeypatch=None):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASK_ROWS))
    (tmp_path / "reward.py").write_text(REWARD.replace("{act}", act))
    if monkeypatch is not None:
        monkeypatch.setenv("REWARD_AT", str(at))
    return [
        *RUN,
        "--dataset",
        "custom",
        "--data-path",
        str(tmp_path / "train.jsonl"),
        "--question-field",
        "q",
        "--answer-field",
        "a",
        "--reward",
        f"{tmp_path / 'reward.py'}:score",
    ]


def metrics(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def same_step(a, b):
    """Two metrics lines of the same step, but for the clock and the memory."""
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}  # noqa: E731
    return drop(a) == drop(b)


@pytest.mark.parametrize(
    "where, at, words",
    [
        ("import", 0, "importing it raised SystemExit"),
        ("setup", 1, "raised SystemExit (0) on row 'custom/train/0'"),
    ],
)
def test_a_reward_that_exits_at_setup_is_one_error_line(tmp_path, monkeypatch, capsys, where, at, words):
    """sys.exit(0) in a reward (SystemExit passes `except Exception`) is the user's error: exit 2, not 0."""
    argv = your_task(tmp_path, "sys.exit(0)", at, monkeypatch)
    if where == "import":
        (tmp_path / "reward.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(SystemExit) as e:
        grpo.main([*argv, "--steps", "2", "--out-dir", str(tmp_path / "run")])
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("grpo.py: error: --reward ") and words in line, line
    assert where == "import" or line.endswith(
        "(the check at setup: the first record and an empty completion)"
    ), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "act, words",
    [
        ("sys.exit(0)", "raised SystemExit"),
        ("return 1e300", "returned 1e+300 on row"),
        ("raise KeyboardInterrupt", None),
    ],
)
def test_a_reward_that_fails_mid_run_saves_the_last_step_and_the_run_resumes_exactly(
    tmp_path, monkeypatch, capsys, act, words
):
    """On its 12th call (step 2) the reward exits, or returns 1e300 (inf in float32: refused, never a NaN
    loss), or raises a KeyboardInterrupt (which keeps its meaning: it passes). Exit 2 with one line naming
    the function and the row; step 1, completed but not due for a save, is saved as it ended, and a resume
    with the reward fixed runs step 2 exactly as a run that never failed."""
    argv = your_task(tmp_path, act, 12, monkeypatch)
    out = tmp_path / "run"
    if words is None:
        with pytest.raises(KeyboardInterrupt):
            grpo.main([*argv, "--steps", "2", "--out-dir", str(out)])
        assert not (out / "ckpt").exists()
        return
    with pytest.raises(SystemExit) as e:
        grpo.main([*argv, "--steps", "2", "--out-dir", str(out)])
    line = last_line(capsys)
    assert e.value.code == 2 and words in line and "reward.py:score" in line, line
    assert "on row 'custom/train/" in line and f"step 1 is saved ({out / 'ckpt'}): --resume" in line
    assert (out / "ckpt" / "COMPLETE").read_text() == "1" and len(metrics(out)) == 1
    monkeypatch.setenv("REWARD_AT", "0")  # fixed: it never acts
    grpo.main(["--resume", str(out), "--reward", f"{tmp_path / 'reward.py'}:score"])
    grpo.main([*argv, "--steps", "2", "--out-dir", str(tmp_path / "whole")])
    assert same_step(metrics(out)[1], metrics(tmp_path / "whole")[1])


@pytest.mark.parametrize("where", ["import", "call"])
def test_os_exit_in_a_reward_is_named_not_obeyed(tmp_path, monkeypatch, capsys, where):
    """os._exit skips every handler and would end the run with status 0: inside the user's code it is a
    SystemExit (guard.guarded), one line like any other exit; the real os._exit is back after."""
    real = os._exit
    argv = your_task(tmp_path, "os._exit(0)", 1, monkeypatch)
    if where == "import":
        (tmp_path / "reward.py").write_text("import os\nos._exit(0)\n")
    with pytest.raises(SystemExit) as e:
        grpo.main([*argv, "--out-dir", str(tmp_path / "run")])
    line = last_line(capsys)
    assert e.value.code == 2 and "raised SystemExit" in line and "os._exit(0)" in line, line
    assert os._exit is real and not (tmp_path / "run").exists()


def test_a_reward_past_float32_is_refused_in_either_form():
    rec = {"id": "r0", "question": "q"}
    for fn in (
        lambda completion, record: 1e300,
        lambda completions, **k: [1e300],
        lambda c, r: 10**400,
        lambda c, r: -float("inf"),
        lambda completions, **k: [torch.tensor(float("nan"))],
    ):
        with pytest.raises(reward_code.RewardError, match="finite as a float32"):
            reward_code.UserReward([reward_code.Term("r.py:f", fn, 1.0)]).batch([""], [rec], [[]])
    big = [reward_code.Term(f"r.py:f{i}", lambda c, r: 3e38, 1.0) for i in range(2)]  # each fits, the sum not
    with pytest.raises(reward_code.RewardError, match="weighted sum .* is 6e\\+38 on row 'r0'"):
        reward_code.UserReward(big).batch([""], [rec], [[]])
    ok = reward_code.UserReward(
        [
            reward_code.Term("r.py:f", lambda c, r: torch.tensor(0.5), 1.0),
            reward_code.Term("r.py:g", lambda c, r: True, 2.0),
        ]
    )
    assert ok("", rec) == 2.5  # a 0-d tensor, a bool: numbers


@pytest.mark.parametrize("sig, hang", [(signal.SIGINT, "busy"), (signal.SIGTERM, "sleep")])
def test_a_reward_that_never_returns_stops_at_the_first_signal_and_saves_the_last_step(
    tmp_path, monkeypatch, capsys, sig, hang
):
    """The reward hangs on step 2 (a busy loop, or a sleep). Under --stop-grace 0 the first Ctrl-C / SIGTERM
    stops it at once: step 1 is saved as it ended (its RNG states), the run says so and exits with the
    signal's status (130, 143); the resume equals the run that never hung. (A reward that is never
    interrupted would give up after 60 s and fail the test instead of hanging it.)"""
    mark = tmp_path / "hanging"
    wait = (
        "t = time.time()\n        while time.time() - t < 60:\n            pass"
        if hang == "busy"
        else "time.sleep(60)"
    )
    argv = your_task(
        tmp_path,
        f"open({str(mark)!r}, 'w').close()\n        {wait}\n        raise RuntimeError('never interrupted')",
        12,
        monkeypatch,
    )

    def interrupt():
        for _ in range(600):
            if mark.exists():
                time.sleep(0.2)
                return os.kill(os.getpid(), sig)
            time.sleep(0.1)

    threading.Thread(target=interrupt, daemon=True).start()
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        grpo.main([*argv, "--steps", "3", "--stop-grace", "0", "--out-dir", str(out)])
    assert done.value.code == 128 + sig and "stopped): checkpoint saved (step 1)" in capsys.readouterr().out
    assert (out / "ckpt" / "COMPLETE").read_text() == "1" and len(metrics(out)) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back
    monkeypatch.setenv("REWARD_AT", "0")
    grpo.main(["--resume", str(out), "--steps", "2", "--reward", f"{tmp_path / 'reward.py'}:score"])
    grpo.main([*argv, "--steps", "2", "--out-dir", str(tmp_path / "whole")])
    assert same_step(metrics(out)[1], metrics(tmp_path / "whole")[1])


def test_interruptible_passes_the_signal_to_the_handler_in_force_then_raises():
    """Inside: a first signal reaches the handler in force (RunLog's sets stop_requested) and raises
    Interrupted (a KeyboardInterrupt); the handlers are the ones in force again after."""
    seen = []
    before = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with pytest.raises(guard.Interrupted):
            with guard.interruptible():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with guard.interruptible():
            pass  # no signal: nothing happens
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_reward_interrupted_at_setup_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """A Ctrl-C while setup's check (or the import) runs the user's code: one line, not a traceback."""
    (tmp_path / "r.py").write_text(
        "from training.usercode import guard\nraise guard.Interrupted('SIGTERM')\n"
    )
    cfg = grpo.Config(reward=f"{tmp_path / 'r.py'}:f")
    with pytest.raises(reward_code.RewardError, match=r"interrupted \(SIGTERM\) while importing it"):
        reward_code.load(cfg, {"id": "x", "question": "q"})

    def stuck(completion, record):
        raise guard.Interrupted("SIGINT")  # what the handler raises inside the call

    monkeypatch.setattr(reward_code, "import_function", lambda s, modules=None: stuck)
    with pytest.raises(reward_code.RewardError, match=r"r\.py:f: interrupted \(SIGINT\) in the check at"):
        reward_code.load(cfg, {"id": "x", "question": "q"})


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
    model_tok = load_model("tiny-qwen3")[1]
    ids = model_tok(text, add_special_tokens=False).input_ids
    for call in (
        lambda: build_batch(model_tok, [[1, 2]], [ids], answer_pattern=CATASTROPHIC),
        lambda: answers.answer_token_range(model_tok, ids, CATASTROPHIC),
    ):
        with pytest.raises(answers.PatternError):
            call()
    assert find_answer_span("so 12 then 7", r"(\d+)\D*$") == (11, 12)  # a linear one: as before
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
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
