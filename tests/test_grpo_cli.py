"""grpo.py's command line: every user error is one line, `grpo.py: error: ...`, exit status 2, naming the flag
or file, and comes before any model loads (hardening finding 12 among them). Table-driven; no model is loaded,
so the table runs in seconds. The embedded model's defaults apply to it alone, named or not."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import last_line, no_model

import grpo
from grpo import parse_args
from training.config import presets
from training.model import gguf, pretrained, trainable

ROOT = Path(grpo.__file__).resolve().parent


BAD_FLAGS = [  # (argv, a word the one line must contain)
    (["--adv-clip", "-1"], "--adv-clip"),
    (["--loss-agg", "bogus"], "--loss-agg"),
    (["--group-size", "1"], "--group-size"),
    (["--gamma", "nan"], "--gamma"),
    (["--gamma", "-5"], "--gamma"),
    (["--gamma", "inf"], "--gamma"),
    (["--save-every", "0"], "--save-every"),
    (["--rollouts-every", "0"], "--rollouts-every"),
    (["--steps", "0"], "--steps"),
    (["--max-bad-steps", "0"], "--max-bad-steps"),
    (["--credit", "nosuch"], "--credit"),
    (["--shaping", "x"], "--shaping"),
    (["--dataset", "nosuch"], "--dataset"),
    (["--prompt-style", "x"], "--prompt-style"),
    (["--layers", "mid"], "--layers"),
    (["--layers", "5:2"], "--layers"),
    (["--top-frac", "2"], "--top-frac"),
    (["--top-frac", "0"], "--top-frac"),
    (["--temperature", "0"], "--temperature"),
    (["--temperature", "1e-300"], "--temperature"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--eval-size", "0"], "--eval-size"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--report-to", "mlflow"], "--report-to"),
    (["--gen-chunk", "-1"], "--gen-chunk"),
    (["--micro-batch", "-1"], "--micro-batch"),  # 0: sized
    (["--num-iterations", "0"], "--num-iterations"),
    (["--lr", "nan"], "--lr"),
    (["--eps-low", "1"], "--eps-low"),
    (["--dual-clip", "0.5"], "--dual-clip"),
    (["--filter-low", "0.9", "--filter-high", "0.1"], "--filter-low"),
    (["--credit-pass", "both"], "--credit-pass"),
    (["--token-class", "digits"], "--token-class"),
    (["--shaping", "entropy-adv"], "entropy-adv"),
    (["--attn-window", "9"], "--attn-window"),
    (["--oar-outcome", "x"], "--oar-outcome"),
    (["--steps", "two"], "--steps"),
    (["--no-such-flag"], "no-such-flag"),
    (["--optimizer", "sgd"], "--optimizer"),
    (["--resume", "/nonexistent/run"], "/nonexistent/run"),
]


@pytest.mark.parametrize("argv, word", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_exit_2(argv, word, capsys):
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err[-1].startswith("grpo.py: error: ") and word in err[-1], err


def test_cuda_without_gpu_is_an_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(["--device", "cuda"])
    assert e.value.code == 2 and "--device" in capsys.readouterr().err


def test_good_flags_parse():
    cfg = grpo.parse_args(
        ["--credit", "entropy", "--shaping", "entropy-adv", "--layers", "2:4", "--gamma", "2"]
    )
    assert (cfg.credit, cfg.shaping, cfg.layers, cfg.gamma) == ("entropy", "entropy-adv", "2:4", 2.0)


BAD_FILES = [  # (file name, content, a word the line must contain); each fails before the model loads
    ("bad.jsonl", '{"question": "1+1", "answer": "2"}\n{not json\n', "line 2"),
    ("missing.jsonl", '{"question": "1+1"}\n', "answer"),
    ("wrongtype.jsonl", '{"question": 5, "answer": "2"}\n', "question"),
    ("empty.jsonl", "", "empty.jsonl"),
    ("table.csv", "question,answer\n1+1,2\n", "table.csv"),
    ("latin1.jsonl", b'{"question": "caf\xe9", "answer": "2"}\n', "latin1.jsonl"),
]


@pytest.mark.parametrize("name, content, word", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_data_path_fails_before_the_model_loads(tmp_path, monkeypatch, capsys, name, content, word):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.setattr(
        trainable, "load_model", lambda *a, **k: pytest.fail("the model loaded before the data")
    )
    with pytest.raises(SystemExit) as e:
        grpo.main(["--data-path", str(path), "--dataset", "arithmetic", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("grpo.py: error: ") and word in err[-1], err


def test_missing_data_file_and_existing_run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainable, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        grpo.main(["--data-path", str(tmp_path / "nosuch.jsonl"), "--out-dir", str(tmp_path / "r")])
    assert e.value.code == 2 and "nosuch.jsonl" in capsys.readouterr().err
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(SystemExit) as e:
        grpo.main(["--out-dir", str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--resume" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_text() == json.dumps({"step": 1}) + "\n"  # nothing was truncated


def test_subprocess_error_is_one_line_without_traceback(tmp_path):
    p = subprocess.run(
        [sys.executable, str(ROOT / "grpo.py"), "--group-size", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("grpo.py: error: --group-size")


# ----------------------------------------------------------------------------- presets and the run directory
def test_naming_the_embedded_model_runs_the_same_demo():
    """The preset follows what --model means, not whether it appeared: the embedded model, named or not, or
    as its .gguf file, gets the 6-step demo; a paper model gets the paper's preset; another, the defaults."""
    demo = grpo.parse_args([])
    assert (demo.model, demo.steps, demo.out_dir) == (
        "smollm2-135m",
        presets.EMBEDDED["steps"],
        "runs/embedded",
    )
    assert grpo.parse_args(["--model", "smollm2-135m"]) == demo
    assert grpo.parse_args(["--model=smollm2-135m"]) == demo
    from_file = grpo.parse_args(["--model", f"/models/{gguf.SMOLLM2_GGUF}"])
    assert dataclasses.replace(from_file, model=demo.model) == demo
    paper = grpo.parse_args(["--model", "Qwen/Qwen3-4B-Base"])
    assert paper == grpo.Config(model="Qwen/Qwen3-4B-Base", **presets.PAPER_MODEL)
    assert grpo.parse_args(["--model", "tiny-qwen3"]) == grpo.Config(model="tiny-qwen3")
    assert grpo.parse_args(["--steps", "2"]).steps == 2  # a flag given wins


