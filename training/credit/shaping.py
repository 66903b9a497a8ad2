"""Shaping rules: how a credit signal's scores become the per-token weight gamma_{i,t} of GRPO's loss.

    c = SHAPINGS[cfg.shaping](scores, batch, cfg, eligible=None)   -> flowtracer.Credit of every column (B, T)

scores: (B, T) float32 from scoring.SIGNALS (0 off the response); batch: a data.Batch; cfg: a
grpo.Config; eligible: the token-class mask (baselines.token_class_mask) or None. baselines.assign
runs a signal, then a rule, and keeps the response columns; grpo.py multiplies each token's surrogate term by
the weight (eq. 5: gamma_{i,t} * A_i).

  topk / bottomk   eq. 6: gamma on the top (bottom) ceil(top_frac*n) tokens (flowtracer.flow_credit)
  raw, log1p, sigmoid, tanh-z, mad   Table 7 continuous weights, sum-preserving (departure 3)
  soft             Table 7 soft thresholding: gamma on the fewest tokens holding soft_mass of the score mass
  80-20            Wang et al. 2025b: weight 1 on the top entropy_frac tokens of the whole batch, 0 else
  identity         the weight is the score itself (no ranking, no rescaling): with --credit random, OAR's
                   "Random Credit" baseline, a weight ~ U(0, 1) on each token (OAR §4.2; departure 6)
  bilevel          OAR eq. 14-17 (log1p, min-max, percentile tau, beta, sum-preserving)
  entropy-adv      Cheng et al. (OAR eq. 6): A_t = A + min(alpha H_t, |A| / kappa), handed to GRPO as
                   gamma_t = A_t / A (baselines.assign does it: it is additive, not a multiplicative weight)
Every rule: token_class ("structural" | "semantic" | "") restricts selection to one token class (Table 11b);
tokens outside it keep weight 1.

Padding and sequences without an answer, for every rule (tested):
  * the weight is 0 off the response (prompt, padding); scores there are ignored.
  * a sequence with no answer region, no eligible token, or fewer than two distinct scores among its eligible
    tokens carries no ranking: all-1 weights on its response (plain GRPO) and fallback=True. This holds for
    every signal, so the runs differ only in the credit criterion (§4.1); flow_credit does the same for flow.

Departures (numbered; baselines.py's departure 1: rows with A = 0 get no credit):
 2. Fallback as above also for "none": its constant scores give all-1 weights under every rule.
 3. Table 7 does not give formulas for its continuous forms. Here each maps the eligible scores s to a
    non-negative phi(s) and rescales it to mean 1 over those tokens (sum-preserving, as OAR eq. 17), so the
    update scale matches GRPO's: raw phi = s; log1p phi = log1p(s / mean s); sigmoid phi = sigmoid(z);
    tanh-z phi = 1 + tanh(z), z the within-sequence z-score; mad phi = 1 + tanh(z_mad), z_mad the robust
    z-score (s - median) / (1.4826 MAD). Raw scaling thus lets outliers take huge weights, as §5.1 reports.
    Readings, one among several, pinned by hand in tests/credit/test_shaping.py (test_continuous_hand_cases);
    soft (§5.1 (ii)): the fewest top tokens with soft_mass of the row's mass
    (test_soft_thresholding_hand_cases).
 4. bilevel's tau is a within-sequence percentile of the normalised scores (OAR §4.1: "tau = 0.4 (meaning the
    top 60% of tokens are boosted)"), linear interpolation; eps = 1e-6 in eq. 14, 16.
 5. "80-20" takes its threshold over the eligible tokens of the non-fallback sequences of the batch (the rows
    with A != 0, baselines.py's departure 1).
 6. OAR's Random Credit (--credit random --shaping identity) keeps the common fallback above: a row without an
    answer gets all-1 weights, as under every other signal, so the runs differ only in the credit (§4.1).

Run the tests: python -m pytest -q tests/credit/test_shaping.py
"""

from __future__ import annotations

import math

import torch

from flowtracer import Credit, flow_credit
from flowtracer import rank as ranks

EPS = 1e-6  # the smoothing constant of OAR eq. 14 and 16 (departure 4)


