"""The decode engine's fused step (training/decode/fused_step.py) and its weights (decode_weights.py), on the
CPU in fp32: its greedy rows equal HF generate's and the model step's (the engine's step before it), with its
SDPA and its FlexAttention attention; it traces whole; compiled, it writes the cache in place; its copies are
filled again after the weights change and counted by the memory estimate; LoRA decodes the adapted model
and leaves the training weights untouched; a model it cannot read falls back in one line; top-k on 16-bit
logits keeps HF's distribution."""

import re

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

import grpo
from training.decode import decode_weights, engine, fused_step, rollout, static_step
from training.memory import shapes, terms
from training.model.load import load_model
from training.model.lora import with_lora

FEWSHOT = "Q: 1+1? A: 2. Q: 2+3? A: 5. Q: "  # a shared prefix, as few-shot exemplars make
PROMPTS = [FEWSHOT + "4+4? A:", FEWSHOT + "10+7? A:", FEWSHOT + "3+9, then double it? A:", "no shared prefix"]


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu", dtype=torch.float32)


def spread_eos(model, tok, prompts, n, N):
    """A token HF's greedy rows emit mid-response at the most different steps, to be the EOS: rows stop at
    different lengths (the tiny models' own EOS rarely comes)."""
    rows = rollout.generate(
        model, tok, prompts, n, rollout.Sampling(N, greedy=True), share_prefix=False
    ).response_ids
    stops = {t: {r.index(t) if t in r else -1 for r in rows} for t in {t for r in rows for t in r[1:-1]}}
    return max(sorted(stops), key=lambda t: len(stops[t]))


@pytest.mark.parametrize(
    "prompts,n,chunk",
    [(PROMPTS[:3], 2, 5), (PROMPTS, 3, 8), (PROMPTS[:1], 1, 1), (PROMPTS, 1, 3)],
    ids=["fewshot-5", "no-common-prefix-8", "one-row", "one-each-3"],
)
def test_greedy_rows_equal_hf_generate_and_the_model_step(tiny, prompts, n, chunk):
    """Prompts with and without a shared prefix, several row counts and chunks (a last chunk with idle
    rows), a mid-response token as EOS so rows finish at different lengths: the fused step's rows (SDPA,
    eager) equal HF generate's on the same rows and the model step's (the engine before the fused step)."""
    model, tok = tiny
    eos = spread_eos(model, tok, prompts, n, 30)
    old, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos
    kw = dict(n=n, sampling=rollout.Sampling(30, greedy=True), chunk_size=chunk)
    try:
        hf = rollout.generate(model, tok, prompts, share_prefix=False, **kw)
        fused = rollout.generate(model, tok, prompts, engine=engine.Engine(model, graphs=False), **kw)
        before = engine.Engine(model, graphs=False, fused=False)
        assert fused == hf == rollout.generate(model, tok, prompts, engine=before, **kw)
    finally:
        model.generation_config.eos_token_id = old
    if n * len(prompts) > 2:
        assert len({len(r) for r in hf.response_ids}) >= 2 and not all(hf.truncated)


def test_flex_attention_rows_equal_hf_generate(tiny):
    """FlexAttention (eager here: its unfused path, as slow as it is exact) over the rows' lengths, with
    enable_gqa and a BlockMask made on the device: the rows equal HF generate's."""
    model, tok = tiny
    kw = dict(n=2, sampling=rollout.Sampling(12, greedy=True), chunk_size=8)
    hf = rollout.generate(model, tok, PROMPTS, share_prefix=False, **kw)
    eng = engine.Engine(model, graphs=False, attention="flex")
    assert eng.attention == "flex" and rollout.generate(model, tok, PROMPTS, engine=eng, **kw) == hf


