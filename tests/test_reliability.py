"""Reliability: no lost run data, no silent wrong answer, one clear line for every user error.
Table-driven; nothing here loads a real model (the checkpoint cases use the tiny one)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import answers
import checkpoint as ckpt_io
import countdown
import data
import grpo
from models import load_model

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- silent wrong answers
MATH = [  # (gold, completion, reward)
    ("2024", "\\boxed{2024.001}", 0.0), ("1000000", "\\boxed{1000000.9}", 0.0), ("2024", "\\boxed{2024.0}", 1.0),
    ("1000", "\\boxed{1,000}", 1.0), ("0.5", "\\boxed{\\frac{1}{2}}", 1.0), ("25", "\\boxed{025}", 1.0),
    ("3", "\\boxed{nan}", 0.0), ("nan", "\\boxed{nan}", 0.0), ("0.1", "\\boxed{0.1000000001}", 0.0),
]


@pytest.mark.parametrize("gold, completion, want", MATH)
def test_math_reward_exact(gold, completion, want):
    assert data.math_reward(completion, gold) == want


def test_a_timeout_is_never_cached(monkeypatch):
    import math_verify
    real, calls = math_verify.parse, []

    def slow_once(text, *a, **k):           # the first parse of the gold "times out": math-verify returns []
        calls.append(text)
        return [] if len(calls) == 1 else real(text, *a, **k)
    monkeypatch.setattr(math_verify, "parse", slow_once)
    answers._PARSED.clear()
    gold = "\\frac{3}{7}"
    assert not answers.equivalent(gold, "\\frac{6}{14}")      # the timed-out comparison scores 0 ...
    assert answers.equivalent(gold, "\\frac{6}{14}")          # ... but the next one parses again: 1


COUNTDOWN = [  # (completion, answer, reward): 1 correct, 0.1 answer but wrong, 0 no answer
    ("<answer>3*4+5</answer>", {"nums": [3, 4, 5], "target": 17}, 1.0),
    ("<answer>0x3*0b100+0o5</answer>", {"nums": [3, 4, 5], "target": 17}, 0.1),
    ("<answer>3*4+5 # comment</answer>", {"nums": [3, 4, 5], "target": 17}, 0.1),
    ("<answer>3*4+5</answer>", {"nums": [3, 4, 5], "target": 17.9}, 0.1),
    ("<answer>4*5-3</answer>", {"nums": [3.7, 4, 5], "target": 17}, 0.1),
    ("<answer>1_0+7</answer>", {"nums": [10, 7], "target": 17}, 0.1),
    ("no tag", {"nums": [3, 4, 5], "target": 17}, 0.0),
]


@pytest.mark.parametrize("completion, answer, want", COUNTDOWN)
def test_countdown_reward_only_decimal_integers(completion, answer, want):
    assert countdown.reward(completion, answer) == want


BAD_ROWS = [  # (jsonl line, task, words the DataError must name)
    ('{"question": "", "answer": "2"}', "arithmetic", ["line 1", "question", "empty"]),
    ('{"question": "1+1?", "answer": NaN}', "arithmetic", ["line 1", "answer", "finite"]),
    ('{"question": "1+1?", "answer": Infinity}', "arithmetic", ["line 1", "answer", "finite"]),
    ('{"question": "1+1?", "answer": "nan"}', "arithmetic", ["line 1", "answer"]),
    ('{"nums": [3, 4], "target": 17.9}', "countdown", ["line 1", "target"]),
    ('{"nums": [3.7, 4], "target": 17}', "countdown", ["line 1", "nums"]),
]


@pytest.mark.parametrize("line, task, words", BAD_ROWS)
def test_bad_dataset_values_are_rejected_naming_the_field(tmp_path, line, task, words):
    p = tmp_path / "rows.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(data.DataError) as e:
        data.load_task(task, split="train", path=p)
    assert str(p) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_non_utf8_names_file_and_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(data.DataError, match=r"x\.jsonl, line 2: not UTF-8"):
        data.load_task("arithmetic", split="train", path=p)


# ----------------------------------------------------------------------------- eval.py: one line, exit 2
EVAL_BAD = [(["bench", "--n-problems", "0"], "--n-problems"), (["bench", "--ks", "8", "--n", "4"], "--ks"),
            (["intervene", "--frac", "0"], "--frac"), (["bench", "--n", "0"], "--n")]


@pytest.mark.parametrize("argv, word", EVAL_BAD)
def test_eval_bad_args(argv, word, capsys):
    import eval as ev
    with pytest.raises(SystemExit) as e:
        ev.parse(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "error:" in err and word in err


def test_eval_plot_unknown_key_is_an_error(tmp_path):
    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text(json.dumps({"step": 1, "acc": 0.5}) + "\n")
    p = subprocess.run([sys.executable, str(ROOT / "eval.py"), "plot", "--metrics", str(m), "--keys", "nosuch",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2 and "nosuch" in p.stderr and "Traceback" not in p.stderr


# ----------------------------------------------------------------------------- model and checkpoint files
def test_model_file_errors_name_the_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf")
    bad = tmp_path / "badckpt"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen3"}')
    (bad / "model.safetensors").write_bytes(b"junk")
    for name, word in ((str(fake), "fake.gguf"), (str(tmp_path / "nosuch"), "no such model directory"),
                       ("./nosuch-model", "no such model directory"), (str(bad), "badckpt")):
        with pytest.raises(ValueError, match=word):
            load_model(name)


@pytest.fixture(scope="module")
def tiny_state():
    model, tok = load_model("tiny-llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, tok, opt, sched, grpo.Config()


# Each step of the save, killed: the exception stands in for SIGKILL at that point.
KILL_POINTS = ["save_pretrained", "torch.save", "marker", "rename old", "rename new", "delete old"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_kill_at_any_point_of_the_save_leaves_a_checkpoint(tmp_path, monkeypatch, tiny_state, point):
    model, tok, opt, sched, cfg = tiny_state
    ckpt = tmp_path / "ckpt"
    ckpt_io.save_checkpoint(ckpt, model, tok, opt, sched, 1, cfg, 0)          # the previous checkpoint

    class Killed(Exception):
        pass

    def kill(*a, **k):
        raise Killed(point)
    renames = {"n": 0}
    real_rename, real_rmtree = Path.rename, ckpt_io.shutil.rmtree

    def rename(self, target):
        renames["n"] += 1
        if (point == "rename old" and renames["n"] == 1) or (point == "rename new" and renames["n"] == 2):
            kill()
        return real_rename(self, target)

    def rmtree(p, *a, **k):
        if point == "delete old" and str(p).endswith(".old") and Path(p).exists():
            kill()
        return real_rmtree(p, *a, **k)
    if point == "save_pretrained":
        monkeypatch.setattr(type(model), "save_pretrained", kill)
    elif point == "torch.save":
        monkeypatch.setattr(ckpt_io.torch, "save", kill)
    elif point == "marker":
        monkeypatch.setattr(Path, "write_text", kill)
    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(ckpt_io.shutil, "rmtree", rmtree)
    with pytest.raises(Killed):
        ckpt_io.save_checkpoint(ckpt, model, tok, opt, sched, 2, cfg, 0)
    monkeypatch.undo()
    found = ckpt_io.find_checkpoint(tmp_path)
    step, _ = ckpt_io.load_checkpoint(found, opt, sched)
    assert step in (1, 2)
    assert step == 1 or point in ("rename new", "delete old")                 # the new one only once complete
    load_model(str(found))                                                     # its weights load too


def test_corrupted_trainer_state_names_the_file(tmp_path, tiny_state):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    (tmp_path / "ckpt" / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="trainer_state.pt"):
        ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), opt, sched)
    p = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--resume", str(tmp_path)], capture_output=True,
                       text=True)
    assert p.returncode == 2 and "trainer_state.pt" in p.stderr and "Traceback" not in p.stderr


def test_metrics_resume_cuts_back_to_the_checkpoint(tmp_path):
    f = ckpt_io.open_metrics(tmp_path, None)
    for s in (1, 2, 3):
        ckpt_io.write_metrics(f, {"step": s})
    f.close()
    with open(tmp_path / "metrics.jsonl", "a") as g:
        g.write('{"step": 4, "cut by a ki')                                   # a line cut by a kill
    f = ckpt_io.open_metrics(tmp_path, 2)
    ckpt_io.write_metrics(f, {"step": 3})
    f.close()
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]
