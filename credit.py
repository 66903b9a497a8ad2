"""Token credit for GRPO: every signal and shaping rule the FlowTracer and OAR papers compare.

FlowTracer's claims are comparative (Tables 2, 3, 5, 7, 10, 11b, Fig. 6): only the credit criterion changes
between runs, everything else stays fixed (§4.1). So credit is two swappable steps, each a plain function:

    scores = SIGNALS[name](model, batch, cfg)    -> (B, T) float32, 0 off the response      (--credit)
    credit = SHAPINGS[name](scores, batch, cfg)  -> flowtracer.Credit(weights (B, T), fallback (B,))  (--shaping)

and GRPO multiplies each token's advantage by weights (eq. 5: gamma_{i,t} * A_i). `batch` is a
flowtracer.Regions; `cfg` is anything with the attributes below (read with getattr, defaults in brackets).

Signals                                                             cfg attributes read
  none         1 on every response token (plain GRPO)               -
  flow         FlowTracer throughput tau (eq. 1-4, §3.3)            layers [None = middle]
  random       uniform [0, 1), seeded by (seed, batch content)      seed [0]
  entropy      policy entropy H_t (OAR eq. 5; Wang et al. 2025b)    entropy_rows [2^25 / V]
  attention    FAI, global-anchor score of Li et al. 2025d          attn_window [(10, 100)], attn_global_frac [0.3]
  attention-max  max attention a token receives (the cheap proxy)   layers
  oar-p, oar-g OAR's outcome-grounded scores (in oar.py: one idea,  oar_outcome, oar_chunk, oar_sigma,
               and the forward helpers entropy shares)              oar_prefix_cache, pad_id
Shaping rules (weights are 1 off the selection, 0 off the response)
  topk / bottomk   eq. 6: gamma on the top (bottom) ceil(top_frac*n) tokens   top_frac [0.4], gamma [1.5]
  raw, log1p, sigmoid, tanh-z, mad   Table 7 continuous weights, sum-preserving (departure 3)
  soft             Table 7 soft thresholding: gamma on the fewest tokens holding soft_mass of the score mass
  80-20            Wang et al. 2025b: weight 1 on the top entropy_frac [0.2] tokens of the whole batch, 0 else
  bilevel          OAR eq. 14-17 (log1p, min-max, percentile tau, beta, sum-preserving)
                   bilevel_tau [0.4], bilevel_beta [2.0] (OAR §4.1)
  entropy-adv      all-1 weights here; the additive bonus of Cheng et al. (OAR eq. 6) is entropy_bonus(), which
                   grpo applies to the advantage itself (it is not a multiplicative weight)
Every rule: token_class ["structural" | "semantic" | None] restricts selection to one token class (Table 11b);
tokens outside it keep weight 1. Pass the class mask as `eligible` (token_class_mask) or use assign().

Padding and sequences without an answer, for every rule (tested):
  * weights are 0 off the response (prompt, padding); scores there are ignored.
  * a sequence with no answer region, no eligible token, or fewer than two distinct scores among its eligible
    tokens carries no ranking: all-1 weights on its response (plain GRPO) and fallback=True. This holds for
    every signal, so the runs differ only in the credit criterion (§4.1); flow_credit does the same for flow.

Departures (numbered):
 1. "random" is seeded by hashing (cfg.seed, input_ids): deterministic for a seed and a batch, but a new draw
    each step, so the same positions are not boosted every step.
 2. Fallback as above also for "none": its constant scores give all-1 weights under every rule, fallback=True.
 3. Table 7 does not give formulas for its continuous forms. Here each maps the eligible scores s to a
    non-negative phi(s) and rescales it to mean 1 over those tokens (sum-preserving, as OAR eq. 17), so the
    update scale matches GRPO's: raw phi = s; log1p phi = log1p(s / mean s); sigmoid phi = sigmoid(z);
    tanh-z phi = 1 + tanh(z), z the within-sequence z-score; mad phi = 1 + tanh(z_mad), z_mad the robust
    z-score (s - median) / (1.4826 MAD). Raw scaling thus lets outliers take huge weights, as §5.1 reports.
 4. bilevel's tau is a within-sequence percentile of the normalised scores (OAR §4.1: "tau = 0.4 (meaning the
    top 60% of tokens are boosted)"), linear interpolation; eps = 1e-6 in eq. 14, 16.
 5. "80-20" takes its threshold over the eligible tokens of the non-fallback sequences of the batch.

Run the tests: python -m pytest -q tests/test_credit.py
Time them:     python benchmarks/credit_overhead.py
"""
from __future__ import annotations

