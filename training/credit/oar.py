"""Outcome-grounded token importance: OAR-P and OAR-G (§3.1-3.2, §6.2 of the OAR paper: "Outcome-Grounded
Advantage Reshaping for Fine-Grained Credit Assignment in Mathematical Reasoning", Li, Kang et al., ACL 2026;
arXiv 2601.07408).

Both ask how much a response token moves the model's *outcome* phi(x, y) (OAR §6.2, cfg.oar_outcome):

    phi  AS-Mean    the mean logits over the positions that predict the answer span   [default: §6.2 trains
                    with it, Table 4's best]; P = softmax(phi)
         LT-Logits  the next-token logits at the last real token; P = softmax(phi)
         AS-Joint   a scalar: the mean log pi(a_{l+1} | x, y_<=l) over those answer positions (Table 4)
    oar-p   I_t = KL(P || P^(t)), P^(t): token t replaced by the pad token           (eq. 7-8)
            AS-Joint: I_t = phi - phi^(t), the score drop (§6.2)
    oar-g   J = KL(P_0 || P_eps), P_eps: Gaussian noise (sigma) on the response        (eq. 9-11)
            embeddings; I_t = |<dJ/de_t, e_t>| (Gradient x Input), one backward pass   (eq. 12-13)
            AS-Joint: J = phi_0 - phi_eps (departure 9)

The bi-level reshaping of OAR (eq. 14-17) is a shaping rule, shaping.shape_bilevel; it works on any signal.
This file also holds the two forward helpers the other model-based signals share: `hidden` (the decoder
trunk, no lm_head) and `lm_logits` (lm_head on chosen rows only), so that (B, T, V) logits are never built.

cfg is a grpo.Config: oar_outcome, oar_chunk (masked copies per forward, OAR-P), oar_prefix_cache
(both), oar_sigma (OAR-G), pad_id, seed.

Departures (numbered):
 1. AS-Mean uses the answer span of data.build_batch (last \\boxed{...}, else <answer>...</answer>).
    A sequence without one uses LT-Logits, as OAR's warm-up does (§6.2); credit's shaping rules give such
    sequences plain GRPO anyway.
 2. The pad id: cfg.pad_id if >= 0, else the id found at the batch's padding positions, else the model's
    generation_config / config pad_token_id; no pad id at all is an error. The replaced token stays attended
    (attention_mask unchanged): it is the token [PAD], not a deletion.
 3. OAR-P batches the masked copies, oar_chunk per forward (OAR §4.1 "parallelized batch decoding"). With
    oar_prefix_cache [True] a chunk holds copies of one sequence, masked at columns t0 <= t < t0 + chunk; the
    columns before t0 are identical in all of them, so their keys/values come from one cached forward of the
    original and only columns t0.. are recomputed: about n^2/2 + chunk*n/2 token-forwards per sequence instead
    of n*T (the prompt is never recomputed). oar_prefix_cache=False runs full copies, rows mixed (for models
    without a KV cache). Either way each copy stops at the last outcome position: later tokens cannot change
    the outcome (causal attention) and get 0 without a forward pass. AS-Joint reads its targets a_{l+1} from
    the original row, so masking an answer token changes only the positions after it.
 4. OAR-G draws its noise from a generator seeded by (seed, batch), deterministic like credit's "random".
    J is summed over the batch before the single backward pass: the rows are independent, so each row's
    gradient is its own. Gradients go to the embeddings only (torch.autograd.grad), never to parameters.
 5. Both run the model in eval mode (no dropout) and restore its mode afterwards.
 6. OAR-G turns autocast off: a sigma = 1e-3 perturbation is below bf16 resolution (2^-8), so under bf16
    autocast the KL gradient would be mostly rounding noise. With a bf16 model it is still at the mercy of
    bf16 weights; load the policy in fp32 (grpo does) or raise oar_sigma.
 7. OAR-G runs the prompt (columns < prompt_width) once, in the teacher's no-grad forward, and reuses its
    keys/values for the student: the prompt gets no noise and needs no gradient, and causal attention makes
    its keys/values independent of the response, so the gradient is unchanged while the grad-enabled forward
    and the backward cover only the response columns. oar_prefix_cache=False differentiates the whole row.
 8. AS-Joint. Its score drop phi - phi^(t) is negative when masking y_t makes the answer more likely; such a
    token is no support of the answer and gets 0 (KL is >= 0 anyway), so every shaping rule, eq. 14's log1p
    included, gets non-negative scores. AS-Joint is a scalar, so a row without an answer span has no outcome
    (LT-Logits is a distribution, no fallback for it): its scores are 0 and credit gives it plain GRPO.
 9. OAR defines AS-Joint for masking only (§6.2). For OAR-G, J = phi_0 - phi_eps takes the place of eq. 11's
    KL: the same score drop, under embedding noise.
 10. AS-Mean's "LT-Logits warm-up" (§6.2: the model may not yet write the answer format) is read per row:
    departure 1 falls back to LT-Logits for exactly the rows that have no answer span.

Run the tests: python -m pytest -q tests/credit/test_oar.py
"""

