"""--load-in-4bit (QLoRA; training/model/quantize.py, grpo.py departure 10): the 4-bit forward against the
16/32-bit one, a run on the CPU that trains the adapters on a frozen 4-bit base, resume, the flags' errors,
the memory estimate against a real step and the 12 GB plan, the decode engine and evaluation on the 4-bit
base.

tiny-qwen3's linear weights (64 x 64, 32 x 64, 128 x 64, 64 x 128) are whole blocks of 64; bitsandbytes takes
any shape (a last block shorter than 64: test_any_shape_quantizes)."""

import json
import zlib
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import dequantize_4bit, quantize_4bit  # noqa: E402
from bitsandbytes.nn import Linear4bit  # noqa: E402
from conftest import SMALL_STEP  # noqa: E402

import flowtracer  # noqa: E402
import grpo  # noqa: E402
from data import build_batch  # noqa: E402
from evaluation import memtrace  # noqa: E402
from training import policy  # noqa: E402
from training.decode import rollout  # noqa: E402
from training.memory import budget, phases, shapes  # noqa: E402
from training.model import load, quantize, trainable  # noqa: E402

TINY = "--model tiny-qwen3 --device cpu --prompts-per-step 2 --group-size 4 --max-new-tokens 12".split()
TINY += "--micro-batch 4 --warmup-steps 1 --save-every 1 --seed 3 --lora-rank 8 --load-in-4bit".split()


def four_bit(quant_type="nf4", nested=False):
    """The BitsAndBytesConfig of the flags, fp32 compute (the CPU's precision)."""
    flags = SimpleNamespace(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, use_bnb_nested_quant=nested, lora_rank=8
    )
    return quantize.four_bit(flags, torch.float32)


def toy_reward(monkeypatch):
    """A random tiny model never answers: a reward by the text's hash (as tests/model/test_lora.py) trains
    rows."""
    monkeypatch.setattr(grpo.data, "reward", lambda txt, rec: zlib.crc32(txt.encode()) % 4 / 3)


def block_absmax(w):
    """(out, in): each weight's block absmax, blocks of quantize.BLOCK over the weight flattened row by
    row (bitsandbytes' layout)."""
    flat = w.flatten()
    pad = -flat.numel() % quantize.BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, quantize.BLOCK).abs().amax(-1)
    return blocks.repeat_interleave(quantize.BLOCK)[: flat.numel()].view_as(w)


@pytest.mark.parametrize("quant_type", quantize.QUANT_TYPES)
def test_each_4bit_layer_is_within_its_codes_bound_of_the_16_bit_one(quant_type):
    """Each weight is rounded to the nearest code of its block (W ~ absmax_b code[q]), so it is off by at
    most max_step (half the widest gap between two codes, from bitsandbytes' table: 0.152 for NF4) times
    its block's absmax; a layer's output y_i = sum_j x_j W_ij is then off by at most
    max_step sum_j |x_j| absmax_b(i, j). Every 4-bit layer of tiny-qwen3 against the fp32 model's, on
    random inputs: within that bound (+ 1e-5 of float rounding), and quantized (not equal)."""
    plain = load.load_model("tiny-qwen3", device="cpu")[0]
    q = load.load_model("tiny-qwen3", device="cpu", quantization=four_bit(quant_type))[0]
    step = quantize.max_step(quant_type)
    layers = {n: m for n, m in q.named_modules() if isinstance(m, Linear4bit)}
    assert len(layers) == 4 * 7  # every linear of the decoder layers; the head stays fp32
    assert type(q.get_output_embeddings()) is torch.nn.Linear
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    for name, m in layers.items():
        w = plain.get_submodule(name).weight.detach()  # (out, in)
        xi = x[:, : w.shape[1]]
        with torch.no_grad():
            err = (m(xi) - xi @ w.T).abs()  # (16, out)
        bound = step * xi.abs() @ block_absmax(w).T + 1e-5
        assert (err <= bound).all(), name
        assert err.max() > 1e-3, name  # quantized
        assert torch.equal(m.weight.quant_state.absmax, block_absmax(w).flatten()[:: quantize.BLOCK])


