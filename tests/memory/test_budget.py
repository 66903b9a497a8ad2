"""training/memory/budget.py, the budget sized to the card: the sizes budget.plan picks for Qwen3-4B (LoRA on
a 24 GB card, the paper's batch on 80 GB; the engine kept resident where it fits), and run.setup's sizing
before the weights load on a faked GPU (torch.cuda.mem_get_info, or --gpu-gb; one past the card is said): the
sizes it picks where the flags left them free, and the one error line, with nothing written, where the flags
given cannot fit. LoRA's estimate against real steps: tests/memory/test_phases.py."""

import pytest
import torch

import grpo
from training.memory import budget, phases, shapes
from training.model import trainable
from training.model.load import qwen3_4b_config
from training.run import setup as run_mod


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
    engine allocates (its K, V buffers and its copy of the weights), in every phase with it resident and in
    generation alone with it released."""
    from training.decode import decode_weights, rollout
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
    copy = decode_weights.copy_bytes(eng.w, model)  # the fused step's merged Q, K, V and gate, up
    for ph in phases.PHASES[1:]:
        assert sum(est[ph].values()) - sum(freed[ph].values()) == held + copy > held


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


def test_a_gpu_gb_past_the_card_is_said_and_the_card_is_taken(monkeypatch, capsys):
    """--gpu-gb 1e9 on a 10 GB card sized the step to 1e9 GB without a word; now a notice, and the card."""
    card = 10 * budget.GB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (card, card))
    cfg = grpo.parse_args(
        ["--model", "qwen3-4b-random", "--gpu-gb", "1e9", "--max-new-tokens", "256", "--lora-rank", "16"]
    )
    capsys.readouterr()
    try:
        budget.size(cfg, torch.device("cuda"), 256)
    except ValueError as e:  # nothing fits 10 GB: the card's size is named
        assert "the GPU has 10.0 GB free of 10.0 GB (torch.cuda.mem_get_info)" in str(e)
    out = capsys.readouterr().out
    assert "--gpu-gb 1e+09 is more than the GPU's 10.0 GB" in out