from __future__ import annotations

import hashlib

import torch
from transformers import DynamicCache


def batch_seed(input_ids, seed):
    """A 63-bit seed from (seed, the token ids): same batch and seed -> same draw."""
    h = hashlib.sha256(str(int(seed)).encode() + input_ids.detach().cpu().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


# ----------------------------------------------------------------------------- forward helpers
def hidden(model, attention_mask, input_ids=None, inputs_embeds=None):
    """(B, T, D) final hidden states of the decoder trunk (final norm included, lm_head not applied).
    Position ids follow HF generate for left padding: cumsum(attention_mask) - 1."""
    mask = attention_mask.long()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model.get_decoder()(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=mask,
        position_ids=pos,
        use_cache=False,
    )
    return out.last_hidden_state


def lm_logits(model, h):
    """fp32 logits for hidden states h (..., D) -> (..., V), with the model's final logit soft-capping."""
    z = model.get_output_embeddings()(h).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(z / cap) * cap if cap else z


class eval_mode:
    """Context manager: model.eval() inside, the previous train/eval mode restored on exit."""

    def __init__(self, model):
        self.model, self.was = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was)


# ----------------------------------------------------------------------------- the outcome (OAR §6.2)
OUTCOMES = ("as-mean", "lt-logits", "as-joint")


def outcome_mask(attention_mask, answer_mask, kind="as-mean"):
    """(B, T) bool: the positions whose next-token logits make the outcome phi (OAR §6.2).
    lt-logits: the last real token. as-mean, as-joint: the positions predicting an answer token (answer
    column - 1); rows without an answer: as-mean falls back to lt-logits (departure 1), as-joint has none
    (departure 8)."""
    if kind not in OUTCOMES:
        raise ValueError(f"oar_outcome must be one of {', '.join(OUTCOMES)}, got {kind!r}")
    valid = attention_mask.bool()
    T = valid.shape[-1]
    last = T - 1 - valid.flip(-1).long().argmax(-1)  # (B,) last real column
    lt = torch.zeros_like(valid)
    lt[torch.arange(len(last), device=lt.device), last] = True
    if kind == "lt-logits":
        return lt
    am = torch.zeros_like(valid)
    am[:, :-1] = answer_mask.bool()[:, 1:] & valid[:, :-1]  # position l predicts l + 1
    return am if kind == "as-joint" else torch.where(am.any(-1, keepdim=True), am, lt)


def next_tokens(input_ids):
    """(B, T) the token each position predicts: input_ids shifted left (the last column: 0, never read)."""
    nxt = torch.zeros_like(input_ids)
    nxt[:, :-1] = input_ids[:, 1:]
    return nxt


def outcome(model, h, pm, kind, nxt=None):
    """The outcome from hidden states h (B, T, D) at the positions pm (B, T). lt-logits, as-mean: (B, V)
    log softmax(phi), phi the mean logits over pm. as-joint: (B,) phi = the mean over pm of log pi(nxt)
    (nxt (B, T): next_tokens of the original row); 0 for a row without positions."""
    rows, cols = pm.nonzero(as_tuple=True)  # (N,)
    z = lm_logits(model, h[rows, cols])  # (N, V) only these rows
    n = pm.sum(-1).clamp_min(1).to(z.dtype)  # (B,)
    if kind == "as-joint":
        lp = torch.log_softmax(z, -1).gather(-1, nxt[rows, cols][:, None]).squeeze(-1)  # (N,) log pi(a)
        return torch.zeros(pm.shape[0], dtype=z.dtype, device=z.device).index_add_(0, rows, lp) / n
    phi = torch.zeros(pm.shape[0], z.shape[-1], dtype=z.dtype, device=z.device).index_add_(0, rows, z)
    return torch.log_softmax(phi / n[:, None], dim=-1)  # (B, V) AS-Mean / LT


