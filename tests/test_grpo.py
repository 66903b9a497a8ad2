"""grpo.py: the advantages by hand, the loss vs a hand-written GRPO reference (eq. 5), gamma scaling and the
token-mean aggregation. The command line: tests/test_grpo_cli.py; runs end to end: tests/test_grpo_runs.py;
the update's fused and one-pass paths: tests/test_grpo_update.py; the log-probs: tests/test_policy.py; the
phase clock: tests/run/test_log_clock.py."""

from types import SimpleNamespace

import torch

from grpo import Experience, compute_advantages, grpo_loss


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
