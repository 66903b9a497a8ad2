"""The policy as one device trains it: the device, the weights' dtype, the optimizer, autocast, loading.

run.setup and memtrace.measure both build the policy here (load_policy), so the step memtrace.py measures
is grpo.py's. The log-probs of the update are training/logprobs.py's; grpo.update calls optimizer_step.

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

 4. LoRA (--lora-rank R > 0; grpo.py's departure 9): the base weights are frozen in bf16 on CUDA (fp32 on
    the CPU; fp16 under --precision fp16), peft's adapters and their plain torch AdamW states are fp32
    (scheme "lora": the Kahan sum is for bf16 weights, and the adapters are not bf16). The reference of
    --beta > 0 is the same weights with the adapters off (Reference): no second model. A checkpoint holds
    peft's adapter files; the base is loaded again from the run's --model.
 5. --precision (precision(), said in one line with its reason). auto: bf16 where the card has bf16 tensor
    cores (compute capability >= 8.0, NVIDIA Ampere on); below it (a T4 is 7.5, a V100 7.0) bf16 matmuls
    are emulated and SDPA's fused kernels refuse bf16 (torch's sdp_utils: flash needs 8.0, the memory-
    efficient kernel takes fp16 and fp32 below it), so a LoRA run takes fp16 and full fine-tuning fp32
    AdamW (fp16 full fine-tuning is not offered: its weights and AdamW states would round away lr 1e-6).
    On the CPU: fp32 (bf16 under --optimizer kahan). fp16 (LoRA only): the frozen base in fp16, the adapters
    and their AdamW states fp32, fp16 autocast, and torch.amp.GradScaler (ScaledAdamW: its defaults, scale
    2^16 halved at an overflow, doubled after 2,000 clean steps, as accelerate's and HF Trainer's): the loss
    is scaled before backward, the gradients unscaled before clipping, and a step whose scaled gradients
    overflowed is skipped while the scale halves; that is the scaler's working, not a non-finite step
    (optimizer_step). Its state is part of the optimizer's state_dict: a checkpoint holds it, --resume
    continues it exactly.

Run: python eval.py memory --model qwen3-4b-random        # the accounting this scheme was chosen by
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24
"""
import math
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

import flowtracer
from flowtracer import select_layers
from gpu_kernels.availability import unavailable
from training.logprobs import checkpointing
from training.models import load_model


@dataclass
class AdapterConfig:
    """grpo.Config's LoRA flags (departure 4 below; grpo.py's departure 9)."""
    # LoRA (peft; departure 4 of training/policy.py)
    lora_rank: int = 0                 # LoRA adapters of this rank (departure 9); 0: full fine-tuning (paper)
    lora_alpha: float = 32.0           # LoRA's scale is alpha / rank ("LoRA Without Regret": 32 at any rank)
    lora_targets: str = "all-linear"   # modules given adapters, comma-separated; all-linear: attention + MLP
    lora_dropout: float = 0.0          # dropout on the adapters' input ("LoRA Without Regret": none)


