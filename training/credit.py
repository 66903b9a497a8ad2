"""Token credit for GRPO: the knobs, the shaping rules, and the credit step as one call.

FlowTracer's claims are comparative (Tables 2, 3, 5, 7, 10, 11b, Fig. 6): only the credit criterion changes
between runs, everything else stays fixed (§4.1). So credit is two swappable steps, each a plain function:

    scores = signals.SIGNALS[cfg.credit](model, batch, cfg)    -> (B, T) float32, 0 off the response
    c      = SHAPINGS[cfg.shaping](scores, batch, cfg)         -> flowtracer.Credit of every column (B, T)

and GRPO multiplies each token's surrogate term by the weight gamma_{i,t} (eq. 5: gamma_{i,t} * A_i).
`assign` runs both, plus the token-class mask, and gives the response columns: flowtracer.Credit (weight,
scores (B, R), fallback (B,)), the record flow_credit gives. It is the credit call of flowtracer_trl.py, and
of grpo.py for every setting but the paper's default (PAPER), through `Baseline` (grpo.update computes the
default, flow with top-k, in plain lines). `batch` is a rollout.Batch; `cfg` is a CreditConfig.

Shaping rules (gamma is 1 off the selection, 0 off the response)
  topk / bottomk   eq. 6: gamma on the top (bottom) ceil(top_frac*n) tokens
  raw, log1p, sigmoid, tanh-z, mad   Table 7 continuous weights, sum-preserving (departure 3)
  soft             Table 7 soft thresholding: gamma on the fewest tokens holding soft_mass of the score mass
  80-20            Wang et al. 2025b: weight 1 on the top entropy_frac tokens of the whole batch, 0 else
  identity         gamma = the score itself (no ranking, no rescaling): with --credit random, OAR's "Random
                   Credit" baseline, gamma ~ U(0, 1) on each token (OAR §4.2; departure 6)
  bilevel          OAR eq. 14-17 (log1p, min-max, percentile tau, beta, sum-preserving)
  entropy-adv      Cheng et al. (OAR eq. 6): A_t = A + min(alpha H_t, |A| / kappa), handed to GRPO as
                   gamma_t = A_t / A (assign does it: it is additive, not a multiplicative weight)
Every rule: token_class ("structural" | "semantic" | "") restricts selection to one token class (Table 11b);
tokens outside it keep gamma 1.

Which credit is fused into the training forward (--credit-pass fused, the default; Baseline decides):
  fused     signals none, random, flow, attention, entropy (signals.FUSED) with a per-row rule: the
            micro-batch's training forward captures the attention maps / entropy, then flow -> gamma -> loss.
  separate  signals fai, gradient, correlation, oar-p, oar-g (their own passes), and the batch-wide rule 80-20
            (its threshold needs every row's scores before any loss): one credit pass over the rows with
            A != 0 before the update, as with --credit-pass separate for any signal (the teaching reference).

Padding and sequences without an answer, for every rule (tested):
  * gamma is 0 off the response (prompt, padding); scores there are ignored.
  * a sequence with no answer region, no eligible token, or fewer than two distinct scores among its eligible
    tokens carries no ranking: all-1 gamma on its response (plain GRPO) and fallback=True. This holds for
    every signal, so the runs differ only in the credit criterion (§4.1); flow_credit does the same for flow.

Departures (numbered):
 1. Rows with A = 0 add nothing to the loss (beta = 0), so grpo.py runs no credit for them in either pass.
 2. Fallback as above also for "none": its constant scores give all-1 gamma under every rule, fallback=True.
 3. Table 7 does not give formulas for its continuous forms. Here each maps the eligible scores s to a
    non-negative phi(s) and rescales it to mean 1 over those tokens (sum-preserving, as OAR eq. 17), so the
    update scale matches GRPO's: raw phi = s; log1p phi = log1p(s / mean s); sigmoid phi = sigmoid(z);
    tanh-z phi = 1 + tanh(z), z the within-sequence z-score; mad phi = 1 + tanh(z_mad), z_mad the robust
    z-score (s - median) / (1.4826 MAD). Raw scaling thus lets outliers take huge weights, as §5.1 reports.
    Readings, one among several, pinned by hand in tests/test_credit.py (test_continuous_hand_cases); soft
    (§5.1 (ii)): the fewest top tokens with soft_mass of the row's mass (test_soft_thresholding_hand_cases).
 4. bilevel's tau is a within-sequence percentile of the normalised scores (OAR §4.1: "tau = 0.4 (meaning the
    top 60% of tokens are boosted)"), linear interpolation; eps = 1e-6 in eq. 14, 16.
 5. "80-20" takes its threshold over the eligible tokens of the non-fallback sequences of the batch (the rows
    with A != 0, departure 1).
 6. OAR's Random Credit (--credit random --shaping identity) keeps the common fallback above: a row without an
    answer gets all-1 gamma, as under every other signal, so the runs differ only in the credit (§4.1).

Run the tests: python -m pytest -q tests/test_credit.py
Time them:     python benchmarks/credit_overhead.py
"""
from __future__ import annotations

