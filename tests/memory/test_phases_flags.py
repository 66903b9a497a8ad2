"""training/memory/phases.py by flag: each flag moves the estimate by its derived amount, generation as
generate prefills, the margin, Qwen3-4B's fit in 70 GB under the scheme (not in fp32). The estimate against
live-storage counts: tests/memory/test_phases.py; the Kahan scheme and the CUDA allocator setting:
tests/model/test_trainable.py; `eval.py memory`: tests/evaluation/test_memory_command.py."""

from types import SimpleNamespace

from conftest import qwen3_4b

import grpo
from evaluation import memory
from training.memory import budget, phases, shapes, terms
from training.model.load import qwen3_4b_config


def total(est, phase):
    return sum(est[phase].values())


def test_each_flag_moves_the_estimate_by_its_derived_amount():
    base, cfg = qwen3_4b()
    mc = qwen3_4b_config()
    L, D, b, B, T, R = 36, 2560, 8, 128, 1280, 1024
    N = shapes.param_counts(mc)[0]
    # --no-grad-checkpointing (one pass over every row): each layer keeps its layer_saved, not its bf16 input
    unshared, _ = qwen3_4b("--no-share-prefix")
    off, _ = qwen3_4b("--no-grad-checkpointing", "--no-share-prefix")
    extra = b * T * L * (terms.layer_saved(mc, T, 2, 2) - D * 2)
    assert off["credit"]["activations"] - unshared["credit"]["activations"] == extra
    for phase in ("update forward", "backward"):  # the peak may move within the phase
        assert abs(total(off, phase) - total(unshared, phase) - extra) < 0.05 * extra
    # checkpointed and shared (the default): each layer keeps its bf16 input of the 1 x P prompt and the
    # 8 x R responses, and the prompt's K, V (8 KV heads of 128, bf16) that the responses' replays read
    P = T - R
    prompt, resp = (terms.kept(mc, L, terms.layer_saved(mc, t, 2, 2), 2, True) for t in (P, T))
    assert base["credit"]["activations"] == P * prompt + b * R * resp + L * P * 2 * 2 * 8 * 128
    assert base["credit"]["activations"] < unshared["credit"]["activations"]
    assert 60e9 < b * T * L * terms.layer_saved(mc, T, 2, 2) < 75e9  # "about 68 GB" at 1K
    # and with the micro-batch's one prompt read once (--share-prefix, policy.response_states): the prompt
    # pass keeps 1 x P tokens, the response pass 8 x R queries and the prompt's K, V (bf16, repeated to the
    # 32 query heads) of each of its 8 rows in each layer
    shared, _ = qwen3_4b("--no-grad-checkpointing")
    prompt, resp = (terms.kept(mc, L, terms.layer_saved(mc, t, 2, 2), 2, False) for t in (P, T))
    assert shared["credit"]["activations"] == P * prompt + b * R * resp + L * b * P * 2 * 2 * 32 * 128
    assert shared["credit"]["activations"] < off["credit"]["activations"]
    assert total(shared, "generation") == total(base, "generation")
    # --num-iterations 2: the old log-probs, (B, R) fp32, through the update
    it2, _ = qwen3_4b("--num-iterations", "2")
    for phase in ("update forward", "credit", "backward"):
        assert total(it2, phase) - total(base, phase) == B * R * 4
    assert total(it2, "optimizer step") == total(base, "optimizer step")
    # --beta > 0: the reference policy's bf16 weights in every phase, its forward in backward
    kl, _ = qwen3_4b("--beta", "0.1")
    for phase in phases.PHASES:
        assert kl[phase]["weights"] - base[phase]["weights"] == 2 * N
    assert total(kl, "generation") - total(base, "generation") == 2 * N
    # a separate credit pass: no capture in the training forward; before the update, the maps of one
    # micro-batch's rows at a time (flow scores each row alone: baselines.ROWWISE), the scores of all B kept
    sep, _ = qwen3_4b("--credit-pass", "separate")
    assert base["update forward"]["attention"] == b * T * T * 4 and sep["update forward"]["attention"] == 0
    assert sep["credit"]["attention"] == b * T * T * 4 and sep["credit"]["grads"] == 0
    assert total(sep, "credit") < total(base, "credit")  # before the update: no gradients nor activations


def test_generation_follows_how_generate_prefills():
    """--no-share-prefix: HF generate prefills the chunk's g rows. --share-prefix (the default): each prompt
    is prefilled once into a cache reserved at T, then each layer's row cache moves into one reserved at T."""
    mc, P, R = qwen3_4b_config(), 256, 1024
    kv = lambda rows, t: 2 * 36 * 8 * 128 * t * rows * 2  # noqa: E731  bf16 K and V
    assert terms.prefilled_rows(64, 8, shared=False) == 64
    assert terms.generation(mc, 64, 8, P, R, 2, 2, shared=False)["KV cache"] == kv(64, P + R)
    assert terms.prefilled_rows(64, 8) == 8 and terms.prefilled_rows(12, 8) == 3
    gen = terms.generation(mc, 64, 8, P, R, 2, 2)  # the first decode step
    assert gen["KV cache"] == kv(64, P + R) + (kv(64, P) + kv(8, P + R)) // 36
    est, _ = qwen3_4b("--no-share-prefix")
    assert est["generation"]["KV cache"] == kv(64, P + R)


def test_margin_is_printed_and_counted_in_the_fit():
    est, cfg = qwen3_4b()
    mc = qwen3_4b_config()
    m = budget.margin(cfg, mc)
    assert sum(m.values()) == budget.CONTEXT + 2 * 36 * 8 * 128 * 2 * 64 * 256  # + one bf16 prompt cache
    assert f"budget 80 GB, margin assumed {sum(m.values()) / 1e9:.2f} GB" in memory.report(cfg)
    tight = SimpleNamespace(**{**vars(cfg), "max_new_tokens": 8192})
    g, _ = budget.fit(tight, mc, "cuda")
    for n, fits in ((g, True), (2 * g, False)):  # every phase at micro_batch 1: the engine stays
        c = SimpleNamespace(**{**vars(tight), "gen_chunk": n, "micro_batch": 1})
        est = phases.estimate(c, mc, "cuda")
        assert (
            max(total(est, ph) for ph in phases.PHASES) + sum(budget.margin(c, mc).values()) <= 80e9
        ) == fits


def test_qwen3_4b_fits_70gb_under_the_scheme_and_not_in_fp32():
    cfg = grpo.parse_args(["--model", "qwen3-4b-random"])
    mc = qwen3_4b_config()
    N, N_cast, _ = shapes.param_counts(mc)
    assert 4.0e9 < N < 4.05e9  # 4.02 B parameters
    est = phases.estimate(cfg, mc, "cuda")
    kv = 2 * 36 * 8 * 128 * 2  # 144 KiB per token and row
    assert est["generation"]["KV cache"] == kv * 64 * 1280 + kv * 8 * 256  # the engine's, 8 prompts' cache
    assert phases.peak(est)[1] <= 70e9
    fp32 = phases.estimate(SimpleNamespace(**{**vars(cfg), "optimizer": "adamw"}), mc, "cuda")
    assert fp32["generation"]["cast cache"] == 2 * N_cast > 1.99 * N  # autocast's bf16 copies (tied head)
    assert phases.peak(fp32)[1] > 80e9
    gen_chunk, micro = budget.fit(SimpleNamespace(**{**vars(cfg), "max_new_tokens": 8192}), mc, "cuda")
    assert gen_chunk < 64 and micro < 8  # 8K needs smaller chunks