import math
import unicodedata

import torch

from flowtracer import Credit, attention_graph, flow_credit, select_layers, trace_flow
from oar import batch_seed, eval_mode, hidden, lm_logits, signal_oar_g, signal_oar_p

EPS = 1e-6  # the smoothing constant of OAR eq. 14 and 16 (departure 4)


def opt(cfg, name, default):
    """cfg.name, or the documented default when cfg lacks it (cfg may be a grpo.Config or a SimpleNamespace)."""
    v = getattr(cfg, name, default) if cfg is not None else default
    return default if v is None and default is not None else v


# ----------------------------------------------------------------------------- signals: (B, T), 0 off response
def signal_none(model, batch, cfg=None):
    """All-1 on the response: no token is preferred, so every shaping rule gives plain GRPO (departure 2)."""
    return batch.response_mask.float()


def signal_random(model, batch, cfg=None):
    """Uniform [0, 1) scores on the response, the neutral lower bound of Table 2 ("Random")."""
    g = torch.Generator().manual_seed(batch_seed(batch.input_ids, opt(cfg, "seed", 0)))
    u = torch.rand(batch.input_ids.shape, generator=g)                       # (B, T) drawn on the CPU
    return u.to(batch.response_mask.device) * batch.response_mask.float()


def signal_flow(model, batch, cfg=None):
    """FlowTracer: throughput tau of the answer-targeted flow on the middle-layer attention DAG (§3.1, §3.3)."""
    dev = model.device
    attn = attention_graph(model, batch.input_ids.to(dev), batch.attention_mask.to(dev), opt(cfg, "layers", None))
    valid = batch.attention_mask.to(dev).bool()
    tau = trace_flow(attn, batch.question_mask.to(dev), batch.answer_mask.to(dev), valid_mask=valid).throughput
    resp = batch.response_mask
    return (tau.float() * resp.to(dev)).to(resp.device)                     # (B, T)


