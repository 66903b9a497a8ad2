"""Token credit for GRPO: the baselines' knobs, the token classes, and the credit step as one call.

FlowTracer's claims are comparative (Tables 2, 3, 5, 7, 10, 11b, Fig. 6): only the credit criterion changes
between runs, everything else stays fixed (§4.1). So credit is two swappable steps, each a plain function:

    scores = scoring.SIGNALS[cfg.credit](model, batch, cfg)    -> (B, T) float32, 0 off the response
    c      = shaping.SHAPINGS[cfg.shaping](scores, batch, cfg) -> flowtracer.Credit of every column (B, T)

and GRPO multiplies each token's surrogate term by the weight gamma_{i,t} (eq. 5: gamma_{i,t} * A_i).
`assign` runs both, plus the token-class mask (Table 11b, below), and gives the response columns:
flowtracer.Credit (weight, scores (B, R), fallback (B,)), the record flow_credit gives. It is the credit
call of flowtracer_trl.py, and of grpo.py for every setting but the paper's default (PAPER), through
`OtherCredit`, which has the call shape of grpo.update's own lines for the default (flow with top-k).
`batch` is a data.Batch; `cfg` a grpo.Config: the paper's knobs, and the baselines' (BaselineConfig).

Which credit is fused into the training forward (--credit-pass fused, the default; OtherCredit decides):
  fused     signals none, random, flow, attention, entropy (scoring.FUSED) with a per-row rule: the
            micro-batch's training forward captures the attention maps / entropy, then flow -> weight -> loss.
  separate  signals fai, gradient, correlation, oar-p, oar-g (their own passes), and the batch-wide rule 80-20
            (its threshold needs every row's scores before any loss): one credit pass over the rows with
            A != 0 before the update, as with --credit-pass separate for any signal (the teaching reference).
            A signal whose row's scores read that row alone (ROWWISE) scores the update's micro-batches
            (--micro-batch rows a forward: the same scores, the memory of b rows, and an out-of-memory
            back-off, training/memory/backoff.py, shrinks it too); random, fai and OAR score the rows at once
            (their draws and fai's choice of heads read the whole batch).
Fallbacks, padding and the shaping rules' departures: training/credit/shaping.py.

Departures (numbered):
 1. Rows with A = 0 add nothing to the loss (beta = 0), so grpo.py runs no credit for them in either pass.

Run the tests: python -m pytest -q tests/credit
Time them:     python benchmarks/credit_overhead.py
"""

from __future__ import annotations

import functools
import math
import unicodedata
from dataclasses import dataclass

import torch

from data import take
from flowtracer import Credit, select_layers
from training.credit.oar import OUTCOMES
from training.credit.scoring import FUSED, NEEDS, SIGNALS, ForwardOutputs
from training.credit.shaping import BATCH_RULES, SHAPINGS, entropy_bonus


@dataclass
class BaselineConfig:
    """The baselines' own knobs. grpo.Config inherits them beside the paper's (credit, shaping, top_frac,
    gamma, layers): a credit function's `cfg` is a grpo.Config; `python grpo.py --soft-mass 0.6` sets one."""

    # credit: the baselines' knobs (training/credit/baselines.py)
    credit_pass: str = "fused"  # fused: credit from the update's own forward | separate: its own pass
    token_class: str = ""  # "" | structural | semantic: select only within one class (Table 11b)
    soft_mass: float = 0.4  # --shaping soft: cumulative score mass to cover (Table 7)
    entropy_frac: float = 0.2  # --shaping 80-20: top fraction by entropy over the batch (Wang et al.)
    entropy_alpha: float = 0.4  # --shaping entropy-adv: bonus min(alpha H, |A|/kappa) (OAR eq. 6)
    entropy_kappa: float = 2.0  # --shaping entropy-adv: the bonus is capped at |A|/kappa (OAR eq. 6)
    attn_window: str = "10:100"  # --credit fai: FAI reads queries t with s+10 <= t <= s+100
    attn_global_frac: float = 0.3  # --credit fai: top 30% heads by mean attention distance
    oar_outcome: str = "as-mean"  # OAR outcome: as-mean (OAR §6.2 trains with it), lt-logits, as-joint
    oar_sigma: float = 1e-3  # std of OAR-G's Gaussian noise on the embeddings (OAR §3.2)
    oar_chunk: int = 64  # OAR-P masked copies per forward pass
    oar_prefix_cache: bool = True  # OAR-P/G: reuse the cached keys/values of the unchanged prefix
    pad_id: int = -1  # OAR-P replacement token; -1: the batch's padding id (oar.py dep. 2)
    bilevel_tau: float = 0.4  # --shaping bilevel: percentile threshold (OAR §4.1)
    bilevel_beta: float = 2.0  # --shaping bilevel: boost coefficient (OAR §4.1)


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
PAPER = ("flow", "topk", "", "fused")  # (credit, shaping, token_class, credit_pass): grpo.update's own lines
ROWWISE = {"none", "flow", "attention", "entropy", "gradient", "correlation"}  # a row's scores: its own


