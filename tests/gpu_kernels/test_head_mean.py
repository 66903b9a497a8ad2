"""Tests for gpu_kernels/head_mean.py: the fused head-mean map against add_head_mean and eager attention.

Every kernel test runs on each device present: 'cuda' runs the compiled kernels, 'cpu' Triton's interpreter.
The interpreter takes over @triton.jit only where TRITON_INTERPRET=1 was set before triton was first
imported (triton.language's own zeros, sum, max are @triton.jit functions too, decorated at that import), so
a fresh import of gpu_kernels/head_mean.py is not enough: test_through_the_interpreter runs this file again
in a child pytest with TRITON_INTERPRET=1, where the 'cpu' cases run (in this process they are skipped, saying
so). `TRITON_INTERPRET=1 python -m pytest tests/gpu_kernels/test_head_mean.py` runs them in one process.

Tolerances (fp32): 1e-5 absolute (docs/gpu.md's criterion), over an error scale of about 5e-6: the kernel
takes p = 2^(s log2 e - m) where torch takes e^(s - m), rounding an exponent argument of |s| log2 e < 40 here
to fp32 (p moves by <= 40 * 2^-24 = 2.4e-6 relative), and both sum at most S < 64 terms of a row in
another order (< 64 * 2^-24 = 3.8e-6 relative); every p <= 1. bf16: see test_bf16_inputs.
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "Triton is not installed (requirements.txt; a CUDA torch ships its own)", allow_module_level=True
    )

import triton  # noqa: E402
from conftest import ROOT
from transformers.masking_utils import sdpa_mask  # noqa: E402

import flowtracer  # noqa: E402
import gpu_kernels.head_mean as head_mean  # noqa: E402
from flowtracer import (
    add_head_mean,  # noqa: E402
    select_layers,  # noqa: E402
)
from training.credit.attention import attention_graph  # noqa: E402
from training.model.load import load_model  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ATOL = 1e-5
# Before 3.7 the interpreter turns a loop bound computed from tl.program_id into a Python int with int() of a
# one-element array, which NumPy 2.4 (requirements.txt) refuses; 3.7 squeezes it first. Compiled: no matter.
OLD_INTERPRETER = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)


@pytest.fixture(params=DEVICES)
def kernel(request):
    """(head_mean_triton, device): the compiled kernels on CUDA, the interpreter on the CPU (in the child
    run of test_through_the_interpreter, or wherever TRITON_INTERPRET=1 was set from the start)."""
    if request.param == "cpu" and OLD_INTERPRETER:
        pytest.skip(f"triton {triton.__version__}'s interpreter fails on NumPy 2.4 (needs triton >= 3.7)")
    if request.param == "cpu" and not head_mean.interpreted():
        pytest.skip(
            "the interpreter needs TRITON_INTERPRET=1 before triton's import: see "
            "test_through_the_interpreter, which runs this case in a child pytest"
        )
    if request.param == "cuda" and head_mean.interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set: gpu_kernels.head_mean is interpreted, not compiled")
    return head_mean.head_mean_triton, request.param


def test_through_the_interpreter():
    """This file's 'cpu' cases, in a child pytest that imports triton under TRITON_INTERPRET=1."""
    if head_mean.interpreted():
        pytest.skip("this is the interpreted run")
    if OLD_INTERPRETER:
        pytest.skip(f"triton {triton.__version__}'s interpreter fails on NumPy 2.4 (needs triton >= 3.7)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-k",
        "cpu",
        str(Path(__file__).resolve()),
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in last and "skipped" not in last, (
        f"{' '.join(cmd)} (TRITON_INTERPRET=1):\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    )


def qk(B, H, Hkv, T, S, hd, device, seed=0, spread=2.0):
    """Random Q (B, H, T, hd) and K (B, Hkv, S, hd), strided as transformers hands them over (a transpose of
    (B, T, H, hd)); `spread` makes the attention far from uniform."""
    g = torch.Generator().manual_seed(seed)
    q = spread * torch.randn(B, T, H, hd, generator=g)
    k = torch.randn(B, S, Hkv, hd, generator=g)
    return q.to(device).transpose(1, 2), k.to(device).transpose(1, 2)


def make_mask(kind, B, T, S, pad, device):
    """`kind` of mask for queries at key positions S-T .. S-1, row b left-padded by pad[b] keys, as
    transformers builds it: sdpa_mask's bool (B, 1, T, S) (batch stride 0 without padding), or the additive
    form (0 / the dtype's min) that eager attention uses, in fp32 ("float") or bf16 ("bf16 float")."""
    if kind == "none":
        return None
    valid = torch.arange(S)[None, :] >= torch.tensor(pad)[:, None] if any(pad) else None  # (B, S)
    allowed = sdpa_mask(
        batch_size=B,
        q_length=T,
        kv_length=S,
        q_offset=S - T,
        attention_mask=valid,
        allow_is_causal_skip=False,
    )  # (B, 1, T, S)
    if kind == "bool":
        return allowed.to(device)
    dt = torch.bfloat16 if kind == "bf16 float" else torch.float32
    return torch.zeros(allowed.shape, dtype=dt).masked_fill(~allowed, torch.finfo(dt).min).to(device)


def run_both(fill, B, H, Hkv, T, S, hd, kind, pad, device, block):
    """(kernel, add_head_mean) on the rows S-T .. S-1 of a random (B, S, S) buffer, as Capture.take calls
    them: both add into the view, the rest of the buffer must stay as it was."""
    q, k = qk(B, H, Hkv, T, S, hd, device)
    mask = make_mask(kind, B, T, S, pad, device)
    big = torch.rand(B, S, S, generator=torch.Generator().manual_seed(1)).to(device)
    ref = big.clone()
    fill(big[:, S - T :, :], q, k, mask, hd**-0.5, block_m=block, block_n=block)
    add_head_mean(ref[:, S - T :, :], q, k, mask, hd**-0.5, 7)
    return big, ref


CASES = {  # B, H, Hkv, T, S, hd, mask, left padding per row, tile
    "causal, GQA 4:2": (2, 4, 2, 21, 21, 16, "none", (0, 0), 32),
    "cached prefix, tiles": (1, 4, 2, 20, 28, 16, "none", (0,), 16),
    "smollm2 GQA 9:3 hd 64, padding": (2, 9, 3, 12, 12, 64, "bool", (0, 5), 16),
    "prefix, padding, tiles, MQA": (2, 2, 1, 26, 34, 16, "bool", (0, 14), 16),
    "prefix, batch-broadcast mask": (2, 2, 1, 12, 18, 16, "bool", (0, 0), 32),
    "qwen3-4b GQA 32:8 hd 128": (1, 32, 8, 10, 10, 128, "bool", (3,), 16),
    "additive, MHA, tiles": (2, 2, 2, 18, 18, 16, "float", (3, 0), 16),
    "additive, prefix, hd 64": (2, 3, 1, 12, 17, 64, "float", (0, 9), 32),
    "additive bf16 mask": (2, 2, 1, 12, 12, 16, "bf16 float", (4, 0), 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_add_head_mean(kernel, case):
    fill, device = kernel
    B, H, Hkv, T, S, hd, kind, pad, block = CASES[case]
    got, ref = run_both(fill, B, H, Hkv, T, S, hd, kind, pad, device, block)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["none", "bool", "float"])
def test_zero_queries_hand_computed(kernel, kind):
    """q = 0: every score is 0, so each query spreads 1 evenly over its allowed keys: 1/n on
    pad .. t + S - T (n of them), 0 elsewhere; a query with no allowed key gets 1/S on every key."""
    fill, device = kernel
    B, H, Hkv, T, S, hd, pad = 2, 2, 1, 12, 20, 16, (0, 11)
    q, k = qk(B, H, Hkv, T, S, hd, device)
    buf = torch.zeros(B, T, S, device=device)
    fill(
        buf,
        torch.zeros_like(q),
        k,
        make_mask(kind, B, T, S, pad if kind != "none" else (0, 0), device),
        0.25,
        block_m=16,
        block_n=16,
    )
    want = torch.zeros(B, T, S)
    for b in range(B):
        p = pad[b] if kind != "none" else 0
        for t in range(T):
            last = t + S - T  # the query's own key position
            want[b, t, p : last + 1] = 1.0 / (last + 1 - p) if last >= p else 0.0
            if last < p:
                want[b, t, :] = 1.0 / S  # left padding: no key allowed
    if kind != "none":
        assert (want[1, 0] == 1.0 / S).all() and want[1, -1, 0] == 0  # a padding row, a padded row
    torch.testing.assert_close(buf.cpu(), want, atol=ATOL, rtol=0)


def test_minus_inf_mask_gives_uniform_rows_not_nan(kernel):
    """A fully masked query row: add_head_mean's softmax of equal -3.4e38 scores is 1/S on every key; with
    -inf it would be NaN. The kernel gives 1/S for both (departure 2)."""
    fill, device = kernel
    B, H, Hkv, T, S, hd = 1, 4, 2, 10, 10, 16
    q, k = qk(B, H, Hkv, T, S, hd, device)
    allowed = make_mask("bool", B, T, S, (4,), device)  # queries 0..3 see nothing
    add = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, -math.inf)
    got = torch.zeros(B, T, S, device=device)
    fill(got, q, k, add, 0.25)
    ref = torch.zeros(B, T, S, device=device)
    add_head_mean(ref, q, k, add.clamp_min(torch.finfo(torch.float32).min), 0.25, 4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0, :4], torch.full((4, S), 1.0 / S, device=device), atol=1e-7, rtol=0)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("hd", [16, 128])
def test_bf16_inputs(kernel, hd):
    """bf16 Q and K, as the training forward hands them over.
    (a) Against add_head_mean on the same bf16 values: both multiply bf16 exactly into fp32, so fp32's ATOL.
    (b) Against the fp32 reference of the unrounded Q, K: rounding each to bf16 (unit roundoff u = 2^-8)
        moves a score s = scaling q.k by at most D = scaling sum_d |q_d k_d| (2u + u^2), and a softmax
        whose scores each move by at most D moves every p by at most p (e^{2D} - 1); the head mean, a mean
        of such p, by at most mean (e^{2D} - 1). Checked element-wise with D the largest over all pairs."""
    fill, device = kernel
    B, H, Hkv, T, S, pad = 2, 4, 2, 12, 16, (0, 9)
    q, k = qk(B, H, Hkv, T, S, hd, device)
    mask = make_mask("bool", B, T, S, pad, device)
    q16, k16 = q.bfloat16(), k.bfloat16()
    got = torch.zeros(B, T, S, device=device)
    fill(got, q16, k16, mask, hd**-0.5)
    same = torch.zeros(B, T, S, device=device)
    add_head_mean(same, q16, k16, mask, hd**-0.5, 8)
    torch.testing.assert_close(got, same, atol=ATOL, rtol=0)  # (a)
    ref = torch.zeros(B, T, S, device=device)
    add_head_mean(ref, q, k, mask, hd**-0.5, 8)
    u = 2.0**-8
    G = H // Hkv
    qk_abs = q.abs().reshape(B, Hkv, G * T, hd) @ k.abs().mT  # (B, Hkv, G T, S) sum_d |q_d k_d|
    D = hd**-0.5 * qk_abs.max().item() * (2 * u + u * u)
    bound = ref * math.expm1(2 * D) + ATOL  # (b)
    assert D < 1.0 and ((got - ref).abs() <= bound).all(), f"D = {D:.3g}"


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_attention_graph_equals_eager(kernel, name, monkeypatch):
    """attention.attention_graph with the kernel in place of add_head_mean, on layers 0 and 1 of a tiny
    Qwen3 / Llama (GQA 4:2, head_dim 16, fp32), left and right padding, against eager attention's
    output_attentions averaged over heads and layers (padding rows and columns zeroed, as the capture)."""
    fill, device = kernel
    calls = []

    def counted(buf, query, key, attention_mask, scaling, chunk=None):
        calls.append(query.shape)
        return fill(buf, query, key, attention_mask, scaling, chunk)

    monkeypatch.setattr(flowtracer, "add_head_mean", counted)
    monkeypatch.setattr(flowtracer, "head_mean_triton", counted, raising=False)  # after the CUDA `if`
    model, tok = load_model(name, device=device, dtype=torch.float32)
    ids = torch.randint(32, 127, (3, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    mask[2, :2] = mask[2, -2:] = 0  # both
    ids, mask = ids.to(device), mask.to(device)
    got = attention_graph(model, ids, mask, "0:2")
    assert len(calls) == 2
    old = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            output_attentions=True,
        )
    model.set_attn_implementation(old)
    idx = select_layers("0:2", model.config.num_hidden_layers)
    want = torch.stack([out.attentions[i] for i in idx]).float().mean(dim=(0, 2))  # (B, T, T)
    m = mask.float()
    torch.testing.assert_close(got, want * m[:, :, None] * m[:, None, :], atol=ATOL, rtol=0)


def test_bad_shapes_are_one_clear_error(kernel):
    fill, device = kernel
    q, k = qk(1, 4, 2, 8, 8, 16, device)
    buf = torch.zeros(1, 8, 8, device=device)
    with pytest.raises(ValueError, match="buf must be"):
        fill(torch.zeros(1, 8, 9, device=device), q, k, None, 0.25)
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        fill(buf, q[:, :3], k, None, 0.25)
    with pytest.raises(ValueError, match="attention_mask must be"):
        fill(buf, q, k, torch.ones(1, 4, 8, 8, dtype=torch.bool, device=device), 0.25)
