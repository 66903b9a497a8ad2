"""Hardening: hostile or malformed input gets one clear line and exit 2, never code execution, a traceback, a
hang or a wrong score. One section per finding; each test failed before its fix.

  1-4   checkpoints and the run directory: a crafted trainer_state.pt runs no code, two runs never share an
        out_dir, a --resume that changes the run's meaning is refused, a full disk keeps the old checkpoint
  5-7   rewards: wrong answers that scored 1.0, and an answer that made the checker raise
  8-10  slow or malformed input: linear patterns (timed on inputs that took seconds to minutes), a FIFO as a
        data file, a lone surrogate
  11-12 eval.py and grpo.py flags refused before any model loads
  13    your code: a --reward that exits, returns past float32 or never returns; an --answer-pattern that
        backtracks without end (each one line, or a stop at the first signal, the last step saved)
"""

import argparse
import dataclasses
import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from hypothesis import given, settings
from hypothesis import strategies as st

import data
import eval as ev
import grpo
from evaluation import harness, probes
from tasks import answers
from tasks.answers import find_answer_span
from training import checkpoint as ckpt_io
from training import load, reward_code, rundir, runlog, usercode
from training import run as run_mod
from training.models import load_model


@pytest.fixture(scope="module")
def tiny_state():
    model, tok = load_model("tiny-llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, tok, opt, sched, grpo.Config(model="tiny-llama")


def last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def no_model(monkeypatch):
    """Any model load fails the test: the error must come first."""
    for module in (load, harness):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))


