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

 4. LoRA (--lora-rank R > 0; grpo.py's departure 9): the base weights are frozen in bf16 on CUDA (fp32 on
    the CPU), peft's adapters and their plain torch AdamW states are fp32 (scheme "lora": the Kahan sum is
    for bf16 weights, and the adapters are not bf16). The reference of --beta > 0 is the same weights with
    the adapters off (Reference): no second model. A checkpoint holds peft's adapter files; the base is
    loaded again from the run's --model.

Run: python eval.py memory --model qwen3-4b-random        # the accounting this scheme was chosen by
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24
"""
import os
from dataclasses import dataclass
import warnings

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


def scheme(cfg, device) -> str:
    """'kahan' (bf16 weights, bf16 AdamW states + Kahan compensation, torch-optimi) or 'adamw' (fp32 weights,
    fp32 torch AdamW). --optimizer auto: kahan on CUDA, adamw on the CPU (the embedded path stays fp32).
    'lora' whenever --lora-rank > 0 (departure 4): frozen base weights, fp32 adapters and fp32 AdamW."""
    if getattr(cfg, "lora_rank", 0) > 0:
        return "lora"
    name = getattr(cfg, "optimizer", "auto")
    if name not in ("auto", "kahan", "adamw"):
        raise ValueError(f"--optimizer must be auto, kahan or adamw, got {name!r}")
    return ("kahan" if torch.device(device).type == "cuda" else "adamw") if name == "auto" else name


def weight_dtype(cfg, device) -> torch.dtype:
    """The dtype the policy is loaded in: bf16 under the kahan scheme, fp32 under adamw; under lora the
    frozen base's: bf16 on CUDA, fp32 on the CPU (its adapters are fp32 either way)."""
    kind = scheme(cfg, device)
    cuda = torch.device(device).type == "cuda"
    return torch.bfloat16 if kind == "kahan" or kind == "lora" and cuda else torch.float32


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
    if scheme(cfg, device) in ("adamw", "lora"):   # the CPU: torch's fused step (its default there loops over
        cpu = torch.device(device).type == "cpu"    # the tensors, 3x slower at SmolLM2's size; TRL's default)
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                 weight_decay=cfg.weight_decay, fused=True if cpu else None)
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


def autocast(device):
    """The run's autocast: bf16 on CUDA (a no-op for bf16 weights), off on the CPU."""
    return torch.autocast("cuda", torch.bfloat16, enabled=torch.device(device).type == "cuda")


def load_policy(cfg, device, path=None):
    """(model, tokenizer, reference model or None, optimizer): the policy from `path` (a checkpoint) or
    cfg.model in the scheme's dtype, under the attention "sdpa_capture" (sdpa, plus the head-mean maps when a
    forward is given a flowtracer.Capture); a --layers it lacks an error here; the frozen reference when
    beta > 0; gradient checkpointing as --grad-checkpointing says (training/logprobs.py's checkpointing).
    Under LoRA (departure 4) the base comes from cfg.model and the adapters from `path`, or new ones
    (with_lora)."""
    dtype, lora = weight_dtype(cfg, device), getattr(cfg, "lora_rank", 0) > 0
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


def lora_config(cfg):
    """peft's LoraConfig of --lora-rank, --lora-alpha, --lora-targets (a comma list of module names, or
    all-linear: every linear layer of attention and MLP, not the LM head) and --lora-dropout."""
    from peft import LoraConfig
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else \
        [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                      lora_dropout=cfg.lora_dropout, bias="none", task_type="CAUSAL_LM")


def with_lora(model, cfg, path=None):
    """The frozen `model` with peft's LoRA adapters: new ones (B = 0: the same function as the base at
    first), or those a checkpoint at `path` holds (trainable, to continue). The adapters are fp32 whatever
    the base's dtype (peft's autocast_adapter_dtype); a --lora-targets that names no module: ValueError."""
    from peft import PeftModel, get_peft_model
    try:
        if path is not None:
            return PeftModel.from_pretrained(model, path, is_trainable=True)
        return get_peft_model(model, lora_config(cfg))
    except (ValueError, OSError) as e:          # no module of that name, a checkpoint without adapters
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
