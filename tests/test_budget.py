"""LoRA's memory and the budget sized to the card: phases.estimate under --lora-rank against live-storage
counts of real steps, the sizes budget.plan picks for Qwen3-4B on a 24 GB card, and run.setup's sizing
before the weights load on a faked GPU (torch.cuda.mem_get_info, or --gpu-gb): the sizes it picks where the
flags left them free, and the one error line, with nothing written, where the flags given cannot fit."""

import pytest
import torch
from conftest import SMALL_STEP

import grpo
from evaluation import memory, memtrace
from training.memory import budget, phases, shapes
from training.model import trainable
from training.model.load import qwen3_4b_config
from training.run import setup as run_mod


@pytest.mark.parametrize(
    "flags",
    [
        ["--lora-rank", "8"],
        ["--lora-rank", "64", "--no-grad-checkpointing"],
        ["--lora-rank", "16", "--lora-targets", "q_proj,v_proj", "--no-share-prefix"],
    ],
)
def test_lora_estimate_within_10_percent_of_a_real_step(flags):
    """Every phase of a real tiny LoRA step against the estimate (frozen weights, adapter gradients and
    states, the activations LoRA adds and those a frozen norm no longer keeps), as test_memory.py does for
    full fine-tuning."""
    cfg = grpo.parse_args(SMALL_STEP + flags)
    measured = memtrace.measure(cfg, 32, grpo.update, "cpu")
    est = phases.estimate(cfg, phases.model_config(cfg.model), "cpu", 32)
    model = trainable.load_policy(cfg, torch.device("cpu")).model
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert est["optimizer step"]["grads"] == 4 * adapters  # fp32, the adapters only
    for phase in phases.PHASES:
        ratio = sum(est[phase].values()) / measured[phase]
        assert 0.9 <= ratio <= 1.1, (phase, ratio)


@pytest.mark.slow
def test_lora_estimate_within_10_percent_at_the_issues_tiny_shape():
    """16 x 8 rows of 256 + 64 tokens, gen_chunk 64, micro_batch 8, as test_memory.py's full fine-tuning."""
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--max-new-tokens", "64", "--lora-rank", "8"])
    measured = memtrace.measure(cfg, 256, grpo.update, "cpu")
    est = phases.estimate(cfg, phases.model_config(cfg.model), "cpu", 256)
    for phase in phases.PHASES:
        assert 0.9 <= sum(est[phase].values()) / measured[phase] <= 1.1, phase


def test_a_24_gb_card_runs_qwen3_4b_at_1k_with_lora_16_and_80_gb_the_paper_batch():
    """16 prompts x 8 of 256 + 1,024 tokens: under --lora-rank 16 a 24 GB card keeps gen_chunk >= 16 and
    micro_batch >= 4 with the estimate and its margin under 24 GB; full fine-tuning does not fit it, and at
    the paper's batch still fits 80 GB at the flags' own sizes."""
    mc = qwen3_4b_config()
    lora = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16", "--gpu-gb", "24"])
    p = budget.plan(lora, mc, "cuda", 256, 24 * budget.GB)
    assert p.gen_chunk >= 16 and p.micro_batch >= 4 and p.peak <= 24 * budget.GB
    full = grpo.parse_args(["--model", "qwen3-4b-random", "--gpu-gb", "24"])
    assert budget.plan(full, mc, "cuda", 256, 24 * budget.GB).gen_chunk is None
    paper = grpo.parse_args(["--model", "qwen3-4b-random", "--paper-batch"])
    q = budget.plan(paper, mc, "cuda", 256, budget.GPU)
    top = budget.largest(paper)  # sizes left at 0: 64 and 8 tried first
    assert (q.gen_chunk, q.micro_batch) == (top.gen_chunk, top.micro_batch) and q.peak <= budget.GPU


