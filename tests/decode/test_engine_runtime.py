"""training/decode/engine.py at run time, on the CPU (graphs on CUDA when one is present): the decode step
reads nothing back to the host and traces as one graph, graphs only on CUDA and equal to eager,
rollout.generate takes the engine on CUDA only, the attention kernels it allows, the shapes a kept engine
captures, and its
memory against the generation estimate. What it computes: tests/decode/test_engine.py."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import Qwen3Config

import grpo
from evaluation.memtrace import track_peak
from training.decode import engine, rollout, static_step
from training.memory import phases, shapes, terms
from training.model.load import load_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FEWSHOT = "Q: 1+1? A: 2. Q: 2+3? A: 5. Q: "  # a shared prefix, as few-shot exemplars make
PROMPTS = [FEWSHOT + "4+4? A:", FEWSHOT + "10+7? A:", FEWSHOT + "3+9, then double it? A:", "no shared prefix"]


@torch.no_grad()
def prefill(model, ids, pad):
    """rollout's prefill of the distinct prompts `ids` (all the shared prefix, then each suffix once)."""
    return rollout.prefill_rows(model, rollout.shared_prefix(model, ids, 0), ids, pad)


BUFFERS = ("x", "n", "done", "out", "t", "keys", "values", "ends", "ban")


def run_step_without_data(model, tok, fused=True):
    """Engine.step with every engine buffer a fake tensor (shapes, no values): any read of a value on the
    host (.item(), bool(), int(), .tolist(), nonzero) raises instead of syncing."""
    ids, pad = tok(PROMPTS[:2]).input_ids, tok.pad_token_id
    eng = engine.Engine(model, 3, fused=fused).reserve(
        4, max(map(len, ids)) + 8, 8, [tok.eos_token_id], pad, (0.9, 10, 0.9)
    )
    inp, mask, cache = prefill(model, ids, pad)
    eng.allocate(cache)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for name in BUFFERS:
            setattr(eng, name, mode.from_tensor(getattr(eng, name)))
        with torch.no_grad():
            eng.step(4)