@pytest.mark.parametrize("kind", fused_step.ATTENTIONS)
def test_attention_reads_each_rows_first_m_keys_with_gqa(kind):
    """fused_step.attention against softmax(q K^T / sqrt(d)) V written out, query head i on K, V head
    i // (Hq / Hkv), each row over its first m_r keys (one row over a single key, one over all S, one past
    a key block of 128); what lies beyond m_r (here NaN-free noise) does not enter."""
    g = torch.Generator().manual_seed(0)
    b, Hq, Hkv, S, d = 3, 8, 2, 320, 16
    q, K, V = (torch.randn(*s, generator=g) for s in ((b, Hq, d), (b, Hkv, S, d), (b, Hkv, S, d)))
    m = torch.tensor([1, S, 130])
    got = fused_step.attention(kind, q, K, V, fused_step.length_mask(kind, m, S))  # (b, Hq d)
    for r in range(b):
        k, v = (
            K[r].repeat_interleave(Hq // Hkv, 0)[:, : m[r]],
            V[r].repeat_interleave(Hq // Hkv, 0)[:, : m[r]],
        )
        p = torch.softmax(q[r, :, None] @ k.mT / d**0.5, -1)  # (Hq, 1, m_r)
        torch.testing.assert_close(got[r], (p @ v).reshape(-1), rtol=1e-5, atol=1e-5)


def step_graphs(model, tok, attention, warp):
    """torch._dynamo.explain of one Engine.step (4 rows): its graphs and graph breaks."""
    ids = tok(PROMPTS[:2]).input_ids
    eng = engine.Engine(model, 3, attention=attention).reserve(
        4, max(map(len, ids)) + 8, 8, [tok.eos_token_id], tok.pad_token_id, warp
    )
    torch._dynamo.reset()
    try:
        with torch.no_grad(), eng.scope():
            return torch._dynamo.explain(eng.step)(4)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("attention", fused_step.ATTENTIONS)
def test_the_fused_step_traces_whole(attention, monkeypatch):
    """The fused step (forward, its attention, min_new_tokens, sampling, bookkeeping) traces as one graph
    with no graph break, greedy and sampled, as torch.compile(fullgraph=True) needs it on CUDA; a norm that
    reads a value on the host breaks it (the check can fail)."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    for warp in (None, (0.9, 10, 0.9)):
        ex = step_graphs(model, tok, attention, warp)
        assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    real = fused_step.rms
    monkeypatch.setattr(fused_step, "rms", lambda x, w, eps: real(x, w, eps) * (1 + 0 * float(x.sum())))
    assert step_graphs(model, tok, attention, None).graph_break_count > 0


@pytest.mark.slow
def test_compiled_the_step_writes_the_cache_in_place():
    """Inductor (on the CPU) compiles the fused step whole: the generated code holds no buffer of the K, V
    cache's shape (each layer's write is an index_put_ on the buffer itself, not a copy of it and a copy
    back: on a GPU that copy would move the whole cache every step), and the compiled engine's greedy rows
    equal HF generate's."""
    from torch._inductor.utils import run_and_get_code

    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    kw = dict(n=2, sampling=rollout.Sampling(16, greedy=True), chunk_size=8)
    hf = rollout.generate(model, tok, PROMPTS, share_prefix=False, **kw)
    eng = engine.Engine(model, graphs=False, compile_step=True)
    torch._dynamo.reset()
    try:
        got, code = run_and_get_code(rollout.generate, model, tok, PROMPTS, engine=eng, **kw)
    finally:
        torch._dynamo.reset()
    assert eng.compile and got == hf
    L, rows, Hkv, S, d = eng.keys.shape
    layer, cache = f"({rows}, {Hkv}, {S}, {d})", f"({L}, {rows}, {Hkv}, {S}, {d})"
    made = re.findall(r"empty_strided\w*\((\([^)]*\))", "\n".join(code))
    assert made and layer not in made and cache not in made, made


def tiny_lora(targets="all-linear", seed=0):
    """tiny-qwen3 under peft's adapters (rank 4) with random B (peft starts at B = 0: the base)."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    cfg = grpo.parse_args(["--model", "tiny-qwen3", "--lora-rank", "4", "--lora-targets", targets])
    pm, g = with_lora(model, cfg), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return pm, tok


def test_lora_decodes_the_adapted_model_and_leaves_its_weights_untouched():
    """Under LoRA the fused step reads the base's own matrices with the adapters as low-rank pairs (no
    merged copy); its greedy rows equal the unmerged peft model's HF generate (fp32), differ from the base's
    (the adapters matter), and every parameter of the peft model is bit-equal after the rollout."""
    pm, tok = tiny_lora()
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    kw = dict(n=2, sampling=rollout.Sampling(24, greedy=True), chunk_size=5)
    hf = rollout.generate(pm, tok, PROMPTS, share_prefix=False, **kw)
    eng = engine.Engine(pm, graphs=False)
    assert eng.attention == "sdpa" and rollout.generate(pm, tok, PROMPTS, engine=eng, **kw) == hf
    qkv = eng.w.layers[0].qkv
    assert len(qkv.ws) == 3 and qkv.A.shape == (12, 64) and qkv.B.shape == (128, 12)  # the base's own
    assert all(torch.equal(before[n], p) for n, p in pm.named_parameters())
    with pm.disable_adapter():
        assert rollout.generate(pm, tok, PROMPTS, share_prefix=False, **kw) != hf


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_kept_engine_decodes_the_weights_as_they_are_after_a_step(lora):
    """The weights change in place between two rollouts (as the optimizer steps them): the engine kept
    for the run fills its copies again at the next reserve, in the same storage, and its rows equal HF
    generate's of the changed model (and differ from the first rollout's)."""
    model, tok = tiny_lora() if lora else load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    kw = dict(n=2, sampling=rollout.Sampling(16, greedy=True), chunk_size=8)
    eng = engine.Engine(model, graphs=False)
    first = rollout.generate(model, tok, PROMPTS, engine=eng, **kw)
    held = [t.data_ptr() for layer in eng.w.layers for p in (layer.qkv, layer.gate_up) for t in (*p.ws, p.A)
            if t is not None]  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and p.ndim == 2 and "embed" not in name:  # LoRA: the adapters alone
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    got = rollout.generate(model, tok, PROMPTS, engine=eng, **kw)
    assert got == rollout.generate(model, tok, PROMPTS, share_prefix=False, **kw) != first
    assert held == [t.data_ptr() for layer in eng.w.layers for p in (layer.qkv, layer.gate_up)
                    for t in (*p.ws, p.A) if t is not None]  # fmt: skip


@pytest.mark.parametrize("name,targets", [("tiny-qwen3", None), ("tiny-llama", None), ("tiny-qwen3",
                         "all-linear"), ("tiny-qwen3", "q_proj,v_proj")])  # fmt: skip
def test_the_estimate_counts_the_decode_copy(name, targets):
    """terms.decode_copy, from the config (shapes.read_shapes' count, the run's flags), equals the bytes the
    engine's copies hold beyond the model's own tensors: full fine-tuning's merged Q, K, V and gate, up;
    LoRA's low-rank pairs, for every linear and for two of them."""
    if targets:
        model, tok = tiny_lora(targets)
        flags = ["--lora-rank", "4", "--lora-targets", targets]
    else:
        model, tok = load_model(name, device="cpu", dtype=torch.float32)
        flags = []
    eng = engine.Engine(model, graphs=False).reserve(4, 64, 8, [tok.eos_token_id], tok.pad_token_id, None)
    cfg = grpo.parse_args(["--model", name, *flags])
    s = shapes.read_shapes(shapes.largest(cfg), model.config, "cpu", 32)
    assert s.decode_copy == decode_weights.copy_bytes(eng.w, model) > 0


