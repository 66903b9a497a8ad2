"""memory.py and policy.py: the estimate against live-storage counts of real steps (each flag that changes
memory), the flags' derived amounts, the Kahan scheme against fp32 AdamW, the autocast weight cache, the
CUDA allocator setting, and `eval.py memory`."""

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RotaryEmbedding,
)

import grpo
from evaluation import memory, memtrace
from gpu_kernels import reference
from training import budget, footprint, load, policy, step_bytes, step_shapes
from training.models import load_model, qwen3_4b_config, tiny_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--model",
    "tiny-qwen3",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "48",
    "--gen-chunk",
    "8",
    "--micro-batch",
    "4",
    "--logprob-chunk",
    "16",
]


def test_tracker_counts_views_once_and_frees():
    with memtrace.track_peak() as tr:
        tr.phase("a")
        x = torch.zeros(1000)  # 4000 bytes
        y = x[10:]  # a view: nothing new
        z = x * 2  # 4000 more
        assert tr.now == 8000
        del x, z
        assert tr.now == 4000  # the view keeps x's storage alive
        del y
    assert tr.now == 0 and tr.peak["a"] == 8000


@pytest.mark.parametrize(
    "arch,dtype",
    [
        ("qwen3", torch.float32),
        ("qwen3", torch.bfloat16),
        ("llama", torch.float32),
        ("llama", torch.bfloat16),
    ],
)
def test_layer_saved_equals_the_count(arch, dtype):
    """What one decoder layer saves for backward, counted by track_peak, equals layer_saved exactly."""
    if arch == "qwen3":
        mc, Layer, Rope = tiny_config("tiny-qwen3", 260), Qwen3DecoderLayer, Qwen3RotaryEmbedding
    else:
        mc, Layer, Rope = (
            LlamaConfig(
                hidden_size=96,
                intermediate_size=160,
                num_attention_heads=6,
                num_key_value_heads=2,
                head_dim=16,
            ),
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )
    mc._attn_implementation = "sdpa"
    b, T = 3, 40
    layer = Layer(mc, 0).to(dtype)
    x = torch.randn(b, T, mc.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = Rope(mc)(x, torch.arange(T)[None].expand(b, T))
    mask = torch.ones(b, 1, T, T, dtype=torch.bool).tril()
    mask[0, :, :, :5] = False  # left padding in row 0
    with memtrace.track_peak(layer, x, cos, sin, mask) as tr:
        base = tr.now
        out = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, tuple) else out
        saved = tr.now - base - out.untyped_storage().nbytes()
    nb = 4 if dtype == torch.float32 else 2
    assert saved == b * T * footprint.layer_saved(mc, T, nb, nb)


@pytest.mark.parametrize(
    "flags",
    [
        ["--optimizer", "adamw"],
        ["--optimizer", "kahan"],
        ["--no-share-prefix"],
        ["--no-grad-checkpointing"],
        ["--credit-pass", "separate"],
        ["--beta", "0.1"],
        ["--num-iterations", "2"],
    ],
)
def test_estimate_within_10_percent_of_a_real_step(flags):
    """Every phase of a real tiny step (padded prompts, the fused flow capture, checkpointing) against the
    estimate: fp32 (the CPU path), bf16 + Kahan (the CUDA scheme, run on the CPU), and each flag that
    changes memory."""
    cfg = grpo.parse_args(SMALL + flags)
    measured = memtrace.measure(cfg, 32, grpo.update, "cpu")
    est = step_bytes.estimate(cfg, step_bytes.model_config(cfg.model), "cpu", 32)
    for phase in step_bytes.PHASES:
        ratio = sum(est[phase].values()) / measured[phase]
        assert 0.9 <= ratio <= 1.1, (phase, ratio)