def assign(model, tok, batch, adv, cfg, outputs=None, rows=None) -> Credit:
    """The whole credit step: the signal (scoring.py), the token-class mask, the shaping rule, Cheng et al.'s
    additive entropy bonus (entropy-adv), on the response columns: Credit (B, R) as flow_credit gives it.
    batch: data.Batch of B rows; adv: (B,) sequence advantages; outputs: what the training forward
    computed (fused pass) or None; rows: a ROWWISE signal's rows a forward (the separate pass's micro-batch),
    None: all B at once. The shaping rule always reads every row's scores."""
    scores = signal_scores(model, batch, cfg, outputs, rows)  # (B, T)
    eligible = token_class_mask(tok, batch.input_ids, cfg.token_class)
    c = SHAPINGS[cfg.shaping](scores, batch, cfg, eligible)  # every column, (B, T)
    P, resp = batch.prompt_width, batch.response_mask
    weight = c.weight[:, P:]  # (B, R)
    if cfg.shaping == "entropy-adv":  # Cheng et al.: A_t = A + bonus_t, written as gamma_t = A_t / A
        A_t = entropy_bonus(adv, scores, resp & ~c.fallback[:, None], cfg.entropy_alpha, cfg.entropy_kappa)
        ratio = A_t[:, P:] / torch.where(adv != 0, adv, 1.0)[:, None]  # (B, R)
        weight = torch.where(adv[:, None] != 0, ratio, weight) * resp[:, P:].float()
    return Credit(weight, scores[:, P:], c.fallback)


def signal_scores(model, batch, cfg, outputs=None, rows=None):
    """(B, T) the signal's scores of `batch`: a ROWWISE signal `rows` rows a call (each row's scores are its
    own, so the same scores with the memory of `rows` rows), any other at once."""
    B = batch.input_ids.shape[0]
    if rows is None or rows >= B or outputs is not None or cfg.credit not in ROWWISE:
        return SIGNALS[cfg.credit](model, batch, cfg, outputs)
    parts = [take(batch, list(range(s, min(s + rows, B)))) for s in range(0, B, rows)]
    return torch.cat([SIGNALS[cfg.credit](model, part, cfg) for part in parts])  # (B, T)


def is_paper(cfg):
    """True for the paper's credit, which grpo.update computes in plain lines (PAPER): flow, top-k (eq. 6),
    every response token eligible, fused into the training forward. Every other setting: OtherCredit."""
    return (cfg.credit, cfg.shaping, cfg.token_class or "", cfg.credit_pass) == PAPER


def separate_pass(cfg):
    """True when credit needs its own pass before the update: asked for (--credit-pass separate), a signal
    that runs its own forwards (attention, OAR), or a rule that needs every row's scores first (80-20)."""
    return cfg.credit_pass == "separate" or cfg.credit not in FUSED or cfg.shaping in BATCH_RULES


def reads_maps(cfg):
    """True when the training forward must capture the attention maps (flow or attention, fused): setup then
    gives the Run the layers to capture (an empty list otherwise)."""
    return not separate_pass(cfg) and NEEDS.get(cfg.credit) == "attn"