def test_the_4bit_forward_is_the_16_bit_forward_of_its_dequantized_weights():
    """The 4-bit model's logits (and the maps FlowTracer's Capture takes in the same forward) equal those of
    the fp32 model whose linear weights are the 4-bit ones dequantized, to float rounding (1e-5): what the
    4-bit base computes is the plain forward of its quantized weights, and only those differ."""
    q, tok = load.load_model("tiny-qwen3", device="cpu", quantization=four_bit())
    plain = load.load_model("tiny-qwen3", device="cpu")[0]
    with torch.no_grad():
        for name, m in q.named_modules():
            if isinstance(m, Linear4bit):
                plain.get_submodule(name).weight.copy_(dequantize_4bit(m.weight.data, m.weight.quant_state))
    ids = torch.tensor([list(range(40, 60)), list(range(70, 90))])
    mask = torch.ones_like(ids)
    layers = flowtracer.select_layers("all", 4)
    out = []
    for model in (q, plain):
        cap = flowtracer.Capture(layers)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, flow_capture=cap).logits
        out.append((logits, cap.maps(mask)))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(out[0][1], out[1][1], rtol=1e-5, atol=1e-6)


def test_any_shape_quantizes():
    """bitsandbytes quantizes a weight whose size is no multiple of 64 (its last block is shorter), within
    the same bound, with nested quantization too."""
    w = torch.randn(30, 50, generator=torch.Generator().manual_seed(1))
    for nested in (False, True):
        packed, st = quantize_4bit(w, blocksize=quantize.BLOCK, quant_type="nf4", compress_statistics=nested)
        err = (dequantize_4bit(packed, st) - w).abs()
        assert (err <= quantize.max_step("nf4") * block_absmax(w) + 1e-6).all()


def test_grpo_py_trains_the_adapters_on_a_frozen_4bit_base(tmp_path, monkeypatch, capsys):
    """`python grpo.py --model tiny-qwen3 --lora-rank 8 --load-in-4bit --steps 2` on the CPU (short
    responses; a reward the random model earns): rows are trained, every lora_B moved off zero, the 4-bit
    weights and every other base weight are unchanged, one line says the base is 4-bit, and the checkpoint
    holds the adapters alone with the quantization in its run_config.json."""
    toy_reward(monkeypatch)
    out = grpo.main([*TINY, "--steps", "2", "--out-dir", str(tmp_path)])
    said = capsys.readouterr().out
    assert "base: 4-bit nf4 (bitsandbytes), 28 linear layers" in said
    assert "nf4 4-bit linears + fp32 frozen base, fp32 adapters and AdamW" in said
    assert sum(m["rows/trained"] for m in out.history) > 0
    saved = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # the adapters, not the base
    assert all(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)
    config = json.loads((tmp_path / "ckpt" / "run_config.json").read_text())
    assert (config["load_in_4bit"], config["bnb_4bit_quant_type"], config["lora_rank"]) == (True, "nf4", 8)


def test_a_step_keeps_the_4bit_base_frozen(tmp_path, monkeypatch):
    """After a step the 4-bit weights and their scales are bit-equal to a fresh 4-bit load, every other base
    weight to the loaded model's; only the fp32 adapters require gradients and are in the optimizer."""
    toy_reward(monkeypatch)
    cfg = grpo.parse_args([*TINY, "--steps", "1", "--out-dir", str(tmp_path)])
    run = grpo.setup(cfg)
    trained = [p for p in run.policy.model.parameters() if p.requires_grad]
    assert {id(p) for g in run.policy.opt.param_groups for p in g["params"]} == {id(p) for p in trained}
    assert all(p.dtype == torch.float32 for p in trained)
    assert grpo.train(cfg, run).history[0]["rows/trained"] > 0
    fresh = dict(load.load_model("tiny-qwen3", device="cpu", quantization=four_bit())[0].named_modules())
    for name, m in run.policy.model.named_modules():
        if isinstance(m, Linear4bit):
            base = fresh[name.replace("base_model.model.", "").replace(".base_layer", "")]
            assert torch.equal(m.weight.data, base.weight.data), name
            assert torch.equal(m.weight.quant_state.absmax, base.weight.quant_state.absmax), name