def prepare(scores, batch, eligible=None):
    """Checks and the common fallback. Returns (s, sel, fallback):
    s (B, T) float32 scores, 0 off the selectable tokens; sel (B, T) bool, the response tokens that may be
    selected (response & eligible); fallback (B,) bool: no answer region, no selectable token, or fewer than
    two distinct scores among them (no ranking): such sequences get all-1 gamma (module docstring)."""
    resp = batch.response_mask.bool()
    if tuple(scores.shape) != tuple(resp.shape):
        raise ValueError(f"scores must have the batch's shape {tuple(resp.shape)}, got {tuple(scores.shape)}")
    sel = resp & eligible.to(resp.device).bool() if eligible is not None else resp
    s = scores.to(resp.device, torch.float32)
    if not bool(torch.isfinite(s[sel]).all()):
        raise ValueError("scores contain NaN or inf on the response")
    s = torch.where(sel, s, torch.zeros_like(s))  # (B, T)
    hi = torch.where(sel, s, torch.full_like(s, -math.inf)).amax(-1)  # (B,)
    lo = torch.where(sel, s, torch.full_like(s, math.inf)).amin(-1)  # (B,)
    fallback = ~batch.answer_mask.to(resp.device).bool().any(-1) | ~sel.any(-1) | ~(hi > lo)
    return s, sel, fallback


def finish(weight, sel, fallback, batch, scores):
    """Credit of every column (B, T): weight as given on the selectable tokens, 1 on the other response
    tokens, 0 off the response; all-1 on the response of fallback rows; scores as prepared."""
    resp = batch.response_mask.bool()
    one = torch.ones_like(weight, dtype=torch.float32)
    weight = torch.where(sel & ~fallback.unsqueeze(-1), weight.float(), one)
    return Credit(weight * resp.float(), scores, fallback)


def nonnegative(s, sel, rule):
    if bool((s[sel] < 0).any()):
        raise ValueError(f"shaping {rule!r} needs non-negative scores (flow, entropy, OAR, attention are)")


def check_eligible(cfg, eligible):
    if cfg.token_class not in (None, "", "none") and eligible is None:
        raise ValueError(
            "cfg.token_class is set: pass eligible=token_class_mask(tokenizer, input_ids, "
            "cfg.token_class) to the shaping rule, or call baselines.assign()"
        )


def shape_topk(scores, batch, cfg, eligible=None, largest=True):
    """eq. 6: gamma on the ceil(top_frac * n) selectable tokens with the highest (largest=False: lowest, the
    Bottom-k ablation of Table 5) scores, ties to the earlier token; 1 on the rest (flow_credit)."""
    check_eligible(cfg, eligible)
    s, sel, fallback = prepare(scores, batch, eligible)
    c = flow_credit(s, sel, cfg.top_frac, cfg.gamma, largest=largest)  # every column
    return finish(c.weight, sel, fallback | c.fallback, batch, s)


def shape_bottomk(scores, batch, cfg, eligible=None):
    """Table 5 ablation: gamma on the lowest-scored ceil(top_frac * n) tokens."""
    return shape_topk(scores, batch, cfg, eligible, largest=False)


def masked_quantile(x, m, q):
    """(B,) the q-quantile of x over the tokens in m, per row, linear interpolation (as torch.quantile);
    0 for a row without tokens."""
    n = m.sum(-1)  # (B,)
    srt = torch.where(m, x, torch.full_like(x, math.inf)).sort(-1).values  # (B, T) tokens first
    pos = q * (n - 1).clamp_min(0).to(x.dtype)  # (B,)
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp_min(0))
    vlo, vhi = srt.gather(-1, lo[:, None]).squeeze(-1), srt.gather(-1, hi[:, None]).squeeze(-1)
    out = vlo + (pos - lo.to(x.dtype)) * (vhi - vlo)
    return torch.where(n > 0, out, torch.zeros_like(out))


