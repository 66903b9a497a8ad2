"""The policy as setup loads it: the device, the weights' dtype, the optimizer for that dtype.

    policy = load_policy(cfg, device, path)    # run.setup, memtrace.measure, benchmarks: a policy.Policy

run.setup and memtrace.measure both build the policy here, so the step memtrace.py measures is grpo.py's.
What the step does with it (log-probs, backward, the optimizer step, the schedule) is training/policy.py's.

Departures (numbered; grpo.py's departure 3 in full):
 1. On CUDA (--optimizer auto = kahan) the weights, gradients and AdamW's m and v are bf16, with a bf16 Kahan
    compensation of each weight (torch-optimi's AdamW, kahan_sum=True): 10 bytes a parameter instead of fp32
    AdamW's 16 plus autocast's bf16 copies, so Qwen3-4B's 1K step fits one 80 GB GPU. p + c, the weight plus
    its compensation, is the weight the optimizer tracks (policy.master_weights): at lr 1e-6 a plain bf16
    AdamW rounds every update away, the Kahan sum keeps it. The accounting, the alternatives tried and how
    close the updates stay to fp32 AdamW's: docs/method.md, "The optimizer on one GPU". The CPU: fp32 AdamW.
 2. optimi's step is chosen here, not left to optimi (policy.optimi_kernel, one printed line): its Triton step
    needs a C compiler for Triton's launcher (gpu_kernels/availability.py), and runtime images often have
    none; CUDA then runs its foreach step, the same arithmetic.
 3. On CUDA the caching allocator gets expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
    unless the variable is set): a KV cache grown step by step leaves no trail of freed blocks.
 4. --precision (precision(), said in one line with its reason). auto: bf16 where the card has bf16 tensor
    cores (compute capability >= 8.0, NVIDIA Ampere on); below it (a T4 is 7.5, a V100 7.0) bf16 matmuls
    are emulated and SDPA's fused kernels refuse bf16 (torch's sdp_utils: flash needs 8.0, the memory-
    efficient kernel takes fp16 and fp32 below it), so a LoRA run takes fp16 and full fine-tuning fp32
    AdamW (fp16 full fine-tuning is not offered: its weights and AdamW states would round away lr 1e-6).
    On the CPU: fp32 (bf16 under --optimizer kahan). fp16 (LoRA only): the frozen base in fp16, the adapters
    and their AdamW states fp32, fp16 autocast, and torch.amp.GradScaler (ScaledAdamW: its defaults, scale
    2^16 halved at an overflow, doubled after 2,000 clean steps, as accelerate's and HF Trainer's): the loss
    is scaled before backward, the gradients unscaled before clipping, and a step whose scaled gradients
    overflowed is skipped while the scale halves; that is the scaler's working, not a non-finite step
    (Policy.step). Its state is part of the optimizer's state_dict: a checkpoint holds it, --resume
    continues it exactly.

Run: python eval.py memory --model qwen3-4b-random        # the accounting this scheme was chosen by
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24
"""

import os
import warnings
from typing import NamedTuple

import torch

from flowtracer import select_layers
from gpu_kernels.availability import unavailable
from training import policy
from training.model import quantize
from training.model.load import load_model
from training.model.lora import with_lora
from training.policy import Policy, ScaledAdamW