def stable(m):
    return {k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}


def test_a_resumed_4bit_run_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    """Two steps, or one then --resume for the second: the second step's metrics and the adapters equal."""
    toy_reward(monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    flags = [*TINY, "--lr", "1e-2"]
    full = grpo.train(grpo.parse_args([*flags, "--steps", "2", "--out-dir", str(a)])).history
    grpo.train(grpo.parse_args([*flags, "--steps", "1", "--out-dir", str(b)]))
    more = grpo.train(grpo.parse_args(["--resume", str(b), "--steps", "2"])).history
    assert full[0]["rows/trained"] > 0
    assert stable(more[0]) == stable(full[1])
    wa, wb = (load_file(str(d / "ckpt" / "adapter_model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--model", "tiny-qwen3", "--load-in-4bit"],
            "grpo.py: error: --load-in-4bit needs --lora-rank R: the 4-bit base is frozen",
        ),
        (
            ["--model", "tiny-qwen3", "--lora-rank", "8", "--load-in-4bit", "--bnb-4bit-quant-type", "int4"],
            "grpo.py: error: argument --bnb-4bit-quant-type: invalid choice: 'int4'",
        ),
    ],
)
def test_bad_4bit_flags_are_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and line in err and "Traceback" not in err


def test_the_quantization_flags_without_load_in_4bit_are_a_notice(capsys):
    grpo.parse_args(["--model", "tiny-qwen3", "--lora-rank", "8", "--bnb-4bit-quant-type", "fp4"])
    assert "--bnb-4bit-quant-type has no effect: --load-in-4bit is off" in capsys.readouterr().err


