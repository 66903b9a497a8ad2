"""--precision (training/model/trainable.py departure 4): what auto picks by the card's compute capability
(faked), the flags that cannot go together (one error line each), an fp16 LoRA run on the CPU (fp16 base, fp32
adapters, fp16 autocast, a GradScaler) that trains, says so in one line and resumes exactly with the scaler's
state, a
step the scaler skips that is not a non-finite one, and the learning rate's line and notice."""

import json

import pytest
import torch
from test_lora import TINY, stable, toy_reward

import grpo
from training import policy
from training.model import trainable

T4, A100 = (7, 5), (8, 0)


def cfg(*argv):
    return grpo.parse_args(["--model", "tiny-qwen3", *argv])


# ----------------------------------------------------------------------------- what auto picks, by the card
@pytest.mark.parametrize("lora", [False, True])
def test_auto_picks_by_the_cards_compute_capability(lora, monkeypatch):
    """Below 8.0 (a T4: 7.5) auto picks fp16 for LoRA and fp32 AdamW for full fine-tuning; from 8.0 bf16
    (Kahan AdamW, or a bf16 base); on the CPU fp32. The card is read from torch.cuda, faked here."""
    c = cfg(*(["--lora-rank", "8"] if lora else []))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: T4)
    t4 = trainable.precision(c, "cuda")
    assert (t4.name, t4.scheme) == (("fp16", "lora") if lora else ("fp32", "adamw"))
    assert t4.weights == (torch.float16 if lora else torch.float32)
    assert t4.autocast == (torch.float16 if lora else None) and not t4.math_sdpa
    assert "compute capability 7.5 has no bf16 tensor cores" in t4.line and t4.line.count("\n") == 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: A100)
    a100 = trainable.precision(c, "cuda")
    assert (a100.name, a100.scheme, a100.weights) == ("bf16", "lora" if lora else "kahan", torch.bfloat16)
    cpu = trainable.precision(c, "cpu")
    assert (cpu.name, cpu.weights, cpu.autocast) == ("fp32", torch.float32, None)
    assert trainable.precision(c, "cuda", T4) == t4  # the capability as an argument


def test_bf16_below_8_runs_the_math_kernel_and_says_so():
    """--precision bf16 (or --optimizer kahan) on a T4: it runs, emulated, on SDPA's math kernel: said in the
    line, and memory.py counts the kernel's score matrices."""
    for c in (cfg("--lora-rank", "8", "--precision", "bf16"), cfg("--optimizer", "kahan")):
        p = trainable.precision(c, "cuda", T4)
        assert p.name == "bf16" and p.math_sdpa and "SDPA's math kernel" in p.line
        assert not trainable.precision(c, "cuda", A100).math_sdpa


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--precision", "fp16"], "--precision fp16 needs --lora-rank"),
        (["--optimizer", "kahan", "--lora-rank", "8"], "--optimizer kahan is for full fine-tuning"),
        (["--optimizer", "kahan", "--precision", "fp32"], "--optimizer kahan keeps bf16 weights"),
    ],
)
def test_flags_that_cannot_go_together_are_one_error_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(argv)  # the embedded model: no load
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith(f"grpo.py: error: {says}")


# ----------------------------------------------------------------------------- fp16 LoRA on the CPU
def scaler_state(out):
    return torch.load(out / "ckpt" / "trainer_state.pt", weights_only=True)["optimizer"]["grad_scaler"]