@pytest.mark.parametrize("device", DEVICES)
def test_the_decode_step_reads_nothing_on_the_host(device, monkeypatch):
    """The step (forward, top-k/top-p sampling, min_new_tokens, pad after EOS, the counters) runs on tensors
    whose values do not exist: it never reads one back. Reading one, as HF's per-step stop check does, or
    a sampler calling .item() / .tolist(), fails the same check. On CUDA, the eager step also runs under
    torch.cuda.set_sync_debug_mode("error"), and the graph path captures (a sync inside a capture is an
    error) and replays."""
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    run_step_without_data(model, tok)
    run_step_without_data(model, tok, fused=False)  # the model step
    real = engine.sample
    for bad in (
        lambda lg, *w: real(lg, *w) + int(lg.argmax(-1)[0]) * 0,
        lambda lg, *w: torch.tensor(real(lg, *w).tolist(), device=lg.device),
    ):
        monkeypatch.setattr(engine, "sample", bad)
        with pytest.raises(Exception, match="data-dependent|_local_scalar_dense|DataDependent|tolist"):
            run_step_without_data(model, tok)
    monkeypatch.setattr(engine, "sample", real)
    if device == "cuda":
        ids, pad = tok(PROMPTS[:2]).input_ids, tok.pad_token_id
        eng = engine.Engine(model, 3, graphs=False).reserve(
            4, max(map(len, ids)) + 8, 8, [tok.eos_token_id], pad, (0.9, 10, 0.9)
        )
        with torch.no_grad():
            inp, mask, cache = prefill(model, ids, pad)
            eng.allocate(cache)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with eng.scope():
                    eng.step(4)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        kw = dict(n=3, sampling=rollout.Sampling(12, temperature=0.9, top_p=0.9, top_k=50), chunk_size=6)
        g = rollout.generate(model, tok, PROMPTS, graphs=True, **kw)
        assert len(g.response_ids) == 12 and any(len(r) > 1 for r in g.response_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_only_on_cuda_and_equal_to_eager(device):
    """graphs=None means CUDA graphs on a CUDA model; on the CPU asking for them is an error. On CUDA the
    replayed graphs give the eager step's greedy rows."""
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    assert engine.Engine(model).graphs == (device == "cuda")
    if device == "cpu":
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
            engine.Engine(model, graphs=True)
        return
    kw = dict(n=3, sampling=rollout.Sampling(100, greedy=True), chunk_size=5, check_every=4)  # idle rows
    assert rollout.generate(model, tok, PROMPTS, graphs=True, **kw) == rollout.generate(
        model, tok, PROMPTS, graphs=False, **kw
    )


@pytest.mark.parametrize("device", DEVICES)
def test_rollout_generate_takes_the_engine_on_cuda_only(device, monkeypatch):
    """rollout.generate's dispatch, each decoder replaced by a recorder: on CUDA the shared path (also with
    min_new_tokens) decodes with the engine; on the CPU with rollout.decode unless graphs is given; with
    share_prefix=False or an HF-only option, HF generate (neither)."""
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    used, pad = [], tok.pad_token_id
    monkeypatch.setattr(
        engine.Engine,
        "decode",
        lambda self, inp, mask, cache, which: (
            used.append("engine") or torch.full((len(which), 4), pad, device=inp.device)
        ),
    )
    monkeypatch.setattr(
        rollout,
        "decode",
        lambda model, inp, *a: used.append("decode") or torch.full((len(inp), 4), pad, device=inp.device),
    )
    kw = dict(n=2, sampling=rollout.Sampling(4, greedy=True))
    for extra in (
        {},
        {"min_new_tokens": 2},
        {"share_prefix": False},
        {"repetition_penalty": 1.0},
        {"graphs": False},
    ):
        rollout.generate(model, tok, PROMPTS[:2], **kw, **extra)
    assert used == (["engine", "engine", "engine"] if device == "cuda" else ["decode", "engine"])


def test_supports_full_attention_only():
    model = lambda cfg: type("M", (), {"config": cfg})()  # noqa: E731
    assert engine.supports(model(Qwen3Config()))
    assert not engine.supports(
        model(
            Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=2)
        )
    )