def test_resume_with_other_quantization_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A 4-bit run resumed with --no-load-in-4bit or another code: one error line, exit 2, nothing run; the
    same settings given again are no change; --allow-config-change lets it continue."""
    toy_reward(monkeypatch)
    grpo.train(grpo.parse_args([*TINY, "--steps", "1", "--out-dir", str(tmp_path)]))
    for other in (["--no-load-in-4bit"], ["--bnb-4bit-quant-type", "fp4"], ["--use-bnb-nested-quant"]):
        with pytest.raises(SystemExit) as e:
            grpo.parse_args(["--resume", str(tmp_path), "--steps", "2", *other])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "the checkpoint's adapters trained on its nf4 4-bit base" in err
    same = ["--resume", str(tmp_path), "--steps", "2", "--load-in-4bit", "--bnb-4bit-quant-type", "nf4"]
    assert grpo.parse_args(same).load_in_4bit
    cfg = grpo.parse_args([*same[:4], "--bnb-4bit-quant-type", "fp4", "--allow-config-change"])
    assert cfg.bnb_4bit_quant_type == "fp4"


@pytest.mark.parametrize(
    "flags",
    [
        ["--lora-rank", "8", "--load-in-4bit"],
        ["--lora-rank", "8", "--load-in-4bit", "--use-bnb-nested-quant"],
    ],
)
def test_the_4bit_estimate_within_10_percent_of_a_real_step(flags):
    """Every phase of a real tiny 4-bit LoRA step (live tensor storages: the 4-bit weights and their scales,
    the dequantized weight of each matmul) against phases.estimate, as tests/memory/test_budget.py does for
    LoRA; the weights' bytes equal the quantized model's exactly without nested quantization."""
    cfg = grpo.parse_args(SMALL_STEP + flags)
    measured = memtrace.measure(cfg, 32, grpo.update, "cpu")
    est = phases.estimate(cfg, phases.model_config(cfg.model), "cpu", 32)
    for phase in phases.PHASES:
        ratio = sum(est[phase].values()) / measured[phase]
        assert 0.9 <= ratio <= 1.1, (phase, ratio)
    if "--use-bnb-nested-quant" not in flags:  # the 4-bit weights, scales, the rest and the adapters
        four, _, rest = quantize.quantized_bytes(trainable.load_policy(cfg, torch.device("cpu")).model)
        assert est["optimizer step"]["weights"] == four + rest


def test_a_12_gb_card_runs_qwen3_4b_at_1k_with_lora_16_on_a_4bit_base(capsys):
    """`eval.py memory --model qwen3-4b-random --lora-rank 16 --load-in-4bit --gpu-gb 12`: a plan whose peak,
    margin included, is at most 12 GB (at most the 10.8 GB planned), printed with its table; the 4-bit
    weights with their scales are 4.5 bits a weight, nested quantization 0.37 bits less."""
    import eval as ev

    flags = ["--model", "qwen3-4b-random", "--lora-rank", "16", "--load-in-4bit", "--gpu-gb", "12"]
    cfg = grpo.parse_args(flags, for_gpu=True)
    mc = phases.model_config(cfg.model)
    _, p, card = budget.planned(cfg, mc, "cuda", 256)
    assert p.gen_chunk and p.peak <= card * (1 - budget.RESERVE) <= 12 * budget.GB
    ev.main(["memory", *flags])
    out = capsys.readouterr().out
    assert "scheme lora, a 4-bit nf4 base" in out and f"gen_chunk {p.gen_chunk}, micro_batch" in out
    assert "update forward" in out and "budget 12 GB" in out
    plain = phases.estimate(grpo.parse_args(flags[:-3]), mc)["optimizer step"]["weights"]
    four = phases.estimate(cfg, mc)["optimizer step"]["weights"]
    nested = grpo.parse_args([*flags, "--use-bnb-nested-quant"], for_gpu=True)
    less = four - phases.estimate(nested, mc)["optimizer step"]["weights"]
    linears = 36 * sum(i * o for _, i, o in shapes.counts(mc.to_json_string())[3])
    copy = shapes.read_shapes(grpo.parse_args(flags[:-3]), mc, "cuda", 256).decode_copy  # the engine's pairs
    assert plain - four == pytest.approx(linears * (2 - 4.5 / 8) + copy)  # bf16 -> 4.5 bits; no fused copy
    assert less == pytest.approx(linears * (4.5 - 4 - 8 / 64 - 32 / 64 / 256) / 8 - 36 * 7 * 1024)


def test_the_engine_decodes_the_4bit_base():
    """The decode engine (graphs=False: its static cache and step on the CPU) runs the 4-bit model with the
    model's own step, said in one line (the fused step reads plain linear weights: no copy in the plan): its
    greedy rows equal rollout.decode's, and differ from the fp32 model's (the 4-bit weights are read)."""
    from training.decode import engine as decode_engine

    q, tok = load.load_model("tiny-qwen3", device="cpu", quantization=four_bit())
    attention, line = decode_engine.step_kind(q, True, None)
    assert attention is None and "Linear4bit, not a plain linear layer" in line
    plain = load.load_model("tiny-qwen3", device="cpu")[0]
    argmax = rollout.Sampling(12, greedy=True)
    prompts = ["Q: 1+1? A: 2. Q: 4+4? A:", "Q: 1+1? A: 2. Q: 10+7? A:", "no shared prefix"]
    eager = rollout.generate(q, tok, prompts, 1, argmax, share_prefix=False)
    engine = rollout.generate(q, tok, prompts, 1, argmax, graphs=False)
    assert engine.response_ids == eager.response_ids
    assert eager.response_ids != rollout.generate(plain, tok, prompts, 1, argmax).response_ids


def test_a_4bit_checkpoint_evaluates_unmerged_on_its_4bit_base(tmp_path, monkeypatch, capsys):
    """load.load_model of a 4-bit run's ckpt/ (eval.py bench's path): the base read in 4 bits as trained, the
    adapters unmerged (one line says why), its log-probs the trained model's."""
    toy_reward(monkeypatch)
    cfg = grpo.parse_args([*TINY, "--lr", "1e-2", "--steps", "1", "--out-dir", str(tmp_path)])
    run = grpo.setup(cfg)
    assert grpo.train(cfg, run).history[0]["rows/trained"] > 0
    capsys.readouterr()
    model, tok = load.load_model(str(tmp_path / "ckpt"), device="cpu")
    assert "adapters stay unmerged on the nf4 4-bit base" in capsys.readouterr().out
    assert type(model).__name__.startswith("PeftModel") and quantize.is_4bit(model.get_base_model())
    prompts, responses = [list(range(40, 49))] * 2, [list(range(70, 80)), list(range(81, 86))]
    batch = build_batch(tok, prompts, responses)
    want = policy.fixed_logprobs(run.policy.model.eval(), batch, [0, 1], 2, 4)
    assert torch.allclose(policy.fixed_logprobs(model, batch, [0, 1], 2, 4), want, atol=1e-5)