def test_estimate_within_10_percent_at_the_issues_tiny_shape():
    """The first GPU memory target shape: 16 x 8 rows of 256 + 64 tokens, gen_chunk 64, micro_batch 8
    (prefill-bound)."""
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--max-new-tokens", "64"])
    measured = memtrace.measure(cfg, 256, grpo.update, "cpu")
    est = step_bytes.estimate(cfg, step_bytes.model_config(cfg.model), "cpu", 256)
    for phase in step_bytes.PHASES:
        assert 0.9 <= sum(est[phase].values()) / measured[phase] <= 1.1, phase


def qwen3_4b(*flags):
    """(estimate, cfg) of Qwen3-4B at 1K on CUDA with grpo.py's flags."""
    cfg = grpo.parse_args(["--model", "qwen3-4b-random", *flags])
    return step_bytes.estimate(cfg, qwen3_4b_config(), "cuda"), cfg


def total(est, phase):
    return sum(est[phase].values())


def live_at_the_first_layers_backward(tied, device):
    """Live tensor bytes (track_peak) when backward reaches decoder layer 0 of a checkpointed, shared-prompt
    update (policy.token_logprobs, 4 log-prob chunks), less those after the forward; gradients exist (from
    the second micro-batch on)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from data import build_batch

    _, tok = load_model("tiny-qwen3", device="cpu")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=32768,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=tied,
            pad_token_id=256,
            eos_token_id=259,
        )
    ).to(device)
    b = build_batch(tok, [list(range(3, 43))] * 4, [list(range(50, 82))] * 4).to(device)
    model.train()
    policy.checkpointing(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    seen = []
    with memtrace.track_peak(model) as tr:
        hook = model.model.layers[0].register_full_backward_pre_hook(lambda mod, g: seen.append(tr.now))
        lp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 8, True)
        after = tr.now
        (lp * b.response_mask[:, b.prompt_width :]).sum().backward()
        hook.remove()
    return seen[0] - after


def test_the_tied_head_gradient_waits_for_the_embeddings_backward(device):
    """What step_bytes.estimate's backward counts as `held`: with a tied embedding, the LM head's gradient,
    summed over the log-prob chunks in one (V, D) buffer, waits for the embedding's backward (the graph's
    last node), so it is live through the whole decoder backward: exactly V D 4 more bytes at layer 0's
    backward than with an untied head (whose gradient is taken after the last chunk). The estimate
    counts it for Qwen3-4B (tied) at 1K: V D 2 in bf16 beside the recomputed layer, backward's peak."""
    V, D = 32768, 64
    tied, untied = (live_at_the_first_layers_backward(t, device) for t in (True, False))
    assert tied - untied == V * D * 4
    est, cfg = qwen3_4b()
    mc = qwen3_4b_config()
    assert mc.tie_word_embeddings and est["backward"]["logits"] == mc.vocab_size * mc.hidden_size * 2


