"""LoRA (grpo.py departure 9, lora.py): at initialisation the adapted model is the base model (log-probs,
FlowTracer's maps and credit equal exactly on the CPU), a step changes the adapters alone, the reference of
--beta is the base with the adapters off, the learning rate preset, --resume continues a LoRA run exactly, and
LoRA flags that name nothing or ask too much are one line (grpo.py and the TRL plug-in)."""

import json
import zlib

import pytest
import torch
from conftest import TINY_RUN
from safetensors.torch import load_file

import flowtracer
import grpo
from data import build_batch
from flowtracer import Capture, flow_credit, select_layers, trace_flow
from training import policy
from training.config import presets
from training.decode import rollout
from training.model import load, lora, trainable

TINY = [
    "--model",
    "tiny-qwen3",
    "--device",
    "cpu",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "12",
    "--micro-batch",
    "4",
    "--warmup-steps",
    "1",
    "--save-every",
    "1",
    "--seed",
    "3",
]


PROMPTS = ["Q: 1+1? A: 2. Q: 4+4? A:", "Q: 1+1? A: 2. Q: 10+7? A:", "no shared prefix"]


def toy_reward(monkeypatch):
    """A random tiny model never answers: every group would have A = 0. A reward it earns by the text's hash
    (as tests/test_reading_path.py) makes rows train."""
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: zlib.crc32(txt.encode()) % 4 / 3)


def base_name(name):
    """A peft-wrapped parameter's name in the plain model."""
    return name.replace("base_model.model.", "").replace(".base_layer", "")


def batch_of(tok):
    """Two prompts of 9 and 6 tokens, two responses each (a shared prompt), left-padded: (B = 4, T)."""
    prompts = [list(range(40, 49)), list(range(60, 66))]
    responses = [list(range(70, 80)), list(range(81, 86)), list(range(90, 97)), list(range(100, 110))]
    return build_batch(tok, [prompts[0], prompts[0], prompts[1], prompts[1]], responses)


def credit_of(model, batch, share, layers):
    """(log-probs (B, R), captured maps (B, T, T), weight (B, R)) of grpo.update's first micro-batch."""
    cap = Capture(layers)
    logp, _ = policy.token_logprobs(
        model, batch.input_ids, batch.attention_mask, batch.prompt_width, 4, share, capture=cap
    )
    W = cap.maps(batch.attention_mask)
    flow = trace_flow(W.clone(), batch.question_mask, batch.answer_mask, batch.attention_mask)
    c = flow_credit(flow.throughput, batch.response_mask, 0.4, 1.5, prompt_width=batch.prompt_width)
    return logp, W, c.weight


@pytest.mark.parametrize("share,ckpt", [(True, True), (False, False)])
def test_at_initialisation_lora_equals_the_base_exactly(share, ckpt):
    """B = 0: the adapters add exact zeros, so log-probs, maps and gamma are the base model's bit for bit.
    The base is frozen as LoRA leaves it (torch's matmul folds a 3-D input into another GEMM shape when the
    weight needs no gradient: the head's log-probs would differ in the last bit either way, LoRA or not)."""
    cfg = grpo.parse_args([*TINY, "--lora-rank", "8"])
    base, tok = load.load_model("tiny-qwen3", device="cpu", attn_implementation=flowtracer.IMPL)
    if ckpt:
        policy.checkpointing(base)
    batch, layers = batch_of(tok), select_layers(cfg.layers, base.config.num_hidden_layers)
    base.train()
    base.requires_grad_(False)
    want = credit_of(base, batch, share, layers)
    adapted = lora.with_lora(base, cfg)
    assert any("lora_A" in n for n, _ in adapted.named_parameters())
    adapted.train()
    for a, b in zip(want, credit_of(adapted, batch, share, layers)):
        assert torch.equal(a, b)