def test_an_fp16_lora_run_trains_says_so_and_resumes_exactly_with_its_scaler(tmp_path, monkeypatch, capsys):
    """--lora-rank 4 --precision fp16 on the CPU: one line says fp16; the base is fp16, the adapters and
    their AdamW states fp32, the forward under fp16 autocast; rows train and the adapters move. Three steps,
    or two then --resume: the third step's metrics, the adapters and the GradScaler's state are equal, the
    scaler's state saved with the checkpoint (its growth tracker has counted the clean steps)."""
    toy_reward(monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    argv = [*TINY, "--lora-rank", "4", "--lr", "1e-2", "--precision", "fp16"]
    run = grpo.setup(c := grpo.parse_args([*argv, "--steps", "3", "--out-dir", str(a)]))
    full = grpo.train(c, run).history
    out = capsys.readouterr().out
    assert [x for x in out.splitlines() if x.startswith("precision:")] == [
        "precision: fp16 (--precision fp16): fp16 frozen base, fp32 adapters and AdamW, fp16 autocast, "
        "a GradScaler"
    ]
    dtypes = {n: p.dtype for n, p in run.policy.model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.float16}
    assert all(
        v.dtype == torch.float32
        for st in run.policy.opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    assert sum(m["rows/trained"] for m in full) > 0 and all("scaler/scale" in m for m in full)
    assert any(p.abs().max() > 0 for n, p in run.policy.model.named_parameters() if "lora_B" in n)
    grpo.train(grpo.parse_args([*argv, "--steps", "2", "--out-dir", str(b)]))
    saved = scaler_state(b)
    assert saved["_growth_tracker"] + (saved["scale"] < 2**16) > 0  # not a fresh scaler's state
    resumed = grpo.setup(grpo.parse_args(["--resume", str(b), "--steps", "3"]))
    assert resumed.policy.opt.scaler.state_dict() == saved
    more = grpo.train(resumed.cfg, resumed).history
    assert stable(more[0]) == stable(full[2])
    assert scaler_state(a) == scaler_state(b)
    from safetensors.torch import load_file

    wa, wb = (load_file(str(d / "ckpt" / "adapter_model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((b / "ckpt" / "run_config.json").read_text())["precision"] == "fp16"


def test_a_step_the_scaler_skips_is_not_a_non_finite_step(tmp_path, monkeypatch):
    """A scale so large that the scaled fp16 gradient overflows: the GradScaler skips the step and halves its
    scale; under --max-bad-steps 1 the run goes on (a non-finite step would stop it), the adapters and the
    schedule stay, and the metrics say scaler/skipped."""
    toy_reward(monkeypatch)
    c = grpo.parse_args(
        [
            *TINY,
            "--lora-rank",
            "4",
            "--lr",
            "1e-2",
            "--precision",
            "fp16",
            "--steps",
            "2",
            "--max-bad-steps",
            "1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    run = grpo.setup(c)
    run.policy.opt.scaler.load_state_dict(
        {**run.policy.opt.scaler.state_dict(), "scale": 2.0**120}
    )  # fp32 holds it
    before = {n: p.detach().clone() for n, p in run.policy.model.named_parameters() if "lora_" in n}
    out = grpo.train(c, run)
    first = next(m for m in out.history if m["rows/trained"] > 0)
    assert out.status == 0 and out.stop is None and len(out.history) == 2
    assert first["scaler/skipped"] == 1 and first["bad_steps"] == 0 and first["scaler/scale"] == 2.0**119
    assert all(m["scaler/skipped"] == 1 for m in out.history if m["rows/trained"] > 0)
    assert all(torch.equal(p, before[n]) for n, p in run.policy.model.named_parameters() if "lora_" in n)
    assert int(run.policy.sched.last_epoch) == 0  # no optimizer step was taken


def test_the_optimizer_step_tells_a_skip_from_a_non_finite_loss():
    """Policy.step under a GradScaler (CPU): a finite step steps; an overflowing gradient is a skip (the
    scale halves); a NaN loss is neither: a non-finite step, as without a scaler."""
    m = torch.nn.Linear(4, 1, bias=False)
    w = m.weight
    torch.nn.init.ones_(w)

    def policy_of(opt):
        return policy.Policy(m, None, None, opt, None, None, torch.device("cpu"))

    pol = policy_of(policy.ScaledAdamW([w], "cpu", lr=0.1))
    pol.backward((w * 2).sum())
    s = pol.step(8.0, 1.0)
    assert (s.stepped, s.skipped, s.scale) == (True, False, 2.0**16) and not torch.equal(w, torch.ones(1, 4))
    w.grad = torch.full((1, 4), float("inf"))
    s = pol.step(8.0, 1.0)
    assert (s.stepped, s.skipped, s.scale) == (False, True, 2.0**15)
    w.grad = torch.ones(1, 4)
    s = pol.step(float("nan"), 1.0)
    assert (s.stepped, s.skipped) == (False, False) and w.grad is None
    x = torch.tensor(3.0, requires_grad=True)
    policy_of(torch.optim.AdamW([w], lr=0.1)).backward(x * 1.0)
    assert x.grad == 1.0  # no scaler: the loss itself


# ----------------------------------------------------------------------------- the learning rate, said
def test_the_learning_rate_and_where_it_came_from(tmp_path, capsys):
    """flags.parse says where the lr came from as it resolves it (presets.lr_lines; say=True: grpo.main's
    first lines): the default (the paper's), a preset (the embedded model's), LoRA's 10x, --lr (also at its
    default value), a --config file; and one notice when a file's lr (a file without lora_rank) meets
    --lora-rank on the command line. Without say, nothing is printed."""

    def said(*argv):
        capsys.readouterr()
        grpo.parse_args(list(argv), say=True)
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith(("lr ", "notice: lr"))]

    tiny = ("--model", "tiny-qwen3")
    assert said(*tiny) == ["lr 1e-06: the default (AdamW learning rate (the paper's, §4.1, App. C.3))"]
    assert said() == ["lr 1e-05: set by the embedded model"]
    assert said("--lora-rank", "8") == [
        "lr 0.0001: set by --lora-rank on the embedded model: 10 x 1e-05, full fine-tuning's"
    ]
    assert said(*tiny, "--lora-rank", "8", "--lr", "3e-5") == ["lr 3e-05: --lr"]
    assert said(*tiny, "--lr", "1e-6") == ["lr 1e-06: --lr"]  # given at its default
    full = tmp_path / "full.yaml"
    full.write_text("lr: 2e-6\n")
    assert said(*tiny, "--config", str(full)) == [f"lr 2e-06: --config {full}"]
    lines = said(*tiny, "--config", str(full), "--lora-rank", "8")
    assert lines[0] == f"lr 2e-06: --config {full}" and len(lines) == 2
    assert lines[1].startswith(
        f"notice: lr 2e-06 comes from --config {full}, which does not set lora_rank, "
        f"while --lora-rank 8 is given on the command line"
    )
    both = tmp_path / "lora.yaml"
    both.write_text("lr: 2e-5\nlora_rank: 8\n")
    assert said(*tiny, "--config", str(both)) == [f"lr 2e-05: --config {both}"]  # no notice
    assert said(*tiny, "--config", str(full), "--lora-rank", "8", "--lr", "3e-5") == ["lr 3e-05: --lr"]
    capsys.readouterr()
    grpo.parse_args(["--lora-rank", "8"])
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- the estimate, by the card
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_math_kernel_saves_what_layer_saved_counts(dtype):
    """One Qwen3 decoder layer with SDPA forced onto its math kernel (the kernel bf16 gets below compute
    capability 8.0): what it saves for backward, counted by track_peak, equals layer_saved(math=True); its
    fp32 score matrices make it larger than the fused kernels' count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    from evaluation import memtrace
    from training.memory import terms
    from training.model.load import tiny_config

    mc = tiny_config("tiny-qwen3", 260)
    mc._attn_implementation = "sdpa"
    b, T = 3, 40
    layer = Qwen3DecoderLayer(mc, 0).to(dtype)
    x = torch.randn(b, T, mc.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = Qwen3RotaryEmbedding(mc)(x, torch.arange(T)[None].expand(b, T))
    mask = torch.ones(b, 1, T, T, dtype=torch.bool).tril()
    mask[0, :, :, :5] = False  # left padding in row 0
    with memtrace.track_peak(layer, x, cos, sin, mask) as tr, sdpa_kernel(SDPBackend.MATH):
        base = tr.now
        out = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, tuple) else out
        saved = tr.now - base - out.untyped_storage().nbytes()
    nb = 4 if dtype == torch.float32 else 2
    assert saved == b * T * terms.layer_saved(mc, T, nb, nb, math=True)
    assert terms.layer_saved(mc, T, nb, nb, math=True) > terms.layer_saved(mc, T, nb, nb)


def test_the_estimate_counts_the_kernel_the_card_runs():
    """Qwen3-4B's step under --precision bf16 on a T4 (7.5: the math kernel) holds more than on an A100 (8.0:
    a fused kernel), by at least the backward's two score-sized gradients of one micro-batch; fp16 on the T4
    (the memory-efficient kernel) holds what it holds on the A100; and its weights are 2 bytes a parameter,
    fp32 AdamW's 4."""
    from training.memory import phases, shapes, terms
    from training.model.load import qwen3_4b_config

    mc = qwen3_4b_config()
    bf16 = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16", "--precision", "bf16"])
    est = {cap: phases.estimate(bf16, mc, "cuda", 256, cap=cap) for cap in (T4, A100)}
    b, T = bf16.micro_batch, 256 + bf16.max_new_tokens
    grew = sum(est[T4]["backward"].values()) - sum(est[A100]["backward"].values())
    assert grew >= terms.math_scores(b, mc.num_attention_heads, T, T)
    assert sum(est[T4]["update forward"].values()) > sum(est[A100]["update forward"].values())
    fp16 = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16", "--precision", "fp16"])
    assert phases.estimate(fp16, mc, "cuda", 256, cap=T4) == phases.estimate(fp16, mc, "cuda", 256, cap=A100)
    full = grpo.parse_args(["--model", "qwen3-4b-random"])  # auto: fp32 AdamW on a T4
    N = shapes.param_counts(mc)[0]
    copy = shapes.read_shapes(full, mc, "cuda", 256, cap=T4).decode_copy  # the fused step's merged Q K V, ...
    assert copy > 0
    assert phases.estimate(full, mc, "cuda", 256, cap=T4)["generation"]["weights"] == 4 * N + copy
    assert phases.estimate(fp16, mc, "cuda", 256, cap=T4)["generation"]["weights"] < 2.1 * N
