"""training/decode/engine.py, the GPU decode behind rollout.generate, run here through its own API
(graphs=False on the CPU, graphs on CUDA when one is present): the static cache holds what a full forward
computes, greedy rows equal HF generate's (fp32), and the sampler draws HF's warped distribution (chi-square).
How the engine
runs (host reads, graphs, kernels, shapes, its memory): tests/decode/test_engine_runtime.py."""

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from training.decode import engine, rollout, static_step
from training.model.load import load_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FEWSHOT = "Q: 1+1? A: 2. Q: 2+3? A: 5. Q: "  # a shared prefix, as few-shot exemplars make
PROMPTS = [FEWSHOT + "4+4? A:", FEWSHOT + "10+7? A:", FEWSHOT + "3+9, then double it? A:", "no shared prefix"]
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(
    scope="module",
    params=[(m, d) for m in ("tiny-qwen3", "tiny-llama") for d in DEVICES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def tiny(request):
    """fp32 on every device (load_model's CUDA default is bf16): greedy rows are compared in fp32."""
    name, device = request.param
    return load_model(name, device=device, dtype=torch.float32)


@torch.no_grad()
def prefill(model, ids, pad):
    """rollout's prefill of the distinct prompts `ids` (all the shared prefix, then each suffix once)."""
    return rollout.prefill_rows(model, rollout.shared_prefix(model, ids, 0), ids, pad)


def stop_spreading_eos(model, tok, prompts, n, N):
    """A token that HF's greedy rows emit mid-response at the most different steps: made the EOS, rows stop
    at different times (the tiny models' own EOS rarely comes)."""
    free = rollout.generate(model, tok, prompts, n, rollout.Sampling(N, greedy=True), share_prefix=False)
    rows = free.response_ids
    stops = {t: {r.index(t) if t in r else -1 for r in rows} for t in {t for r in rows for t in r[1:-1]}}
    return max(sorted(stops), key=lambda t: len(stops[t]))


@pytest.mark.parametrize(
    "prompts",
    [PROMPTS[:3], PROMPTS, PROMPTS[:1], ["a", "b"]],
    ids=["fewshot", "no-common-prefix", "one-prompt", "one-token"],
)
def test_greedy_rows_equal_hf_generate(tiny, prompts):
    """Prompts of different lengths (left padding), one token, one prompt; chunks of 5 rows (a last chunk of
    3 rows); a mid-response token as EOS, so rows stop at different steps and finished rows attend one key
    (check_every 2): prompt ids, responses, texts and truncation flags equal HF generate's, and
    rollout.decode's."""
    model, tok = tiny
    eos = stop_spreading_eos(model, tok, prompts, 2, 40)
    old, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos
    kw = dict(n=2, sampling=rollout.Sampling(40, greedy=True), chunk_size=5)
    try:
        ref = rollout.generate(model, tok, prompts, share_prefix=False, **kw)
        got = rollout.generate(model, tok, prompts, graphs=model.device.type == "cuda", check_every=2, **kw)
        assert got == ref
        assert got == rollout.generate(model, tok, prompts, **kw)
    finally:
        model.generation_config.eos_token_id = old
    if len(prompts) > 2:
        assert len({len(r) for r in ref.response_ids}) >= 2 and not all(ref.truncated)


def test_pad_after_eos_and_min_new_tokens(tiny):
    """The engine's raw rows: HF generate's tokens, then pad after each row's EOS to max_new_tokens; with
    min_new_tokens, HF's too (no EOS before it, rollout.generate passes it through on CUDA)."""
    model, tok = tiny
    eos = stop_spreading_eos(model, tok, PROMPTS[:3], 1, 16)
    old, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos
    try:
        ids = tok(PROMPTS[:3]).input_ids
        pad = tok.pad_token_id
        enc = tok(PROMPTS[:3], return_tensors="pt", padding=True).to(model.device)
        for low in (None, 6):
            kw = dict(
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=rollout.eos_ids(model, tok),
                pad_token_id=pad,
                **({"min_new_tokens": low} if low else {}),
            )
            hf = model.generate(**enc, **kw)[:, enc.input_ids.shape[1] :]  # (3, <= 16), pad after EOS
            eng = engine.Engine(model, low or 0, check_every=4).reserve(
                3, max(map(len, ids)) - 1 + 16, 16, rollout.eos_ids(model, tok), pad, None
            )
            inp, mask, cache = prefill(model, ids, pad)
            seq = eng.decode(inp, mask, cache, torch.arange(3, device=model.device))  # (3, 16)
            w = hf.shape[1]
            assert torch.equal(seq[:, :w], hf) and (seq[:, w:] == pad).all()
            if low is None:  # a row stopped, then pad
                assert ((seq == eos).any(-1) & (seq[:, -1] == pad)).any()
            else:
                assert not (seq[:, :low] == eos).any()
    finally:
        model.generation_config.eos_token_id = old


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "model-step"])
def test_static_cache_holds_the_full_forwards_keys(tiny, fused):
    """After N greedy steps the buffers hold, left-compacted (row r's slots 0 .. n_r - 1: its real prompt
    tokens, then each generated token fed back, n_r of them; min_new_tokens N keeps every row writing), the
    keys and values of one full forward over the same rows, past 128 keys, for the fused step and the
    model's own forward; the buffers never
    move (same storage), slots past n_r stay zero. fp32: the full forward sums the same products in another
    order, so the tolerance is the rounding of a D-term dot product through each of the L layers, on the
    largest key."""
    model, tok = tiny
    ids, pad, N = tok(PROMPTS[:3]).input_ids, tok.pad_token_id, 100
    eng = engine.Engine(model, N, check_every=N, fused=fused).reserve(  # no EOS before N: every row live
        4, max(map(len, ids)) - 1 + N, N, [tok.eos_token_id], pad, None
    )
    inp, mask, cache = prefill(model, ids, pad)
    which = torch.tensor([0, 1, 2, 2], device=model.device)  # prompt 2 has two rows
    eng.allocate(cache)
    ptr = eng.keys.data_ptr()
    seq = eng.decode(inp, mask, cache, which)  # (4, N)
    full_ids = torch.cat([inp[which], seq[:, :-1]], 1)  # (4, W + N - 1) what was fed
    full_mask = torch.cat([mask[which], torch.ones_like(seq[:, :-1])], 1)
    with torch.no_grad():
        ref = model(
            input_ids=full_ids,
            attention_mask=full_mask,
            position_ids=(full_mask.cumsum(-1) - 1).clamp_min(0),
            use_cache=True,
        ).past_key_values
    n = eng.n[:4]
    assert torch.equal(n, full_mask.sum(-1)) and len(set(n.tolist())) == 3 and min(n) > 128  # 3 lengths
    tol = model.config.hidden_size * model.config.num_hidden_layers * EPS32
    for i, layer in enumerate(ref.layers):
        for got, want in ((eng.keys[i, :4], layer.keys), (eng.values[i, :4], layer.values)):
            for r in range(4):  # (n_r, Hkv, d): the real positions of row r, in order
                real = want[r].transpose(0, 1)[full_mask[r].bool()]
                torch.testing.assert_close(
                    got[r, :, : n[r]].transpose(0, 1), real, rtol=0, atol=tol * want.abs().max().item()
                )
                assert not got[r, :, n[r] :].any()  # nothing written past the end
    assert eng.keys.data_ptr() == ptr and int(eng.t) == N and eng.S > 128


