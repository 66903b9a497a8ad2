"""LoRA: peft's adapters on a frozen base, the one part of the model that trains under --lora-rank.

    cfg = lora_config(cfg, model)      # peft's LoraConfig of the flags (flowtracer_trl.py hands it to TRL)
    model = with_lora(model, cfg)      # trainable.load_policy: new adapters, or a checkpoint's

LoRA (--lora-rank R > 0; grpo.py's departure 9): the base weights are frozen in bf16 on CUDA (fp32 on
the CPU; fp16 under --precision fp16), peft's adapters and their plain torch AdamW states are fp32
(scheme "lora": the Kahan sum is for bf16 weights, and the adapters are not bf16). The reference of
--beta > 0 is the same weights with the adapters off (peft's disable_adapter; Policy.ref_logprobs): no
second model. A checkpoint holds peft's adapter files; the base is loaded again from the run's --model.
--load-in-4bit (QLoRA) stores the frozen base's linear layers in 4 bits under the same adapters:
training/model/quantize.py.

Run: python grpo.py --lora-rank 8                      # LoRA on the embedded model, CPU
     python -m pytest -q tests/model/test_lora.py
"""

from dataclasses import dataclass

import torch


@dataclass
class AdapterConfig:
    """grpo.Config's LoRA flags (above; grpo.py's departure 9)."""

    # LoRA (peft; training/model/lora.py)
    lora_rank: int = 0  # LoRA adapters of this rank (departure 9); 0: full fine-tuning (paper)
    lora_alpha: float = 32.0  # LoRA's scale is alpha / rank ("LoRA Without Regret": 32 at any rank)
    lora_targets: str = "all-linear"  # modules given adapters, comma-separated; all-linear: attention + MLP
    lora_dropout: float = 0.0  # dropout on the adapters' input ("LoRA Without Regret": none)
    load_in_4bit: bool = False  # the frozen base's linears in 4 bits (QLoRA; TRL's name; quantize.py)
    bnb_4bit_quant_type: str = "nf4"  # --load-in-4bit's code: nf4 (QLoRA's NormalFloat; TRL's) or fp4
    use_bnb_nested_quant: bool = False  # --load-in-4bit: the scales in 8 bits too, 0.37 bits a weight less


def lora_config(cfg, model=None):
    """peft's LoraConfig of --lora-rank, --lora-alpha, --lora-targets (a comma list of module names, or
    all-linear: every linear layer of attention and MLP, not the LM head) and --lora-dropout; given the model
    (a module or a name), ValueError where it cannot have them (lora_problem)."""
    from peft import LoraConfig

    if model is not None and (problem := lora_problem(cfg, model)):
        raise ValueError(problem)
    targets = (
        cfg.lora_targets
        if cfg.lora_targets == "all-linear"
        else [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    )
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=targets,
        lora_dropout=cfg.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def lora_problem(cfg, model):
    """Why --lora-targets and --lora-rank cannot give `model` (a module, or a name: its config's meta copy)
    the adapters asked for, as one sentence, or None: a target that no module's name ends with (peft adapts
    the others without a word), or a rank above every adapted layer's min(d_in, d_out)."""
    if isinstance(model, str):
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        except Exception:  # no config here: the model's own load says why
            return None
    named = lambda n, t: n == t or n.endswith("." + t)  # noqa: E731  peft's rule for a target's name
    targets = (
        None
        if cfg.lora_targets == "all-linear"
        else [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    )
    if targets and "all-linear" in targets:
        return f"--lora-targets {cfg.lora_targets}: all-linear stands alone (every linear layer already)"
    mods = list(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in mods if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets or [] if not any(named(n, t) for n, _ in mods)]
    if missing:
        return (
            f"--lora-targets {cfg.lora_targets}: no module of {type(model).__name__} is called "
            f"{', '.join(map(repr, missing))} (its linear layers: {', '.join(linear)}; or all-linear)"
        )
    rank = max(
        (
            min(m.in_features, m.out_features)
            for n, m in mods
            if isinstance(m, torch.nn.Linear) and (targets is None or any(named(n, t) for t in targets))
        ),
        default=0,
    )
    if rank == 0:  # "model", "mlp": modules, but no linear layer among them
        return (
            f"--lora-targets {cfg.lora_targets}: names no linear layer of {type(model).__name__} (its "
            f"linear layers: {', '.join(linear)}; or all-linear)"
        )
    if cfg.lora_rank > rank:
        return (
            f"--lora-rank {cfg.lora_rank} is more than any adapted layer's rank, min(d_in, d_out) <= "
            f"{rank}: a LoRA that wide is a full-rank update (use --lora-rank <= {rank}, or 0: full "
            f"fine-tuning)"
        )
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
    except (ValueError, OSError, SafetensorError) as e:  # no module of that name, no adapters, a cut file
        why = " ".join(str(e).split())[:200]
        raise ValueError(
            f"--lora-targets {cfg.lora_targets}: {why}"
            if path is None
            else f"{path}: cannot load its LoRA adapters ({why})"
        ) from None