def shape_continuous(kind):
    """Table 7 continuous reweighting (departure 3): gamma = phi(s) / mean(phi(s)) over selectable tokens."""

    def rule(scores, batch, cfg, eligible=None):
        check_eligible(cfg, eligible)
        s, sel, fallback = prepare(scores, batch, eligible)
        m = sel.float()
        n = m.sum(-1, keepdim=True).clamp_min(1.0)  # (B, 1)
        mean = (s * m).sum(-1, keepdim=True) / n  # (B, 1)
        if kind in ("raw", "log1p"):
            nonnegative(s, sel, kind)
        if kind == "raw":
            phi = s
        elif kind == "log1p":
            phi = torch.log1p(s / mean.clamp_min(1e-30))  # scale-free: log1p(s / mean s)
        elif kind in ("sigmoid", "tanh-z"):
            std = (((s - mean) ** 2 * m).sum(-1, keepdim=True) / n).sqrt()
            z = (s - mean) / std.clamp_min(1e-30)  # (B, T) within-sequence z-score
            phi = torch.sigmoid(z) if kind == "sigmoid" else 1.0 + torch.tanh(z)
        else:  # "mad": robust z-score; MAD = 0 (over half the scores tie) -> mean absolute deviation instead
            med = masked_quantile(s, sel, 0.5).unsqueeze(-1)  # (B, 1)
            dev = (s - med).abs()
            mad = 1.4826 * masked_quantile(dev, sel, 0.5).unsqueeze(-1)  # consistent for a normal
            scale = torch.where(mad > 0, mad, 1.2533 * (dev * m).sum(-1, keepdim=True) / n)
            phi = 1.0 + torch.tanh((s - med) / scale.clamp_min(1e-30))
        phi = phi * m
        weight = phi * n / phi.sum(-1, keepdim=True).clamp_min(1e-30)  # (B, T) mean 1 over sel
        return finish(weight, sel, fallback, batch, s)

    rule.__name__ = f"shape_{kind.replace('-', '_')}"
    rule.__doc__ = shape_continuous.__doc__
    return rule


def shape_soft(scores, batch, cfg, eligible=None):
    """Table 7 "soft dynamic thresholding": gamma on the fewest top-scored tokens whose scores hold at least
    soft_mass (0.2/0.4/0.6/0.8) of the sequence's score mass, 1 on the rest. Ties to the earlier token."""
    check_eligible(cfg, eligible)
    p = cfg.soft_mass
    if not 0.0 < p <= 1.0:
        raise ValueError(f"soft_mass must be in (0, 1], got {p}")
    s, sel, fallback = prepare(scores, batch, eligible)
    nonnegative(s, sel, "soft")
    rank, order = ranks(s.double(), sel)
    srt = s.double().gather(-1, order)  # (B, T) descending, 0 off sel
    before = srt.cumsum(-1) - srt  # mass ranked strictly above
    total = srt.sum(-1, keepdim=True)
    chosen = (before < p * total).gather(-1, rank) & sel  # (B, T) back in token order
    return finish(1.0 + (cfg.gamma - 1.0) * chosen.float(), sel, fallback, batch, s)


def shape_8020(scores, batch, cfg, eligible=None):
    """Wang et al. 2025b ("80/20"): weight 1 on the top entropy_frac of the selectable tokens of the whole
    batch (one threshold for the batch, departure 5), 0 on the other selectable tokens: only the
    high-entropy "forking" tokens get a policy gradient. Ties to the earlier (row, token)."""
    check_eligible(cfg, eligible)
    frac = cfg.entropy_frac
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"entropy_frac must be in [0, 1], got {frac}")
    s, sel, fallback = prepare(scores, batch, eligible)
    pool = sel & ~fallback.unsqueeze(-1)  # (B, T)
    k = math.ceil(frac * int(pool.sum()) - 1e-9)
    rank, _ = ranks(s.double().flatten()[None], pool.flatten()[None])  # one row: the whole batch
    kept = (rank.view_as(s) < k) & pool
    return finish(kept.float(), sel, fallback, batch, s)