def test_each_flag_moves_the_estimate_by_its_derived_amount():
    base, cfg = qwen3_4b()
    mc = qwen3_4b_config()
    L, D, b, B, T, R = 36, 2560, 8, 128, 1280, 1024
    N = step_shapes.param_counts(mc)[0]
    # --no-grad-checkpointing (one pass over every row): each layer keeps its layer_saved, not its bf16 input
    unshared, _ = qwen3_4b("--no-share-prefix")
    off, _ = qwen3_4b("--no-grad-checkpointing", "--no-share-prefix")
    extra = b * T * L * (footprint.layer_saved(mc, T, 2, 2) - D * 2)
    assert off["credit"]["activations"] - unshared["credit"]["activations"] == extra
    for phase in ("update forward", "backward"):  # the peak may move within the phase
        assert abs(total(off, phase) - total(unshared, phase) - extra) < 0.05 * extra
    # checkpointed and shared (the default): each layer keeps its bf16 input of the 1 x P prompt and the
    # 8 x R responses, and the prompt's K, V (8 KV heads of 128, bf16) that the responses' replays read
    P = T - R
    prompt, resp = (footprint.kept(mc, L, footprint.layer_saved(mc, t, 2, 2), 2, True) for t in (P, T))
    assert base["credit"]["activations"] == P * prompt + b * R * resp + L * P * 2 * 2 * 8 * 128
    assert base["credit"]["activations"] < unshared["credit"]["activations"]
    assert 60e9 < b * T * L * footprint.layer_saved(mc, T, 2, 2) < 75e9  # "about 68 GB" at 1K
    # and with the micro-batch's one prompt read once (--share-prefix, policy.response_states): the prompt
    # pass keeps 1 x P tokens, the response pass 8 x R queries and the prompt's K, V (bf16, repeated to the
    # 32 query heads) of each of its 8 rows in each layer
    shared, _ = qwen3_4b("--no-grad-checkpointing")
    prompt, resp = (footprint.kept(mc, L, footprint.layer_saved(mc, t, 2, 2), 2, False) for t in (P, T))
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
    for phase in step_bytes.PHASES:
        assert kl[phase]["weights"] - base[phase]["weights"] == 2 * N
    assert total(kl, "generation") - total(base, "generation") == 2 * N
    # a separate credit pass: no capture in the training forward; before the update, the maps of one
    # micro-batch's rows at a time (flow scores each row alone: credit.ROWWISE), the scores of all B kept
    sep, _ = qwen3_4b("--credit-pass", "separate")
    assert base["update forward"]["attention"] == b * T * T * 4 and sep["update forward"]["attention"] == 0
    assert sep["credit"]["attention"] == b * T * T * 4 and sep["credit"]["grads"] == 0
    assert total(sep, "credit") < total(base, "credit")  # before the update: no gradients nor activations


def test_generation_follows_how_generate_prefills():
    """--no-share-prefix: HF generate prefills the chunk's g rows. --share-prefix (the default): each prompt
    is prefilled once into a cache reserved at T, then each layer's row cache moves into one reserved at T."""
    mc, P, R = qwen3_4b_config(), 256, 1024
    kv = lambda rows, t: 2 * 36 * 8 * 128 * t * rows * 2  # noqa: E731  bf16 K and V
    assert footprint.prefill_rows(64, 8, shared=False) == 64
    assert footprint.generation(mc, 64, 8, P, R, 2, 2, shared=False)["KV cache"] == kv(64, P + R)
    assert footprint.prefill_rows(64, 8) == 8 and footprint.prefill_rows(12, 8) == 3
    gen = footprint.generation(mc, 64, 8, P, R, 2, 2)  # the first decode step
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
        est = step_bytes.estimate(c, mc, "cuda")
        assert (
            max(total(est, ph) for ph in step_bytes.PHASES) + sum(budget.margin(c, mc).values()) <= 80e9
        ) == fits


