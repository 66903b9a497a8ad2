"""Tests for training/credit/shaping.py through grpo.Config: every shaping rule on hand-made scores
(hand-computed cases), and properties over random rows: padding and no-answer behaviour, how many tokens
each rule selects, eligibility to one class, and clear errors for bad scores. The signals and OAR:
tests/credit/test_scoring.py and tests/credit/test_oar.py."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo
from data import Batch
from flowtracer import flow_credit, trace_flow
from training.credit import shaping

SHAPINGS_ALL = sorted(shaping.SHAPINGS)
SUM_PRESERVING = ["raw", "log1p", "sigmoid", "tanh-z", "mad", "bilevel"]


def cfg(**kw):
    return grpo.Config(**kw)


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
