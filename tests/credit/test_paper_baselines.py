"""The papers' baselines under the papers' names (paper fidelity): FlowTracer Table 2's Gradient and
Correlation signals, OAR's Random Credit (--shaping identity), OAR's AS-Joint outcome, and Fig. 6's layer
presets.
Each against a direct reference on the tiny random models."""

import math

import pytest
import torch

import grpo
from data import build_batch
from flowtracer import select_layers
from training.credit import baselines, oar, scoring, shaping
from training.model.load import load_model


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def tiny(request):
    return load_model(request.param, device="cpu", dtype=torch.float32)


def batch_of(tok):
    """Three rows: two with a \\boxed{} answer (one EOS-terminated), one without an answer."""
    prompts = ["Q: 2+2=?", "Q: what is 10-3?", "Q: 1+1?"]
    responses = [
        "so it is 4, answer \\boxed{4} ok",
        "ten minus three is seven: \\boxed{7}",
        "one and one, two",
    ]
    p = [tok(x).input_ids for x in prompts]
    r = [tok(x).input_ids for x in responses]
    r[0] = r[0] + [tok.eos_token_id]
    return build_batch(tok, p, r)


def positions(b):
    return (b.attention_mask.cumsum(-1) - 1).clamp_min(0)


# ----------------------------------------------------------------------------- gradient (Green et al.)
def test_gradient_is_the_embedding_gradient_norm_of_the_response_loglik(tiny):
    model, tok = tiny
    b = batch_of(tok)
    got = scoring.signal_gradient(model, b, grpo.Config(), rows_per_block=7)  # several blocks
    e = model.get_input_embeddings()(b.input_ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=e, attention_mask=b.attention_mask, position_ids=positions(b)).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    L = (logp * b.response_mask[:, 1:]).sum()  # sum_u log pi(y_u)
    (g,) = torch.autograd.grad(L, e)
    ref = g.norm(dim=-1) * b.response_mask
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    last = b.response_mask.long().cumsum(-1).argmax(-1)  # each row's last response token
    assert (got[torch.arange(3), last] == 0).all()  # causality: nothing after it
    assert (got[b.response_mask] > 0).float().mean() > 0.5
    assert all(p.grad is None for p in model.parameters()) and not model.training
    with torch.no_grad():  # as grpo calls signals
        assert torch.equal(scoring.signal_gradient(model, b, grpo.Config(), rows_per_block=7), got)


# ----------------------------------------------------------------------------- correlation (Nie et al.)
def test_correlation_is_the_mean_pairwise_pearson_correlation(tiny):
    model, tok = tiny
    b = batch_of(tok)
    got = scoring.SIGNALS["correlation"](model, b, grpo.Config())
    with torch.no_grad():
        h = (
            model(
                input_ids=b.input_ids,
                attention_mask=b.attention_mask,
                position_ids=positions(b),
                output_hidden_states=True,
            )
            .hidden_states[-1]
            .float()
        )  # (B, T, D), final norm applied
    ref = torch.zeros_like(got)
    for i in range(3):
        cols = b.response_mask[i].nonzero().flatten()
        R = torch.corrcoef(h[i, cols].double())  # (n, n) Pearson, D units
        n = len(cols)
        ref[i, cols] = ((1 + (R.sum(-1) - R.diagonal()) / (n - 1)) / 2).float()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert (got >= 0).all() and (got <= 1).all() and (got[~b.response_mask] == 0).all()


def test_correlation_of_a_one_token_response_is_one_half(tiny):
    model, tok = tiny
    b = build_batch(tok, [tok("Q: hi").input_ids], [[tok.eos_token_id]])
    got = scoring.SIGNALS["correlation"](model, b, grpo.Config())
    assert got[b.response_mask].tolist() == [0.5]


def test_new_signals_run_their_own_pass():
    assert {"gradient", "correlation", "fai"}.isdisjoint(scoring.FUSED) and "attention" in scoring.FUSED
    assert "attention-max" not in scoring.SIGNALS  # one name, the paper's
    assert baselines.separate_pass(grpo.Config(credit="gradient"))
    assert not baselines.separate_pass(grpo.Config(credit="attention"))


# ----------------------------------------------------------------------------- OAR's Random Credit
def test_identity_rule_uses_the_scores_as_gamma():
    b = build_batch_by_hand()
    S = torch.zeros(2, 6)
    S[:, 2:6] = torch.tensor([[0.25, 0.5, 0.0, 0.75], [0.1, 0.2, 0.3, 0.4]])
    c = shaping.SHAPINGS["identity"](S, b, grpo.Config())
    assert c.weight[0].tolist() == [0, 0, 0.25, 0.5, 0.0, 0.75] and not c.fallback[0]
    assert c.weight[1].tolist() == [0, 0, 1, 1, 1, 1] and c.fallback[1]  # no answer: plain GRPO (dep. 6)
    with pytest.raises(ValueError, match="non-negative"):
        shaping.SHAPINGS["identity"](-S, b, grpo.Config())


def build_batch_by_hand():
    from data import Batch

    mask = torch.ones(2, 6, dtype=torch.long)
    q = torch.zeros(2, 6, dtype=torch.bool)
    q[:, :2] = True
    ans = torch.zeros_like(q)
    ans[0, 4:6] = True
    return Batch(torch.zeros(2, 6, dtype=torch.long), mask, q, ~q, ans, 2)