def test_flowtracer_trl_trains_fp32_adapters_on_a_4bit_base(tmp_path, monkeypatch):
    """flowtracer_trl.py --lora-rank --load-in-4bit: TRL trains peft's adapters on the 4-bit tiny model,
    FlowTracer's capture and credit read it (gamma != 1 on some tokens, no fallback), the adapters stay
    fp32 (TRL would make them bf16) and move, and the 4-bit base does not."""
    pytest.importorskip("trl")
    import test_flowtracer_trl as test_trl

    import flowtracer_trl as ft
    from training.model import lora

    real = test_trl.load_model
    monkeypatch.setattr(
        test_trl,
        "load_model",
        lambda name, device, dtype: real(name, device=device, dtype=dtype, quantization=four_bit()),
    )
    args = ft.parse_args(["--model", "tiny-qwen3", "--lora-rank", "4", "--load-in-4bit"])[0]
    tr, _, init = test_trl.one_step(ft.FlowTracerGRPOTrainer, tmp_path, peft_config=lora.lora_config(args))
    assert quantize.is_4bit(tr.model)
    logged = next(m for m in tr.state.log_history if "loss" in m)
    assert 0 < logged["credit/boosted_frac"] < 1 and logged["credit/fallback_frac"] == 0.0
    adapters = {n: p for n, p in tr.model.named_parameters() if p.requires_grad}
    assert adapters and all(p.dtype == torch.float32 for p in adapters.values())
    assert all(p.abs().max() > 0 for n, p in adapters.items() if "lora_B" in n)
    for name, m in tr.model.named_modules():
        if isinstance(m, Linear4bit):
            key = name.replace("base_model.model.", "").replace(".base_layer", "") + ".weight"
            assert torch.equal(m.weight.data, init[key]), name


def test_flowtracer_trl_reads_a_local_model_in_4_bits_and_refuses_it_without_lora(capsys):
    import flowtracer_trl as ft
    from training.config import trl_setup

    args, _, targs = ft.parse_args(["--model", "tiny-qwen3", "--lora-rank", "4", "--load-in-4bit"])
    parts = trl_setup.build(args, targs)
    assert quantize.is_4bit(parts.model) and parts.lora.r == 4
    with pytest.raises(SystemExit) as e:
        ft.parse_args(["--model", "tiny-qwen3", "--load-in-4bit"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "flowtracer_trl.py: error: --load-in-4bit needs --lora-rank R" in err
