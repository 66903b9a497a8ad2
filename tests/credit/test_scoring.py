"""Tests for baselines.py and oar.py: token classes, every signal on tiny models, OAR against serial
references and OAR-G vs OAR-P on a toy whose outcome one token determines, and baselines.assign end to end.
The shaping
rules on hand-made scores: tests/test_credit_shaping.py."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import grpo
from data import Batch, build_batch
from training.credit import baselines, oar, scoring, shaping
from training.model.load import load_model

SHAPINGS_ALL = sorted(shaping.SHAPINGS)


def cfg(**kw):
    return grpo.Config(**kw)


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
    assert baselines.is_structural(text) is structural


def test_token_class_mask_on_the_byte_tokenizer(tiny):
    _, tok = tiny
    ids = torch.tensor([[ord("."), ord("a"), ord("7"), ord("\n"), tok.eos_token_id, 200]])
    assert baselines.token_class_mask(tok, ids, "structural").tolist() == [
        [True, False, False, True, True, False]
    ]
    assert baselines.token_class_mask(tok, ids, "semantic").tolist() == [
        [False, True, True, False, False, True]
    ]
    assert (
        baselines.token_class_mask(tok, ids, None) is None
        and baselines.token_class_mask(tok, ids, "") is None
    )
    with pytest.raises(ValueError, match="token_class"):
        baselines.token_class_mask(tok, ids, "digits")


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
    got = scoring.SIGNALS["oar-p"](model, b, c)
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
    got = scoring.SIGNALS["oar-g"](model, b, c)
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
        assert torch.equal(scoring.SIGNALS["oar-g"](model, b, c), got)


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
    p = scoring.SIGNALS["oar-p"](model, batch, cfg(oar_outcome=outcome, oar_chunk=4, oar_prefix_cache=False))
    g = scoring.SIGNALS["oar-g"](model, batch, cfg(oar_outcome=outcome, oar_prefix_cache=False))
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
    c = baselines.assign(model, tok, b, adv, cfg(credit="random", shaping="topk", token_class="structural"))
    P = b.prompt_width
    structural = baselines.token_class_mask(tok, b.input_ids, "structural")[:, P:]  # (B, R)
    assert c.weight.shape == c.scores.shape == b.response_mask[:, P:].shape
    boosted = c.weight == 1.5
    assert boosted.any() and (structural[boosted]).all()
    assert (c.weight[~b.response_mask[:, P:]] == 0).all()  # 0 on padding
    with pytest.raises(ValueError, match="oar_sigma"):
        scoring.SIGNALS["oar-g"](model, b, cfg(oar_sigma=0.0))