def fake_gpu(monkeypatch, total):
    """A CUDA device of `total` bytes (card["total"]: changed later) as run.setup sees it before the weights
    load, nothing held on it; loading them fails."""
    card = {"total": total}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (card["total"], card["total"]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100's
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # device_of leaves it

    def no_weights(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(trainable, "load_model", no_weights)
    return card


TINY = [
    "--model",
    "tiny-qwen3",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "32",
    "--device",
    "cuda",
    "--steps",
    "1",
]


@pytest.mark.parametrize("how", ["torch.cuda.mem_get_info", "--gpu-gb"])
def test_a_card_too_small_for_the_flags_given_is_one_line_before_the_weights_load(
    how, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    fake_gpu(monkeypatch, 10 * budget.GB if how == "--gpu-gb" else 0.9 * budget.GB)
    flags = [*TINY, "--micro-batch", "4", "--out-dir", str(out)] + (
        ["--gpu-gb", "0.9"] if how == "--gpu-gb" else []
    )
    with pytest.raises(SystemExit) as e:
        grpo.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("grpo.py: error: the step needs about")
    has = "0.9 GB free of 0.9 GB" if how == "torch.cuda.mem_get_info" else "0.9 GB"  # the free memory named
    assert f"the GPU has {has} ({how})" in err and "--lora-rank 16" in err and "smaller model" in err
    assert not out.exists()  # nothing written


def test_sizes_left_free_are_picked_to_fit_and_said_in_one_line(tmp_path, monkeypatch, capsys):
    """A card that fits gen_chunk 4 and micro_batch 2 but not the defaults (64, 8): setup writes the sizes
    budget.plan picks into the run's config before the weights load; a --micro-batch given is kept."""
    box = fake_gpu(monkeypatch, 0)
    cfg = grpo.parse_args([*TINY, "--out-dir", str(tmp_path / "a")])
    mc, widest = phases.model_config(cfg.model), 200
    small = type(cfg)(**{**vars(cfg), "gen_chunk": 4, "micro_batch": 2})
    card = (
        sum(budget.margin(small, mc, widest).values())
        + phases.peak(phases.estimate(small, mc, "cuda", widest))[1]
    )
    box["total"] = card / (1 - budget.RESERVE)  # the plan keeps the reserve

    class Loaded(Exception):
        pass

    def stop(*a, **k):
        raise Loaded

    monkeypatch.setattr(run_mod, "load_for_update", stop)
    got = {}
    real = budget.plan
    monkeypatch.setattr(
        budget,
        "plan",
        lambda c, m, d, w, b, *a, **kw: got.setdefault("widest", w) and real(c, m, d, widest, b, *a, **kw),
    )
    with pytest.raises(Loaded):
        run_mod.setup(cfg)
    assert got["widest"] > 0
    assert (cfg.gen_chunk, cfg.micro_batch) != (64, 8)
    assert budget.plan(cfg, mc, "cuda", widest, card).peak <= card
    assert "budget:" in capsys.readouterr().out
    given = grpo.parse_args([*TINY, "--micro-batch", "4", "--out-dir", str(tmp_path / "b")])
    with pytest.raises(ValueError, match="--gen-chunk"):  # 4 rows do not fit
        run_mod.setup(given)
    assert given.micro_batch == 4


def test_with_held_out_evaluation_the_estimate_counts_the_engine_the_preflight_reserves():
    """One prompt of 8 rows, --eval-every with 64 questions, gen_chunk 64: the preflight reserves the engine
    for 64 rows (a chunk of the evaluation), 8x a chunk of the rollout; the estimate counts the bytes the
    engine allocates, in every phase with it resident and in generation alone with it released."""
    from training.decode import rollout
    from training.memory import preflight
    from training.model.load import load_model

    cfg = budget.largest(
        grpo.parse_args(
            [
                "--model",
                "tiny-qwen3",
                "--prompts-per-step",
                "1",
                "--group-size",
                "8",
                "--max-new-tokens",
                "32",
                "--eval-every",
                "1",
                "--eval-size",
                "64",
            ]
        )
    )  # sized as the CPU sizes it
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)  # bf16: CUDA's cache bytes
    widest, n_eval = 40, 64
    eng = preflight.make_engine(cfg, model, tok, widest, n_eval)
    rollout.generate(
        model, tok, [[1, 5, 6, 7]], 1, rollout.Sampling(2, greedy=True), chunk_size=1, engine=eng
    )
    held = eng.keys.nbytes + eng.values.nbytes  # allocated by the decode
    mc = phases.model_config(cfg.model)
    est = phases.estimate(cfg, mc, "cuda", widest, n_eval=n_eval)
    assert eng.rows == shapes.engine_rows(cfg, n_eval) == 64 and cfg.gen_chunk == 64
    assert all(est[ph]["KV cache"] == held for ph in phases.PHASES[1:])
    assert est["generation"]["KV cache"] >= held
    none = phases.estimate(cfg, mc, "cuda", widest, n_eval=0)  # no evaluation: 8 rows
    assert 8 * none["backward"]["KV cache"] == held
    freed = phases.estimate(cfg, mc, "cuda", widest, n_eval=n_eval, release=True)
    assert all(freed[ph]["KV cache"] == 0 for ph in phases.PHASES[1:])
    assert freed["generation"] == est["generation"]
    for ph in phases.PHASES[1:]:
        assert sum(est[ph].values()) - sum(freed[ph].values()) == held


def test_the_plan_keeps_the_engine_resident_where_it_fits_and_releases_it_for_larger_sizes():
    """Qwen3-4B: LoRA at 1K on 24 GB keeps the engine resident at gen_chunk 32, micro_batch 8. Full
    fine-tuning at 8K on 80 GB releases it: resident, neither size fits at 32 / 8, released they do."""
    mc = qwen3_4b_config()
    lora = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16", "--gpu-gb", "24"])
    p = budget.plan(lora, mc, "cuda", 256, 24 * budget.GB)
    assert (p.gen_chunk, p.micro_batch, p.release) == (32, 8, False)
    long = grpo.parse_args(["--model", "qwen3-4b-random", "--max-new-tokens", "8192"])
    q = budget.plan(long, mc, "cuda", 256, budget.GPU)
    assert q.release and q.peak <= budget.GPU and (q.gen_chunk, q.micro_batch) == (32, 8)
    at = type(long)(**{**vars(long), "gen_chunk": 32, "micro_batch": 8})
    kept = phases.peak(phases.estimate(at, mc, "cuda", 256))[1] + sum(budget.margin(at, mc, 256).values())
    assert kept > budget.GPU  # resident, the same sizes do not fit


def test_eval_memory_prints_the_table_of_the_plan_and_its_layout():
    """`eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24`: the table is the plan's
    (gen_chunk 32, micro_batch 8), the engine resident, and the line says what releasing it would free."""
    cfg = grpo.parse_args(["--model", "qwen3-4b-random", "--lora-rank", "16", "--gpu-gb", "24"])
    out = memory.report(cfg, 256).splitlines()
    planned = type(cfg)(**{**vars(cfg), "gen_chunk": 32, "micro_batch": 8})
    mc = phases.model_config(cfg.model)
    cache = phases.estimate(planned, mc, "cuda", 256)["backward"]["KV cache"]
    assert out[0].startswith("precision: bf16")  # the card's precision, then the table
    assert "gen_chunk 32, micro_batch 8, logprob_chunk 128, the plan for 24 GB (GB)" in out[1]
    assert out[3].split()[0] == "generation" and float(out[3].split()[5]) == round(
        phases.estimate(planned, mc, "cuda", 256)["generation"]["KV cache"] / budget.GB, 2
    )
    line = next(x for x in out if x.startswith("engine:"))
    assert line.startswith("engine: resident through the update")
    assert f"{cache / budget.GB:.2f} GB less" in line
    assert any("grpo.py picks gen_chunk 32, micro_batch 8, the engine resident" in x for x in out)
