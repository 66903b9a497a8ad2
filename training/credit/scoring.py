"""Credit signals: how much each response token matters, one function per criterion the papers compare.

    scores = SIGNALS[name](model, batch, cfg, outputs=None)   -> (B, T) float32, 0 off the response

`batch` is a data.Batch, `cfg` a grpo.Config. shaping.py turns scores into the weight gamma_it
(the shaping rules) and baselines.assign runs both; this file only scores. The names are the papers'
(FlowTracer §4.1, Table 2; OAR §4.2, Table 1):

  none           1 on every response token (plain GRPO)
  flow           FlowTracer throughput tau (eq. 1-4, §3.3) on the cfg.layers attention DAG
  random         uniform [0, 1): FlowTracer's "Random" (topk); OAR's "Random Credit" (--shaping identity)
  entropy        policy entropy H_t (OAR eq. 5; Wang et al. 2025b)
  gradient       Green et al.: norm of the gradient of the response log-likelihood w.r.t. token t's embedding
  correlation    Nie et al.: mean correlation of token t's final hidden state with the other response tokens'
  attention      FlowTracer's "Attention" baseline: the maximum attention a token receives (§4.1)
  fai            Li et al. 2025d's own score, FAI (global-anchor attention over a window, per-head maps)
  oar-p, oar-g   OAR's outcome-grounded scores (oar.py)

The fused credit pass. grpo.py's training forward can hand a signal what it computed anyway, as `outputs`:
the cfg.layers head-mean attention maps (a flowtracer.Capture) and each response token's entropy from the
logits of the same forward. The FUSED signals then need no forward of their own: none and random need no
model at all; flow and attention read outputs.attn; entropy reads outputs.entropy. fai (per-head maps under
eager attention), gradient (a backward pass), correlation (the final hidden states) and OAR-P / OAR-G (their
own perturbed forwards) always run their own passes.

Departures (numbered):
 1. "random" is seeded by hashing (cfg.seed, input_ids): deterministic for a seed and a batch, but a new draw
    each step, so the same positions are not boosted every step.
 2. "none" gives constant scores: every shaping rule then gives all-1 weights with fallback=True.
 3. "gradient". FlowTracer gives one line: "prioritizes tokens based on first-order gradient magnitude" (Green
    et al. 2025 is a preprint we cannot read offline). Read as first-order saliency of the quantity GRPO
    differentiates: g_t = d/de_t sum_u log pi(y_u | x, y_<u) over the response tokens u, score ||g_t||_2,
    e_t the input embedding of response token t. Not d log pi(y_t)/d e_t: y_t is predicted from the tokens
    before it, so that gradient is 0 by causality. So the last response token scores 0 (no later token).
    Neither parameter gradients (one backward per token) nor Gradient x Input (that is OAR-G's eq. 13).
    One reading among several; tests/credit/test_paper_baselines.py::
    test_gradient_is_the_embedding_gradient_norm_of_the_response_loglik pins it against a direct autograd
    reference.
 4. "correlation". FlowTracer's line: "selecting tokens with strong mutual dependencies" (Nie et al. 2025: the
    text embedding of an LLM, its pooled last hidden states, aligns with the text's key tokens). Read as the
    mean Pearson correlation (over the D hidden units) of token t's final hidden state with those of the
    other response tokens, r_t = mean_{s != t} corr(h_t, h_s): by linearity this is the alignment of the
    standardised h_t with the pooled standardised states, Nie et al.'s key-token criterion. Scored
    (1 + r_t) / 2 in [0, 1], same ranking, non-negative for every shaping rule. A one-token response gets 1/2.
    One reading among several; test_paper_baselines.py's
    test_correlation_is_the_mean_pairwise_pearson_correlation (against torch.corrcoef) and
    test_correlation_of_a_one_token_response_is_one_half pin it.
 5. "attention" is the head- and layer-mean attention of cfg.layers (the FlowTracer graph), max over the later
    queries; the paper does not say which heads or layers its Attention baseline reads. A reading, pinned by
    tests/credit/test_scoring.py::test_attention_is_the_max_received.

Run the tests: python -m pytest -q tests/credit/test_scoring.py tests/credit/test_paper_baselines.py
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from flowtracer import select_layers, trace_flow
from training.credit.attention import attention_graph
from training.credit.oar import (
    batch_seed,
    eval_mode,
    hidden,
    lm_logits,
    signal_oar_g,
    signal_oar_p,
)


class ForwardOutputs(NamedTuple):
    """What the training forward already computed, for the fused signals. Either field may be None."""

    attn: torch.Tensor | None  # (B, T, T) head/layer-mean attention of cfg.layers, detached
    entropy: torch.Tensor | None  # (B, R) entropy of the distribution that predicts response column P + j


def signal_none(model, batch, cfg, outputs=None):
    """All-1 on the response: no token is preferred, so every shaping rule gives plain GRPO (departure 2)."""
    return batch.response_mask.float()


def signal_random(model, batch, cfg, outputs=None):
    """Uniform [0, 1) scores on the response, the neutral lower bound of Table 2 ("Random")."""
    g = torch.Generator().manual_seed(batch_seed(batch.input_ids, cfg.seed))
    u = torch.rand(batch.input_ids.shape, generator=g)  # (B, T) drawn on the CPU
    return u.to(batch.response_mask.device) * batch.response_mask.float()


def graph(model, batch, cfg, outputs):
    """The (B, T, T) attention DAG of cfg.layers: the captured maps if the training forward took them,
    else one forward of its own (attention.attention_graph)."""
    if outputs is not None and outputs.attn is not None:
        return outputs.attn
    dev = model.device
    return attention_graph(model, batch.input_ids.to(dev), batch.attention_mask.to(dev), cfg.layers)


def signal_flow(model, batch, cfg, outputs=None):
    """FlowTracer: throughput tau of the answer-targeted flow on the middle layers' attention DAG (§3.3)."""
    attn = graph(model, batch, cfg, outputs)  # (B, T, T)
    dev = attn.device
    valid = batch.attention_mask.to(dev).bool()
    q, a = batch.question_mask.to(dev), batch.answer_mask.to(dev)
    tau = trace_flow(attn, q, a, attention_mask=valid).throughput  # (B, T) eq. 1-4
    resp = batch.response_mask
    return (tau.float() * resp.to(dev)).to(resp.device)  # (B, T)