def device_of(name="auto") -> torch.device:
    """--device auto | cpu | cuda as a torch.device; on CUDA, before CUDA starts, expandable segments."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_initialized():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return device


AMPERE = (8, 0)  # bf16 tensor cores from compute capability 8.0 (NVIDIA Ampere: A100, RTX 30xx; later)
PRECISIONS = ("auto", "bf16", "fp16", "fp32")  # --precision (departure 4)
OPTIMIZERS = ("auto", "kahan", "adamw")  # --optimizer (departure 1)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Precision(NamedTuple):
    """What --precision and --optimizer resolve to on a device and card (precision(); departures 1, 4, 5)."""

    name: str  # bf16 | fp16 | fp32: the dtype the forward computes in
    weights: torch.dtype  # the policy's dtype as loaded (LoRA: the frozen base's; adapters fp32)
    autocast: torch.dtype | None  # autocast's dtype; None: off
    scheme: str  # kahan | adamw | lora: the weights and the optimizer (scheme())
    math_sdpa: bool  # SDPA's fused kernels refuse this dtype on this card: its math kernel
    line: str  # the one line that says it, with the reason


def capability(device):
    """The CUDA card's compute capability (major, minor): (7, 5) a T4, (8, 0) an A100, (9, 0) an H100; None on
    the CPU. A "cuda" device where no GPU is visible (eval.py memory's estimate for a card) reads as
    AMPERE, the 80 GB card the estimate budgets unless told (--capability)."""
    if torch.device(device).type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device)) if torch.cuda.is_available() else AMPERE


def precision_problem(cfg):
    """The flags --precision and --optimizer cannot take together, as one sentence naming them, or None
    (flags.check says it before anything loads; precision() raises it)."""
    want, opt, lora = (
        getattr(cfg, "precision", "auto"),
        getattr(cfg, "optimizer", "auto"),
        getattr(cfg, "lora_rank", 0) > 0,
    )
    if want not in PRECISIONS or opt not in OPTIMIZERS:
        return (
            f"--precision must be one of {PRECISIONS} and --optimizer one of {OPTIMIZERS}, got "
            f"{want!r}, {opt!r}"
        )
    if want == "fp16" and not lora:
        return (
            "--precision fp16 needs --lora-rank: full fine-tuning in fp16 is not a supported recipe "
            "(its weights round away small updates); --precision fp32 runs fp32 AdamW"
        )
    if opt == "kahan" and lora:
        return (
            "--optimizer kahan is for full fine-tuning's bf16 weights; a --lora-rank run trains fp32 "
            "adapters with torch's AdamW: leave out --optimizer"
        )
    if opt == "kahan" and want in ("fp16", "fp32"):
        return f"--optimizer kahan keeps bf16 weights: it cannot run under --precision {want}"
    four = getattr(cfg, "load_in_4bit", False)
    return quantize.four_bit_problem(cfg) if four else None  # --load-in-4bit without --lora-rank


def precision(cfg, device, cap=None) -> Precision:
    """--precision (departure 4) and --optimizer on `device`, a card of compute capability `cap` (None: the
    device's own, capability()). ValueError for flags that cannot go together (precision_problem)."""
    problem = precision_problem(cfg)
    if problem:
        raise ValueError(problem)
    want, opt, lora = (
        getattr(cfg, "precision", "auto"),
        getattr(cfg, "optimizer", "auto"),
        getattr(cfg, "lora_rank", 0) > 0,
    )
    cuda = torch.device(device).type == "cuda"
    cap = tuple(cap or capability(device)) if cuda else None
    card = f"compute capability {cap[0]}.{cap[1]}" if cuda else "the CPU"
    old = cuda and cap < AMPERE  # no bf16 tensor cores
    if want != "auto":
        name, why = want, "--precision " + want
    elif opt == "kahan":
        name, why = "bf16", "auto: --optimizer kahan keeps bf16 weights"
    elif not cuda:
        name, why = "fp32", "auto: the CPU"
    elif not old:
        name, why = "bf16", f"auto: {card} has bf16 tensor cores"
    else:
        name, why = (
            ("fp16", f"auto: {card} has no bf16 tensor cores; LoRA takes fp16")
            if lora
            else (
                "fp32",
                f"auto: {card} has no bf16 tensor cores; full fine-tuning takes fp32 AdamW, not fp16",
            )
        )
    kind = "lora" if lora else opt if opt != "auto" else "kahan" if name == "bf16" else "adamw"
    weights = torch.bfloat16 if kind == "kahan" else DTYPES[name] if kind == "lora" else torch.float32
    autocast = DTYPES[name] if name != "fp32" and (cuda or kind != "kahan") else None  # CPU kahan: as is
    math = old and name == "bf16"
    four = f"{cfg.bnb_4bit_quant_type} 4-bit linears + {name} " if getattr(cfg, "load_in_4bit", False) else ""
    what = {
        "kahan": "bf16 weights, gradients and AdamW states + Kahan compensation (torch-optimi)",
        "adamw": "fp32 weights and AdamW",
        "lora": f"{four or name + ' '}frozen base, fp32 adapters and AdamW",
    }[kind]
    what += (f", {name} autocast" if autocast else "") + (", a GradScaler" if name == "fp16" else "")
    slow = f"; {card}: bf16 matmuls emulated, attention on SDPA's math kernel (slow)" if math else ""
    return Precision(name, weights, autocast, kind, math, f"precision: {name} ({why}): {what}{slow}")


# Bytes per trained parameter a checkpoint holds, by scheme (below): the weights (bf16 | fp32 | fp32 LoRA
# adapters: peft's files, the frozen base is not saved) and the optimizer's state (AdamW's m and v, bf16 + a
# bf16 Kahan compensation | fp32 | fp32); the tokenizer and scalars are small.
WEIGHT_BYTES, STATE_BYTES = {"kahan": 2, "adamw": 4, "lora": 4}, {"kahan": 6, "adamw": 8, "lora": 8}


def scheme(cfg, device, cap=None) -> str:
    """'kahan' (bf16 weights, bf16 AdamW states + Kahan compensation, torch-optimi) or 'adamw' (fp32 weights,
    fp32 torch AdamW). --optimizer auto: kahan under bf16 (CUDA from compute capability 8.0), adamw under
    fp32 (the CPU, a card without bf16 tensor cores). 'lora' whenever --lora-rank > 0 (departure 4): frozen
    base weights, fp32 adapters and fp32 AdamW."""
    return precision(cfg, device, cap).scheme


def weight_dtype(cfg, device) -> torch.dtype:
    """The dtype the policy is loaded in: bf16 under the kahan scheme, fp32 under adamw; under lora the
    frozen base's, the precision's (bf16 on CUDA, fp32 on the CPU; fp16), the adapters fp32 either way."""
    return precision(cfg, device).weights


def make_optimizer(model, cfg, device) -> torch.optim.Optimizer:
    """AdamW (torch defaults: betas 0.9/0.999, eps 1e-8) for the scheme; see the docstring for the choice.
    Only the trainable parameters enter it (under lora the adapters; otherwise every weight)."""
    prec = precision(cfg, device)
    if prec.scheme in ("adamw", "lora"):
        params = [p for p in model.parameters() if p.requires_grad]
        if prec.name == "fp16":  # departure 4: with its GradScaler
            return ScaledAdamW(params, device, lr=cfg.lr, weight_decay=cfg.weight_decay)
        cpu = torch.device(device).type == "cpu"  # the CPU: torch's fused step (its default there loops over
        return torch.optim.AdamW(
            params,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,  # the tensors, 3x slower
            fused=True if cpu else None,
        )  # at SmolLM2's size)
    import optimi  # torch-optimi: pure PyTorch (for-loop / foreach / Triton), imported only when chosen

    bad = {p.dtype for p in model.parameters()} - {torch.bfloat16}
    if bad:
        raise ValueError(f"--optimizer kahan needs a bf16 model (trainable.weight_dtype), got {bad}")
    kernel = policy.optimi_kernel(next(model.parameters()).device)  # where the weights are: CPU, for-loop
    why = f" ({unavailable(device) or 'no Triton'})" if kernel == "foreach" else ""
    print(f"optimizer: torch-optimi AdamW with Kahan summation, its {kernel} step{why}")
    with warnings.catch_warnings():  # optimi calls foreach deprecated in favour of Triton: chosen here
        warnings.simplefilter("ignore", DeprecationWarning)
        return optimi.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=cfg.weight_decay,
            kahan_sum=True,
            triton=kernel == "triton",
            foreach=kernel == "foreach",
        )


def autocast(cfg, device):
    """The run's autocast (departure 4): the precision's bf16 or fp16 on CUDA; on the CPU fp16, or bf16 over
    fp32 weights (the kahan scheme's bf16 weights run as they are there); off under fp32."""
    dtype = precision(cfg, device).autocast
    return torch.autocast(torch.device(device).type, dtype or torch.float32, enabled=dtype is not None)


def load_policy(cfg, device, path=None) -> Policy:
    """The policy.Policy of a run: the model from `path` (a checkpoint) or cfg.model in the scheme's dtype,
    under the attention "sdpa_capture" (sdpa, plus the head-mean maps when a forward is given a
    flowtracer.Capture; a model without SDPA: "eager_capture", its own eager attention: load_model); a
    --layers it lacks an error here; gradient checkpointing as --grad-checkpointing says
    (policy.checkpointing); its tokenizer; the reference of beta > 0 (a frozen copy, or under LoRA the
    model itself with its adapters off); the optimizer (make_optimizer) and the warmup schedule (linear over
    --warmup-steps, then constant); the autocast. Under LoRA (training/model/lora.py) the base comes from
    cfg.model and the adapters from `path`, or new ones (with_lora); --load-in-4bit: the base's linears in 4
    bits (training/model/quantize.py), computing in the precision's dtype."""
    prec, lora = precision(cfg, device), getattr(cfg, "lora_rank", 0) > 0
    print(prec.line)  # departure 4: what runs, and why
    four = getattr(cfg, "load_in_4bit", False)  # a BitsAndBytesConfig, computing in the precision's dtype
    dtype, bnb = prec.weights, quantize.four_bit(cfg, DTYPES[prec.name]) if four else None
    model, tok = load_model(
        cfg.model if lora else path or cfg.model, device=device, dtype=dtype, quantization=bnb
    )  # sdpa (or the model's eager attention), + the maps when asked
    if bnb is not None:
        print(quantize.base_line(model, bnb))  # the base is 4-bit: its bytes
    select_layers(cfg.layers, model.config.num_hidden_layers)  # a --layers this model lacks fails here
    if cfg.grad_checkpointing:
        policy.checkpointing(model)  # policy.py: the one switch
    if lora:
        model = with_lora(model, cfg, path)
    ref = (
        None
        if cfg.beta == 0
        else model
        if lora
        else load_model(cfg.model, device=device, dtype=dtype)[0].eval()
    )  # LoRA: the adapters off
    opt = make_optimizer(model, cfg, device)
    warmup = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    return Policy(model, tok, ref, opt, sched, autocast(cfg, device), torch.device(device))