def device_of(name="auto") -> torch.device:
    """--device auto | cpu | cuda as a torch.device; on CUDA, before CUDA starts, expandable segments."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_initialized():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return device


AMPERE = (8, 0)     # bf16 tensor cores from compute capability 8.0 (NVIDIA Ampere: A100, RTX 30xx; later)
PRECISIONS = ("auto", "bf16", "fp16", "fp32")                       # --precision (departure 5)
OPTIMIZERS = ("auto", "kahan", "adamw")                              # --optimizer (departure 1)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Precision(NamedTuple):
    """What --precision and --optimizer resolve to on a device and card (precision(); departures 1, 4, 5)."""
    name: str                       # bf16 | fp16 | fp32: the dtype the forward computes in
    weights: torch.dtype            # the policy's dtype as loaded (LoRA: the frozen base's; adapters fp32)
    autocast: torch.dtype | None    # autocast's dtype; None: off
    scheme: str                     # kahan | adamw | lora: the weights and the optimizer (scheme())
    math_sdpa: bool                 # SDPA's fused kernels refuse this dtype on this card: its math kernel
    line: str                       # the one line that says it, with the reason


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
    want, opt, lora = getattr(cfg, "precision", "auto"), getattr(cfg, "optimizer", "auto"), \
        getattr(cfg, "lora_rank", 0) > 0
    if want not in PRECISIONS or opt not in OPTIMIZERS:
        return f"--precision must be one of {PRECISIONS} and --optimizer one of {OPTIMIZERS}, got " \
               f"{want!r}, {opt!r}"
    if want == "fp16" and not lora:
        return ("--precision fp16 needs --lora-rank: full fine-tuning in fp16 is not a supported recipe "
                "(its weights round away small updates); --precision fp32 runs fp32 AdamW")
    if opt == "kahan" and lora:
        return ("--optimizer kahan is for full fine-tuning's bf16 weights; a --lora-rank run trains fp32 "
                "adapters with torch's AdamW: leave out --optimizer")
    if opt == "kahan" and want in ("fp16", "fp32"):
        return f"--optimizer kahan keeps bf16 weights: it cannot run under --precision {want}"
    return None


def precision(cfg, device, cap=None) -> Precision:
    """--precision (departure 5) and --optimizer on `device`, a card of compute capability `cap` (None: the
    device's own, capability()). ValueError for flags that cannot go together (precision_problem)."""
    problem = precision_problem(cfg)
    if problem:
        raise ValueError(problem)
    want, opt, lora = getattr(cfg, "precision", "auto"), getattr(cfg, "optimizer", "auto"), \
        getattr(cfg, "lora_rank", 0) > 0
    cuda = torch.device(device).type == "cuda"
    cap = tuple(cap or capability(device)) if cuda else None
    card = f"compute capability {cap[0]}.{cap[1]}" if cuda else "the CPU"
    old = cuda and cap < AMPERE                                     # no bf16 tensor cores
    if want != "auto":
        name, why = want, "--precision " + want
    elif opt == "kahan":
        name, why = "bf16", "auto: --optimizer kahan keeps bf16 weights"
    elif not cuda:
        name, why = "fp32", "auto: the CPU"
    elif not old:
        name, why = "bf16", f"auto: {card} has bf16 tensor cores"
    else:
        name, why = ("fp16", f"auto: {card} has no bf16 tensor cores; LoRA takes fp16") if lora else \
            ("fp32", f"auto: {card} has no bf16 tensor cores; full fine-tuning takes fp32 AdamW, not fp16")
    kind = "lora" if lora else opt if opt != "auto" else "kahan" if name == "bf16" else "adamw"
    weights = torch.bfloat16 if kind == "kahan" else DTYPES[name] if kind == "lora" else torch.float32
    autocast = DTYPES[name] if name != "fp32" and (cuda or kind != "kahan") else None   # CPU kahan: as is
    math = old and name == "bf16"
    what = {"kahan": "bf16 weights, gradients and AdamW states + Kahan compensation (torch-optimi)",
            "adamw": "fp32 weights and AdamW", "lora": f"{name} frozen base, fp32 adapters and AdamW"}[kind]
    what += (f", {name} autocast" if autocast else "") + (", a GradScaler" if name == "fp16" else "")
    slow = f"; {card}: bf16 matmuls emulated, attention on SDPA's math kernel (slow)" if math else ""
    return Precision(name, weights, autocast, kind, math, f"precision: {name} ({why}): {what}{slow}")


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


def optimi_kernel(device) -> str:
    """Which torch-optimi step runs (see the docstring): 'triton' on CUDA with Triton and a C compiler,
    'foreach' on CUDA without either, 'for-loop' on the CPU."""
    if torch.device(device).type != "cuda":
        return "for-loop"
    from optimi.utils import HAS_TRITON
    return "triton" if HAS_TRITON and unavailable(device) is None else "foreach"


def make_optimizer(model, cfg, device) -> torch.optim.Optimizer:
    """AdamW (torch defaults: betas 0.9/0.999, eps 1e-8) for the scheme; see the docstring for the choice.
    Only the trainable parameters enter it (under lora the adapters; otherwise every weight)."""
    prec = precision(cfg, device)
    if prec.scheme in ("adamw", "lora"):
        params = [p for p in model.parameters() if p.requires_grad]
        if prec.name == "fp16":                                   # departure 5: with its GradScaler
            return ScaledAdamW(params, device, lr=cfg.lr, weight_decay=cfg.weight_decay)
        cpu = torch.device(device).type == "cpu"    # the CPU: torch's fused step (its default there loops over
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,   # the tensors, 3x slower
                                 fused=True if cpu else None)                        # at SmolLM2's size)
    import optimi  # torch-optimi: pure PyTorch (for-loop / foreach / Triton), imported only when chosen
    bad = {p.dtype for p in model.parameters()} - {torch.bfloat16}
    if bad:
        raise ValueError(f"--optimizer kahan needs a bf16 model (policy.weight_dtype), got {bad}")
    kernel = optimi_kernel(next(model.parameters()).device)     # where the weights are: CPU weights, for-loop
    why = f" ({unavailable(device) or 'no Triton'})" if kernel == "foreach" else ""
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


