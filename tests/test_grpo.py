"""grpo.py: log-probs vs HF, the loss vs a hand-written GRPO reference, gamma scaling, and the command line.
Subprocess runs: tests/test_grpo_runs.py; the phase clock: tests/test_grpo_phase_timing.py.

The log-prob tests run on each device present (conftest.DEVICES), in fp32 against HF's full logits with the
error scale of an fp64 run (conftest.assert_to_rounding), and in bf16, the CUDA run's dtype, against fp32."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_to_rounding

from grpo import Experience, compute_advantages, grpo_loss, parse_args, token_logprobs
from training.config import presets
from training.model.load import load_model


# ----------------------------------------------------------------------------- log-probs
def hf_logprobs(model, ids, mask, P):
    """(log-probs, entropies) of the response columns P.. from HF's full logits, in the logits' dtype (fp32 at
    least), with grad: the reference token_logprobs' chunked selective log-softmax must equal."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : -1]
    logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return logp.gather(-1, ids[:, P:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1).detach()


def left_padded(tok, device):
    enc = tok(["hello there, model", "hi"], return_tensors="pt", padding=True)  # left padding
    return enc.input_ids.to(device), enc.attention_mask.to(device)


@pytest.mark.parametrize("chunk", [3, 128])
def test_token_logprobs_equal_hf_log_softmax(chunk, device):
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    ids, mask = left_padded(tok, model.device)
    P = 3
    with torch.no_grad():
        ref, ref_ent = hf_logprobs(model, ids, mask, P)
        exact, exact_ent = hf_logprobs(copy.deepcopy(model).double(), ids, mask, P)
        lp, ent = token_logprobs(model, ids, mask, P, chunk=chunk)
    assert_to_rounding(lp, ref, exact, what="log-probs")
    assert_to_rounding(ent, ref_ent, exact_ent, what="entropies")


def test_token_logprobs_gradient_matches_full_logits(device):
    model, tok = load_model("tiny-llama", device=device, dtype=torch.float32)
    ids = tok(["gradient check"], return_tensors="pt").input_ids.to(model.device)
    mask = torch.ones_like(ids)
    lp, _ = token_logprobs(model, ids, mask, 2, chunk=4)  # chunked, recomputed in backward
    g1 = torch.autograd.grad(lp.sum(), model.lm_head.weight)[0]
    g2 = torch.autograd.grad(hf_logprobs(model, ids, mask, 2)[0].sum(), model.lm_head.weight)[0]
    wide = copy.deepcopy(model).double()
    g64 = torch.autograd.grad(hf_logprobs(wide, ids, mask, 2)[0].sum(), wide.lm_head.weight)[0]
    assert_to_rounding(g1, g2, g64, what="the LM head's gradient")


def test_token_logprobs_in_bf16_are_as_close_to_fp32_as_hf(device):
    """bf16 is the CUDA run's dtype (trainable.weight_dtype under --optimizer kahan): the chunked log-softmax
    of a bf16 model (bf16 logits, then fp32, as token_logprobs takes them) is no further from the fp32 model's
    log-probs and LM-head gradient than twice HF's own bf16 forward with its full logits, plus 2 bf16 eps of
    the value: ||ours - fp32|| <= 2 ||HF - fp32|| + 2 eps_bf16 ||fp32||. The bound is the bf16 error scale of
    this very forward, measured against fp32 on the same machine and kernels (the two bf16 paths round the
    same layers; 2x lets ours round the head differently), not a number set by trial; fp32 is the reference
    here as fp64 is for fp32 (its own error is ~2^-16 of bf16's)."""
    fp32, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids, mask = left_padded(tok, fp32.device)
    P = 3
    keep = mask[:, P:].bool()  # the real (unpadded) tokens
    out = {}
    for name, m in (("ours", bf16), ("hf", bf16), ("fp32", fp32)):
        lp = (token_logprobs(m, ids, mask, P, chunk=3) if name == "ours" else hf_logprobs(m, ids, mask, P))[0]
        out[name] = (lp * keep, torch.autograd.grad((lp * keep).sum(), m.lm_head.weight)[0])
    for i, what in enumerate(("log-probs", "the LM head's gradient")):
        ours, hf, ref = (out[k][i].double() for k in ("ours", "hf", "fp32"))
        bound = 2 * (hf - ref).norm() + 2 * torch.finfo(torch.bfloat16).eps * ref.norm()
        assert (hf - ref).norm() > 0, what  # bf16 rounds: not vacuous
        assert (ours - ref).norm() <= bound, (what, (ours - ref).norm().item(), bound.item())


# ----------------------------------------------------------------------------- advantages and loss
def test_compute_advantages_hand_cases():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, zero = compute_advantages(r, G=4)
    # group 1: mean 0.25, population std sqrt(3)/4 -> (1 - .25) / .433 = 1.732, -0.25 / .433 = -0.577
    torch.testing.assert_close(
        adv[:4], torch.tensor([3**0.5, -(3**-0.5), -(3**-0.5), -(3**-0.5)]), rtol=1e-4, atol=1e-4
    )
    assert adv[4:].abs().max() == 0 and zero.tolist() == [False, True]
    # (5 - 5/8) / std = 2.65 -> clipped
    adv, _ = compute_advantages(torch.tensor([5.0, 0, 0, 0, 0, 0, 0, 0]), G=8)
    assert adv[0].item() == 2.0
    adv, _ = compute_advantages(r, G=4, scale_std=False)
    torch.testing.assert_close(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def reference_loss(logp, old, adv, gamma, mask, eps_lo, eps_hi, c):
    """Eq. 5 token by token: 1/B sum_i 1/N_i sum_t -gamma * [dual-clipped] min(r A, clip(r) A)."""
    total = 0.0
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        row = 0.0
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            A = adv[i]
            obj = torch.minimum(r * A, torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * A)
            if A < 0:
                obj = torch.maximum(obj, c * A)
            row = row - gamma[i, t] * obj
        total = total + row / max(n, 1)
    return total / logp.shape[0]


def toy_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) * 3
    logp = (old + torch.randn(4, 6, generator=g) * 0.4).requires_grad_()  # ratios inside and outside the clip
    adv = torch.tensor([1.3, -0.7, -2.0, 0.0])
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return logp, old, adv, mask


def test_loss_and_gradient_equal_reference_with_unit_gamma():
    logp, old, adv, mask = toy_batch()
    cfg = SimpleNamespace(eps_low=0.2, eps_high=0.28, dual_clip=3.0, beta=0.0, loss_agg="seq-mean")
    gamma = torch.ones(4, 6)
    loss, stats = grpo_loss(logp, Experience(adv, gamma, mask, old, None, denom=4), cfg)
    g = torch.autograd.grad(loss, logp)[0]
    ref = reference_loss(logp, old, adv, gamma, mask, 0.2, 0.28, 3.0)
    g_ref = torch.autograd.grad(ref, logp)[0]
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)
    assert stats["clip/high"] + stats["clip/low"] > 0  # the toy batch exercises the clip