import functools
import math
import unicodedata
from dataclasses import dataclass

import torch

from flowtracer import Credit, flow_credit, select_layers
from flowtracer import rank as ranks
from training.oar import OUTCOMES
from training.rollout import take
from training.signals import FUSED, NEEDS, SIGNALS, ForwardOutputs

EPS = 1e-6  # the smoothing constant of OAR eq. 14 and 16 (departure 4)


@dataclass
class CreditConfig:
    """Every credit knob. grpo.Config inherits it; `python grpo.py --top-frac 0.2` sets top_frac here."""
    # credit: the signal, the shaping rule and their knobs (training/credit.py)
    credit: str = "flow"               # what ranks the tokens: flow (the paper's) or a baseline (signals.py)
    shaping: str = "topk"              # how a signal's scores become gamma (credit.py's SHAPINGS)
    credit_pass: str = "fused"         # fused: credit from the update's own forward | separate: its own pass
    top_frac: float = 0.4              # fraction of response tokens boosted (the paper's: eq. 6, Table 5)
    gamma: float = 1.5                 # weight of a boosted token's loss term, gamma_flow (eq. 6, Table 7)
    layers: str = "middle"             # attention layers: middle|early|late|all|fig6-*|A:B (App. C.2, Fig. 6)
    token_class: str = ""              # "" | structural | semantic: select only within one class (Table 11b)
    seed: int = 0                      # the run's seed; also seeds --credit random and OAR-G's noise
    soft_mass: float = 0.4             # --shaping soft: cumulative score mass to cover (Table 7)
    entropy_frac: float = 0.2          # --shaping 80-20: top fraction by entropy over the batch (Wang et al.)
    entropy_alpha: float = 0.4         # --shaping entropy-adv: bonus min(alpha H, |A|/kappa) (OAR eq. 6)
    entropy_kappa: float = 2.0         # --shaping entropy-adv: the bonus is capped at |A|/kappa (OAR eq. 6)
    attn_window: str = "10:100"        # --credit fai: FAI reads queries t with s+10 <= t <= s+100
    attn_global_frac: float = 0.3      # --credit fai: top 30% heads by mean attention distance
    oar_outcome: str = "as-mean"       # OAR outcome: as-mean (OAR §6.2 trains with it), lt-logits, as-joint
    oar_sigma: float = 1e-3            # std of OAR-G's Gaussian noise on the embeddings (OAR §3.2)
    oar_chunk: int = 64                # OAR-P masked copies per forward pass
    oar_prefix_cache: bool = True      # OAR-P/G: reuse the cached keys/values of the unchanged prefix
    pad_id: int = -1                   # OAR-P replacement token; -1: the batch's padding id (oar.py dep. 2)
    bilevel_tau: float = 0.4           # --shaping bilevel: percentile threshold (OAR §4.1)
    bilevel_beta: float = 2.0          # --shaping bilevel: boost coefficient (OAR §4.1)


# ----------------------------------------------------------------------------- shaping: scores -> gamma
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
    s = torch.where(sel, s, torch.zeros_like(s))                               # (B, T)
    hi = torch.where(sel, s, torch.full_like(s, -math.inf)).amax(-1)           # (B,)
    lo = torch.where(sel, s, torch.full_like(s, math.inf)).amin(-1)            # (B,)
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
        raise ValueError("cfg.token_class is set: pass eligible=token_class_mask(tokenizer, input_ids, "
                         "cfg.token_class) to the shaping rule, or call credit.assign()")


def shape_topk(scores, batch, cfg, eligible=None, largest=True):
    """eq. 6: gamma on the ceil(top_frac * n) selectable tokens with the highest (largest=False: lowest, the
    Bottom-k ablation of Table 5) scores, ties to the earlier token; 1 on the rest (flow_credit)."""
    check_eligible(cfg, eligible)
    s, sel, fallback = prepare(scores, batch, eligible)
    c = flow_credit(s, sel, cfg.top_frac, cfg.gamma, largest=largest)                # every column
    return finish(c.weight, sel, fallback | c.fallback, batch, s)


