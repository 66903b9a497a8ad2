"""The trained model in use (README): a run's ckpt/ is a save_pretrained directory. grpo.py's command line
writes one that transformers' AutoModelForCausalLM loads and `eval.py bench` evaluates; the model it loads
is the model the run trained (its logits, exactly, on the CPU in fp32)."""

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, subprocess_env
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import grpo
from training.model.load import load_model

RUN = [
    "--model",
    "tiny-qwen3",
    "--device",
    "cpu",
    "--steps",
    "1",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "8",
]
TEXT = ["What is 2 + 3? Put the answer in \\boxed{}.", "Tom has 4 apples and eats one."]


def logits(model, tok):
    enc = tok(TEXT, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.eval()(**enc).logits  # (2, T, V)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    done = subprocess.run(
        [sys.executable, "grpo.py", *RUN, "--out-dir", str(out)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_the_command_lines_checkpoint_loads_with_from_pretrained_and_benches(cli_run):
    ckpt = cli_run / "ckpt"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    ref, _ = load_model("tiny-qwen3", device="cpu")  # the architecture, its own weights
    ref.load_state_dict(load_file(ckpt / "model.safetensors"))  # ... all replaced by the saved ones
    assert torch.equal(logits(model, tok), logits(ref, tok))
    cmd = [
        sys.executable,
        "eval.py",
        "bench",
        "--model",
        str(ckpt),
        "--benchmarks",
        "arithmetic",
        "--n-problems",
        "2",
        "--n",
        "1",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--out",
        str(cli_run / "b"),
    ]
    bench = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, check=False)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert "| arithmetic | 2 | 1 |" in bench.stdout and (cli_run / "b" / "bench.json").is_file()


def test_from_pretrained_gives_the_trained_models_logits(tmp_path, monkeypatch):
    """In process, with a reward that tiny-qwen3's responses sometimes meet (so the step changes the weights):
    the model the run holds at its end and the one from_pretrained loads from its ckpt/ give equal logits."""
    monkeypatch.setattr(data, "reward", lambda text, record: float(len(text) % 2 == 0))
    cfg = grpo.parse_args([*RUN, "--lr", "1e-2", "--warmup-steps", "1", "--out-dir", str(tmp_path / "run")])
    run = grpo.setup(cfg)
    before = {n: p.detach().clone() for n, p in run.policy.model.named_parameters()}
    out = grpo.train(cfg, run)
    assert out.status == 0 and out.history[0]["rows/trained"] > 0
    assert any(not torch.equal(before[n], p) for n, p in run.policy.model.named_parameters())  # it trained
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "ckpt", dtype=torch.float32)
    assert torch.equal(logits(loaded, run.policy.tok), logits(run.policy.model, run.policy.tok))
