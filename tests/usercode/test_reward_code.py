"""training/usercode/reward_code.py, the --reward functions of your own task (docs/your-task.md) and their
values: weighted rewards sum and name the failing function; each bad input is one `grpo.py: error:` line with
nothing written; a reward that exits (sys.exit, or os._exit: named, not obeyed), raises, or returns NaN or a
value past float32 stops the run with one line and the last step saved, from which --resume runs exactly
(hardening finding 13). A reward file in TRL's form: tests/usercode/test_reward_code_trl.py."""

import math
import os

import pytest
import torch
from conftest import TINY_RUN, fails, last_line, metrics, same_step, task_files, your_task

import grpo
from training.usercode import reward_code


# ----------------------------------------------------------------------------- rewards
def test_weighted_rewards_sum_and_name_the_failing_function():
    terms = [
        reward_code.Term("a.py:f", lambda c, r: len(c), 0.5),
        reward_code.Term("b.py:g", lambda c, r: 1, 2.0),
    ]
    assert reward_code.UserReward(terms)("abcd", {"id": "x"}) == 0.5 * 4 + 2.0
    bad = reward_code.UserReward([reward_code.Term("b.py:g", lambda c, r: math.nan, 1.0)])
    with pytest.raises(reward_code.RewardError, match=r"b\.py:g returned nan on row 'x'"):
        bad("", {"id": "x"})
    record = {"id": "y", "cols": 1}
    reward_code.UserReward([reward_code.Term("c.py:h", lambda c, r: r.clear() or 0, 1.0)])("", record)
    assert record == {"id": "y", "cols": 1}  # the function got a copy


# ----------------------------------------------------------------------------- bad inputs: one line, exit 2
BAD = {
    "no file": (lambda t: ["--reward", f"{t / 'nope.py'}:score"], "no such file"),
    "no function": (lambda t: ["--reward", f"{t / 'reward.py'}:scorer"], "no function 'scorer'"),
    "raises": (
        lambda t: (t / "reward.py").write_text("def score(c, r):\n    return r['missing']\n") and [],
        "raised KeyError",
    ),
    "a string": (
        lambda t: (t / "reward.py").write_text("def score(c, r):\n    return '1'\n") and [],
        "returned '1'",
    ),
    "pattern": (lambda t: ["--answer-pattern", "(ANSWER"], "--answer-pattern '(ANSWER' does not compile"),
    "field": (
        lambda t: ["--question-field", "question2"],
        "no column 'question2' (--question-field); the row's columns: q, a, level",
    ),
    "json": (lambda t: ["--chat-template-kwargs", "{enable_thinking: false}"], "--chat-template-kwargs"),
    "weights": (lambda t: ["--reward-weights", "1,2"], "--reward-weights gives 2 weight(s)"),
    "eval": (lambda t: ["--eval-every", "1"], "--eval-data-path"),
    "no reward": (lambda t: ["--reward", ""], "--dataset custom needs"),
    "import": (lambda t: (t / "reward.py").write_text("import not_a_module\n") and [], "ModuleNotFoundError"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    argv = task_files(tmp_path)
    extra, words = BAD[case]
    line = fails(capsys, [*TINY_RUN, *argv, *extra(tmp_path), "--out-dir", str(tmp_path / "run")])
    assert words in line, line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- 13. a reward exits or fails
@pytest.mark.parametrize("failure", ["raise", "nan"])
def test_a_reward_that_fails_mid_run_stops_it_and_the_checkpoint_stands(tmp_path, capsys, failure):
    bad = "raise ZeroDivisionError('boom')" if failure == "raise" else "return float('nan')"
    argv = task_files(
        tmp_path,
        "CALLS = []\n\n\ndef score(completion, record):\n    CALLS.append(1)\n"
        f"    if len(CALLS) > 9:\n        {bad}\n    return len(CALLS) % 2\n",
    )
    line = fails(
        capsys, [*TINY_RUN, *argv, "--steps", "3", "--save-every", "1", "--out-dir", str(tmp_path / "r")]
    )
    assert "reward.py:score" in line and "on row 'custom/train/" in line and "checkpoint stands" in line
    assert ("ZeroDivisionError" if failure == "raise" else "returned nan") in line
    assert (tmp_path / "r" / "ckpt" / "COMPLETE").read_text().strip() == "1"
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 1


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