def test_a_model_the_fused_step_cannot_read_decodes_with_its_forward(capsys, monkeypatch):
    """A model type outside decode_weights.FUSED_TYPES: one line says so at the engine's making, the
    engine decodes with the model step, no copy is made, and its rows still equal HF generate's."""
    model, tok = load_model("tiny-llama", device="cpu", dtype=torch.float32)
    monkeypatch.setattr(decode_weights, "FUSED_TYPES", ("qwen3",))
    eng = engine.Engine(model, graphs=False)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("engine:")]
    assert lines == [
        "engine: the fused decode step cannot read this model (model type 'llama' is not one of "
        "('qwen3',)); it decodes with the model's forward"
    ]
    kw = dict(n=2, sampling=rollout.Sampling(12, greedy=True), chunk_size=8)
    got = rollout.generate(model, tok, PROMPTS, engine=eng, **kw)
    assert eng.attention is None and eng.w is None
    assert got == rollout.generate(model, tok, PROMPTS, share_prefix=False, **kw)
    assert terms.decode_copy(model.config, shapes.counts(model.config.to_json_string())[3], (), 0, 4) == 0


def test_a_failed_compile_runs_the_step_uncompiled_on_sdpa(monkeypatch, capsys):
    """A compile that fails in the warm-up: one line, the step uncompiled from then on, its attention SDPA
    (flex's eager path is the slow one); the warm-up then runs the step as written."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    eng = engine.Engine(model, graphs=False, attention="flex", compile_step=True)
    eng.reserve(4, 64, 8, [tok.eos_token_id], tok.pad_token_id, None)

    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("InductorError: no kernel for this shape\nmore lines")

        return run

    ran = []
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(engine.cudagraph, "warm_up", lambda step, side: ran.append(step()))
    eng.warm_up(4)
    assert not eng.compile and eng.attention == "sdpa" and len(ran) == 1 and int(eng.t) == 1
    assert capsys.readouterr().out.splitlines() == [
        "engine: torch.compile of the decode step failed (RuntimeError: InductorError: no kernel for this "
        "shape); it runs uncompiled from here on, its attention SDPA over a length mask"
    ]


def test_top_k_on_16_bit_logits_draws_hfs_distribution():
    """static_step.sample on bf16 logits (the step's, no fp32 copy of the vocabulary): 100,000 draws fit HF's
    temperature and top-k warpers on the same logits' fp32 copy (chi-square, p > 1e-3), and are rejected
    against the distribution without the temperature (p < 1e-6)."""
    logits = (torch.randn(64, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()  # (V,)
    torch.manual_seed(0)
    draws = static_step.sample(logits.expand(100_000, -1), 0.7, 12, 1.0)
    counts = torch.bincount(draws, minlength=64).double()

    def pvalue(T):
        x = TopKLogitsWarper(12)(None, TemperatureLogitsWarper(T)(None, logits.double()[None]))
        p = torch.softmax(x, -1)[0]
        keep = p > 0
        assert counts[~keep].sum() == 0
        return stats.chisquare(counts[keep].numpy(), (p[keep] * counts.sum()).numpy()).pvalue

    assert pvalue(0.7) > 1e-3 and pvalue(1.0) < 1e-6
