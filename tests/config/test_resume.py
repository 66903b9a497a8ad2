"""training/config/resume.py, what --resume reads from the saved run and what it may change: a LoRA flag that
would change the checkpoint's adapters is one line; a run launched in another working directory resumes with
its own files; a reward file that changed since the run recorded it is refused unless given again. A --resume
that changes the run's meaning: tests/run/test_checkpoint.py."""

import json

import pytest
from conftest import TINY_RUN, VARIED, fails, task_files

import grpo


# ----------------------------------------------------------------------------- the LoRA adapters
@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lora-rank", "8", "--allow-config-change"], "--lora-rank 4 -> 8"),
        (["--lora-rank", "0", "--allow-config-change"], "--lora-rank 4 -> 0"),
        (["--lora-alpha", "8"], "--lora-alpha 32.0 -> 8.0"),
        (["--lora-targets", "q_proj", "--allow-config-change"], "--lora-targets 'all-linear' -> 'q_proj'"),
    ],
)
def test_a_resume_that_would_change_the_adapters_is_one_line(lora_run, capsys, argv, words):
    """It exited 0 with run_config.json saying rank 8 and the adapters still rank 4 (--lora-rank 0: an empty
    optimizer). --allow-config-change cannot change a checkpoint's adapters."""
    with pytest.raises(SystemExit) as e:
        grpo.main(["--resume", str(lora_run), "--steps", "2", *argv])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and words in line and "adapter_config.json" in line, line
    assert (lora_run / "ckpt" / "COMPLETE").read_text() == "1"


# ----------------------------------------------------------------------------- resume from elsewhere
def test_a_resume_from_another_directory_reads_the_runs_own_files(tmp_path, monkeypatch, capsys):
    """A run launched in A with relative --data-path and --reward resumes from B: given again by their
    absolute paths (the documented way out: it was refused as a change of meaning), or not given at all."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "train.jsonl").write_text(
        "".join(json.dumps({"q": f"What is {i} + 1?", "a": i + 1}) + "\n" for i in range(3))
    )
    (a / "reward.py").write_text("def score(completion, record):\n    return len(completion) % 3 / 2\n")
    monkeypatch.chdir(a)
    grpo.main(
        [
            *TINY_RUN,
            "--dataset",
            "custom",
            "--data-path",
            "train.jsonl",
            "--question-field",
            "q",
            "--reward",
            "reward.py:score",
            "--steps",
            "1",
            "--out-dir",
            "runs/r",
        ]
    )
    monkeypatch.chdir(b)
    grpo.main(
        [
            "--resume",
            str(a / "runs" / "r"),
            "--steps",
            "2",
            "--reward",
            f"{a / 'reward.py'}:score",
            "--data-path",
            str(a / "train.jsonl"),
        ]
    )
    grpo.main(["--resume", str(a / "runs" / "r"), "--steps", "3"])
    assert (a / "runs" / "r" / "ckpt" / "COMPLETE").read_text() == "3"
    saved = json.loads((a / "runs" / "r" / "ckpt" / "run_config.json").read_text())
    assert saved["data_path"] == str(a / "train.jsonl") and saved["reward"] == f"{a / 'reward.py'}:score"
    (a / "reward.py").write_text("def score(completion, record):\n    return 0.5\n")
    with pytest.raises(SystemExit):  # a changed file: still refused
        grpo.main(["--resume", str(a / "runs" / "r"), "--steps", "4"])
    assert "changed since the run recorded it" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a reward file changed
def test_resume_refuses_an_edited_reward_file_unless_given_again(tmp_path, capsys):
    argv = task_files(tmp_path)
    out = tmp_path / "run"
    grpo.main([*TINY_RUN, *argv, "--steps", "1", "--out-dir", str(out)])
    first = json.loads((out / "ckpt" / "run_config.json").read_text())["reward_files"]
    (tmp_path / "reward.py").write_text(VARIED.replace("% 4 / 3", "% 3 / 2"))
    line = fails(capsys, ["--resume", str(out), "--steps", "2"])
    assert f"{(tmp_path / 'reward.py').resolve()} changed" in line and "--reward" in line
    grpo.main(["--resume", str(out), "--steps", "2", "--reward", f"{tmp_path / 'reward.py'}:score"])
    saved = json.loads((out / "ckpt" / "run_config.json").read_text())
    assert saved["reward_files"] != first and (out / "ckpt" / "COMPLETE").read_text().strip() == "2"
    cfg = grpo.parse_args(
        ["--config", str(out / "ckpt" / "run_config.json"), "--out-dir", str(tmp_path / "b")]
    )
    assert cfg.reward == saved["reward"] and cfg.reward_files == saved["reward_files"]
    (tmp_path / "reward.py").rename(tmp_path / "moved.py")
    assert "gone" in fails(capsys, ["--resume", str(out), "--steps", "3"])
