"""Tests for credit.py and oar.py: every signal on tiny models, OAR-G vs OAR-P on a toy whose outcome one
token
determines, every shaping rule on hand-made scores, padding / no-answer behaviour, token classes."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from data import Batch, build_batch
from flowtracer import flow_credit, trace_flow
from training import credit, oar, shaping, signals
from training.models import load_model

SHAPINGS_ALL = sorted(shaping.SHAPINGS)
SUM_PRESERVING = ["raw", "log1p", "sigmoid", "tanh-z", "mad", "bilevel"]


def cfg(**kw):
    return credit.CreditConfig(**kw)


def regions(resp_lens, P=3, answer=None, T=None):
    """Hand-made Batch: no prompt padding, responses right-padded; answer = the last 2 response tokens
    of the rows with answer[b] True (all rows by default)."""
    B = len(resp_lens)
    T = T or P + max(resp_lens)
    answer = [True] * B if answer is None else answer
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    q, resp, ans = (torch.zeros(B, T, dtype=torch.bool) for _ in range(3))
    for b, n in enumerate(resp_lens):
        mask[b, : P + n] = 1
        q[b, :P] = True
        resp[b, P : P + n] = True
        if answer[b] and n >= 2:
            ans[b, P + n - 2 : P + n] = True
    return Batch(ids, mask, q, resp, ans, P)


def put(scores_per_row, P=3, answer=None):
    """(scores (B, T), batch) from per-row response scores."""
    batch = regions([len(s) for s in scores_per_row], P, answer)
    S = torch.zeros(batch.input_ids.shape)
    for b, s in enumerate(scores_per_row):
        S[b, P : P + len(s)] = torch.tensor(s, dtype=torch.float32)
    return S, batch


# ----------------------------------------------------------------------------- shaping: hand-computed
def test_topk_and_bottomk_hand_case():
    S, batch = put([[5, 1, 4, 2, 3]])
    w = shaping.SHAPINGS["topk"](S, batch, cfg()).weight[0, 3:]
    assert w.tolist() == [1.5, 1, 1.5, 1, 1]  # ceil(0.4 * 5) = 2: scores 5 and 4
    w = shaping.SHAPINGS["bottomk"](S, batch, cfg(gamma=2.0, top_frac=0.6)).weight[0, 3:]
    assert w.tolist() == [1, 2, 1, 2, 2]  # ceil(0.6 * 5) = 3 lowest: 1, 2, 3


def test_topk_ties_go_to_the_earlier_token():
    S, batch = put([[1, 3, 3, 3, 0]])
    w = shaping.SHAPINGS["topk"](S, batch, cfg()).weight[0, 3:]
    assert w.tolist() == [1, 1.5, 1.5, 1, 1]


def test_topk_on_flow_matches_flow_credit():
    torch.manual_seed(0)
    batch = regions([6, 4], P=3)
    A = torch.rand(2, 9, 9).tril(-1)
    A = A / A.sum(-1, keepdim=True).clamp_min(1e-9)
    tau = trace_flow(A, batch.question_mask, batch.answer_mask, batch.attention_mask.bool()).throughput
    S = (tau * batch.response_mask).float()
    assert torch.equal(
        shaping.SHAPINGS["topk"](S, batch, cfg()).weight, flow_credit(S, batch.response_mask).weight
    )


def test_continuous_hand_cases():
    S, batch = put([[1, 3]])
    w = lambda k: shaping.SHAPINGS[k](S, batch, cfg()).weight[0, 3:]  # noqa: E731
    assert torch.allclose(w("raw"), torch.tensor([0.5, 1.5]))  # s / mean s
    l1, l3 = math.log1p(0.5), math.log1p(1.5)  # log1p(s / 2)
    assert torch.allclose(w("log1p"), torch.tensor([2 * l1 / (l1 + l3), 2 * l3 / (l1 + l3)]))
    sig = torch.sigmoid(torch.tensor([-1.0, 1.0]))  # z = -1, +1
    assert torch.allclose(w("sigmoid"), 2 * sig / sig.sum())
    th = 1 + torch.tanh(torch.tensor([-1.0, 1.0]))
    assert torch.allclose(w("tanh-z"), 2 * th / th.sum())
    S, batch = put([[1, 2, 6]])  # median 2, |dev| = 1, 0, 4: MAD = 1
    phi = 1 + torch.tanh(torch.tensor([-1.0, 0.0, 4.0]) / 1.4826)
    assert torch.allclose(shaping.SHAPINGS["mad"](S, batch, cfg()).weight[0, 3:], 3 * phi / phi.sum())


def test_mad_with_zero_mad_uses_mean_absolute_deviation():
    S, batch = put([[1, 1, 1, 5]])  # median 1, MAD 0; mean |dev| = 1
    phi = 1 + torch.tanh(torch.tensor([0.0, 0.0, 0.0, 4.0]) / 1.2533)
    assert torch.allclose(shaping.SHAPINGS["mad"](S, batch, cfg()).weight[0, 3:], 4 * phi / phi.sum())


@pytest.mark.parametrize(
    "p,expected",
    [(0.4, [1.5, 1, 1, 1]), (0.5, [1.5, 1.5, 1, 1]), (0.8, [1.5, 1.5, 1.5, 1]), (1.0, [1.5, 1.5, 1.5, 1.5])],
)
def test_soft_thresholding_hand_cases(p, expected):
    S, batch = put([[4, 3, 2, 1]])  # mass 10: 4 | 7 | 9 | 10
    assert shaping.SHAPINGS["soft"](S, batch, cfg(soft_mass=p)).weight[0, 3:].tolist() == expected


def test_bilevel_hand_case():
    s = [0.0, math.e - 1, math.e**3 - 1, math.e**4 - 1]  # log1p: 0, 1, 3, 4 -> I_hat ~ 0, .25, .75, 1
    S, batch = put([s])
    I = torch.tensor([0, 1, 3, 4.0]) / (4 + shaping.EPS)
    t = I[1] + 0.2 * (I[2] - I[1])  # 0.4 percentile of 4 values: pos 1.2
    omega = torch.where(I < t, I / (t + shaping.EPS), 1 + 2.0 * (I - t) / (1 - t + shaping.EPS))
    w = shaping.SHAPINGS["bilevel"](S, batch, cfg()).weight[0, 3:]
    assert torch.allclose(w, 4 * omega / omega.sum(), atol=1e-6)
    assert w[0] == 0 and w[1] < w[2] < w[3]  # suppressed below tau, boosted above


def test_bilevel_extremes_suppress_only_and_boost_only():
    S, batch = put([[0.1, 0.5, 2.0, 3.0]])
    boost = shaping.SHAPINGS["bilevel"](S, batch, cfg(bilevel_tau=0.0)).weight[0, 3:]
    supp = shaping.SHAPINGS["bilevel"](S, batch, cfg(bilevel_tau=1.0, bilevel_beta=0.0)).weight[0, 3:]
    I = torch.log1p(torch.tensor([0.1, 0.5, 2.0, 3.0]))
    I = (I - I.min()) / (I.max() - I.min() + shaping.EPS)
    assert torch.allclose(boost, 4 * (1 + 2 * I) / (1 + 2 * I).sum(), atol=1e-6)  # every token boosted
    assert torch.allclose(supp, 4 * I / I.sum(), atol=1e-5)  # every token suppressed


def test_8020_threshold_is_over_the_whole_batch():
    S, batch = put([[9, 1, 2, 3], [8, 7, 6, 0.5]])
    w = shaping.SHAPINGS["80-20"](S, batch, cfg(entropy_frac=0.25)).weight[:, 3:]  # k = ceil(0.25 * 8) = 2
    assert w.tolist() == [[1, 0, 0, 0], [1, 0, 0, 0]]  # 9 and 8 kept
    w = shaping.SHAPINGS["80-20"](S, batch, cfg(entropy_frac=0.5)).weight[:, 3:]
    assert w.tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]  # row 0 gets one token


def test_entropy_adv_weights_and_bonus():
    S, batch = put([[0.5, 3.0], [1.0, 0.1]])
    c = shaping.SHAPINGS["entropy-adv"](S, batch, cfg())
    assert torch.equal(c.weight, batch.response_mask.float())
    adv = torch.tensor([1.0, -1.0])
    A = shaping.entropy_bonus(adv, S, batch.response_mask & ~c.fallback[:, None], alpha=0.4, kappa=2.0)
    assert torch.allclose(A[:, 3:], torch.tensor([[1 + 0.2, 1 + 0.5], [-1 + 0.4, -1 + 0.04]]))
    assert torch.equal(A[:, :3], adv[:, None].expand(2, 3))  # no bonus off the mask


# ----------------------------------------------------------------------------- shaping: properties
rows = st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(rows=rows, seed=st.integers(0, 2**16), name=st.sampled_from(SHAPINGS_ALL))
def test_every_rule_on_padding_and_no_answer(rows, seed, name):
    """Weights are 0 off the response; rows without an answer (or with constant scores) are all-1 +
    fallback."""
    lens, answer = [n for n, _ in rows], [a for _, a in rows]
    batch = regions(lens, P=2, answer=answer, T=2 + max(lens) + 2)  # extra right padding
    S = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(seed)) * 3
    S[0, 2 : 2 + lens[0]] = 0.7  # row 0: constant scores
    c = shaping.SHAPINGS[name](S, batch, cfg())
    resp = batch.response_mask
    assert torch.isfinite(c.weight).all() and (c.weight[~resp] == 0).all()
    no_rank = ~batch.answer_mask.any(-1)
    no_rank[0] = True
    assert torch.equal(c.fallback, no_rank)
    assert torch.equal(c.weight[c.fallback], resp[c.fallback].float())
    if name in SUM_PRESERVING:
        assert torch.allclose(c.weight.sum(-1), resp.sum(-1).float(), rtol=1e-5)  # sum gamma = n (eq. 17)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 2**16), frac=st.sampled_from([0.2, 0.4, 0.6]))
def test_topk_boosts_exactly_ceil_frac_n(n, seed, frac):
    S, batch = put([torch.rand(n, generator=torch.Generator().manual_seed(seed)).tolist()])
    for name in ("topk", "bottomk"):
        w = shaping.SHAPINGS[name](S, batch, cfg(top_frac=frac)).weight
        assert int((w == 1.5).sum()) == math.ceil(frac * n - 1e-9)
    w = shaping.SHAPINGS["topk"](S, batch, cfg(top_frac=frac)).weight[0, 3:]
    assert S[0, 3:][w == 1.5].min() > S[0, 3:][w == 1].max() if (w == 1).any() else True


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 30), seed=st.integers(0, 2**16), p=st.sampled_from([0.2, 0.4, 0.6, 0.8]))
def test_soft_selects_the_fewest_tokens_reaching_the_mass(n, seed, p):
    s = torch.rand(n, generator=torch.Generator().manual_seed(seed)).double() + 0.01
    S, batch = put([s.tolist()])
    chosen = shaping.SHAPINGS["soft"](S, batch, cfg(soft_mass=p)).weight[0, 3:] == 1.5
    x = S[0, 3:].double()
    assert x[chosen].sum() >= p * x.sum() - 1e-6  # reaches the mass ...
    assert x[chosen].sum() - x[chosen].min() < p * x.sum() + 1e-6  # ... and no token is spare
    assert x[chosen].min() >= x[~chosen].max() if (~chosen).any() else True  # top-scored ones


def test_eligible_restricts_selection_to_one_class():
    S, batch = put([[9, 8, 7, 1, 2, 3, 4, 5]])
    elig = torch.zeros_like(batch.response_mask)
    elig[0, 3 + 3 : 3 + 8] = True  # tokens 3..7 (scores 1..5) are the class
    w = shaping.SHAPINGS["topk"](S, batch, cfg(token_class="semantic"), elig).weight[0, 3:]
    assert w.tolist() == [1, 1, 1, 1, 1, 1, 1.5, 1.5]  # ceil(0.4 * 5) = 2 of the class: 4 and 5
    w = shaping.SHAPINGS["bilevel"](S, batch, cfg(), elig).weight[0, 3:]
    assert torch.allclose(w[:3], torch.ones(3)) and torch.isclose(w.sum(), torch.tensor(8.0))
    with pytest.raises(ValueError, match="token_class"):
        shaping.SHAPINGS["topk"](S, batch, cfg(token_class="structural"))


@pytest.mark.parametrize("name", ["raw", "log1p", "soft", "bilevel"])
def test_bad_scores_are_clear_errors(name):
    S, batch = put([[1.0, -2.0, 3.0]])
    with pytest.raises(ValueError, match="non-negative"):
        shaping.SHAPINGS[name](S, batch, cfg())
    S[0, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        shaping.SHAPINGS[name](S, batch, cfg())
    with pytest.raises(ValueError, match="shape"):
        shaping.SHAPINGS[name](S[:, :-1], batch, cfg())


# ----------------------------------------------------------------------------- token classes
@pytest.mark.parametrize(
    "text,structural",
    [
        ("\n", True),
        (" ", True),
        (".", True),
        (", ", True),
        ("=", True),
        (" +", True),
        ("(", True),
        ("\\", True),
        ("$", True),
        ("}", True),
        ("×", True),
        ("the", False),
        (" x", False),
        ("12", False),
        ("\\frac", False),
        ("\ufffd", False),
        ("a.", False),
    ],
)
def test_is_structural(text, structural):
    assert credit.is_structural(text) is structural


def test_token_class_mask_on_the_byte_tokenizer(tiny):
    _, tok = tiny
    ids = torch.tensor([[ord("."), ord("a"), ord("7"), ord("\n"), tok.eos_token_id, 200]])
    assert credit.token_class_mask(tok, ids, "structural").tolist() == [
        [True, False, False, True, True, False]
    ]
    assert credit.token_class_mask(tok, ids, "semantic").tolist() == [[False, True, True, False, False, True]]
    assert credit.token_class_mask(tok, ids, None) is None and credit.token_class_mask(tok, ids, "") is None
    with pytest.raises(ValueError, match="token_class"):
        credit.token_class_mask(tok, ids, "digits")


# ----------------------------------------------------------------------------- signals on tiny models
@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu")


def real_batch(tok):
    """Three rows: EOS-terminated, cut without EOS, and an empty response (nothing to credit)."""
    prompts = ["Q: 2+2=?", "Q: what is 10-3?", "Q: 1+1?"]
    responses = ["so it is 4, answer \\boxed{4} ok", "ten minus three is seven: \\boxed{7}", ""]
    p = [tok(x).input_ids for x in prompts]
    r = [tok(responses[0]).input_ids + [tok.eos_token_id], tok(responses[1]).input_ids, []]
    return build_batch(tok, p, r)


@pytest.mark.parametrize("name", sorted(signals.SIGNALS))
def test_signal_shape_finite_deterministic_masked(tiny, name):
    model, tok = tiny
    batch = real_batch(tok)
    s1, s2 = signals.SIGNALS[name](model, batch, cfg()), signals.SIGNALS[name](model, batch, cfg())
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
    s0, s1 = (signals.SIGNALS[name](model, batch, cfg(seed=k)) for k in (0, 1))
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
    got = signals.signal_entropy(model, b, cfg(), rows_per_block=5)  # several blocks
    assert torch.allclose(got, ref, atol=1e-4)


def test_attention_fai_matches_an_eager_loop_reference(tiny):
    model, tok = tiny
    b = real_batch(tok)
    c = cfg(layers="all", attn_window=(3, 8), attn_global_frac=0.5)
    got = signals.SIGNALS["fai"](model, b, c)
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
    A = signals.attention_graph(model, b.input_ids, b.attention_mask, "middle")
    got = signals.SIGNALS["attention"](model, b, cfg())
    for i, s in b.response_mask.nonzero().tolist():
        assert math.isclose(
            float(got[i, s]), float(A[i, s + 1 :, s].max()) if s + 1 < A.shape[1] else 0.0, abs_tol=1e-6
        )


# ----------------------------------------------------------------------------- OAR against serial references
def serial_outcome(model, ids, mask, pm):
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    z = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    return torch.log_softmax((z * pm[..., None]).sum(1) / pm.sum(-1, keepdim=True), -1)


@pytest.mark.parametrize("outcome,share", [("lt-logits", True), ("as-mean", True), ("as-mean", False)])
def test_oar_p_matches_serial_masking(tiny, outcome, share):
    model, tok = tiny
    b = real_batch(tok)
    c = cfg(oar_outcome=outcome, oar_chunk=7, oar_prefix_cache=share)
    got = signals.SIGNALS["oar-p"](model, b, c)
    pm = oar.outcome_mask(b.attention_mask, b.answer_mask, outcome)
    ref = torch.zeros_like(got)
    with torch.no_grad():
        for i, t in b.response_mask.nonzero().tolist():
            x = b.input_ids[i : i + 1].clone()
            x[0, t] = tok.pad_token_id
            P = serial_outcome(model, b.input_ids[i : i + 1], b.attention_mask[i : i + 1], pm[i : i + 1])
            Q = serial_outcome(model, x, b.attention_mask[i : i + 1], pm[i : i + 1])
            ref[i, t] = (P.exp() * (P - Q)).sum().clamp_min(0)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4)
    if outcome == "as-mean":  # tokens after the last answer-predicting position
        last = int(pm[0].nonzero().max())
        assert (got[0, last + 1 :] == 0).all() and (
            got[0, : last + 1][b.response_mask[0, : last + 1]] > 0
        ).all()


@pytest.mark.parametrize("share", [True, False])
def test_oar_g_matches_a_direct_autograd_reference_and_leaves_params_alone(tiny, share):
    model, tok = tiny
    b = real_batch(tok)
    c = cfg(oar_outcome="as-mean", seed=3, oar_prefix_cache=share)
    got = signals.SIGNALS["oar-g"](model, b, c)
    pm = oar.outcome_mask(b.attention_mask, b.answer_mask, "as-mean")
    pos = (b.attention_mask.cumsum(-1) - 1).clamp_min(0)
    e = model.get_input_embeddings()(b.input_ids).detach()
    gen = torch.Generator().manual_seed(oar.batch_seed(b.input_ids, 3))
    x = (e + torch.randn(e.shape, generator=gen) * 1e-3 * b.response_mask[..., None]).requires_grad_(True)

    def phi(emb):
        return model(inputs_embeds=emb, attention_mask=b.attention_mask, position_ids=pos).logits.float()

    with torch.no_grad():
        P0 = torch.log_softmax((phi(e) * pm[..., None]).sum(1) / pm.sum(-1, keepdim=True), -1)
    Q = torch.log_softmax((phi(x) * pm[..., None]).sum(1) / pm.sum(-1, keepdim=True), -1)
    (g,) = torch.autograd.grad((P0.exp() * (P0 - Q)).sum(), x)
    ref = (g * e).sum(-1).abs() * b.response_mask
    assert torch.allclose(got, ref, rtol=1e-2, atol=1e-3 * float(ref.max()))
    assert got.argmax() == ref.argmax() and float(ref.max()) > 0
    assert all(p.grad is None for p in model.parameters()) and all(
        p.requires_grad for p in model.parameters()
    )
    with torch.no_grad():  # grpo calls signals under no_grad
        assert torch.equal(signals.SIGNALS["oar-g"](model, b, c), got)


class OneTokenModel(nn.Module):
    """A toy causal LM whose outcome provably depends on one token: h_t = tanh(W sum_{s<=t} c_s x_s) with
    c_s = 1 at position id `src` and 0 elsewhere, so every logit from there on is a function of that token
    alone."""

    def __init__(self, src, V=16, D=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.W, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)
        self.src = src  # the deciding position id (after left padding)
        self.config = SimpleNamespace(pad_token_id=0)

    device = property(lambda self: self.emb.weight.device)
    get_input_embeddings = lambda self: self.emb  # noqa: E731
    get_output_embeddings = lambda self: self.head  # noqa: E731
    get_decoder = lambda self: self.trunk  # noqa: E731

    def trunk(
        self,
        input_ids=None,
        inputs_embeds=None,
        attention_mask=None,
        position_ids=None,
        use_cache=False,
        past_key_values=None,
    ):  # no KV cache: run with oar_prefix_cache=False
        x = self.emb(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, D)
        c = ((position_ids == self.src) & attention_mask.bool()).to(x.dtype)  # (B, T)
        return SimpleNamespace(last_hidden_state=torch.tanh(self.W((c[..., None] * x).cumsum(1))))


@pytest.mark.parametrize("outcome", ["lt-logits", "as-mean"])
def test_oar_g_and_oar_p_agree_on_the_deciding_token(outcome):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 0, 3, 4, 5, 6, 7, 8, 9, 10]])
    mask = (torch.arange(10) >= torch.tensor([[0], [2]])).long()
    q = torch.zeros(2, 10, dtype=torch.bool)
    q[0, :3], q[1, 2:5] = True, True
    resp = mask.bool() & ~q
    ans = torch.zeros_like(q)
    ans[:, 8:10] = True
    batch = Batch(ids, mask, q, resp, ans, 3)
    model = OneTokenModel(src=4)  # column 4 of row 0, column 6 of row 1 (2 pads)
    p = signals.SIGNALS["oar-p"](model, batch, cfg(oar_outcome=outcome, oar_chunk=4, oar_prefix_cache=False))
    g = signals.SIGNALS["oar-g"](model, batch, cfg(oar_outcome=outcome, oar_prefix_cache=False))
    for s, tol in ((p, 1e-6), (g, 0.0)):
        assert s.argmax(-1).tolist() == [4, 6]  # both rank the deciding token first
        top = s[[0, 1], [4, 6]].clone()
        s = s.clone()
        s[[0, 1], [4, 6]] = 0
        # every other token: 0 (OAR-P: up to rounding)
        assert (top > 0).all() and (s <= tol * top.min()).all()
    assert all(x.grad is None for x in model.parameters())


def test_outcome_mask_and_pad_id():
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    ans = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]]).bool()
    assert oar.outcome_mask(mask, ans, "lt-logits").nonzero().tolist() == [[0, 4], [1, 5]]
    assert oar.outcome_mask(mask, ans, "as-mean").nonzero().tolist() == [[0, 2], [0, 3], [1, 5]]  # row 1: LT
    assert oar.outcome_mask(mask, ans, "as-joint").nonzero().tolist() == [[0, 2], [0, 3]]  # row 1: none
    with pytest.raises(ValueError, match="oar_outcome"):
        oar.outcome_mask(mask, ans, "last-token")
    model = SimpleNamespace(config=SimpleNamespace(pad_token_id=7))
    b = Batch(
        torch.tensor([[9, 1, 2]]), torch.tensor([[0, 1, 1]]), *(torch.zeros(1, 3, dtype=torch.bool),) * 3, 1
    )
    assert oar.pad_id(model, b, cfg(pad_id=3)) == 3
    assert oar.pad_id(model, b, cfg()) == 9 == oar.pad_id(model, b, cfg(pad_id=-1))  # found in the padding
    assert oar.pad_id(model, b._replace(attention_mask=torch.ones(1, 3, dtype=torch.long)), cfg()) == 7


def test_assign_runs_signal_class_and_shaping(tiny):
    model, tok = tiny
    b = real_batch(tok)
    adv = torch.ones(b.input_ids.shape[0])
    c = credit.assign(model, tok, b, adv, cfg(credit="random", shaping="topk", token_class="structural"))
    P = b.prompt_width
    structural = credit.token_class_mask(tok, b.input_ids, "structural")[:, P:]  # (B, R)
    assert c.weight.shape == c.scores.shape == b.response_mask[:, P:].shape
    boosted = c.weight == 1.5
    assert boosted.any() and (structural[boosted]).all()
    assert (c.weight[~b.response_mask[:, P:]] == 0).all()  # 0 on padding
    with pytest.raises(ValueError, match="oar_sigma"):
        signals.SIGNALS["oar-g"](model, b, cfg(oar_sigma=0.0))
