"""training/run/checkpoint.py against hostile or malformed input: one clear line and exit 2, never code
execution, a traceback or lost data (hardening findings 1, 3 and 4; each test failed before its fix): a
crafted trainer_state.pt runs no code and a saved state is plain data, a --resume that changes the run's
meaning is refused, a full disk keeps the old checkpoint and says how much space it needs; the run directory
of a checkpoint is the one that holds it, and a cut weights file is one line on --resume and in eval.py bench.
Two runs never share an out_dir (finding 2): tests/run/test_directory.py."""

import dataclasses
import errno
import json
import os
import random
from pathlib import Path

import pytest
import torch
from conftest import enospc, last_line

import eval as ev
import grpo
from evaluation import harness
from training.model import trainable
from training.model.load import load_model
from training.run import checkpoint as ckpt_io


@pytest.fixture(scope="module")
def tiny_state():
    model, tok = load_model("tiny-llama", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, tok, opt, sched, grpo.Config(model="tiny-llama", device="cpu")


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
            "--device",
            "cpu",
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
                "--device",
                "cpu",
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


# ----------------------------------------------------------------------------- its run dir, weights cut short
@pytest.mark.parametrize("saved", ["ckpt", "ckpt.tmp", "ckpt.old"])
def test_the_run_directory_of_a_checkpoint_is_the_one_that_holds_it(tmp_path, saved):
    run = tmp_path / "moved" / "run"
    (run / saved).mkdir(parents=True)
    for f in (ckpt_io.MARK, "trainer_state.pt"):
        (run / saved / f).write_text("1")
    for given in (run, run / "ckpt", run / saved):
        assert ckpt_io.run_dir(ckpt_io.find_checkpoint(given)) == run


def test_a_cut_weights_file_is_one_line_on_resume_and_in_eval_bench(lora_run, tmp_path, monkeypatch, capsys):
    """A truncated adapter_model.safetensors was a SafetensorError traceback; now one line naming it,
    before any model loads."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(lora_run, run)
    f = run / "ckpt" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    monkeypatch.setattr(trainable, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(harness, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))
    for main, argv in (
        (grpo.main, ["--resume", str(run), "--steps", "2"]),
        (
            ev.main,
            [
                "bench",
                "--model",
                str(run),
                "--benchmarks",
                "gsm8k",
                "--n-problems",
                "1",
                "--out",
                str(tmp_path / "o"),
            ],
        ),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and f"{f}: cut short or corrupted" in line, line
    assert ckpt_io.safetensors_problem(lora_run / "ckpt") is None