def test_peak_memory_within_the_generation_estimate():
    """The engine's peak live tensor bytes (memtrace.track_peak) of a chunk beyond the weights is what the
    estimate counts for a chunk beside the run's engine: its K, V buffers (2 L Hkv hd S g, S the widest
    prompt + R in multiples of 64) and its fused step's copy of the weights (terms.decode_copy), reserved
    before the chunk, then the prompts' cache and the prefill (terms.engine_generation), within the 10%
    that tests/memory/test_phases.py allows."""
    model, tok = load_model("tiny-qwen3", device="cpu")
    mc, P, R, G, g = model.config, 80, 48, 4, 16
    prompts = ["".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(P - (i * 7) % 16)) for i in range(4)]
    S = 64 * -(-(max(map(len, rollout.prompt_ids(tok, prompts))) - 1 + R) // 64)
    kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * S * g * 4
    copy = terms.decode_copy(mc, shapes.counts(mc.to_json_string())[3], (), 0, 4)
    est = sum(terms.engine_generation(mc, g, G, P, 4, 4).values()) + kv + copy
    with torch.no_grad(), track_peak(model) as tr:
        w = tr.now
        tr.phase("generation")
        run = rollout.Sampling.of(grpo.Config(max_new_tokens=R))  # the rollouts' sampling
        rollout.generate(model, tok, prompts, G, run, chunk_size=g, min_new_tokens=R, graphs=False)
    assert copy > 0 and 0.9 < est / (tr.peak["generation"] - w) < 1.1


def test_generate_speed_gpu_table_runs_on_the_cpu():
    """benchmarks/generate_speed.py's GPU table (--engine; --device cuda on a GPU) end to end at the tiny
    shape: the three decoders timed, the bound, in fp32 the engine's greedy rows all equal HF's, and the
    engine, kept for the run, captures nothing in the timed rounds."""
    import importlib.util as iu
    from pathlib import Path

    spec = iu.spec_from_file_location(
        "generate_speed", Path(__file__).parents[2] / "benchmarks" / "generate_speed.py"
    )
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--engine", "--model", "tiny-qwen3", "--shape", "tiny", "--rounds", "1"])
    assert set(out["speed"]) == {"engine", "HF dynamic", "HF static"} and out["bound_tok_s"] > 0
    assert all(d["tok_s"] > 0 and d["ms_step"] > 0 for d in out["speed"].values())
    assert out["equal"]["float32"]["engine"] == out["equal"]["float32"]["HF dynamic"] == out["rows"] == 8
    assert out["captures"][0] >= 1 and out["captures"][1] == 0  # the engine kept: none timed
    with pytest.raises(SystemExit):
        bench.main(["--sampled"])  # needs --engine


def engine_rows(model, tok, eng, **kw):
    """The greedy rows of rollout.generate through `eng` (kept by the caller), 3 rows a prompt."""
    return rollout.generate(
        model, tok, PROMPTS, 3, rollout.Sampling(20, greedy=True), chunk_size=5, engine=eng, **kw
    )


def test_attention_kernels_refuse_the_math_kernel_unless_nothing_else_runs(monkeypatch, capsys):
    """Decode attention: flash / memory-efficient when torch's own checks pass for the step's shapes, without
    SDPA's math kernel; when neither can run, the math kernel with one line (torch's checks replaced)."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    eng = engine.Engine(model).reserve(4, 100, 8, [tok.eos_token_id], tok.pad_token_id, None)
    ids = tok(PROMPTS[:2]).input_ids
    eng.allocate(prefill(model, ids, tok.pad_token_id)[2])
    seen = []
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", lambda p, debug=False: False)
    for ok in (True, False):
        monkeypatch.setattr(
            torch.backends.cuda,
            "can_use_efficient_attention",
            lambda p, debug=False, ok=ok: seen.append(p) or ok,
        )
        kernels = static_step.attention_kernels(model.config, eng.keys, 4, 128)
        assert (torch.nn.attention.SDPBackend.MATH in kernels) != ok
        assert ("math kernel" in capsys.readouterr().out) != ok
    assert isinstance(seen[0], torch.backends.cuda.SDPAParams)


def test_an_engine_kept_for_a_run_captures_each_warp_once():
    """An engine passed to every call keeps its buffers and graphs: one graph per warp (no row or key-length
    buckets), captured by the warp's first call; a second call captures nothing (eagerly, `captures` counts
    what the step would capture) and gives the rows of a fresh engine; a call with more rows grows it (new
    buffers, graphs dropped, captured again); another warp gets its own graph over the same buffers
    (greedy evaluation beside sampled rollouts)."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    eng = engine.Engine(model, graphs=False, check_every=2)
    first = engine_rows(model, tok, eng)  # 12 rows in chunks of 5: one graph
    keys = eng.keys
    assert eng.captures == 1 and set(eng.graph) == {None} and eng.rows == 5
    assert (
        engine_rows(model, tok, eng)
        == first
        == engine_rows(model, tok, engine.Engine(model, graphs=False, check_every=2))
    )
    assert eng.captures == 1 and eng.keys is keys  # the same buffers, no capture
    wide = dict(n=3, sampling=rollout.Sampling(20, greedy=True), chunk_size=8, engine=eng)
    rollout.generate(model, tok, PROMPTS, **wide)
    assert eng.rows == 8 and eng.keys is not keys and eng.captures == 2  # grown: captured again
    keys = eng.keys
    rollout.generate(model, tok, PROMPTS, **wide)
    assert eng.captures == 2 and eng.keys is keys
    assert engine_rows(model, tok, eng) == first and eng.keys is keys  # 5 rows fit in the 8
    hotter = rollout.Sampling(20, temperature=0.5, top_k=100)
    rollout.generate(model, tok, PROMPTS, 3, hotter, chunk_size=5, engine=eng)
    assert eng.keys is keys and eng.warp == (0.5, 100, 1.0)  # another warp: the same buffers,
    assert set(eng.graph) == {None, (0.5, 100, 1.0)} and eng.captures == 3  # its graph
    with pytest.raises(ValueError, match="engine= decodes the shared-prefix path"):
        rollout.generate(model, tok, PROMPTS, 1, hotter, engine=eng, share_prefix=False)


