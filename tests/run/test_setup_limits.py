"""What setup reads of the card and the model before the first step, said in one line: the card's free memory
and what other processes hold, the reserve taken of what is free (budget.size); the model's positions
(prompt + --max-new-tokens within max_position_embeddings: refused, or the prompt skipped and counted); what
`eval.py memory` says grpo.py picks, equal to what budget.size picks; and the precision --precision resolved
to, recorded in run_config.json beside it (an old run_config.json without it still resumes)."""

import json

import pytest
import torch
from conftest import TINY_RUN

import grpo
from evaluation import memory
from training.memory import budget
from training.run import setup as run_mod

GB = budget.GB


def fake_card(monkeypatch, free, total):
    """A CUDA device with `free` of its `total` bytes free (torch.cuda.mem_get_info), capability 9.0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


# ----------------------------------------------------------------------------- the card's free memory
def test_the_budget_names_the_free_memory_and_plans_from_it(monkeypatch, capsys):
    """70 of 80 GB held by another process: the line names 10.0 GB free and the 70.0 GB held; the plan is 90%
    of what is free (and this process's context, which the margin counts): 9.9 GB, where it was 80 x 0.9 - 69
    = 3.0 GB."""
    fake_card(monkeypatch, 10 * GB, 80 * GB)
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--max-new-tokens", "64"])
    got = budget.size(cfg, torch.device("cuda"), 256)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        "budget: 10.0 GB free of 80.0 GB (torch.cuda.mem_get_info): 70.0 GB held by other processes" in line
    )
    assert "; 9.9 GB planned (a 10% reserve of what is free)" in line
    assert got.planned == pytest.approx((10 + 1) * GB * (1 - budget.RESERVE))
    assert got.plan.peak <= got.planned


def test_a_step_past_the_free_memory_is_one_error_naming_it(monkeypatch):
    """Qwen3-4B LoRA with 10 GB free of 80: the error names the free memory, the other processes' and what
    is planned, not the card's 80 GB alone; --gpu-gb 24 beyond the 10 GB free is said too."""
    fake_card(monkeypatch, 10 * GB, 80 * GB)
    cfg = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16"])
    with pytest.raises(ValueError) as e:
        budget.size(cfg, torch.device("cuda"), 256)
    assert "the GPU has 10.0 GB free of 80.0 GB (torch.cuda.mem_get_info): 70.0 GB held by other " in str(
        e.value
    )
    assert "9.9 GB planned" in str(e.value)
    cfg = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16", "--gpu-gb", "24"])
    with pytest.raises(ValueError, match=r"the GPU has 24.0 GB \(--gpu-gb\), but 10.0 GB free of 80.0 GB"):
        budget.size(cfg, torch.device("cuda"), 256)


# ----------------------------------------------------------------------------- what eval.py memory says
@pytest.mark.parametrize("gpu_gb", ["1", "24", "1e9"])
def test_eval_memory_says_what_budget_size_picks_for_any_gpu_gb(gpu_gb, monkeypatch, capsys):
    """`eval.py memory --lora-rank 16 --gpu-gb N`: its line "grpo.py picks" names the sizes budget.size picks
    on a free card of N GB (1 GB: nothing fits, and the line says so); on the CPU, the CPU's sizes."""
    flags = ["--model", "qwen3-4b-random", "--lora-rank", "16", "--gpu-gb", gpu_gb]
    line = next(x for x in memory.report(grpo.parse_args(flags), 256).splitlines() if x.startswith("grpo.py"))
    assert f"for --gpu-gb {float(gpu_gb):g}" in line
    fake_card(monkeypatch, float(gpu_gb) * GB, float(gpu_gb) * GB)
    cfg = grpo.parse_args(flags)
    try:
        b = budget.size(cfg, torch.device("cuda"), 256)
    except ValueError:
        assert line.startswith("grpo.py picks nothing") and gpu_gb == "1"
        return
    capsys.readouterr()
    assert line.startswith(
        f"grpo.py picks gen_chunk {cfg.gen_chunk}, micro_batch {cfg.micro_batch}, the engine "
        f"{budget.LAYOUTS[b.plan.release]}"
    )
    cpu = grpo.parse_args(["--model", "qwen3-4b-random", "--device", "cpu"])
    out = memory.report(cpu, 256, device="cpu").splitlines()
    assert "grpo.py picks gen_chunk 64, micro_batch 8 on the CPU" in "\n".join(out)


# ----------------------------------------------------------------------------- the model's positions
def test_max_new_tokens_past_the_models_positions_is_one_line(in_process, tmp_path):
    """tiny-qwen3 has 2,048 positions: --max-new-tokens 2048 leaves none for the prompt: exit 2, one line,
    nothing written (it trained past the model's length before)."""
    out = tmp_path / "run"
    flags = ["--model", "tiny-qwen3", "--max-new-tokens", "2048", "--device", "cpu", "--steps", "1"]
    p = in_process(grpo.main, *flags, "--prompts-per-step", "1", "--group-size", "2", "--out-dir", out)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "grpo.py: error: --max-new-tokens 2048: tiny-qwen3 has 2048 positions" in p.stderr
    assert not out.exists()


def test_a_prompt_past_the_models_positions_is_skipped_and_counted(tmp_path, capsys):
    """A question of about 2,500 tokens under --max-prompt-tokens 4000 on tiny-qwen3 (2,048 positions): one
    line at setup; its step skips it and counts it in prompts/skipped_long, as --max-prompt-tokens does."""
    rows = [
        {"question": "What is 3 + 4? " + "word " * 500, "answer": "7"},
        {"question": "1 + 1?", "answer": 2},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text("def score(completion, record):\n    return 0.0\n")
    cfg = grpo.parse_args(
        [
            *TINY_RUN,
            "--dataset",
            "custom",
            "--data-path",
            str(tmp_path / "train.jsonl"),
            "--reward",
            f"{tmp_path / 'reward.py'}:score",
            "--max-prompt-tokens",
            "4000",
            "--prompts-per-step",
            "2",
            "--steps",
            "1",
            "--out-dir",
            str(tmp_path / "run"),
        ]
    )
    out = grpo.train(cfg)
    said = capsys.readouterr().out
    assert (
        "prompts: 1 of the run's 2 prompts are longer than 2040 tokens (tiny-qwen3's 2048 positions less "
        "--max-new-tokens 8): skipped and counted" in said
    )
    assert out.history[0]["prompts/skipped_long"] == 1
    assert "step 1: 1 prompt(s) longer than 2040 tokens (tiny-qwen3's 2048 positions" in said


def test_the_limit_is_max_prompt_tokens_within_the_positions_and_held_out_questions_past_them_refused():
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--max-new-tokens", "100", "--max-prompt-tokens", "50"])
    assert run_mod.prompt_limit(cfg, [], [], 2048) == (50, "--max-prompt-tokens 50")
    assert run_mod.prompt_limit(cfg, [], [], 120).tokens == 20
    long = grpo.parse_args(["--model", "tiny-qwen3", "--max-new-tokens", "2000"])
    assert run_mod.prompt_limit(long, [], []).tokens == 48  # tiny-qwen3's config: 2,048 positions
    with pytest.raises(ValueError, match="1 of the 2 held-out questions are longer than 48 tokens"):
        run_mod.prompt_limit(long, [10], [10, 60])


# ----------------------------------------------------------------------------- the precision recorded
def test_run_config_records_the_resolved_precision_and_an_old_one_resumes(tmp_path):
    """run_config.json: "precision": "auto" as asked, "precision_resolved": "fp32" as run (the CPU). A
    run_config.json written before the field (without it) resumes, and its next save records it."""
    run = tmp_path / "run"
    grpo.train(grpo.parse_args([*TINY_RUN, "--steps", "1", "--out-dir", str(run)]))
    saved = json.loads((run / "ckpt" / "run_config.json").read_text())
    assert saved["precision"] == "auto" and saved["precision_resolved"] == "fp32"
    del saved["precision_resolved"]  # as a run_config.json was written before
    (run / "ckpt" / "run_config.json").write_text(json.dumps(saved, indent=1))
    out = grpo.train(grpo.parse_args(["--resume", str(run), "--steps", "2"]))
    assert out.status == 0 and len(out.history) == 1
    assert json.loads((run / "ckpt" / "run_config.json").read_text())["precision_resolved"] == "fp32"