def test_gamma_scales_token_gradient_exactly():
    logp, old, adv, mask = toy_batch(1)
    cfg = SimpleNamespace(eps_low=0.2, eps_high=0.2, dual_clip=3.0, beta=0.0, loss_agg="seq-mean")
    ones = torch.ones(4, 6)
    boosted = ones.clone()
    boosted[0, 1] = boosted[1, 0] = boosted[2, 3] = 1.5
    g1 = torch.autograd.grad(grpo_loss(logp, Experience(adv, ones, mask, old, None, 4), cfg)[0], logp)[0]
    g2 = torch.autograd.grad(grpo_loss(logp, Experience(adv, boosted, mask, old, None, 4), cfg)[0], logp)[0]
    sel = boosted == 1.5
    assert (g1[sel] != 0).any()
    torch.testing.assert_close(g2[sel], 1.5 * g1[sel], rtol=0, atol=0)
    torch.testing.assert_close(g2[~sel], g1[~sel], rtol=0, atol=0)


def test_token_mean_aggregation():
    logp, old, adv, mask = toy_batch(2)
    cfg = SimpleNamespace(eps_low=0.2, eps_high=0.2, dual_clip=3.0, beta=0.0, loss_agg="token-mean")
    exp = Experience(adv, torch.ones(4, 6), mask, old, None, denom=mask.sum().item())
    loss, _ = grpo_loss(logp, exp, cfg)
    # equal-length rows make token-mean and seq-mean agree; here they differ, and token-mean is sum/N
    per = -torch.min(
        torch.exp(logp - old) * adv[:, None], torch.exp(logp - old).clamp(0.8, 1.2) * adv[:, None]
    )
    per = torch.where(adv[:, None] < 0, torch.max(-per, 3.0 * adv[:, None]).neg(), per)
    torch.testing.assert_close(loss, (per * mask).sum() / mask.sum())


# ----------------------------------------------------------------------------- command line
def test_unknown_flag_is_an_error():
    with pytest.raises(SystemExit):
        parse_args(["--no-such-flag", "1"])


def test_embedded_defaults_apply_only_to_the_embedded_model():
    assert parse_args([]).steps == presets.EMBEDDED["steps"]
    assert parse_args(["--steps", "3"]).steps == 3
    paper = parse_args(["--model", "Qwen/Qwen3-4B-Base"])
    assert (paper.lr, paper.group_size, paper.top_frac, paper.gamma, paper.temperature) == (
        1e-6,
        8,
        0.4,
        1.5,
        0.99,
    )