def test_slot_layer_writes_each_rows_slot_in_place():
    """SlotLayer.update: row r's new (Hkv, d) key goes to its slot n_r of the buffer and nowhere else, and
    the layer hands back the buffer itself (the same storage: no copy, no concatenation)."""
    keys, values = torch.randn(3, 2, 8, 4), torch.randn(3, 2, 8, 4)
    before = keys.clone()
    n = torch.tensor([5, 0, 7])
    layer = static_step.SlotLayer(keys, values, n)
    k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    K, Vv = layer.update(k, v)
    assert K.data_ptr() == keys.data_ptr() and Vv.data_ptr() == values.data_ptr()
    written = torch.zeros(3, 8, dtype=torch.bool)
    written[torch.arange(3), n] = True
    for r in range(3):
        assert torch.equal(keys[r, :, n[r]], k[r, :, 0]) and torch.equal(values[r, :, n[r]], v[r, :, 0])
    assert torch.equal(keys.transpose(1, 2)[~written], before.transpose(1, 2)[~written])
    assert layer.get_mask_sizes(1) == (8, 0)


def warped(logits, T, k, p):
    """HF's own warpers, HF's order, in fp64: the exact distribution the engine must draw from."""
    x = logits.double()[None]
    for w, on in (
        (TemperatureLogitsWarper(T), T != 1.0),
        (TopKLogitsWarper(k) if k else None, bool(k)),
        (TopPLogitsWarper(p), p < 1.0),
    ):
        x = w(None, x) if on else x
    return torch.softmax(x, -1)[0]  # (V,)