def test_a_step_changes_the_adapters_alone(tmp_path, monkeypatch):
    """One grpo.train step under --lora-rank: rows are trained, every lora_B moves off zero, and every base
    weight is bit-equal to the loaded model's; the optimizer holds the adapters only."""
    toy_reward(monkeypatch)
    cfg = grpo.parse_args([*TINY, "--lora-rank", "4", "--steps", "1", "--out-dir", str(tmp_path)])
    run = grpo.setup(cfg)
    assert trainable.scheme(cfg, "cpu") == "lora"
    trained = [p for p in run.policy.model.parameters() if p.requires_grad]
    assert {id(p) for g in run.policy.opt.param_groups for p in g["params"]} == {id(p) for p in trained}
    out = grpo.train(cfg, run)
    assert out.history[0]["rows/trained"] > 0 and out.history[0]["grad_norm"] > 0
    init = dict(load.load_model("tiny-qwen3", device="cpu")[0].named_parameters())
    for name, p in run.policy.model.named_parameters():
        if "lora_" in name:
            assert p.dtype == torch.float32 and p.requires_grad
            if "lora_B" in name:
                assert p.abs().max() > 0, name
        else:
            assert not p.requires_grad and torch.equal(p, init[base_name(name)]), name
    saved = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # the adapters, not the base


def test_the_reference_is_the_base_with_the_adapters_off():
    """--beta > 0 under LoRA: Policy.ref_logprobs are the base model's (peft's disable_adapter), after the
    adapters moved; the reference is no second model."""
    cfg = grpo.parse_args([*TINY, "--lora-rank", "4", "--beta", "0.1"])
    pol = trainable.load_policy(cfg, torch.device("cpu"))
    model, tok = pol.model, pol.tok
    assert pol.ref is model
    base = load.load_model("tiny-qwen3", device="cpu")[0]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    batch = batch_of(tok)
    rows = list(range(batch.input_ids.shape[0]))
    want = policy.fixed_logprobs(base, batch, rows, 2, 4)
    got = pol.ref_logprobs(batch, rows, 2, 4)
    moved = policy.fixed_logprobs(model, batch, rows, 2, 4)
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(moved, want, atol=1e-3)


def test_lora_learning_rate_is_ten_times_the_presets_and_flags_win():
    assert grpo.parse_args(["--model", "tiny-qwen3", "--lora-rank", "8"]).lr == pytest.approx(1e-5)
    assert grpo.parse_args(["--lora-rank", "8"]).lr == pytest.approx(1e-4)  # the embedded model's 1e-5
    assert grpo.parse_args(["--model", "tiny-qwen3", "--lora-rank", "8", "--lr", "3e-5"]).lr == 3e-5
    assert grpo.parse_args(["--model", "tiny-qwen3"]).lr == 1e-6


@pytest.mark.parametrize("flag", ["--lora-rank=-1", "--lora-alpha=0", "--lora-dropout=1", "--gpu-gb=-2"])
def test_bad_lora_flags_are_one_line(flag, capsys):
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(["--model", "tiny-qwen3", flag])
    assert e.value.code == 2 and "grpo.py: error: --" + flag[2:].split("=")[0] in capsys.readouterr().err