@torch.no_grad()
def signal_entropy(model, batch, cfg, outputs=None, rows_per_block=None):
    """H_t = -sum_v pi(v | x, y_<t) log pi(v | x, y_<t) (OAR eq. 5) for each response token t, from one
    no-grad forward. The logits of the response positions only, rows_per_block of them at a time, so the
    (B, T, V) fp32 logits never exist (default: about 2^25 floats per block). Temperature 1.
    With outputs.entropy (the training forward's own logits), no forward runs."""
    if outputs is not None and outputs.entropy is not None:
        P, resp = batch.prompt_width, batch.response_mask
        out = torch.zeros(resp.shape, dtype=torch.float32, device=outputs.entropy.device)
        out[:, P:] = outputs.entropy.float().clamp_min(0.0)
        return out.to(resp.device) * resp.float()
    dev = model.device
    mask = batch.attention_mask.to(dev)
    resp = batch.response_mask.to(dev).bool()
    with eval_mode(model):
        h = hidden(model, mask, batch.input_ids.to(dev))  # (B, T, D)
        pred = torch.zeros_like(resp)
        pred[:, :-1] = resp[:, 1:]  # column t - 1 predicts token t
        rows, cols = pred.nonzero(as_tuple=True)  # (N,)
        V = model.get_output_embeddings().weight.shape[0]
        step = rows_per_block or max(1, 2**25 // V)
        H = torch.zeros(len(rows), dtype=torch.float32, device=dev)
        for i in range(0, len(rows), step):
            logp = torch.log_softmax(
                lm_logits(model, h[rows[i : i + step], cols[i : i + step]]), -1
            )  # (n, V)
            H[i : i + step] = -(logp.exp() * logp).sum(-1)
    out = torch.zeros(resp.shape, dtype=torch.float32, device=dev)
    out[rows, cols + 1] = H.clamp_min(0.0)
    return out.to(batch.response_mask.device)


def signal_attention(model, batch, cfg, outputs=None):
    """FlowTracer's "Attention" baseline ("using maximum attention scores as a proxy for importance", §4.1):
    max over later queries t > s of the head- and layer-mean attention a(t, s) of cfg.layers (departure 5).
    Li et al.'s own score, which §4.1 cites for it, is signal_fai."""
    A = graph(model, batch, cfg, outputs)  # (B, T, T)
    dev = A.device
    received = A.tril(-1).amax(-2)  # (B, T) max over queries t > s
    return (received * batch.response_mask.to(dev).float()).to(batch.response_mask.device)


def signal_gradient(model, batch, cfg, outputs=None, rows_per_block=None):
    """Green et al.'s "Gradient" baseline as read in departure 3: score_t = ||d L / d e_t||_2 with
    L = sum over response tokens u of log pi(y_u | x, y_<u) and e_t the input embedding of response token t.
    One forward and one backward (gradients to the embeddings only, never to the parameters), in full
    precision. The log-softmax over V runs rows_per_block predicted tokens at a time under activation
    checkpointing, so the (B, T, V) logits never exist, not even for the backward."""
    dev = model.device
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    resp = batch.response_mask.to(dev).bool()
    pred = torch.zeros_like(resp)
    pred[:, :-1] = resp[:, 1:]  # column l predicts token l + 1
    rows, cols = pred.nonzero(as_tuple=True)  # (N,)
    score = torch.zeros(resp.shape, dtype=torch.float32, device=dev)
    if not len(rows):
        return score.to(batch.response_mask.device)
    V = model.get_output_embeddings().weight.shape[0]
    step = rows_per_block or max(1, 2**25 // V)
    logp = lambda h, y: torch.log_softmax(lm_logits(model, h), -1).gather(-1, y[:, None]).sum()  # noqa: E731
    with eval_mode(model), torch.autocast(dev.type, enabled=False), torch.enable_grad():
        e = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # (B, T, D)
        h = hidden(model, mask, inputs_embeds=e)  # (B, T, D)
        blocks = [(rows[i : i + step], cols[i : i + step]) for i in range(0, len(rows), step)]
        L = sum(checkpoint(logp, h[r, c], ids[r, c + 1], use_reentrant=False) for r, c in blocks)  # eq. above
        (g,) = torch.autograd.grad(L, e)  # (B, T, D)
    score = g.float().norm(dim=-1)  # (B, T) ||g_t||
    return (score * resp.float()).to(batch.response_mask.device)


@torch.no_grad()
def signal_correlation(model, batch, cfg, outputs=None):
    """Nie et al.'s "Correlation" baseline as read in departure 4: (1 + r_t) / 2 with r_t the mean Pearson
    correlation of h_t with h_s over the other response tokens s, h the final hidden states (B, T, D).
    With z_t = (h_t - mean h_t) / ||h_t - mean h_t|| (mean over the D units), corr(h_t, h_s) = <z_t, z_s>, so
    r_t = (<z_t, sum_s z_s> - 1) / (n - 1): O(n D), no n x n matrix."""
    dev = model.device
    resp = batch.response_mask.to(dev).bool()
    with eval_mode(model):
        h = hidden(model, batch.attention_mask.to(dev), batch.input_ids.to(dev)).float()  # (B, T, D)
    z = h - h.mean(-1, keepdim=True)
    z = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # (B, T, D) unit, centred
    m = resp.float()  # (B, T)
    pooled = (z * m[..., None]).sum(1, keepdim=True)  # (B, 1, D) sum_s z_s
    n = m.sum(-1, keepdim=True)  # (B, 1)
    self_dot = (z * z).sum(-1)  # (B, T) 1 (0: h_t constant)
    r = ((z * pooled).sum(-1) - self_dot) / (n - 1).clamp_min(1.0)  # (B, T) mean over s != t
    r = torch.where(n > 1, r, torch.zeros_like(r)).clamp(-1.0, 1.0)
    return ((1.0 + r) / 2.0 * m).to(batch.response_mask.device)


class _Done(Exception):
    """Raised after the last chosen layer: the rest of the forward pass is skipped."""


@torch.no_grad()
def signal_fai(model, batch, cfg, outputs=None):
    """Li et al. 2025d (arXiv 2510.13554) global-anchor score FAI_s: the mean attention token s receives from
    the tokens t with s + w0 <= t <= s + w1 (attn_window = (10, 100) or "10:100"), averaged over the
    "global" heads: the top attn_global_frac (30%) of the heads of the chosen layers (cfg.layers, default
    middle) by mean attention distance sum_{t,s} a(t,s)(t - s) per query, over the batch. Needs the
    per-head maps, so the model runs with eager attention; one layer's (B, H, T, T) maps exist at a time.
    Tokens with no t in the window get 0."""
    win = cfg.attn_window
    w0, w1 = (int(x) for x in (win.split(":") if isinstance(win, str) else win))  # (10, 100) or "10:100"
    frac = cfg.attn_global_frac
    if not (0 <= w0 <= w1 and 0.0 < frac <= 1.0):
        raise ValueError("need 0 <= attn_window[0] <= attn_window[1] and 0 < attn_global_frac <= 1")
    dev = model.device
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    valid = mask.bool().float()  # (B, T)
    T = ids.shape[-1]
    ar = torch.arange(T, device=dev)
    lag = (ar[:, None] - ar[None, :]).float()  # (T, T) t - s, query t, key s
    band = ((lag >= w0) & (lag <= w1)).float()  # (T, T) the FAI window
    count = torch.einsum("bt,ts->bs", valid, band).clamp_min(1.0)  # (B, T) queries in the window
    layers = select_layers(cfg.layers, model.config.num_hidden_layers)
    dist, fai = [], []  # per layer: (H,), (B, H, T)

    def keep(module, args, out):
        A = out[1].float() * valid[:, None, :, None] * valid[:, None, None, :]  # (B, H, T, T) query t, key s
        d = (A * lag.clamp_min(0)).sum((-1, -2)) / valid.sum(-1, keepdim=True)  # (B, H) mean distance
        dist.append(d.mean(0))
        fai.append(torch.einsum("bhts,ts->bhs", A, band) / count[:, None])  # (B, H, T)
        if module.layer_idx == layers[-1]:
            raise _Done  # later layers are not needed

    attn_modules = [
        m for m in model.modules() if getattr(m, "layer_idx", None) in layers and hasattr(m, "o_proj")
    ]
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
    D, F = torch.cat(dist), torch.cat(fai, dim=1)  # (L*H,), (B, L*H, T)
    k = max(1, math.ceil(frac * len(D) - 1e-9))
    top = torch.topk(D, k).indices  # the global heads
    return (F[:, top].mean(1) * batch.response_mask.to(dev).float()).to(batch.response_mask.device)


SIGNALS = {
    "none": signal_none,
    "flow": signal_flow,
    "random": signal_random,
    "entropy": signal_entropy,
    "gradient": signal_gradient,
    "correlation": signal_correlation,
    "attention": signal_attention,
    "fai": signal_fai,
    "oar-p": signal_oar_p,
    "oar-g": signal_oar_g,
}
FUSED = {"none", "random", "flow", "entropy", "attention"}  # can read `outputs` instead of a forward
NEEDS = {"flow": "attn", "attention": "attn", "entropy": "entropy"}  # what each fused signal reads
