"""training/credit/oar.py: OAR-P against serial masking and OAR-G against a direct autograd reference (leaving
the parameters alone), OAR-G and OAR-P agreeing on a toy whose outcome one token determines, and the outcome
mask."""

from types import SimpleNamespace

import pytest
import torch
from conftest import cfg, real_batch
from torch import nn

from data import Batch
from training.credit import oar, scoring
from training.model.load import load_model


# ----------------------------------------------------------------------------- the tiny models
@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu")


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
