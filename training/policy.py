"""The policy as one device trains it: the device, the weights' dtype, the optimizer, autocast, loading.

run.setup and memtrace.measure both build the policy here (load_policy), so the step memtrace.py measures
is grpo.py's. The log-probs of the update are training/logprobs.py's; the optimizer step is grpo.py's.

Departures (numbered; grpo.py's departure 3 in full):
 1. On CUDA (--optimizer auto = kahan) the weights, gradients and AdamW's m and v are bf16, with a bf16 Kahan
    compensation of each weight (torch-optimi's AdamW, kahan_sum=True): 10 bytes a parameter instead of fp32
    AdamW's 16 plus autocast's bf16 copies, so Qwen3-4B's 1K step fits one 80 GB GPU. p + c, the weight plus
    its compensation, is the weight the optimizer tracks (master_weights): at lr 1e-6 a plain bf16 AdamW
    rounds every update away, the Kahan sum keeps it. The accounting, the alternatives tried and how close
    the updates stay to fp32 AdamW's: docs/method.md, "The optimizer on one GPU". The CPU: fp32 AdamW.
 2. optimi's step is chosen here, not left to optimi (optimi_kernel, one printed line): its Triton step
    needs a C compiler for Triton's launcher (gpu_kernels/availability.py), and runtime images often have
    none; CUDA then runs its foreach step, the same arithmetic.
 3. On CUDA the caching allocator gets expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
    unless the variable is set): a KV cache grown step by step leaves no trail of freed blocks.

Run: python eval.py memory --model qwen3-4b-random        # the accounting this scheme was chosen by
"""
import os
import warnings

import torch

import flowtracer
from flowtracer import select_layers
from gpu_kernels.availability import c_compiler
from training.logprobs import checkpointing
from training.models import load_model


def device_of(name="auto") -> torch.device:
    """--device auto | cpu | cuda as a torch.device; on CUDA, before CUDA starts, expandable segments."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_initialized():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return device


def scheme(cfg, device) -> str:
    """'kahan' (bf16 weights, bf16 AdamW states + Kahan compensation, torch-optimi) or 'adamw' (fp32 weights,
    fp32 torch AdamW). --optimizer auto: kahan on CUDA, adamw on the CPU (the embedded path stays fp32)."""
    name = getattr(cfg, "optimizer", "auto")
    if name not in ("auto", "kahan", "adamw"):
        raise ValueError(f"--optimizer must be auto, kahan or adamw, got {name!r}")
    return ("kahan" if torch.device(device).type == "cuda" else "adamw") if name == "auto" else name


def weight_dtype(cfg, device) -> torch.dtype:
    """The dtype the policy is loaded in: bf16 under the kahan scheme, fp32 under adamw."""
    return torch.bfloat16 if scheme(cfg, device) == "kahan" else torch.float32


def optimi_kernel(device) -> str:
    """Which torch-optimi step runs (see the docstring): 'triton' on CUDA with Triton and a C compiler,
    'foreach' on CUDA without either, 'for-loop' on the CPU."""
    if torch.device(device).type != "cuda":
        return "for-loop"
    from optimi.utils import HAS_TRITON
    return "triton" if HAS_TRITON and c_compiler() else "foreach"


def make_optimizer(model, cfg, device) -> torch.optim.Optimizer:
    """AdamW (torch defaults: betas 0.9/0.999, eps 1e-8) for the scheme; see the docstring for the choice."""
    if scheme(cfg, device) == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    import optimi  # torch-optimi: pure PyTorch (for-loop / foreach / Triton), imported only when chosen
    bad = {p.dtype for p in model.parameters()} - {torch.bfloat16}
    if bad:
        raise ValueError(f"--optimizer kahan needs a bf16 model (policy.weight_dtype), got {bad}")
    kernel = optimi_kernel(next(model.parameters()).device)     # where the weights are: CPU weights, for-loop
    why = " (no Triton, or no C compiler for its launcher: $CC, gcc, clang)" if kernel == "foreach" else ""
    print(f"optimizer: torch-optimi AdamW with Kahan summation, its {kernel} step{why}")
    with warnings.catch_warnings():     # optimi calls foreach deprecated in favour of Triton: chosen here
        warnings.simplefilter("ignore", DeprecationWarning)
        return optimi.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=cfg.weight_decay, kahan_sum=True, triton=kernel == "triton",
                            foreach=kernel == "foreach")


def master_weights(model, opt) -> dict:
    """{name: fp32 tensor}: the weights the optimizer holds, p + its Kahan compensation where it has one."""
    out = {}
    for n, p in model.named_parameters():
        comp = opt.state.get(p, {}).get("kahan_comp")
        out[n] = p.detach().float().clone() + (comp.float() if comp is not None else 0)
    return out


def autocast(device):
    """The run's autocast: bf16 on CUDA (a no-op for bf16 weights), off on the CPU."""
    return torch.autocast("cuda", torch.bfloat16, enabled=torch.device(device).type == "cuda")


def load_policy(cfg, device, path=None):
    """(model, tokenizer, reference model or None, optimizer): the policy from `path` (a checkpoint) or
    cfg.model in the scheme's dtype, under the attention "sdpa_capture" (sdpa, plus the head-mean maps when a
    forward is given a flowtracer.Capture); a --layers it lacks an error here; the frozen reference when
    beta > 0; gradient checkpointing as --grad-checkpointing says (training/logprobs.py's checkpointing)."""
    dtype = weight_dtype(cfg, device)
    model, tok = load_model(path or cfg.model, device=device, dtype=dtype,
                            attn_implementation=flowtracer.IMPL)          # sdpa, + the maps when asked
    select_layers(cfg.layers, model.config.num_hidden_layers)     # a --layers this model lacks fails here
    ref = load_model(cfg.model, device=device, dtype=dtype)[0].eval() if cfg.beta > 0 else None
    if cfg.grad_checkpointing:
        checkpointing(model)                                      # logprobs.py: the one switch
    return model, tok, ref, make_optimizer(model, cfg, device)
