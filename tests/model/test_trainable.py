"""training/model/trainable.py: the optimizer for the weights. torch-optimi's step chosen at setup
(policy.optimi_kernel): Triton only with a C compiler for its launcher, and only for CUDA weights (CPU weights
under the CUDA scheme take the for-loop); the Kahan scheme against fp32 AdamW and the scheme's defaults; the
CUDA allocator setting made before CUDA starts. --precision: tests/model/test_precision.py."""

import copy
import os
from types import SimpleNamespace

import pytest
import torch

import grpo
from gpu_kernels import availability
from training import policy
from training.model import trainable
from training.model.load import load_model


# ----------------------------------------------------------------------------- the optimizer's kernel
@pytest.mark.parametrize(
    "device, triton, compilers, want",
    [
        ("cuda", True, {"gcc": "/usr/bin/gcc"}, "triton"),
        ("cuda", True, {"clang": "/usr/bin/clang"}, "triton"),
        ("cuda", True, {}, "foreach"),
        ("cuda", False, {"gcc": "/usr/bin/gcc"}, "foreach"),
        ("cpu", True, {"gcc": "/usr/bin/gcc"}, "for-loop"),
    ],
)
def test_the_optimizer_step_is_chosen_at_setup(monkeypatch, device, triton, compilers, want):
    """Triton only where its launcher can be built (a C compiler, as Triton looks for one), else foreach."""
    import optimi.utils

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(availability.shutil, "which", compilers.get)
    monkeypatch.setattr(availability, "libcuda_dirs", lambda: ["/usr/lib/x86_64-linux-gnu"])  # as on a GPU
    monkeypatch.setattr(optimi.utils, "HAS_TRITON", triton)
    assert policy.optimi_kernel(device) == want


def test_cpu_weights_take_the_for_loop_step_under_the_cuda_scheme(monkeypatch, capsys):
    """make_optimizer chooses optimi's step by where the weights are, not by the device asked for: bf16 CPU
    weights under the scheme grpo.py uses on CUDA, on a machine with Triton and a C compiler, take the
    for-loop step (asked for "cuda", it chose Triton, whose kernel cannot read CPU tensors: "Pointer argument
    (at 0) cannot be accessed from Triton (cpu tensor?)", tests/memory/test_phases.py on the H100)."""
    import optimi.utils

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(availability.shutil, "which", {"gcc": "/usr/bin/gcc"}.get)
    monkeypatch.setattr(availability, "libcuda_dirs", lambda: ["/usr/lib/x86_64-linux-gnu"])  # as on a GPU
    monkeypatch.setattr(optimi.utils, "HAS_TRITON", True)
    assert policy.optimi_kernel("cuda") == "triton"  # what "cuda" alone would choose
    model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    opt = trainable.make_optimizer(
        model, SimpleNamespace(optimizer="kahan", lr=1e-3, weight_decay=0.0), "cuda"
    )
    assert "its for-loop step" in capsys.readouterr().out
    assert (opt.param_groups[0]["triton"], opt.param_groups[0]["foreach"]) == (False, False)
    before = policy.master_weights(model, opt)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-2)
    opt.step()  # runs, on the CPU
    after = policy.master_weights(model, opt)  # p + its Kahan compensation
    assert all(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("kernel", ["foreach", "for-loop"])
def test_make_optimizer_runs_the_chosen_step(monkeypatch, capsys, kernel):
    """The choice reaches optimi (one printed line), and its foreach step equals the for-loop on the CPU."""
    monkeypatch.setattr(policy, "optimi_kernel", lambda device: kernel)
    cfg = grpo.Config(model="tiny-qwen3", optimizer="kahan", lr=1e-3)
    model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    opt = trainable.make_optimizer(model, cfg, "cpu")
    assert f"its {kernel} step" in capsys.readouterr().out
    g = opt.param_groups[0]
    assert (g["foreach"], g["triton"]) == (kernel == "foreach", False)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 1e-2
    opt.step()
    monkeypatch.setattr(policy, "optimi_kernel", lambda device: "for-loop")
    ref_model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16)
    ref = trainable.make_optimizer(ref_model, cfg, "cpu")
    for p in ref_model.parameters():
        p.grad = torch.ones_like(p) * 1e-2
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


# ----------------------------------------------------------------------------- the Kahan scheme
def cumulative_updates(steps=20, lr=1e-6, device="cpu"):
    """{scheme: relative norm of (its cumulative update - fp32 AdamW's)} on tiny-qwen3, same gradients. The
    kahan optimizer is what grpo.py builds for weights on `device` (on CUDA optimi's Triton or foreach step,
    on the CPU its for-loop: trainable.make_optimizer chooses by where the weights are)."""
    ref, _ = load_model("tiny-qwen3", device=device, dtype=torch.float32)
    cfg = SimpleNamespace(optimizer="kahan", lr=lr, weight_decay=0.0)
    runs = {"fp32": (ref, torch.optim.AdamW(ref.parameters(), lr=lr))}
    m = copy.deepcopy(ref).to(torch.bfloat16)
    runs["kahan"] = (m, trainable.make_optimizer(m, cfg, "cuda"))  # the CUDA scheme, the weights' step
    m = copy.deepcopy(ref).to(torch.bfloat16)
    runs["bf16"] = (m, torch.optim.AdamW(m.parameters(), lr=lr))  # naive bf16 weights
    w0 = {k: policy.master_weights(m, opt) for k, (m, opt) in runs.items()}
    for k in range(steps):
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(k)).to(ref.device)
        ref.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        for m, opt in runs.values():
            for p, g in zip(m.parameters(), grads):
                p.grad = g.to(p.dtype)
            opt.step()
    d = {
        k: {n: w - w0[k][n] for n, w in policy.master_weights(m, opt).items()} for k, (m, opt) in runs.items()
    }
    norm = lambda x: sum((v**2).sum() for v in x.values()).sqrt()  # noqa: E731
    return {k: float(norm({n: d[k][n] - d["fp32"][n] for n in d[k]}) / norm(d["fp32"])) for k in d}


def test_kahan_keeps_lr_1e6_updates_and_plain_bf16_loses_them(device):
    rel = cumulative_updates(device=device)
    assert rel["kahan"] < 0.05  # the bar: within 5%
    assert rel["bf16"] > 0.5  # rounding drops the update


def test_scheme_defaults_and_errors():
    cfg = SimpleNamespace(optimizer="auto", lr=1e-6, weight_decay=0.0)
    assert trainable.scheme(cfg, "cuda") == "kahan" and trainable.scheme(cfg, "cpu") == "adamw"
    assert trainable.weight_dtype(cfg, "cpu") == torch.float32  # the CPU path stays fp32
    model, _ = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16"):
        trainable.make_optimizer(model, SimpleNamespace(optimizer="kahan", lr=1e-6, weight_decay=0.0), "cpu")
    with pytest.raises(ValueError, match="--optimizer"):
        trainable.scheme(SimpleNamespace(optimizer="sgd"), "cpu")


# ----------------------------------------------------------------------------- the CUDA allocator
def test_expandable_segments_on_cuda_before_it_starts(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert trainable.device_of("cpu").type == "cpu"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert trainable.device_of("cuda").type == "cuda"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's setting wins
    trainable.device_of("cuda")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
