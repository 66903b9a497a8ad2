"""training/credit/scoring.py: every signal on tiny models (its shape, finite, deterministic and masked; a
seeded one changes with the seed), entropy against the full logits, attention's FAI against an eager loop
reference and attention as the most received. The token classes and assign: tests/credit/test_baselines.py;
OAR: tests/credit/test_oar.py; the shaping rules on hand-made scores: tests/credit/test_shaping.py; the
papers' baselines: tests/credit/test_paper_baselines.py."""

import math

import pytest
import torch
from conftest import cfg, real_batch

from training.credit import scoring, shaping
from training.model.load import load_model

SHAPINGS_ALL = sorted(shaping.SHAPINGS)


# ----------------------------------------------------------------------------- signals on tiny models
@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu")


@pytest.mark.parametrize("name", sorted(scoring.SIGNALS))
def test_signal_shape_finite_deterministic_masked(tiny, name):
    model, tok = tiny
    batch = real_batch(tok)
    s1, s2 = scoring.SIGNALS[name](model, batch, cfg()), scoring.SIGNALS[name](model, batch, cfg())
    assert s1.shape == batch.input_ids.shape and s1.dtype == torch.float32
    assert torch.isfinite(s1).all() and torch.equal(s1, s2)
    assert (s1[~batch.response_mask] == 0).all() and (s1 >= 0).all()
    if name != "fai":  # FAI is 0 on the last w0 tokens by definition
        assert (s1[batch.response_mask] != 0).float().mean() > 0.5
    assert not model.training and all(p.grad is None for p in model.parameters())
    for rule in SHAPINGS_ALL:  # every pairing runs
        c = shaping.SHAPINGS[rule](s1, batch, cfg())
        assert torch.isfinite(c.weight).all()


@pytest.mark.parametrize("name", ["random", "oar-g"])
def test_seeded_signals_change_with_the_seed(tiny, name):
    model, tok = tiny
    batch = real_batch(tok)
    s0, s1 = (scoring.SIGNALS[name](model, batch, cfg(seed=k)) for k in (0, 1))
    assert not torch.equal(s0, s1)


def test_entropy_matches_full_logits(tiny):
    model, tok = tiny
    b = real_batch(tok)
    pos = (b.attention_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos
        ).logits.float()
    H = torch.distributions.Categorical(logits=logits).entropy()  # (B, T) entropy of the next token
    ref = torch.zeros_like(H)
    ref[:, 1:] = H[:, :-1]
    ref = ref * b.response_mask
    got = scoring.signal_entropy(model, b, cfg(), rows_per_block=5)  # several blocks
    assert torch.allclose(got, ref, atol=1e-4)


def test_attention_fai_matches_an_eager_loop_reference(tiny):
    model, tok = tiny
    b = real_batch(tok)
    c = cfg(layers="all", attn_window=(3, 8), attn_global_frac=0.5)
    got = scoring.SIGNALS["fai"](model, b, c)
    old = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(
                input_ids=b.input_ids,
                attention_mask=b.attention_mask,
                output_attentions=True,
                position_ids=(b.attention_mask.cumsum(-1) - 1).clamp_min(0),
            )
    finally:
        model.set_attn_implementation(old)
    v = b.attention_mask.float()
    B, T = v.shape
    heads, dists = [], []
    for A in out.attentions:  # (B, H, T, T)
        for h in range(A.shape[1]):
            a = A[:, h].float() * v[:, :, None] * v[:, None, :]
            per_row = [
                sum(float(a[i, t, s]) * (t - s) for t in range(T) for s in range(t + 1)) / float(v[i].sum())
                for i in range(B)
            ]
            dists.append(sum(per_row) / B)
            heads.append(a)
    k = math.ceil(0.5 * len(heads))
    top = sorted(range(len(heads)), key=lambda j: -dists[j])[:k]
    ref = torch.zeros(B, T)
    for i in range(B):
        for s in range(T):
            ts = [t for t in range(s + 3, min(s + 8, T - 1) + 1) if v[i, t]]
            if ts and b.response_mask[i, s]:
                ref[i, s] = sum(float(heads[j][i, t, s]) for j in top for t in ts) / (len(ts) * k)
    assert torch.allclose(got, ref, atol=1e-5)


def test_attention_is_the_max_received(tiny):
    model, tok = tiny
    b = real_batch(tok)
    A = scoring.attention_graph(model, b.input_ids, b.attention_mask, "middle")
    got = scoring.SIGNALS["attention"](model, b, cfg())
    for i, s in b.response_mask.nonzero().tolist():
        assert math.isclose(
            float(got[i, s]), float(A[i, s + 1 :, s].max()) if s + 1 < A.shape[1] else 0.0, abs_tol=1e-6
        )
