"""training/policy.py: the log-probs (token_logprobs) against HF's, and left-padded rows on the one-GPU path,
checked on the CPU.

The log-prob tests run on each device present (conftest.DEVICES), in fp32 against HF's full logits with the
error scale of an fp64 run (conftest.assert_to_rounding), and in bf16, the CUDA run's dtype, against fp32.
Padding rows: no attention row is fully masked, so under a kernel that gives NaN for such rows (some GPU
kernels; torch's CPU kernels give 0) the log-probs, the gradient, the rollouts and the captured maps are
finite. Each prompt read once in the update: tests/test_policy_shared_prefix.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_to_rounding

import data
from grpo import token_logprobs
from training import policy
from training.credit import attention
from training.decode import rollout
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


# ----------------------------------------------------------------------------- padding rows: never empty
@pytest.fixture
def nan_kernel(monkeypatch):
    """sdpa as a GPU kernel that returns NaN for a fully masked query row; the list counts such rows."""
    real, empty = torch.nn.functional.scaled_dot_product_attention, []

    def sdpa(q, k, v, attn_mask=None, **kw):
        out = real(q, k, v, attn_mask=attn_mask, **kw)  # (B, H, q, d)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            rows = ~attn_mask.any(-1, keepdim=True)  # (B, 1, q, 1)
            empty.append(int(rows.sum()))
            out = out.masked_fill(rows, float("nan"))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    return empty


PROMPTS, RESPONSES = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [5, 6, 7]], [[20, 21, 22], [23], [24, 25]]


@pytest.mark.parametrize("share", [False, True])
def test_left_padding_rows_give_finite_log_probs_and_gradients(nan_kernel, share, device):
    """The update's forward over left-padded prompts (build_batch): every log-prob and gradient finite, and
    each row's log-probs those of the row alone, unpadded, to rounding (fp32 against the padded batch in
    float64: conftest.assert_to_rounding): the padding rows add nothing to the loss."""
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    b = data.build_batch(tok, PROMPTS, RESPONSES).to(model.device)
    logp, _ = policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 2, share)
    resp = b.response_mask[:, b.prompt_width :]
    (logp * resp).sum().backward()
    assert torch.isfinite(logp).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        exact, _ = policy.token_logprobs(
            copy.deepcopy(model).double(), b.input_ids, b.attention_mask, b.prompt_width, 2, share
        )
    assert nan_kernel and sum(nan_kernel) == 0, nan_kernel  # no fully masked row was built
    for j, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):  # each row alone, no padding
        one = data.build_batch(tok, [p], [r]).to(model.device)
        alone, _ = policy.token_logprobs(model, one.input_ids, one.attention_mask, one.prompt_width, 2, False)
        assert_to_rounding(alone[0][: len(r)], logp[j][resp[j]], exact[j][resp[j]], what=f"row {j}")


@pytest.mark.parametrize("share", [False, True])
def test_left_padded_rollouts_are_unchanged(nan_kernel, monkeypatch, share):
    """HF generate (share_prefix=False) and the shared path, whose prompts here share no prefix (a
    [pads | suffix] layout): the same greedy tokens as with torch's own kernel."""
    model, tok = load_model("tiny-qwen3", device="cpu")

    def run():
        return rollout.generate(
            model,
            tok,
            ["ab", "cdefg"],
            2,
            rollout.Sampling(6, greedy=True),
            share_prefix=share,
        ).response_ids

    got = run()
    monkeypatch.undo()  # torch's kernel: 0 for such rows
    assert got == run()
    assert nan_kernel and sum(nan_kernel) == 0, nan_kernel


def test_captured_maps_of_left_padded_rows_are_finite(nan_kernel, device):
    model, tok = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    b = data.build_batch(tok, PROMPTS, RESPONSES).to(model.device)
    attn = attention.attention_graph(model, b.input_ids, b.attention_mask, layers="all")
    with attention.capturing(model, b.attention_mask, "all") as cap:
        policy.token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_width, 2, False)
    assert torch.isfinite(attn).all() and torch.isfinite(cap.attn).all()
    torch.testing.assert_close(cap.attn, attn)
    assert sum(nan_kernel) == 0, nan_kernel