def test_lora_targets_that_name_no_module_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        grpo.main(
            [*TINY, "--lora-rank", "4", "--lora-targets", "nothing_here", "--out-dir", str(tmp_path / "o")]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("grpo.py: error: --lora-targets") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def stable(m):
    return {k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}


def test_a_resumed_lora_run_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    """Three steps, or two then --resume for the third: the third step's metrics and adapters are equal."""
    toy_reward(monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    flags = [*TINY, "--lora-rank", "4", "--lr", "1e-2"]
    full = grpo.train(grpo.parse_args([*flags, "--steps", "3", "--out-dir", str(a)])).history
    grpo.train(grpo.parse_args([*flags, "--steps", "2", "--out-dir", str(b)]))
    more = grpo.train(grpo.parse_args(["--resume", str(b), "--steps", "3"])).history
    assert any(m["rows/trained"] > 0 for m in full[:2])
    assert stable(more[0]) == stable(full[2])
    wa, wb = (load_file(str(d / "ckpt" / "adapter_model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((b / "ckpt" / "run_config.json").read_text())["lora_rank"] == 4


@pytest.mark.parametrize("credit_pass", ["fused", "separate"])
def test_flowtracer_trl_trains_lora_with_flow_credit_through_peft(credit_pass, tmp_path):
    """flowtracer_trl.py's peft_config: TRL wraps the policy in peft, FlowTracer's capture and credit read it
    (gamma != 1 on some tokens, no fallback), and the step moves the adapters alone."""
    pytest.importorskip("trl")
    from test_flowtracer_trl import one_step

    import flowtracer_trl as ft

    args = ft.parse_args(["--model", "tiny-qwen3", "--lora-rank", "4", "--credit-pass", credit_pass])[0]
    tr, _, init = one_step(
        ft.FlowTracerGRPOTrainer,
        tmp_path,
        peft_config=lora.lora_config(args),
        credit_cfg=grpo.Config(credit_pass=credit_pass),
    )
    assert type(tr.model).__name__.startswith("PeftModel") and tr.fused == (credit_pass == "fused")
    logged = next(m for m in tr.state.log_history if "loss" in m)
    assert 0 < logged["credit/boosted_frac"] < 1 and logged["credit/fallback_frac"] == 0.0
    moved = {n: p for n, p in tr.model.named_parameters() if "lora_B" in n}
    assert moved and all(p.abs().max() > 0 for p in moved.values())
    for n, p in tr.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, init[base_name(n)]), n


def test_flowtracer_trl_lora_flags_and_learning_rate():
    import flowtracer_trl as ft
    from training.config import trl_setup

    args, _, targs = ft.parse_args(["--model", "tiny-qwen3", "--lora-rank", "8"])
    assert (args.lora_rank, args.lora_alpha, args.lora_targets) == (8, 32.0, "all-linear")
    assert targs.learning_rate == pytest.approx(
        presets.LORA_LR_FACTOR * trl_setup.defaults(grpo.Config)["learning_rate"]
    )
    assert ft.parse_args(["--lora-rank", "8", "--learning-rate", "3e-5"])[2].learning_rate == 3e-5
    assert ft.parse_args([])[2].learning_rate == trl_setup.defaults(grpo.Config)["learning_rate"]


@pytest.mark.parametrize(
    "argv, want",
    [([], torch.bfloat16), (["--fp16", "True"], torch.float16), (["--use-cpu", "True"], torch.float32)],
)
def test_flowtracer_trl_lora_loads_its_base_in_16_bits_on_a_gpu(argv, want, monkeypatch):
    """flowtracer_trl.py --lora-rank on a GPU (--use-cpu False, as its default there) gives TRL the frozen
    base in bf16 (fp16 under --fp16): loaded here for a local name, TRL's model_init_kwargs for a hub name
    (TRL's own default would be fp32); on the CPU fp32. The trainer is stopped before it is made."""
    import flowtracer_trl as ft
    from training.config import trl_setup

    class Made(Exception):
        pass

    seen = {}

    def trainer(model, args, **kw):
        seen["trainer"] = (model, dict(args.model_init_kwargs or {}))
        raise Made

    real = load.load_model
    monkeypatch.setattr(ft, "FlowTracerGRPOTrainer", trainer)
    monkeypatch.setattr(
        trl_setup,
        "load_model",
        lambda name, device, dtype: seen.setdefault("load", dtype) and real(name, device=device, dtype=dtype),
    )
    monkeypatch.setattr(trl_setup.AutoTokenizer, "from_pretrained", lambda name, **k: load.byte_tokenizer())
    # No hub here: the hub name's config is not found at once (lora_problem: the model's load says why),
    # not after huggingface_hub's 23 s of retries
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    load_task = trl_setup.data.load_task  # 8 of the 10000 arithmetic records: each is templated and tokenized
    monkeypatch.setattr(trl_setup.data, "load_task", lambda *a, **k: load_task(*a, **k)[:8])
    gpu = ["--use-cpu", "False", "--bf16", "False", "--lora-rank", "8", "--max-steps", "1"]
    for model in ("tiny-qwen3", "Org/A-Hub-Model"):
        seen.clear()
        with pytest.raises(Made):
            ft.main(["--model", model, *gpu, *argv])
        got = seen["load"] if model == "tiny-qwen3" else seen["trainer"][1]["dtype"]
        assert got == want, model


def test_a_lora_checkpoint_loads_merged_for_evaluation(tmp_path, monkeypatch):
    """load.load_model of a LoRA run's ckpt/ (eval.py bench's path): the base from run_config.json's
    --model with the adapters merged, whose log-probs are the trained peft model's; eval.py bench reads the
    run directory."""
    from conftest import ONE_QUESTION_BENCH, task_data_missing

    import eval as ev
    from evaluation import harness

    toy_reward(monkeypatch)
    out = tmp_path / "run"
    cfg = grpo.parse_args([*TINY, "--lora-rank", "4", "--lr", "1e-2", "--steps", "1", "--out-dir", str(out)])
    run = grpo.setup(cfg)
    assert grpo.train(cfg, run).history[0]["rows/trained"] > 0
    merged, tok = load.load_model(str(out / "ckpt"), device="cpu")
    base = load.load_model("tiny-qwen3", device="cpu")[0]
    batch = batch_of(tok)
    rows = list(range(batch.input_ids.shape[0]))
    want = policy.fixed_logprobs(run.policy.model.eval(), batch, rows, 4, 4)
    assert torch.allclose(policy.fixed_logprobs(merged, batch, rows, 4, 4), want, atol=1e-4)
    assert not torch.allclose(policy.fixed_logprobs(base, batch, rows, 4, 4), want, atol=1e-4)
    assert harness.resolve_model(str(out)) == str(out / "ckpt")
    if why := task_data_missing("gsm8k"):
        pytest.skip(why)
    ev.main(["bench", "--model", str(out), *ONE_QUESTION_BENCH, "--out", str(tmp_path / "o")])
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["benchmarks"]["gsm8k"]["n_problems"] == 1


@pytest.mark.slow
@pytest.mark.smollm2
def test_grpo_py_lora_rank_8_on_the_embedded_model(tmp_path, monkeypatch):
    """`python grpo.py --lora-rank 8` (one step of it, short responses, every group's rewards varied so
    that its rows are trained whatever the model answers): rows are trained, the adapters change, and every
    base weight is bit-equal to the embedded model's."""
    rows = iter(range(10**6))
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: next(rows) % 4 / 3)
    cfg = grpo.parse_args(
        [
            "--device",
            "cpu",
            "--lora-rank",
            "8",
            "--steps",
            "1",
            "--max-new-tokens",
            "16",
            "--seed",
            "1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert cfg.lr == pytest.approx(1e-4) and cfg.model == "smollm2-135m"
    run = grpo.setup(cfg)
    out = grpo.train(cfg, run)
    assert sum(m["rows/trained"] for m in out.history) > 0
    init = dict(load.load_model("smollm2-135m", device="cpu")[0].named_parameters())
    for name, p in run.policy.model.named_parameters():
        if "lora_B" in name:
            assert p.abs().max() > 0, name
        elif "lora_" not in name:
            assert torch.equal(p, init[base_name(name)]), name
    assert (tmp_path / "ckpt" / "adapter_model.safetensors").is_file()


def test_the_engine_decodes_the_adapted_model():
    """The rollout decodes the LoRA model as it is trained: with the adapters moved off zero, the decode
    engine's greedy rows (graphs=False: its static cache and step on the CPU) equal rollout.decode's, fp32,
    and differ from the base model's (the adapters are read, not skipped)."""
    cfg = grpo.parse_args([*TINY, "--lora-rank", "4"])
    base, tok = load.load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    argmax = rollout.Sampling(12, greedy=True)
    plain = rollout.generate(base, tok, PROMPTS, 1, argmax, share_prefix=False)
    adapted = lora.with_lora(base, cfg)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    eager = rollout.generate(adapted, tok, PROMPTS, 1, argmax, share_prefix=False)
    engine = rollout.generate(adapted, tok, PROMPTS, 1, argmax, graphs=False)
    assert engine.response_ids == eager.response_ids
    assert eager.response_ids != plain.response_ids


def test_a_bf16_base_evaluates_its_adapters_as_trained_and_a_bf16_merge_would_not(tmp_path):
    """A bf16 base with adapters of |B| ~ 2e-4 (an RL update's size; grpo.py's LoRA starts at B = 0), saved
    as a LoRA checkpoint: load_model of it in bf16 (eval.py bench on CUDA) is the unmerged model the run
    trained, bit for bit; in fp32 its adapters are merged into fp32 weights, whose log-probs equal the
    unmerged model's (both fp32 compute on the same weights, 1e-5). Merged into the bf16 weights instead
    (peft's merge_and_unload on the bf16 base: what load_model did), most entries of W + BA round back to W
    and most of the update's effect on the log-probs is lost."""
    from peft import PeftModel

    cfg = grpo.parse_args([*TINY, "--lora-rank", "4"])
    base, tok = load.load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    base.save_pretrained(tmp_path / "base")  # a bf16 checkpoint, as a hub model's
    tok.save_pretrained(tmp_path / "base")
    adapted = lora.with_lora(base, cfg)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.copy_(2e-4 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    ckpt = tmp_path / "ckpt"
    adapted.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    (ckpt / "run_config.json").write_text(json.dumps({"model": str(tmp_path / "base")}))
    batch = batch_of(tok)
    rows = list(range(batch.input_ids.shape[0]))
    lp = lambda m: policy.fixed_logprobs(m, batch, rows, 4, 4)  # noqa: E731  (B, R)
    loaded, _ = load.load_model(str(ckpt), device="cpu", dtype=torch.bfloat16)  # eval.py bench on CUDA
    assert type(loaded).__name__.startswith("PeftModel") and torch.equal(lp(loaded), lp(adapted.eval()))
    W = lambda dtype: load.load_model(str(tmp_path / "base"), device="cpu", dtype=dtype)[0]  # noqa: E731
    want = lp(PeftModel.from_pretrained(W(torch.float32), str(ckpt)).eval())  # unmerged, fp32 compute
    update = (want - lp(W(torch.float32))).abs().max().item()
    merged32, _ = load.load_model(str(ckpt), device="cpu", dtype=torch.float32)
    assert not type(merged32).__name__.startswith("PeftModel")  # a plain model: merged
    assert (lp(merged32) - want).abs().max().item() < 1e-5 < 1e-3 * update
    merged16 = PeftModel.from_pretrained(W(torch.bfloat16), str(ckpt)).merge_and_unload()
    w0, w1 = dict(W(torch.bfloat16).named_parameters()), dict(merged16.named_parameters())
    kept = [(w1[k] == w0[k]).float().mean().item() for k in w0 if k.endswith("proj.weight")]
    lost = (lp(merged16.float()) - want).abs().max().item()
    assert sum(kept) / len(kept) > 0.5 and lost > 0.3 * update, (kept, lost, update)


# ----------------------------------------------------------------------------- LoRA flags that name nothing
@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lora-targets", "q_proj,v_prj"], "no module of Qwen3ForCausalLM is called 'v_prj'"),
        (["--lora-targets", "qproj"], "is called 'qproj' (its linear layers: down_proj"),
        (["--lora-rank", "1099511627776"], "--lora-rank 1099511627776 is more than any adapted layer's rank"),
        (["--lora-targets", "model"], "names no linear layer of Qwen3ForCausalLM"),
        (["--lora-targets", "all-linear,q_proj"], "all-linear stands alone"),
    ],
)
def test_lora_flags_that_name_nothing_or_ask_too_much_are_one_line(tmp_path, capsys, argv, words):
    """peft fails only when no module matches: q_proj,v_prj trained q_proj alone and recorded v_prj; a rank
    past int32 was a RuntimeError from inside. Nothing is written."""
    with pytest.raises(SystemExit) as e:
        grpo.main([*TINY_RUN, "--lora-rank", "4", *argv, "--out-dir", str(tmp_path / "r")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and line.startswith("grpo.py: error: --lora-") and words in line, line
    assert not (tmp_path / "r").exists()


def test_the_trl_plug_in_checks_each_lora_target(tmp_path, capsys):
    pytest.importorskip("trl")
    import flowtracer_trl

    with pytest.raises(SystemExit) as e:
        flowtracer_trl.main(
            [
                "--model",
                "tiny-qwen3",
                "--lora-rank",
                "4",
                "--lora-targets",
                "q_proj,v_prj",
                "--max-steps",
                "1",
                "--output-dir",
                str(tmp_path / "t"),
            ]
        )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "flowtracer_trl.py: error: --lora-targets" in line and "'v_prj'" in line