# ----------------------------------------------------------------------------- 1. code from a checkpoint
class Payload:
    """Unpickling it creates a directory: the stand-in for any code a crafted file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


ENTRIES = {  # how a user reaches trainer_state.pt: (argv, main, its prog)
    "grpo --resume": (lambda run, out: ["--resume", str(run)], grpo.main, "grpo.py"),
    "eval plot --model": (
        lambda run, out: [
            "plot",
            "--model",
            str(run),
            "--task",
            "arithmetic",
            "--n-problems",
            "1",
            "--max-new-tokens",
            "2",
            "--out",
            str(out),
        ],
        ev.main,
        "eval.py",
    ),
}


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_crafted_trainer_state_runs_no_code(tmp_path, tiny_state, capsys, entry):
    model, tok, opt, sched, cfg = tiny_state
    run, marker = tmp_path / "run", tmp_path / "code-ran"
    cfg = dataclasses.replace(cfg, out_dir=str(run))  # not runs/grpo of the cwd: tests may run at once
    ckpt_io.save_checkpoint(run / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    state = {
        "optimizer": Payload(marker),
        "scheduler": {},
        "step": 1,
        "rng": {},
        "config": {},
        "bad_steps": 0,
    }
    torch.save(state, run / "ckpt" / "trainer_state.pt")
    argv, main, prog = ENTRIES[entry]
    with pytest.raises(SystemExit) as e:
        main(argv(run, tmp_path / "out"))
    line = last_line(capsys)
    assert not marker.exists(), "unpickling ran the payload"
    assert e.value.code == 2 and line.startswith(f"{prog}: error: ") and "trainer_state.pt" in line, line
    assert "not a grpo.py trainer state" in line


def test_a_saved_state_is_plain_data_and_restores_the_rng_exactly(tmp_path, tiny_state):
    model, tok, opt, sched, cfg = tiny_state
    random.seed(5)
    torch.manual_seed(5)
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 7, cfg, 1)
    after = (random.random(), torch.rand(3))
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)  # no pickle of code
    assert state["config"]["model"] == "tiny-llama" and state["step"] == 7
    random.seed(99)
    torch.manual_seed(99)
    assert ckpt_io.load_checkpoint(tmp_path / "ckpt", opt, sched) == (7, 1)
    again = (random.random(), torch.rand(3))
    assert after[0] == again[0] and torch.equal(after[1], again[1])


BAD_FIELDS = [
    ({"step": "7"}, "step"),
    ({"bad_steps": -1}, "bad_steps"),
    ({"config": [1]}, "config"),
    ({"rng": {"python": 1}}, "rng"),
    ({"step": True}, "step"),
]


@pytest.mark.parametrize("change, word", BAD_FIELDS)
def test_a_trainer_state_with_wrong_fields_names_the_file(tmp_path, tiny_state, change, word):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)
    torch.save({**state, **change}, tmp_path / "ckpt" / "trainer_state.pt")
    with pytest.raises(ckpt_io.RunError, match=rf"trainer_state\.pt: not a grpo\.py trainer state .*{word}"):
        ckpt_io.load_checkpoint(tmp_path / "ckpt", opt, sched)


# ----------------------------------------------------------------------------- 2. two runs, one out_dir
HOLD = (
    "import sys; from training import rundir; rundir.lock_out_dir(sys.argv[1]); "
    "print('locked', flush=True); sys.stdin.read()"
)


def test_a_second_run_into_a_locked_out_dir_names_the_holder(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        no_model(monkeypatch)
        with pytest.raises(SystemExit) as e:
            grpo.main(["--out-dir", str(out), "--overwrite"])
        line = last_line(capsys)
        assert e.value.code == 2 and line.startswith("grpo.py: error: ") and f"PID {holder.pid}" in line, line
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written, nothing cut
    finally:
        holder.stdin.close()
        holder.wait(60)
    run_mod.check_out_dir(out, resume=False, overwrite=False)  # free once the holder ends
    run_mod.check_out_dir(out, resume=False, overwrite=False)  # the same process: again fine
    rundir.unlock_out_dir(out)


def test_an_out_dir_that_is_a_file_fails_before_the_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        grpo.main(["--out-dir", str(tmp_path / "file")])
    assert e.value.code == 2 and "file" in last_line(capsys)


# ----------------------------------------------------------------------------- 3. a resume that changes a run
RESUMES = [  # (flags given with --resume, the flags the error must list; None: accepted)
    (["--credit", "entropy"], ["--credit"]),
    (["--model", "tiny-qwen3", "--seed", "9"], ["--model", "--seed"]),
    (["--group-size", "4"], ["--group-size"]),
    (["--shaping", "bottomk"], ["--shaping"]),
    (["--dataset", "gsm8k"], ["--dataset"]),
    (["--lr", "0.5"], ["--lr"]),
    (["--steps", "9", "--save-every", "2", "--micro-batch", "1", "--device", "cpu"], None),
    (["--credit", "flow", "--seed", "0"], None),  # the saved values: no change
    (["--credit", "entropy", "--allow-config-change"], None),
]


@pytest.mark.parametrize("flags, listed", RESUMES)
def test_a_resume_that_changes_the_runs_meaning_is_refused(tmp_path, tiny_state, capsys, flags, listed):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    if listed is None:
        got = grpo.parse_args(["--resume", str(tmp_path), *flags])
        assert got.model == "tiny-llama" and got.credit == ("entropy" if "entropy" in flags else "flow")
        return
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(["--resume", str(tmp_path), *flags])
    line = last_line(capsys)
    assert e.value.code == 2 and "--allow-config-change" in line and all(f in line for f in listed), line
    assert not any(f in line for f in ("--steps", "--resume ''")), line


# ----------------------------------------------------------------------------- 4. a full disk during a save
def enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def safetensors_full(*a, **k):
    raise RuntimeError(
        "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
        'message: "No space left on device" })'
    )


FULL = [
    ("weights", lambda m, t: (type(m), "save_pretrained"), safetensors_full),
    ("tokenizer", lambda m, t: (type(t), "save_pretrained"), enospc),
    ("trainer state", lambda m, t: (ckpt_io.torch, "save"), enospc),
    ("marker", lambda m, t: (Path, "write_text"), enospc),
]


@pytest.mark.parametrize("where, target, fault", FULL, ids=[f[0] for f in FULL])
def test_a_full_disk_keeps_the_old_checkpoint_and_says_how_much_space(
    tmp_path, monkeypatch, tiny_state, where, target, fault
):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    with monkeypatch.context() as mp:
        mp.setattr(*target(model, tok), fault)
        with pytest.raises(ckpt_io.RunError, match=r"ckpt: no space left .* needs about [0-9.]+ [MG]iB") as e:
            ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    assert "\n" not in str(e.value) and "iB are free" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial ckpt.tmp left
    assert ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), opt, sched)[0] == 1


def test_a_full_disk_during_a_run_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ckpt_io.torch, "save", enospc)
    with pytest.raises(SystemExit) as e:
        grpo.main(
            [
                "--model",
                "tiny-qwen3",
                "--prompts-per-step",
                "1",
                "--group-size",
                "2",
                "--max-new-tokens",
                "4",
                "--steps",
                "1",
                "--out-dir",
                str(tmp_path / "run"),
            ]
        )
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("grpo.py: error: ") and "no space left" in line, line
    assert [json.loads(x)["step"] for x in open(tmp_path / "run" / "metrics.jsonl")] == [1]


@pytest.mark.parametrize(
    "error, full",
    [
        (OSError(errno.ENOSPC, "full"), True),
        (OSError(errno.EDQUOT, "quota"), True),
        (OSError(errno.EACCES, "denied"), False),
        (ValueError("bug"), False),
    ],
)
def test_full_disk_turns_only_a_full_disk_into_one_line(tmp_path, error, full):
    """The guard around rollouts, curves and metrics: a full disk is a RunError naming the file, any other
    error passes unchanged (a bug stays a traceback)."""
    want = (
        dict(expected_exception=ckpt_io.RunError, match="curves.png: no space")
        if full
        else dict(expected_exception=type(error))
    )
    with pytest.raises(**want):
        with ckpt_io.full_disk(tmp_path / "curves.png", "the curves"):
            raise error


def test_eval_full_disk_when_writing_results_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Path, "write_text", enospc)
    with pytest.raises(harness.EvalError) as e:  # eval.main prints it as one line, exit 2
        harness.save(argparse.Namespace(out=str(tmp_path), cmd="bench"), {}, "| table |")
    msg, code = e.value.args
    assert code == 2 and "cannot write the results (No space left on device)" in msg


def test_a_full_disk_while_logging_names_the_file(tmp_path):
    class Full:
        name = str(tmp_path / "metrics.jsonl")
        write = staticmethod(enospc)

    with pytest.raises(ckpt_io.RunError, match="metrics.jsonl: no space left .* step 3"):
        runlog.write_metrics(Full(), {"step": 3})


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


# ----------------------------------------------------------------------------- 13. your code
TASK_ROWS = [
    {"q": "What is 3 + 4?", "a": 7},
    {"q": "What is 10 - 2?", "a": 8},
    {"q": "What is 6 * 2?", "a": 12},
]
RUN = [
    "--model",
    "tiny-qwen3",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "8",
    "--warmup-steps",
    "1",
    "--lr",
    "1e-3",
    "--device",
    "cpu",
]  # the CPU: a resume equals bit for bit
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
    SystemExit (usercode.guarded), one line like any other exit; the real os._exit is back after."""
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
    """The reward hangs on step 2 (a busy loop, or a sleep). The first Ctrl-C / SIGTERM stops it at once:
    step 1 is saved as it ended (its RNG states), the run says so and ends with status 0 as any
    interrupted run; the resume equals the run that never hung. (A reward that is never interrupted would
    give up after 60 s and fail the test instead of hanging it.)"""
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
    done = grpo.main([*argv, "--steps", "3", "--out-dir", str(out)])
    assert done.stop == "interrupted" and "interrupted: checkpoint saved (step 1)" in capsys.readouterr().out
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
        with pytest.raises(usercode.Interrupted):
            with usercode.interruptible():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with usercode.interruptible():
            pass  # no signal: nothing happens
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_reward_interrupted_at_setup_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """A Ctrl-C while setup's check (or the import) runs the user's code: one line, not a traceback."""
    (tmp_path / "r.py").write_text("from training import usercode\nraise usercode.Interrupted('SIGTERM')\n")
    cfg = grpo.Config(reward=f"{tmp_path / 'r.py'}:f")
    with pytest.raises(reward_code.RewardError, match=r"interrupted \(SIGTERM\) while importing it"):
        reward_code.load(cfg, {"id": "x", "question": "q"})

    def stuck(completion, record):
        raise usercode.Interrupted("SIGINT")  # what the handler raises inside the call

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