def shape_bottomk(scores, batch, cfg, eligible=None):
    """Table 5 ablation: gamma on the lowest-scored ceil(top_frac * n) tokens."""
    return shape_topk(scores, batch, cfg, eligible, largest=False)


def masked_quantile(x, m, q):
    """(B,) the q-quantile of x over the tokens in m, per row, linear interpolation (as torch.quantile);
    0 for a row without tokens."""
    n = m.sum(-1)                                                              # (B,)
    srt = torch.where(m, x, torch.full_like(x, math.inf)).sort(-1).values      # (B, T) tokens first
    pos = q * (n - 1).clamp_min(0).to(x.dtype)                                 # (B,)
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
        n = m.sum(-1, keepdim=True).clamp_min(1.0)                             # (B, 1)
        mean = (s * m).sum(-1, keepdim=True) / n                               # (B, 1)
        if kind in ("raw", "log1p"):
            nonnegative(s, sel, kind)
        if kind == "raw":
            phi = s
        elif kind == "log1p":
            phi = torch.log1p(s / mean.clamp_min(1e-30))                       # scale-free: log1p(s / mean s)
        elif kind in ("sigmoid", "tanh-z"):
            std = (((s - mean) ** 2 * m).sum(-1, keepdim=True) / n).sqrt()
            z = (s - mean) / std.clamp_min(1e-30)  # (B, T) within-sequence z-score
            phi = torch.sigmoid(z) if kind == "sigmoid" else 1.0 + torch.tanh(z)
        else:  # "mad": robust z-score; MAD = 0 (over half the scores tie) -> mean absolute deviation instead
            med = masked_quantile(s, sel, 0.5).unsqueeze(-1)                   # (B, 1)
            dev = (s - med).abs()
            mad = 1.4826 * masked_quantile(dev, sel, 0.5).unsqueeze(-1)        # consistent for a normal
            scale = torch.where(mad > 0, mad, 1.2533 * (dev * m).sum(-1, keepdim=True) / n)
            phi = 1.0 + torch.tanh((s - med) / scale.clamp_min(1e-30))
        phi = phi * m
        weight = phi * n / phi.sum(-1, keepdim=True).clamp_min(1e-30)          # (B, T) mean 1 over sel
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
    srt = s.double().gather(-1, order)                                         # (B, T) descending, 0 off sel
    before = srt.cumsum(-1) - srt                                              # mass ranked strictly above
    total = srt.sum(-1, keepdim=True)
    chosen = (before < p * total).gather(-1, rank) & sel                       # (B, T) back in token order
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
    pool = sel & ~fallback.unsqueeze(-1)                                       # (B, T)
    k = math.ceil(frac * int(pool.sum()) - 1e-9)
    rank, _ = ranks(s.double().flatten()[None], pool.flatten()[None])      # one row: the whole batch
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
    Ib = torch.log1p(s)                                                        # (B, T) eq. 14, log
    lo = torch.where(sel, Ib, torch.full_like(Ib, math.inf)).amin(-1, keepdim=True)
    hi = torch.where(sel, Ib, torch.full_like(Ib, -math.inf)).amax(-1, keepdim=True)
    lo, hi = torch.where(sel.any(-1, keepdim=True), lo, 0.0), torch.where(sel.any(-1, keepdim=True), hi, 0.0)
    I = (Ib - lo) / (hi - lo + EPS) * m                                        # (B, T) eq. 14, min-max
    t = masked_quantile(I, sel, tau).unsqueeze(-1)                             # (B, 1) percentile threshold
    weight = torch.where(I < t, I / (t + EPS), 1.0 + beta * (I - t) / (1.0 - t + EPS)) * m   # eq. 16
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
    """"Entropy Adv" (OAR Table 1): the multiplicative gamma stays 1 (plain GRPO); assign adds the additive
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
    A = adv.unsqueeze(-1) if adv.dim() == 1 else adv                            # (B, 1) or (B, T)
    bonus = torch.minimum(alpha * entropy.detach().float(), A.abs() / kappa)   # (B, T) sg(H) as in eq. 6
    return A + bonus * mask.float()


# ----------------------------------------------------------------------------- token classes (Table 11b)
def is_structural(text):
    """Structural delimiter: a token whose text is only whitespace/newlines, punctuation or symbols (Unicode
    P* and S*: . , : ; = + - * / ( ) [ ] { } $ \\ ^ _ < > | ...). Everything else is semantic content: words,
    numbers, LaTeX command names (\\frac), and undecodable byte pieces (U+FFFD)."""
    return "\ufffd" not in text and all(ch.isspace() or unicodedata.category(ch)[0] in "PS" for ch in text)


def structural_table(tokenizer):
    """(V,) bool: token id -> structural (is_structural of its decoded text; special tokens count as
    structural delimiters). Built with one batch_decode, once per tokenizer and vocabulary size."""
    return _structural_table(tokenizer, len(tokenizer))


@functools.lru_cache(maxsize=4)
def _structural_table(tokenizer, V):
    texts = tokenizer.batch_decode([[i] for i in range(V)], skip_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    return torch.tensor([i in special or is_structural(t) for i, t in enumerate(texts)])


def token_class_mask(tokenizer, input_ids, token_class):
    """(B, T) bool mask of the tokens in `token_class` ("structural" | "semantic"); None for no class."""
    if token_class in (None, "", "none"):
        return None
    if token_class not in ("structural", "semantic"):
        raise ValueError(f"token_class must be 'structural', 'semantic' or None, got {token_class!r}")
    table = structural_table(tokenizer).to(input_ids.device)
    m = table[input_ids.clamp(0, len(table) - 1)]
    return m if token_class == "structural" else ~m


# ----------------------------------------------------------------------------- the credit step, one call
PAPER = ("flow", "topk", "", "fused")   # (credit, shaping, token_class, credit_pass): grpo.update's own lines


def assign(model, tok, batch, adv, cfg, outputs=None) -> Credit:
    """The whole credit step: the signal (signals.py), the token-class mask, the shaping rule, Cheng et al.'s
    additive entropy bonus (entropy-adv), on the response columns: Credit (B, R) as flow_credit gives it.
    batch: rollout.Batch of B rows; adv: (B,) sequence advantages; outputs: what the training forward
    computed (fused pass) or None."""
    scores = SIGNALS[cfg.credit](model, batch, cfg, outputs)                      # (B, T)
    eligible = token_class_mask(tok, batch.input_ids, cfg.token_class)
    c = SHAPINGS[cfg.shaping](scores, batch, cfg, eligible)                       # every column, (B, T)
    P, resp = batch.prompt_width, batch.response_mask
    weight = c.weight[:, P:]                                                        # (B, R)
    if cfg.shaping == "entropy-adv":   # Cheng et al.: A_t = A + bonus_t, written as gamma_t = A_t / A
        A_t = entropy_bonus(adv, scores, resp & ~c.fallback[:, None], cfg.entropy_alpha, cfg.entropy_kappa)
        ratio = A_t[:, P:] / torch.where(adv != 0, adv, 1.0)[:, None]               # (B, R)
        weight = torch.where(adv[:, None] != 0, ratio, weight) * resp[:, P:].float()
    return Credit(weight, scores[:, P:], c.fallback)


def is_paper(cfg):
    """True for the paper's credit, which grpo.update computes in plain lines (PAPER): flow, top-k (eq. 6),
    every response token eligible, fused into the training forward. Every other setting: Baseline."""
    return (cfg.credit, cfg.shaping, cfg.token_class or "", cfg.credit_pass) == PAPER


def separate_pass(cfg):
    """True when credit needs its own pass before the update: asked for (--credit-pass separate), a signal
    that runs its own forwards (attention, OAR), or a rule that needs every row's scores first (80-20)."""
    return cfg.credit_pass == "separate" or cfg.credit not in FUSED or cfg.shaping in BATCH_RULES