def test_a_model_that_fails_to_load_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    """The run directory (and its .lock) is made once the model has loaded; --overwrite deletes the old run
    only then, so a failed load keeps it."""

    def fails(cfg, *a, **k):
        raise pretrained.ModelError(f"--model {cfg.model}: not in the local hub cache")

    monkeypatch.setattr(trainable, "load_policy", fails)
    with pytest.raises(SystemExit) as e:
        grpo.main(["--model", "org/name", "--out-dir", str(tmp_path / "run")])
    assert e.value.code == 2 and "org/name" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(SystemExit) as e:
        grpo.main(["--model", "org/name", "--out-dir", str(old), "--overwrite"])
    assert e.value.code == 2 and sorted(p.name for p in old.iterdir()) == ["metrics.jsonl"]


# ----------------------------------------------------------------------------- the embedded defaults
def test_unknown_flag_is_an_error():
    with pytest.raises(SystemExit):
        parse_args(["--no-such-flag", "1"])


def test_embedded_defaults_apply_only_to_the_embedded_model():
    assert parse_args([]).steps == presets.EMBEDDED["steps"]
    assert parse_args(["--steps", "3"]).steps == 3
    paper = parse_args(["--model", "Qwen/Qwen3-4B-Base"])
    assert (paper.lr, paper.group_size, paper.top_frac, paper.gamma, paper.temperature) == (
        1e-6,
        8,
        0.4,
        1.5,
        0.99,
    )


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