def draw_counts(logits, T, k, p, n, device):
    """Counts over the vocabulary of n draws of engine.sample on one row of logits, repeated."""
    torch.manual_seed(0)
    rows = logits.to(device).expand(n, -1)  # (n, V)
    return torch.bincount(engine.sample(rows, T, k, p).cpu(), minlength=logits.shape[-1]).double()


def chi2_pvalue(counts, probs):
    """Pearson's goodness-of-fit p-value on the support (scipy); 0 if a token outside it was drawn."""
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return 0.0
    exp = probs[keep] / probs[keep].sum() * counts.sum()
    return stats.chisquare(counts[keep].numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T,k,p",
    [(0.7, 20, 0.9), (1.3, 6, 1.0), (1.0, 0, 0.8), (0.99, 100, 1.0)],
    ids=["T-k-p", "T-k", "p", "app-c3"],
)
def test_sampler_draws_hfs_warped_distribution(device, T, k, p):
    """100,000 draws of the engine's sampler (exponential race) on fixed logits fit HF's warped
    distribution (chi-square, p > 1e-3: a correct sampler fails 1 run in 1,000); the same counts are
    rejected (p < 1e-6) against the distributions without the temperature, and with another top-k or top-p,
    so the test can fail."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 2.0  # (V,)
    counts = draw_counts(logits, T, k, p, 100_000, device)
    want = warped(logits, T, k, p)
    assert (want > 0).sum() >= 4  # a real choice
    assert chi2_pvalue(counts, want) > 1e-3
    for other in ((1.6 * T, k, p), (T, k // 2 if k else 3, p), (T, k, 0.5 * p)):
        assert chi2_pvalue(counts, warped(logits, *other)) < 1e-6, other


def test_first_tokens_through_the_engine_fit_hfs_warpers():
    """End to end on tiny-qwen3: 3,000 first tokens from the engine fit HF's warpers on the prompt's
    last logits (the sampler reads the right logits, of the right rows)."""
    model, tok = load_model("tiny-qwen3", device="cpu")
    ids = torch.tensor([tok(PROMPTS[0]).input_ids])
    with torch.no_grad():
        want = warped(model(ids).logits[0, -1], 0.7, 20, 0.9)
    torch.manual_seed(0)
    g = rollout.generate(
        model,
        tok,
        PROMPTS[:1],
        3000,
        rollout.Sampling(1, temperature=0.7, top_p=0.9, top_k=20),
        chunk_size=1000,
        graphs=False,
    )
    counts = torch.bincount(torch.tensor([r[0] for r in g.response_ids]), minlength=len(tok)).double()
    assert (want > 0).sum() >= 3 and chi2_pvalue(counts, want) > 1e-3