def shift(o, o_new, kind):
    """(B,) how far the outcome moved. Distributions: KL(P || P_new) (eq. 8, 11); as-joint: the score drop
    phi - phi_new (§6.2). Not clamped: OAR-G differentiates it."""
    return o - o_new if kind == "as-joint" else kl(o, o_new)


def kl(logp, logq):
    """(B,) KL(p || q) from log-probabilities (B, V)."""
    return (logp.exp() * (logp - logq)).sum(-1)


def pad_id(model, batch, cfg):
    """The replacement token of OAR-P (departure 2)."""
    p = cfg.pad_id
    if p is not None and int(p) >= 0:  # -1 (or None): find it
        return int(p)
    padded = batch.input_ids[~batch.attention_mask.bool()]
    if padded.numel():
        return int(padded[0])
    for c in (getattr(model, "generation_config", None), model.config):
        if c is not None and getattr(c, "pad_token_id", None) is not None:
            p = c.pad_token_id
            return int(p[0] if isinstance(p, (list, tuple)) else p)
    raise ValueError("OAR-P needs a pad token id: set cfg.pad_id or model.config.pad_token_id")


# ----------------------------------------------------------------------------- OAR-P (eq. 7-8)
def masked_copies_shared(model, b, ids, mask, pm, cand, end, pad, chunk, scores, kind, nxt):
    """OAR-P for row b with the prefix shared (departure 3): scores[b, t] = KL(P || P^(t)) for cand[b]."""
    cols = cand[b].nonzero().squeeze(-1)  # ascending
    if not len(cols):
        return
    e, dev, dec = int(end[b]), ids.device, model.get_decoder()
    x0, m0, p0, n0 = ids[b : b + 1, :e], mask[b : b + 1, :e], pm[b : b + 1, :e], nxt[b : b + 1, :e]
    pos = (m0.long().cumsum(-1) - 1).clamp_min(0)
    out = dec(input_ids=x0, attention_mask=m0, position_ids=pos, use_cache=True)
    o = outcome(model, out.last_hidden_state, p0, kind, n0)  # (1, V) P_final, or (1,) phi
    kv = [(l.keys, l.values) for l in out.past_key_values.layers]  # per layer (1, Hkv, e, D)
    for i in range(0, len(cols), chunk):
        c = cols[i : i + chunk]
        t0, n = int(c[0]), len(c)  # copies share columns < t0
        x = x0[:, t0:].repeat(n, 1)  # (n, e - t0)
        x[torch.arange(n, device=dev), c - t0] = pad  # eq. 7: y_t -> [PAD]
        prefix = [(k[:, :, :t0].expand(n, -1, -1, -1), v[:, :, :t0].expand(n, -1, -1, -1)) for k, v in kv]
        cache = DynamicCache(ddp_cache_data=prefix, config=model.config) if t0 > 0 else None
        h = dec(
            input_ids=x,
            attention_mask=m0.expand(n, -1),
            position_ids=pos[:, t0:].expand(n, -1),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # (n, e - t0, D)
        o_t = outcome(model, h, p0[:, t0:].expand(n, -1), kind, n0[:, t0:].expand(n, -1))  # P^(t) or phi^(t)
        scores[b, c] = shift(o.expand(n, *o.shape[1:]), o_t, kind).clamp_min(0.0)  # eq. 8 (dep. 8)


@torch.no_grad()
def signal_oar_p(model, batch, cfg, outputs=None):
    """I_t = KL(P_final || P_final^(t)) for every response token t (eq. 8); (B, T) float32, 0 off the
    response. Cost: sum_b n_b masked copies, oar_chunk of them per forward (departure 3)."""
    chunk = int(cfg.oar_chunk)
    if chunk < 1:
        raise ValueError(f"oar_chunk must be >= 1, got {chunk}")
    dev = model.device
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    resp = batch.response_mask.to(dev).bool()
    kind, nxt = cfg.oar_outcome, next_tokens(ids)
    pm = outcome_mask(mask, batch.answer_mask.to(dev), kind)  # (B, T)
    T = ids.shape[-1]
    end = (pm.long() * torch.arange(T, device=dev)).amax(-1) + 1  # (B,) columns the outcome sees
    cand = resp & (torch.arange(T, device=dev) < end.unsqueeze(-1))  # departure 3: later ones get 0
    pad = pad_id(model, batch, cfg)
    share = bool(cfg.oar_prefix_cache)
    scores = torch.zeros(ids.shape, dtype=torch.float32, device=dev)
    with eval_mode(model):
        if share:
            for b in range(len(ids)):  # one row at a time, prefix shared
                masked_copies_shared(model, b, ids, mask, pm, cand, end, pad, chunk, scores, kind, nxt)
        else:  # full copies, rows mixed
            o = outcome(model, hidden(model, mask, ids), pm, kind, nxt)  # (B, V) P_final, or (B,) phi
            rows, cols = cand.nonzero(as_tuple=True)  # (N,) one masked copy each
            for i in range(0, len(rows), chunk):
                r, c = rows[i : i + chunk], cols[i : i + chunk]
                w = int(end[r].max())
                x = ids[r, :w].clone()
                x[torch.arange(len(r), device=dev), c] = pad  # eq. 7: y_t -> [PAD]
                o_t = outcome(model, hidden(model, mask[r, :w], x), pm[r, :w], kind, nxt[r, :w])  # P^(t)
                scores[r, c] = shift(o[r], o_t, kind).clamp_min(0.0)  # eq. 8 (departure 8)
    return scores.to(batch.response_mask.device)


# ----------------------------------------------------------------------------- OAR-G (eq. 9-13)
def signal_oar_g(model, batch, cfg, outputs=None):
    """I_t = |<grad_{e_t} KL(P_0 || P_eps), e_t>| (eq. 13) with one backward pass; (B, T) float32."""
    sigma = float(cfg.oar_sigma)
    if not sigma > 0:
        raise ValueError(f"oar_sigma must be > 0 (at sigma = 0 the KL gradient is exactly 0), got {sigma}")
    dev = model.device
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    resp = batch.response_mask.to(dev).bool()
    kind, nxt = cfg.oar_outcome, next_tokens(ids)
    pm = outcome_mask(mask, batch.answer_mask.to(dev), kind)
    if not pm.any():  # as-joint, no answer anywhere
        return torch.zeros(resp.shape, dtype=torch.float32, device=batch.response_mask.device)
    P = batch.prompt_width if bool(cfg.oar_prefix_cache) else 0  # departure 7
    if resp[:, :P].any() or pm[:, :P].any(-1).logical_and(resp.any(-1)).any():
        P = 0  # not the Batch layout
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    dec = model.get_decoder()
    gen = torch.Generator().manual_seed(batch_seed(batch.input_ids, cfg.seed))
    with eval_mode(model), torch.autocast(dev.type, enabled=False):  # departure 6: full precision
        with torch.no_grad():
            e = model.get_input_embeddings()(ids)  # (B, T, D) E, clean
            out = dec(inputs_embeds=e, attention_mask=mask, position_ids=pos, use_cache=P > 0)
            o0 = outcome(model, out.last_hidden_state, pm, kind, nxt)  # (B, V) eq. 9 teacher P_0
            kv = [(l.keys[:, :, :P], l.values[:, :, :P]) for l in out.past_key_values.layers] if P else None
        noise = torch.randn(e.shape, generator=gen).to(device=dev, dtype=e.dtype) * sigma
        x = (e + noise * resp.unsqueeze(-1).to(e.dtype))[:, P:].detach().requires_grad_(True)  # eq. 10
        with torch.enable_grad():
            # the prompt, constant
            cache = DynamicCache(ddp_cache_data=kv, config=model.config) if P else None
            h = dec(
                inputs_embeds=x,
                attention_mask=mask,
                position_ids=pos[:, P:],
                past_key_values=cache,
                use_cache=P > 0,
            ).last_hidden_state  # (B, T - P, D)
            o_eps = outcome(model, h, pm[:, P:], kind, nxt[:, P:])  # (B, V) student P_eps
            J = (shift(o0, o_eps, kind) * resp.any(-1)).sum()  # eq. 11, summed over rows
            (g,) = torch.autograd.grad(J, x)  # eq. 12, embeddings only
    score = torch.zeros(resp.shape, dtype=torch.float32, device=dev)
    score[:, P:] = (g.float() * e[:, P:].float()).sum(-1).abs()  # (B, T) eq. 13
    return (score * resp.float()).to(batch.response_mask.device)