def test_expandable_segments_on_cuda_before_it_starts(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert load.device_of("cpu").type == "cpu"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert load.device_of("cuda").type == "cuda"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's setting wins
    load.device_of("cuda")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_qwen3_4b_fits_70gb_under_the_scheme_and_not_in_fp32():
    cfg = grpo.parse_args(["--model", "qwen3-4b-random"])
    mc = qwen3_4b_config()
    N, N_cast, _ = step_shapes.param_counts(mc)
    assert 4.0e9 < N < 4.05e9  # 4.02 B parameters
    est = step_bytes.estimate(cfg, mc, "cuda")
    kv = 2 * 36 * 8 * 128 * 2  # 144 KiB per token and row
    assert est["generation"]["KV cache"] == kv * 64 * 1280 + kv * 8 * 256  # the engine's, 8 prompts' cache
    assert step_bytes.peak(est)[1] <= 70e9
    fp32 = step_bytes.estimate(SimpleNamespace(**{**vars(cfg), "optimizer": "adamw"}), mc, "cuda")
    assert fp32["generation"]["cast cache"] == 2 * N_cast > 1.99 * N  # autocast's bf16 copies (tied head)
    assert step_bytes.peak(fp32)[1] > 80e9
    gen_chunk, micro = budget.fit(SimpleNamespace(**{**vars(cfg), "max_new_tokens": 8192}), mc, "cuda")
    assert gen_chunk < 64 and micro < 8  # 8K needs smaller chunks


def test_autocast_caches_a_bf16_copy_of_each_weight_for_the_region():
    """The question: inside one autocast region the bf16 casts of fp32 leaf weights stay alive
    (here on the CPU; CUDA's autocast uses the same cache), so generation under autocast holds them all."""
    model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    cast = sum(
        p.numel() for p in model.parameters() if p.ndim == 2 and p is not model.model.embed_tokens.weight
    )
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad(), memtrace.track_peak(model) as tr:
        base = tr.now
        with torch.autocast("cpu", torch.bfloat16):
            model(input_ids=ids)
            inside = tr.now - base
        after = tr.now - base
    assert inside >= 2 * cast > after


def cumulative_updates(steps=20, lr=1e-6, device="cpu"):
    """{scheme: relative norm of (its cumulative update - fp32 AdamW's)} on tiny-qwen3, same gradients. The
    kahan optimizer is what grpo.py builds for weights on `device` (on CUDA optimi's Triton or foreach step,
    on the CPU its for-loop: load.make_optimizer chooses by where the weights are)."""
    ref, _ = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    cfg = SimpleNamespace(optimizer="kahan", lr=lr, weight_decay=0.0)
    runs = {"fp32": (ref, torch.optim.AdamW(ref.parameters(), lr=lr))}
    m = copy.deepcopy(ref).to(torch.bfloat16)
    runs["kahan"] = (m, load.make_optimizer(m, cfg, "cuda"))  # the CUDA scheme, the weights' step
    m = copy.deepcopy(ref).to(torch.bfloat16)
    runs["bf16"] = (m, torch.optim.AdamW(m.parameters(), lr=lr))  # naive bf16 weights
    w0 = {k: policy.master_weights(m, opt) for k, (m, opt) in runs.items()}
    for k in range(steps):
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(k)).to(ref.device)
        ref.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        for m, opt in runs.values():
            for p, g in zip(m.parameters(), grads):
                p.grad = g.to(p.dtype)
            opt.step()
    d = {
        k: {n: w - w0[k][n] for n, w in policy.master_weights(m, opt).items()} for k, (m, opt) in runs.items()
    }
    norm = lambda x: sum((v**2).sum() for v in x.values()).sqrt()  # noqa: E731
    return {k: float(norm({n: d[k][n] - d["fp32"][n] for n in d[k]}) / norm(d["fp32"])) for k in d}


def test_kahan_keeps_lr_1e6_updates_and_plain_bf16_loses_them(device):
    rel = cumulative_updates(device=device)
    assert rel["kahan"] < 0.05  # the bar: within 5%
    assert rel["bf16"] > 0.5  # rounding drops the update


def test_scheme_defaults_and_errors():
    cfg = SimpleNamespace(optimizer="auto", lr=1e-6, weight_decay=0.0)
    assert load.scheme(cfg, "cuda") == "kahan" and load.scheme(cfg, "cpu") == "adamw"
    assert load.weight_dtype(cfg, "cpu") == torch.float32  # the CPU path stays fp32
    model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16"):
        load.make_optimizer(model, SimpleNamespace(optimizer="kahan", lr=1e-6, weight_decay=0.0), "cpu")
    with pytest.raises(ValueError, match="--optimizer"):
        load.scheme(SimpleNamespace(optimizer="sgd"), "cpu")


def test_eval_memory_command(in_process):
    import eval as ev

    run = lambda *a: in_process(ev.main, "memory", *a)  # noqa: E731  `python eval.py memory a`, in-process
    p = run("--model", "qwen3-4b-random")
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("peak") and "GB" in last and float(last.split()[1]) <= 70
    p = run("--model", "qwen3-4b-random", "--micro-batch", "-1")  # 0: sized
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("grpo.py: error: --micro-batch")
    p = run("--model", "tiny-qwen3", "--snapshot", "x.pickle")  # no --measure, no GPU here
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--snapshot" in p.stderr
    assert not (ROOT / "x.pickle").exists()