class ScaledAdamW(torch.optim.AdamW):
    """torch's AdamW with the torch.amp.GradScaler of an fp16 run (departure 5), whose state travels in
    state_dict: a checkpoint holds it and --resume continues it. scaled() and optimizer_step() use it."""
    def __init__(self, params, device, **kw):
        super().__init__(params, **kw)
        self.scaler = torch.amp.GradScaler(torch.device(device).type)          # torch's defaults
        self.scaler.scale(torch.zeros((), device=device))    # its scale made now: a step with no backward

    def state_dict(self):
        return {**super().state_dict(), "grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        scaler = state_dict.pop("grad_scaler", None)
        super().load_state_dict(state_dict)
        if scaler is None:
            print("resume: the checkpoint holds no GradScaler state (saved under another --precision): the "
                  "fp16 loss scale starts afresh at 2^16")
        else:
            self.scaler.load_state_dict(scaler)


def scaled(opt, loss):
    """The loss that backward runs on: times the GradScaler's scale under fp16 (ScaledAdamW), else itself."""
    return opt.scaler.scale(loss) if isinstance(opt, ScaledAdamW) else loss


class Stepped(NamedTuple):
    """What optimizer_step did (grpo.update's record of it)."""
    grad_norm: float            # the gradient's global norm before clipping (unscaled under fp16)
    stepped: bool               # the optimizer stepped
    skipped: bool               # fp16: the scaled gradient overflowed and the GradScaler skipped the step,
                                # its scale halved (the loss was finite): the scaler's working, not a bad step
    scale: float | None         # the GradScaler's scale after the step; None: no scaler


def optimizer_step(opt, params, max_grad_norm, loss) -> Stepped:
    """Clip the gradients of `params` to max_grad_norm, then one step of `opt`; a non-finite loss or
    gradient: no step. A parameter without a gradient gets zeros (AdamW still steps on a zero gradient, as
    GRPO would). Under fp16 (ScaledAdamW) the gradients are unscaled first and the GradScaler steps, or skips
    a step whose scaled gradients overflowed (departure 5). The gradients are freed either way: none is kept
    through the next rollout."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    scaler = opt.scaler if isinstance(opt, ScaledAdamW) else None
    if scaler is not None:
        scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    finite = math.isfinite(loss)
    if scaler is None:
        stepped, skipped = finite and math.isfinite(norm), False
        if stepped:
            opt.step()
    else:
        before = scaler.get_scale()
        if finite:
            scaler.step(opt)                      # skipped by the scaler when the gradient overflowed
        scaler.update()                           # the scale halves at an overflow
        skipped = finite and scaler.get_scale() < before
        stepped = finite and not skipped
    opt.zero_grad(set_to_none=True)
    return Stepped(norm, stepped, skipped, None if scaler is None else scaler.get_scale())


def autocast(cfg, device):
    """The run's autocast (departure 5): the precision's bf16 or fp16 on CUDA; on the CPU fp16, or bf16 over
    fp32 weights (the kahan scheme's bf16 weights run as they are there); off under fp32."""
    dtype = precision(cfg, device).autocast
    return torch.autocast(torch.device(device).type, dtype or torch.float32, enabled=dtype is not None)


def load_policy(cfg, device, path=None):
    """(model, tokenizer, reference model or None, optimizer): the policy from `path` (a checkpoint) or
    cfg.model in the scheme's dtype, under the attention "sdpa_capture" (sdpa, plus the head-mean maps when a
    forward is given a flowtracer.Capture); a --layers it lacks an error here; the frozen reference when
    beta > 0; gradient checkpointing as --grad-checkpointing says (training/logprobs.py's checkpointing).
    Under LoRA (departure 4) the base comes from cfg.model and the adapters from `path`, or new ones
    (with_lora)."""
    prec, lora = precision(cfg, device), getattr(cfg, "lora_rank", 0) > 0
    print(prec.line)                                              # departure 5: what runs, and why
    dtype = prec.weights
    model, tok = load_model(cfg.model if lora else path or cfg.model, device=device, dtype=dtype,
                            attn_implementation=flowtracer.IMPL)          # sdpa, + the maps when asked
    select_layers(cfg.layers, model.config.num_hidden_layers)     # a --layers this model lacks fails here
    if cfg.grad_checkpointing:
        checkpointing(model)                                      # logprobs.py: the one switch
    if lora:
        model = with_lora(model, cfg, path)
    ref = None if cfg.beta == 0 else Reference(model) if lora else \
        load_model(cfg.model, device=device, dtype=dtype)[0].eval()
    return model, tok, ref, make_optimizer(model, cfg, device)


def lora_config(cfg, model=None):
    """peft's LoraConfig of --lora-rank, --lora-alpha, --lora-targets (a comma list of module names, or
    all-linear: every linear layer of attention and MLP, not the LM head) and --lora-dropout; given the model
    (a module or a name), ValueError where it cannot have them (lora_problem)."""
    from peft import LoraConfig
    if model is not None and (problem := lora_problem(cfg, model)):
        raise ValueError(problem)
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else \
        [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                      lora_dropout=cfg.lora_dropout, bias="none", task_type="CAUSAL_LM")


def lora_problem(cfg, model):
    """Why --lora-targets and --lora-rank cannot give `model` (a module, or a name: its config's meta copy)
    the adapters asked for, as one sentence, or None: a target that no module's name ends with (peft adapts
    the others without a word), or a rank above every adapted layer's min(d_in, d_out)."""
    if isinstance(model, str):
        from transformers import AutoConfig, AutoModelForCausalLM
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        except Exception:                           # no config here: the model's own load says why
            return None
    named = lambda n, t: n == t or n.endswith("." + t)   # noqa: E731  peft's rule for a target's name
    targets = None if cfg.lora_targets == "all-linear" else \
        [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    if targets and "all-linear" in targets:
        return f"--lora-targets {cfg.lora_targets}: all-linear stands alone (every linear layer already)"
    mods = list(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in mods if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets or [] if not any(named(n, t) for n, _ in mods)]
    if missing:
        return (f"--lora-targets {cfg.lora_targets}: no module of {type(model).__name__} is called "
                f"{', '.join(map(repr, missing))} (its linear layers: {', '.join(linear)}; or all-linear)")
    rank = max((min(m.in_features, m.out_features) for n, m in mods if isinstance(m, torch.nn.Linear)
                and (targets is None or any(named(n, t) for t in targets))), default=0)
    if rank == 0:                                   # "model", "mlp": modules, but no linear layer among them
        return (f"--lora-targets {cfg.lora_targets}: names no linear layer of {type(model).__name__} (its "
                f"linear layers: {', '.join(linear)}; or all-linear)")
    if cfg.lora_rank > rank:
        return (f"--lora-rank {cfg.lora_rank} is more than any adapted layer's rank, min(d_in, d_out) <= "
                f"{rank}: a LoRA that wide is a full-rank update (use --lora-rank <= {rank}, or 0: full "
                f"fine-tuning)")
    return None


def with_lora(model, cfg, path=None):
    """The frozen `model` with peft's LoRA adapters: new ones (B = 0: the same function as the base at
    first), or those a checkpoint at `path` holds (trainable, to continue). The adapters are fp32 whatever
    the base's dtype (peft's autocast_adapter_dtype); targets or a rank it cannot have (lora_problem), or a
    checkpoint's adapters that do not load (a cut file): ValueError."""
    from peft import PeftModel, get_peft_model
    from safetensors import SafetensorError
    if path is None and (problem := lora_problem(cfg, model)):
        raise ValueError(problem)
    try:
        if path is not None:
            return PeftModel.from_pretrained(model, path, is_trainable=True)
        return get_peft_model(model, lora_config(cfg))
    except (ValueError, OSError, SafetensorError) as e:   # no module of that name, no adapters, a cut file
        why = " ".join(str(e).split())[:200]
        raise ValueError(f"--lora-targets {cfg.lora_targets}: {why}" if path is None else
                         f"{path}: cannot load its LoRA adapters ({why})") from None


class Reference:
    """The k3 term's reference under LoRA: the policy's own weights with its adapters off, read by
    logprobs.fixed_logprobs as a model (its decoder, embeddings, head and config): no second copy."""
    def __init__(self, model):
        self.model, self.config = model, model.config

    def get_decoder(self):
        return AdaptersOff(self.model)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def eval(self):
        return self


class AdaptersOff(torch.nn.Module):
    """The policy's decoder, run with the LoRA adapters disabled (peft's disable_adapter)."""
    def __init__(self, model):
        super().__init__()
        self.decoder, self.off = model.get_decoder(), model.disable_adapter

    def forward(self, *args, **kwargs):
        with self.off():
            return self.decoder(*args, **kwargs)