@torch.no_grad()
def signal_entropy(model, batch, cfg=None):
    """H_t = -sum_v pi(v | x, y_<t) log pi(v | x, y_<t) (OAR eq. 5) for each response token t, from one
    no-grad forward. The logits of the response positions only, entropy_rows of them at a time, so the
    (B, T, V) fp32 logits never exist (default: about 2^25 floats per block). Temperature 1."""
    dev = model.device
    mask = batch.attention_mask.to(dev)
    resp = batch.response_mask.to(dev).bool()
    with eval_mode(model):
        h = hidden(model, mask, batch.input_ids.to(dev))                       # (B, T, D)
        pred = torch.zeros_like(resp)
        pred[:, :-1] = resp[:, 1:]                                             # column t - 1 predicts token t
        rows, cols = pred.nonzero(as_tuple=True)                               # (N,)
        V = model.get_output_embeddings().weight.shape[0]
        step = int(opt(cfg, "entropy_rows", max(1, 2 ** 25 // V)))
        H = torch.zeros(len(rows), dtype=torch.float32, device=dev)
        for i in range(0, len(rows), step):
            logp = torch.log_softmax(lm_logits(model, h[rows[i:i + step], cols[i:i + step]]), -1)  # (n, V)
            H[i:i + step] = -(logp.exp() * logp).sum(-1)
    out = torch.zeros(resp.shape, dtype=torch.float32, device=dev)
    out[rows, cols + 1] = H.clamp_min(0.0)
    return out.to(batch.response_mask.device)


def signal_attention_max(model, batch, cfg=None):
    """The "maximum attention received" proxy: max over later queries t > s of the head- and layer-mean
    attention a(t, s) (attention_graph, cfg.layers). This is the cheap reading of FlowTracer's "Attention"
    baseline ("maximum attention scores as a proxy", §4.1); signal_attention is Li et al.'s own score."""
    dev = model.device
    A = attention_graph(model, batch.input_ids.to(dev), batch.attention_mask.to(dev), opt(cfg, "layers", None))
    received = A.tril(-1).amax(-2)                                             # (B, T) max over queries t > s
    return (received * batch.response_mask.to(dev).float()).to(batch.response_mask.device)


class _Done(Exception):
    """Raised after the last chosen layer: the rest of the forward pass is skipped."""


@torch.no_grad()
def signal_attention(model, batch, cfg=None):
    """Li et al. 2025d (arXiv 2510.13554) global-anchor score FAI_s: the mean attention token s receives from
    the tokens t with s + w0 <= t <= s + w1 (attn_window = (10, 100) or "10:100"), averaged over the "global" heads: the
    top attn_global_frac (30%) of the heads of the chosen layers (cfg.layers, default middle) by mean attention
    distance sum_{t,s} a(t,s)(t - s) per query, over the batch. Needs the per-head maps, so the model runs
    with eager attention; one layer's (B, H, T, T) maps exist at a time. Tokens with no t in the window get 0."""
    win = opt(cfg, "attn_window", (10, 100))
    w0, w1 = (int(x) for x in (win.split(":") if isinstance(win, str) else win))   # (10, 100) or "10:100"
    frac = opt(cfg, "attn_global_frac", 0.3)
    if not (0 <= w0 <= w1 and 0.0 < frac <= 1.0):
        raise ValueError("need 0 <= attn_window[0] <= attn_window[1] and 0 < attn_global_frac <= 1")
    dev = model.device
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    valid = mask.bool().float()                                                # (B, T)
    T = ids.shape[-1]
    ar = torch.arange(T, device=dev)
    lag = (ar[:, None] - ar[None, :]).float()                                  # (T, T) t - s, query t, key s
    band = ((lag >= w0) & (lag <= w1)).float()                                 # (T, T) the FAI window
    count = torch.einsum("bt,ts->bs", valid, band).clamp_min(1.0)              # (B, T) queries in the window
    layers = select_layers(opt(cfg, "layers", None), model.config.num_hidden_layers)
    dist, fai = [], []                                                         # per layer: (H,), (B, H, T)

    def keep(module, args, out):
        A = out[1].float() * valid[:, None, :, None] * valid[:, None, None, :]  # (B, H, T, T) query t, key s
        d = (A * lag.clamp_min(0)).sum((-1, -2)) / valid.sum(-1, keepdim=True)  # (B, H) mean distance
        dist.append(d.mean(0))
        fai.append(torch.einsum("bhts,ts->bhs", A, band) / count[:, None])       # (B, H, T)
        if module.layer_idx == layers[-1]:
            raise _Done                                                        # later layers are not needed

    attn_modules = [m for m in model.modules() if getattr(m, "layer_idx", None) in layers and hasattr(m, "o_proj")]
    old = model.config._attn_implementation
    hooks = [m.register_forward_hook(keep) for m in attn_modules]
    try:
        model.set_attn_implementation("eager")
        with eval_mode(model):
            hidden(model, mask, ids)
    except _Done:
        pass
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(old)
    if len(dist) != len(layers):
        raise RuntimeError(f"captured {len(dist)} of {len(layers)} attention layers; is this a decoder LM?")
    D, F = torch.cat(dist), torch.cat(fai, dim=1)                              # (L*H,), (B, L*H, T)
    k = max(1, math.ceil(frac * len(D) - 1e-9))
    top = torch.topk(D, k).indices                                             # the global heads
    return (F[:, top].mean(1) * batch.response_mask.to(dev).float()).to(batch.response_mask.device)


# ----------------------------------------------------------------------------- shaping: scores -> Credit
def prepare(scores, batch, eligible=None):
    """Checks and the common fallback. Returns (s, sel, fallback):
    s (B, T) float32 scores, 0 off the selectable tokens; sel (B, T) bool, the response tokens that may be
    selected (response & eligible); fallback (B,) bool: no answer region, no selectable token, or fewer than
    two distinct scores among them (no ranking): such sequences get all-1 weights (module docstring)."""
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


def finish(w, sel, fallback, batch):
    """weights: w on the selectable tokens, 1 on the other response tokens, 0 off the response;
    all-1 on the response of fallback rows."""
    resp = batch.response_mask.bool()
    w = torch.where(sel & ~fallback.unsqueeze(-1), w.float(), torch.ones_like(w, dtype=torch.float32))
    return Credit(w * resp.float(), fallback)


def nonnegative(s, sel, rule):
    if bool((s[sel] < 0).any()):
        raise ValueError(f"shaping {rule!r} needs non-negative scores (flow, entropy, OAR, attention are)")


def check_eligible(cfg, eligible):
    if opt(cfg, "token_class", None) not in (None, "", "none") and eligible is None:
        raise ValueError("cfg.token_class is set: pass eligible=token_class_mask(tokenizer, input_ids, "
                         "cfg.token_class) to the shaping rule, or call credit.assign()")


def shape_topk(scores, batch, cfg=None, eligible=None, largest=True):
    """eq. 6: gamma on the ceil(top_frac * n) selectable tokens with the highest (largest=False: lowest, the
    Bottom-k ablation of Table 5) scores, ties to the earlier token; 1 on the rest (flowtracer.flow_credit)."""
    check_eligible(cfg, eligible)
    s, sel, fallback = prepare(scores, batch, eligible)
    c = flow_credit(s, sel, opt(cfg, "top_frac", 0.4), opt(cfg, "gamma", 1.5), largest=largest)
    return finish(c.weights, sel, fallback | c.fallback, batch)


def shape_bottomk(scores, batch, cfg=None, eligible=None):
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
    """Table 7 continuous reweighting (departure 3): w = phi(s) / mean(phi(s)) over the selectable tokens."""
    def rule(scores, batch, cfg=None, eligible=None):
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
            z = (s - mean) / std.clamp_min(1e-30)                              # (B, T) within-sequence z-score
            phi = torch.sigmoid(z) if kind == "sigmoid" else 1.0 + torch.tanh(z)
        else:  # "mad": robust z-score; MAD = 0 (over half the scores tie) -> mean absolute deviation instead
            med = masked_quantile(s, sel, 0.5).unsqueeze(-1)                   # (B, 1)
            dev = (s - med).abs()
            mad = 1.4826 * masked_quantile(dev, sel, 0.5).unsqueeze(-1)        # consistent for a normal
            scale = torch.where(mad > 0, mad, 1.2533 * (dev * m).sum(-1, keepdim=True) / n)
            phi = 1.0 + torch.tanh((s - med) / scale.clamp_min(1e-30))
        phi = phi * m
        w = phi * n / phi.sum(-1, keepdim=True).clamp_min(1e-30)               # (B, T) mean 1 over sel
        return finish(w, sel, fallback, batch)
    rule.__name__ = f"shape_{kind.replace('-', '_')}"
    rule.__doc__ = shape_continuous.__doc__
    return rule


def rank_desc(key, m):
    """(B, T) rank of each token of m by descending key within its row; ties to the earlier token."""
    key = torch.where(m, key, torch.full_like(key, -math.inf))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ar = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ar), order


def shape_soft(scores, batch, cfg=None, eligible=None):
    """Table 7 "soft dynamic thresholding": gamma on the fewest top-scored tokens whose scores hold at least
    soft_mass (0.2/0.4/0.6/0.8) of the sequence's score mass, 1 on the rest. Ties to the earlier token."""
    check_eligible(cfg, eligible)
    p, gamma = opt(cfg, "soft_mass", 0.4), opt(cfg, "gamma", 1.5)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"soft_mass must be in (0, 1], got {p}")
    s, sel, fallback = prepare(scores, batch, eligible)
    nonnegative(s, sel, "soft")
    rank, order = rank_desc(s.double(), sel)
    srt = s.double().gather(-1, order)                                         # (B, T) descending, 0 off sel
    before = srt.cumsum(-1) - srt                                              # mass ranked strictly above
    total = srt.sum(-1, keepdim=True)
    chosen = (before < p * total).gather(-1, rank) & sel                       # (B, T) back in token order
    return finish(1.0 + (gamma - 1.0) * chosen.float(), sel, fallback, batch)


def shape_8020(scores, batch, cfg=None, eligible=None):
    """Wang et al. 2025b ("80/20"): weight 1 on the top entropy_frac of the selectable tokens of the whole
    batch (one threshold for the batch, departure 5), 0 on the other selectable tokens: only the
    high-entropy "forking" tokens get a policy gradient. Ties to the earlier (row, token)."""
    check_eligible(cfg, eligible)
    frac = opt(cfg, "entropy_frac", 0.2)
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"entropy_frac must be in [0, 1], got {frac}")
    s, sel, fallback = prepare(scores, batch, eligible)
    pool = sel & ~fallback.unsqueeze(-1)                                       # (B, T)
    k = math.ceil(frac * int(pool.sum()) - 1e-9)
    rank, _ = rank_desc(s.double().flatten()[None], pool.flatten()[None])      # one row: the whole batch
    kept = (rank.view_as(s) < k) & pool
    return finish(kept.float(), sel, fallback, batch)