def event(action, addr, size, *names, py=None):
    """One allocator trace entry as torch.cuda.memory._snapshot() writes it (frames innermost first)."""
    frames = ([{"filename": py[0], "line": py[1], "name": py[2]}] if py else []) + [
        {"filename": "??", "line": 0, "name": n} for n in names
    ]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_held_at_peak_replays_the_allocators_count():
    """A hand-made trace: 1000 bytes at the start, 200 of them freed in the window; the count peaks at
    1550, when B, C and D (750 bytes) are the window's live blocks, grouped by where they were made."""
    node = "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"
    snap = {
        "base_allocated": 1000,
        "device_traces": [
            [
                event("alloc", 1, 100, py=("/x/modeling_qwen3.py", 80, "forward")),  # A  1100
                event("alloc", 2, 300, "at::native::mm_out(at::Tensor const&)", node),  # B  1400
                event("free_requested", 1, 100),  #    1300
                event("free_completed", 1, 100),  #    (no change)
                event("segment_alloc", 99, 2**21),  #    (reserved)
                event("alloc", 3, 50, "at::native::mm_out(at::Tensor const&)", node),  # C  1350
                event("free_requested", 7, 200),  # X  1150 (older)
                event("alloc", 4, 400, py=("/x/policy.py", 183, "piece")),  # D  1550 peak
                event("free_requested", 4, 400),  #    1150
                event("alloc", 5, 300, py=("/x/policy.py", 183, "piece")),
            ]
        ],
    }  # E  1450
    peak, before, rows = memtrace.held_at_peak(snap)
    assert (peak, before) == (1550, 800)
    assert rows == [(400, 1, "- | - | policy.py:183 piece"), (350, 2, "MmBackward0 | at::native::mm_out | -")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's history needs a CUDA device")
def test_snapshot_of_the_backward_replays_to_the_allocators_peak(tmp_path):
    """On a GPU: the recorded window of a real tiny step, replayed, peaks where the allocator's own count
    did, and holds blocks made by autograd nodes (the backward's own)."""
    cfg = grpo.parse_args(SMALL)
    path = tmp_path / "backward.pickle"
    measured = memtrace.measure(cfg, 32, grpo.update, "cuda", snapshot=str(path))
    s = json.loads(Path(str(path) + ".json").read_text())  # save_snapshot's summary, every site
    assert path.is_file() and s["peak"] == s["window_peak"] <= measured["backward"]
    assert 0 < s["before"] <= s["base_allocated"]
    assert any("Backward" in site.split(" | ")[0] for _, _, site in s["rows"])  # the backward's own blocks
    assert memtrace.report_held(str(path), measured["backward"]).count("\n") == 1 + min(12, len(s["rows"]))


@pytest.mark.parametrize("chunk", [16, 64])
def test_the_capture_holds_two_score_blocks_whatever_the_chunks(chunk):
    """reference.add_head_mean over 4 query chunks (or 1) holds what capture_workspace counts: q and k in
    fp32, two (B, H, c, S) fp32 blocks (score, softmax) and two (B, c, S) sums; the previous chunk's blocks
    are freed before the next is made (they were not: a third block, found at Qwen3-4B's T on the CPU)."""
    B, H, Hkv, T, D = 2, 4, 2, 64, 8
    q, k = torch.randn(B, H, T, D, dtype=torch.bfloat16), torch.randn(B, Hkv, T, D, dtype=torch.bfloat16)
    mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()  # (B, 1, T, T) True = attend
    buf = torch.zeros(B, T, T)
    with memtrace.track_peak(q, k, mask, buf) as tr:
        base = tr.now
        tr.phase("capture")
        reference.add_head_mean(buf, q, k, mask, D**-0.5, chunk)
    c = min(chunk, T)
    counted = 4 * (B * T * H * D + B * T * Hkv * D + 2 * B * H * T * c + 2 * B * T * c)  # capture_workspace
    blocks = 2 * 4 * B * H * c * T
    assert blocks < tr.peak["capture"] - base <= counted