def reads_maps(cfg):
    """True when the training forward must capture the attention maps (flow or attention, fused): setup then
    gives the Run the layers to capture (an empty list otherwise)."""
    return not separate_pass(cfg) and NEEDS.get(cfg.credit) == "attn"


class Baseline:
    """Every credit but the paper's default (PAPER), with the paper's call shape (grpo.update):

        baseline = Baseline(run, batch, trained, adv)      # a credit with a pass of its own runs it here
        c = baseline(mb, sub, cap, entropy)                # Credit of the micro-batch's rows (b, R)

    where cap is the training forward's Capture (Run.layers not empty: reads_maps) or None. Fused or separate
    is decided here, not in the update: a signal with forwards of its own (fai, gradient, correlation, OAR),
    the batch-wide 80-20 rule and --credit-pass separate run `assign` once over the trained rows, before the
    first micro-batch (no grad); the others read what the training forward computed (its captured maps and
    entropy). run: grpo's Run (model, tok, cfg, autocast)."""
    def __init__(self, run, batch, trained, adv):
        self.run, self.adv, self.given = run, adv, None
        if separate_pass(run.cfg) and trained:
            with torch.no_grad(), run.autocast:
                self.given = assign(run.model, run.tok, take(batch, trained), adv[trained], run.cfg)  # (b, R)
            self.where = {r: i for i, r in enumerate(trained)}           # batch row -> row of `given`

    def __call__(self, mb, sub, cap, entropy) -> Credit:
        if self.given is not None:
            i = torch.tensor([self.where[r] for r in mb], device=self.given.weight.device)
            return Credit(*(x[i] for x in self.given))
        outputs = ForwardOutputs(cap.maps(sub.attention_mask) if cap is not None else None, entropy)
        return assign(self.run.model, self.run.tok, sub, self.adv[mb], self.run.cfg, outputs)