def shape_bilevel(scores, batch, cfg=None, eligible=None):
    """OAR's bi-level reshaping (eq. 14-17): I_hat = min-max(log1p(I)) over the sequence; t = the
    bilevel_tau percentile of I_hat (departure 4); w = I_hat / (t + eps) below t (noise suppression),
    1 + beta (I_hat - t) / (1 - t + eps) from t on (signal boosting); then w * n / sum(w), so sum = n."""
    check_eligible(cfg, eligible)
    tau, beta = opt(cfg, "bilevel_tau", 0.4), opt(cfg, "bilevel_beta", 2.0)
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
    w = torch.where(I < t, I / (t + EPS), 1.0 + beta * (I - t) / (1.0 - t + EPS)) * m   # eq. 16
    w = w * m.sum(-1, keepdim=True) / w.sum(-1, keepdim=True).clamp_min(1e-30)          # eq. 17
    return finish(w, sel, fallback, batch)


def shape_entropy_adv(scores, batch, cfg=None, eligible=None):
    """"Entropy Adv" (OAR Table 1): multiplicative weights stay 1 (plain GRPO); grpo adds the additive
    bonus entropy_bonus(adv, scores, response_mask & ~fallback, entropy_alpha, entropy_kappa)."""
    check_eligible(cfg, eligible)
    s, sel, fallback = prepare(scores, batch, eligible)
    return finish(torch.ones_like(s), sel, fallback, batch)


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