def test_oar_random_credit_weights_are_uniform_draws(tiny):
    model, tok = tiny
    b = batch_of(tok)
    cfg = grpo.Config(credit="random", shaping="identity", seed=5)
    a = baselines.assign(model, tok, b, torch.ones(3), cfg)
    u = scoring.SIGNALS["random"](model, b, cfg)[:, b.prompt_width :]
    resp = b.response_mask[:, b.prompt_width :]
    ok = ~a.fallback
    assert ok.sum() == 2 and a.fallback[2]  # row 2 has no answer
    assert torch.equal(a.weight[ok], u[ok]) and (a.weight[ok][resp[ok]] < 1).all()
    assert baselines.check(cfg) is None


# ----------------------------------------------------------------------------- OAR's AS-Joint outcome
def joint(model, ids, mask, pm, nxt):
    """phi_AS-Joint by hand: mean over pm of log pi(next token)."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    z = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lp = torch.log_softmax(z, -1).gather(-1, nxt[..., None]).squeeze(-1)
    return (lp * pm).sum(-1) / pm.sum(-1).clamp_min(1)


@pytest.mark.parametrize("share", [True, False])
def test_oar_p_as_joint_is_the_clamped_score_drop(tiny, share):
    model, tok = tiny
    b = batch_of(tok)
    got = scoring.SIGNALS["oar-p"](
        model, b, grpo.Config(oar_outcome="as-joint", oar_chunk=5, oar_prefix_cache=share)
    )
    pm = oar.outcome_mask(b.attention_mask, b.answer_mask, "as-joint")
    nxt = oar.next_tokens(b.input_ids)
    ref = torch.zeros_like(got)
    with torch.no_grad():
        for i, t in b.response_mask.nonzero().tolist():
            if not pm[i].any() or t > int(pm[i].nonzero().max()):
                continue  # no outcome / after it: 0
            x = b.input_ids[i : i + 1].clone()
            x[0, t] = tok.pad_token_id
            phi = joint(
                model, b.input_ids[i : i + 1], b.attention_mask[i : i + 1], pm[i : i + 1], nxt[i : i + 1]
            )
            phi_t = joint(
                model, x, b.attention_mask[i : i + 1], pm[i : i + 1], nxt[i : i + 1]
            )  # original targets
            ref[i, t] = (phi - phi_t).clamp_min(0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert (got[2] == 0).all() and (got[:2] > 0).any()  # row 2: no answer, no outcome


@pytest.mark.parametrize("share", [True, False])
def test_oar_g_as_joint_matches_autograd(tiny, share):
    model, tok = tiny
    b = batch_of(tok)
    c = grpo.Config(oar_outcome="as-joint", seed=2, oar_prefix_cache=share)
    got = scoring.SIGNALS["oar-g"](model, b, c)
    pm = oar.outcome_mask(b.attention_mask, b.answer_mask, "as-joint")
    nxt, pos = oar.next_tokens(b.input_ids), positions(b)
    e = model.get_input_embeddings()(b.input_ids).detach()
    gen = torch.Generator().manual_seed(oar.batch_seed(b.input_ids, 2))
    x = (e + torch.randn(e.shape, generator=gen) * 1e-3 * b.response_mask[..., None]).requires_grad_(True)

    def phi(emb):
        z = model(inputs_embeds=emb, attention_mask=b.attention_mask, position_ids=pos).logits.float()
        lp = torch.log_softmax(z, -1).gather(-1, nxt[..., None]).squeeze(-1)
        return (lp * pm).sum(-1) / pm.sum(-1).clamp_min(1)

    with torch.no_grad():
        phi0 = phi(e)
    (g,) = torch.autograd.grad((phi0 - phi(x)).sum(), x)
    ref = (g * e).sum(-1).abs() * b.response_mask
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4 * float(ref.max()))
    assert (got[2] == 0).all() and float(ref.max()) > 0


def test_as_mean_is_the_default_outcome_and_as_joint_a_valid_flag():
    assert grpo.Config().oar_outcome == "as-mean"
    assert baselines.check(grpo.Config(oar_outcome="as-joint")) is None
    assert "--oar-outcome" in baselines.check(grpo.Config(oar_outcome="joint"))


# ----------------------------------------------------------------------------- Fig. 6 layer presets
@pytest.mark.parametrize(
    "L,early,middle,late",
    [
        (36, (0, 15), (15, 25), (25, 36)),  # §4.3 on Qwen3-4B
        (30, (0, 13), (13, 21), (21, 30)),  # SmolLM2: scaled
        (4, (0, 2), (2, 3), (3, 4)),
    ],
)  # the tiny models
def test_fig6_presets_partition_the_layers(L, early, middle, late):
    got = [select_layers(f"fig6-{s}", L) for s in ("early", "middle", "late")]
    assert got == [list(range(*early)), list(range(*middle)), list(range(*late))]
    assert sum(got, []) == list(range(L))  # a partition, boundaries once
    assert select_layers("middle", 36) == list(range(12, 24))  # App. C.2's default differs
    assert baselines.check(grpo.Config(layers="fig6-middle")) is None


def test_fig6_preset_on_too_shallow_a_model_is_a_clear_error():
    with pytest.raises(ValueError, match="fig6-middle.*selects no layer of a 2-layer model"):
        select_layers("fig6-middle", 2)


def test_fig6_preset_runs_the_flow_signal(tiny):
    model, tok = tiny
    b = batch_of(tok)
    s = scoring.SIGNALS["flow"](model, b, grpo.Config(layers="fig6-late"))
    assert torch.isfinite(s).all() and (s[b.answer_mask.any(-1)][:, b.prompt_width :] > 0).any()
    assert not torch.equal(s, scoring.SIGNALS["flow"](model, b, grpo.Config(layers="fig6-early")))
    assert math.isfinite(float(s.sum()))