def shape_bilevel(scores, batch, cfg, eligible=None):
    """OAR's bi-level reshaping (eq. 14-17): I_hat = min-max(log1p(I)) over the sequence; t = the
    bilevel_tau percentile of I_hat (departure 4); gamma = I_hat / (t + eps) below t (noise suppression),
    1 + beta (I_hat - t) / (1 - t + eps) from t on (signal boosting); then gamma n / sum(gamma): sum = n."""
    check_eligible(cfg, eligible)
    tau, beta = cfg.bilevel_tau, cfg.bilevel_beta
    if not (0.0 <= tau <= 1.0 and beta >= 0.0):
        raise ValueError(f"need 0 <= bilevel_tau <= 1 and bilevel_beta >= 0, got {tau}, {beta}")
    s, sel, fallback = prepare(scores, batch, eligible)
    nonnegative(s, sel, "bilevel")
    m = sel.float()
    Ib = torch.log1p(s)  # (B, T) eq. 14, log
    lo = torch.where(sel, Ib, torch.full_like(Ib, math.inf)).amin(-1, keepdim=True)
    hi = torch.where(sel, Ib, torch.full_like(Ib, -math.inf)).amax(-1, keepdim=True)
    lo, hi = torch.where(sel.any(-1, keepdim=True), lo, 0.0), torch.where(sel.any(-1, keepdim=True), hi, 0.0)
    I = (Ib - lo) / (hi - lo + EPS) * m  # (B, T) eq. 14, min-max
    t = masked_quantile(I, sel, tau).unsqueeze(-1)  # (B, 1) percentile threshold
    weight = torch.where(I < t, I / (t + EPS), 1.0 + beta * (I - t) / (1.0 - t + EPS)) * m  # eq. 16
    weight = weight * m.sum(-1, keepdim=True) / weight.sum(-1, keepdim=True).clamp_min(1e-30)  # eq. 17
    return finish(weight, sel, fallback, batch, s)


def shape_identity(scores, batch, cfg, eligible=None):
    """gamma_t = s_t: the score is the weight. With --credit random it is OAR's "Random Credit" (§4.2):
    "assigns each token a random weight w ~ Uniform(0, 1)", so A_t = w_t A (Table 1, "Random Adv"); no
    rescaling."""
    check_eligible(cfg, eligible)
    s, sel, fallback = prepare(scores, batch, eligible)
    nonnegative(s, sel, "identity")
    return finish(s, sel, fallback, batch, s)


def shape_entropy_adv(scores, batch, cfg, eligible=None):
    """ "Entropy Adv" (OAR Table 1): the multiplicative gamma stays 1 (plain GRPO); assign adds the additive
    bonus entropy_bonus(adv, scores, response_mask & ~fallback, entropy_alpha, entropy_kappa)."""
    check_eligible(cfg, eligible)
    s, sel, fallback = prepare(scores, batch, eligible)
    return finish(torch.ones_like(s), sel, fallback, batch, s)


def entropy_bonus(adv, entropy, mask, alpha=0.4, kappa=2.0):
    """Cheng et al. 2025 (arXiv 2506.14758), OAR eq. 6: A_t = A + min(alpha * sg(H_t), |A| / kappa).

    adv (B,) sequence advantages (or (B, T)); entropy (B, T) H_t; mask (B, T) bool where the bonus applies.
    Returns (B, T) token advantages: A + bonus on mask, A elsewhere (grpo's loss mask removes non-response
    tokens). kappa > 1 keeps the sign of A. alpha = 0.4, kappa = 2: our reading of Cheng et al.'s defaults."""
    if not (alpha >= 0 and kappa > 0):
        raise ValueError(f"need entropy_alpha >= 0 and entropy_kappa > 0, got {alpha}, {kappa}")
    A = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    bonus = torch.minimum(alpha * entropy.detach().float(), A.abs() / kappa)  # (B, T) sg(H) as in eq. 6
    return A + bonus * mask.float()


SHAPINGS = {
    "topk": shape_topk,
    "bottomk": shape_bottomk,
    **{k: shape_continuous(k) for k in ("raw", "log1p", "sigmoid", "tanh-z", "mad")},
    "soft": shape_soft,
    "80-20": shape_8020,
    "bilevel": shape_bilevel,
    "entropy-adv": shape_entropy_adv,
    "identity": shape_identity,
}
BATCH_RULES = {"80-20"}  # one threshold over the whole batch: scores of every row before any loss