_TABLES = {}


def structural_table(tokenizer):
    """(V,) bool: token id -> structural (is_structural of its decoded text; special tokens count as structural
    delimiters). Built once per tokenizer with one batch_decode."""
    key = (id(tokenizer), len(tokenizer))
    if key not in _TABLES:
        V = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(V)], skip_special_tokens=False)
        special = set(tokenizer.all_special_ids)
        _TABLES[key] = torch.tensor([i in special or is_structural(t) for i, t in enumerate(texts)])
    return _TABLES[key]


def token_class_mask(tokenizer, input_ids, token_class):
    """(B, T) bool mask of the tokens in `token_class` ("structural" | "semantic"); None for None/""/"none"."""
    if token_class in (None, "", "none"):
        return None
    if token_class not in ("structural", "semantic"):
        raise ValueError(f"token_class must be 'structural', 'semantic' or None, got {token_class!r}")
    table = structural_table(tokenizer).to(input_ids.device)
    m = table[input_ids.clamp(0, len(table) - 1)]
    return m if token_class == "structural" else ~m


def assign(model, tokenizer, batch, cfg):
    """The whole credit phase in one call: scores = SIGNALS[cfg.credit], the token-class mask, then
    SHAPINGS[cfg.shaping]. Returns (scores (B, T), Credit)."""
    scores = SIGNALS[opt(cfg, "credit", "flow")](model, batch, cfg)
    eligible = token_class_mask(tokenizer, batch.input_ids, opt(cfg, "token_class", None))
    return scores, SHAPINGS[opt(cfg, "shaping", "topk")](scores, batch, cfg, eligible)


# ----------------------------------------------------------------------------- registries (--credit, --shaping)
SIGNALS = {"none": signal_none, "flow": signal_flow, "random": signal_random, "entropy": signal_entropy,
           "attention": signal_attention, "attention-max": signal_attention_max,
           "oar-p": signal_oar_p, "oar-g": signal_oar_g}
SHAPINGS = {"topk": shape_topk, "bottomk": shape_bottomk,
            **{k: shape_continuous(k) for k in ("raw", "log1p", "sigmoid", "tanh-z", "mad")},
            "soft": shape_soft, "80-20": shape_8020, "bilevel": shape_bilevel, "entropy-adv": shape_entropy_adv}