def trace_one_step(model, tok):
    """Engine.step of tiny-qwen3 (4 rows, top-k/top-p sampling, min_new_tokens) through torch.compile's
    tracer, fullgraph=True: any graph break (a Python branch on a value, a host read) raises."""
    ids, pad = tok(PROMPTS[:2]).input_ids, tok.pad_token_id
    eng = engine.Engine(model, 3).reserve(
        4, max(map(len, ids)) + 8, 8, [tok.eos_token_id], pad, (0.9, 10, 0.9)
    )
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eng.allocate(prefill(model, ids, pad)[2])
            torch.compile(lambda: eng.step(4), backend="eager", fullgraph=True)()
    finally:
        torch._dynamo.reset()
    return eng


def test_the_decode_step_traces_as_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) traces the whole step (forward, sampling, bookkeeping) of tiny-qwen3:
    no data-dependent Python branch, no host read. A sampler that branches on a value breaks the trace."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    assert int(trace_one_step(model, tok).t) == 1  # the step ran, traced
    real = engine.sample
    monkeypatch.setattr(engine, "sample", lambda lg, *w: real(lg, *w) if lg.max() > 0 else lg.argmax(-1))
    with pytest.raises(Exception, match="[Dd]ata-dependent|[Gg]raph break|Unsupported"):
        trace_one_step(model, tok)


def test_check_every_must_be_at_least_one():
    model, _ = load_model("tiny-qwen3", device="cpu")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="check_every must be an integer >= 1"):
            engine.Engine(model, check_every=bad)


def test_the_estimate_counts_the_engines_reserved_buffers():
    """evaluation/memory.py's engine term is the engine's own buffers, reserved at setup for the run's widest
    prompt + max_new_tokens (the 1K step: --max-prompt-tokens 1024 + 1,024 new tokens, gen_chunk 64 rows): it
    stays in every phase, and the generation phase of 256-token padded prompts holds at least it."""
    from types import SimpleNamespace

    import grpo
    from training.memory import budget, preflight

    cfg = budget.largest(
        grpo.parse_args(["--model", "tiny-qwen3", "--max-new-tokens", "1024", "--max-prompt-tokens", "1024"])
    )  # gen_chunk 0: 64 rows
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    eng = preflight.make_engine(cfg, model, tok, widest=1024, n_eval=0)
    eng.allocate(SimpleNamespace(layers=[]))  # the model's dtype, bf16
    reserved = eng.keys.nbytes + eng.values.nbytes
    assert eng.keys.shape[1] == 64 and eng.keys.shape[3] == 1024 - 1 + 1024 + 1  # rows, S (ALIGN 64)
    mc = phases.model_config(cfg.model)
    for P in (1024, 256):
        est = phases.estimate(cfg, mc, "cuda", prompt_tokens=P, widest=1024)
        assert all(0.9 < est[ph]["KV cache"] / reserved < 1.1 for ph in est if ph != "generation")
        assert est["generation"]["KV cache"] >= reserved


def test_a_call_past_the_reservation_is_said_once(capsys):
    """The run reserves its widest call at setup; a call it did not foresee grows the buffers with one line
    (never silently), one that fits says nothing and keeps the buffers."""
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    eng = engine.Engine(model, graphs=False).reserve(4, 100, 8, [tok.eos_token_id], tok.pad_token_id, None)
    assert capsys.readouterr().out == ""  # the first reservation: silent
    eng.reserve(2, 60, 8, [tok.eos_token_id], tok.pad_token_id, (0.9, 10, 0.9))  # fits, another warp
    assert capsys.readouterr().out == "" and (eng.rows, eng.S) == (4, 128)
    eng.reserve(4, 300, 8, [tok.eos_token_id], tok.pad_token_id, None)  # wider than reserved
    out = capsys.readouterr().out
    assert out.count("past the 4 x 128 x 8 reserved") == 1 and eng.S == 320