class OtherCredit:
    """Every credit but the paper's default (PAPER), with the paper's call shape (grpo.update):

        other = OtherCredit(run, batch, trained, adv)      # a credit with a pass of its own runs it here
        c = other(mb, sub, cap, entropy)                   # Credit of the micro-batch's rows (b, R)

    where cap is the training forward's Capture (Run.layers not empty: reads_maps) or None. Fused or separate
    is decided here, not in the update: a signal with forwards of its own (fai, gradient, correlation, OAR),
    the batch-wide 80-20 rule and --credit-pass separate run `assign` once over the trained rows, before the
    first micro-batch (no grad); the others read what the training forward computed (its captured maps and
    entropy). run: grpo's Run (cfg; policy: model, tok, autocast)."""

    def __init__(self, run, batch, trained, adv):
        self.run, self.adv, self.given = run, adv, None
        if separate_pass(run.cfg) and trained:
            with torch.no_grad(), run.policy.autocast:
                pol = run.policy
                self.given = assign(
                    pol.model, pol.tok, take(batch, trained), adv[trained], run.cfg, rows=run.cfg.micro_batch
                )  # (b, R)
            self.where = {r: i for i, r in enumerate(trained)}  # batch row -> row of `given`

    def __call__(self, mb, sub, cap, entropy) -> Credit:
        if self.given is not None:
            i = torch.tensor([self.where[r] for r in mb], device=self.given.weight.device)
            return Credit(*(x[i] for x in self.given))
        outputs = ForwardOutputs(cap.maps(sub.attention_mask) if cap is not None else None, entropy)
        return assign(self.run.policy.model, self.run.policy.tok, sub, self.adv[mb], self.run.cfg, outputs)


# ----------------------------------------------------------------------------- the flags
CHOICES = {
    "credit": SIGNALS,
    "shaping": SHAPINGS,
    "credit_pass": ("fused", "separate"),  # for --help
    "oar_outcome": OUTCOMES,
}


def check(cfg):
    """The first bad credit flag as one sentence naming it, or None (grpo.py makes it its one-line error)."""
    finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
    rules = [
        ("--credit", cfg.credit in SIGNALS, f"must be one of {', '.join(SIGNALS)}"),
        ("--shaping", cfg.shaping in SHAPINGS, f"must be one of {', '.join(SHAPINGS)}"),
        ("--credit-pass", cfg.credit_pass in ("fused", "separate"), "must be fused or separate"),
        ("--top-frac", finite(cfg.top_frac) and 0 < cfg.top_frac <= 1, "must be in (0, 1]"),
        ("--gamma", finite(cfg.gamma) and cfg.gamma > 0, "must be a finite number > 0 (eq. 6)"),
        (
            "--token-class",
            cfg.token_class in ("", "none", "structural", "semantic"),
            "must be structural or semantic (or empty)",
        ),
        ("--soft-mass", finite(cfg.soft_mass) and 0 < cfg.soft_mass <= 1, "must be in (0, 1]"),
        ("--entropy-frac", finite(cfg.entropy_frac) and 0 <= cfg.entropy_frac <= 1, "must be in [0, 1]"),
        ("--entropy-alpha", finite(cfg.entropy_alpha) and cfg.entropy_alpha >= 0, "must be >= 0"),
        (
            "--entropy-kappa",
            finite(cfg.entropy_kappa) and cfg.entropy_kappa > 1,
            "must be > 1 (keeps A's sign)",
        ),
        (
            "--attn-global-frac",
            finite(cfg.attn_global_frac) and 0 < cfg.attn_global_frac <= 1,
            "must be in (0, 1]",
        ),
        ("--oar-outcome", cfg.oar_outcome in OUTCOMES, f"must be one of {', '.join(OUTCOMES)}"),
        ("--oar-sigma", finite(cfg.oar_sigma) and cfg.oar_sigma > 0, "must be > 0"),
        ("--oar-chunk", cfg.oar_chunk >= 1, "must be >= 1"),
        ("--seed", 0 <= cfg.seed < 2**63, "must be in [0, 2**63): torch seeds are 64-bit"),
        ("--bilevel-tau", finite(cfg.bilevel_tau) and 0 <= cfg.bilevel_tau <= 1, "must be in [0, 1]"),
        ("--bilevel-beta", finite(cfg.bilevel_beta) and cfg.bilevel_beta >= 0, "must be >= 0"),
        (
            "--shaping entropy-adv",
            cfg.shaping != "entropy-adv" or cfg.credit == "entropy",
            "adds an entropy bonus to the advantage: use it with --credit entropy",
        ),
    ]
    for flag, ok, why in rules:
        if not ok:
            return f"{flag} {why}"
    w = str(cfg.attn_window).split(":")
    if len(w) != 2 or not all(x.strip().isdigit() for x in w) or int(w[0]) > int(w[1]):
        return f"--attn-window must be A:B with 0 <= A <= B, got {cfg.attn_window!r}"
    try:
        select_layers(cfg.layers, 10**6)  # syntax only; the model's own depth is checked when it loads
    except ValueError as e:
        return f"--layers: {e}"
    return None