# ----------------------------------------------------------------------------- registries (--shaping)
SHAPINGS = {"topk": shape_topk, "bottomk": shape_bottomk,
            **{k: shape_continuous(k) for k in ("raw", "log1p", "sigmoid", "tanh-z", "mad")},
            "soft": shape_soft, "80-20": shape_8020, "bilevel": shape_bilevel,
            "entropy-adv": shape_entropy_adv, "identity": shape_identity}
CHOICES = {"credit": SIGNALS, "shaping": SHAPINGS, "credit_pass": ("fused", "separate"),   # for --help
           "oar_outcome": OUTCOMES}
BATCH_RULES = {"80-20"}   # one threshold over the whole batch: scores of every row before any loss


def check(cfg):
    """The first bad credit flag as one sentence naming it, or None (grpo.py makes it its one-line error)."""
    finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
    rules = [("--credit", cfg.credit in SIGNALS, f"must be one of {', '.join(SIGNALS)}"),
             ("--shaping", cfg.shaping in SHAPINGS, f"must be one of {', '.join(SHAPINGS)}"),
             ("--credit-pass", cfg.credit_pass in ("fused", "separate"), "must be fused or separate"),
             ("--top-frac", finite(cfg.top_frac) and 0 < cfg.top_frac <= 1, "must be in (0, 1]"),
             ("--gamma", finite(cfg.gamma) and cfg.gamma > 0, "must be a finite number > 0 (eq. 6)"),
             ("--token-class", cfg.token_class in ("", "none", "structural", "semantic"),
              "must be structural or semantic (or empty)"),
             ("--soft-mass", finite(cfg.soft_mass) and 0 < cfg.soft_mass <= 1, "must be in (0, 1]"),
             ("--entropy-frac", finite(cfg.entropy_frac) and 0 <= cfg.entropy_frac <= 1, "must be in [0, 1]"),
             ("--entropy-alpha", finite(cfg.entropy_alpha) and cfg.entropy_alpha >= 0, "must be >= 0"),
             ("--entropy-kappa", finite(cfg.entropy_kappa) and cfg.entropy_kappa > 1,
              "must be > 1 (keeps A's sign)"),
             ("--attn-global-frac", finite(cfg.attn_global_frac) and 0 < cfg.attn_global_frac <= 1,
              "must be in (0, 1]"),
             ("--oar-outcome", cfg.oar_outcome in OUTCOMES, f"must be one of {', '.join(OUTCOMES)}"),
             ("--oar-sigma", finite(cfg.oar_sigma) and cfg.oar_sigma > 0, "must be > 0"),
             ("--oar-chunk", cfg.oar_chunk >= 1, "must be >= 1"),
             ("--seed", 0 <= cfg.seed < 2 ** 63, "must be in [0, 2**63): torch seeds are 64-bit"),
             ("--bilevel-tau", finite(cfg.bilevel_tau) and 0 <= cfg.bilevel_tau <= 1, "must be in [0, 1]"),
             ("--bilevel-beta", finite(cfg.bilevel_beta) and cfg.bilevel_beta >= 0, "must be >= 0"),
             ("--shaping entropy-adv", cfg.shaping != "entropy-adv" or cfg.credit == "entropy",
              "adds an entropy bonus to the advantage: use it with --credit entropy")]
    for flag, ok, why in rules:
        if not ok:
            return f"{flag} {why}"
    w = str(cfg.attn_window).split(":")
    if len(w) != 2 or not all(x.strip().isdigit() for x in w) or int(w[0]) > int(w[1]):
        return f"--attn-window must be A:B with 0 <= A <= B, got {cfg.attn_window!r}"
    try:
        select_layers(cfg.layers, 10 ** 6)     # syntax only; the model's own depth is checked when it loads
    except ValueError as e:
        return f"--layers: {e}"
    return None
