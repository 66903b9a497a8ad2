"""The 4-bit base of --load-in-4bit (QLoRA: Dettmers et al., 2023): the frozen base's linear layers stored in
4 bits by bitsandbytes, under peft's LoRA adapters, which alone train (fp32, with fp32 AdamW).

    bnb = four_bit(cfg, compute)                   # transformers' BitsAndBytesConfig of the flags, or None
    model = quantized(model, bnb, device, dtype, attn)   # a loaded model read back with its linears in 4 bits
    print(base_line(model, bnb))                   # the line that says the base is 4-bit, and its bytes

Each block of BLOCK = 64 weights (a linear's weight flattened row by row) is scaled by its absmax, and each
weight kept as the nearest of 16 codes: W ~ absmax_b * code[q] (NF4, QLoRA's NormalFloat, by default; or
FP4). 4 bits + one fp32 absmax per 64 weights: 4.5 bits a weight (bits_per_weight); --use-bnb-nested-quant
quantizes the absmaxes too, 8 bits each + one fp32 scale per 256 of them: 4.127 bits. A weight is off by at
most max_step (half the widest gap between two codes: 0.152 for NF4) times its block's absmax:
tests/model/test_qlora.py holds each layer's output to that bound. Forward and backward dequantize one layer's
weight at a time into the compute dtype (bitsandbytes' MatMul4Bit; the 4-bit weight gets no gradient): the
memory estimate counts it as one layer's workspace (training/memory/phases.py). The embedding, the norms and
the LM head stay in the run's precision (transformers leaves the output embedding, tied or not, unquantized).

Departures (numbered; grpo.py's departure 10):
 1. transformers quantizes while it reads weights (from_pretrained with quantization_config), its one path
    to a 4-bit model peft recognises (is_loaded_in_4bit). A hub name or a directory is read so directly
    (load_kwargs); a model load.py builds itself (a random one, the embedded GGUF's plain copy) is first
    saved to a temporary directory and read back (`quantized`): the same weights, quantized.
 2. peft's prepare_model_for_kbit_training is not called. Of its steps, freezing the base is get_peft_model's,
    and gradient checkpointing is policy.checkpointing's, the one switch (non-reentrant: no input-gradient
    hook needed); its cast of every 16-bit weight to fp32 would double Qwen3-4B's tied embedding
    (0.78 -> 1.56 GB) and add autocast's 16-bit copy of it, for the norms, which Qwen3's and Llama's RMSNorm
    compute in fp32 already.
 3. bitsandbytes repacks a 4-bit weight in place for its CPU kernel (on CPUs with AVX512-BF16) at the first
    forward without gradients, and a packed weight's forward passes no gradient to its input: the rollout's
    forward would break the update's backward. The repacking is turned off (`quantized`, load_kwargs' model).
 4. Merged into 4-bit weights, an RL update's W + BA is rounded to the codes again (a step of ~0.1 absmax
    against |BA| ~ 1e-4): the update is lost. A checkpoint is evaluated with its adapters unmerged on the
    4-bit base it trained on (load.load_adapted); a merged model is merged into a 16/32-bit copy of the base
    (docs/gpu.md, "A LoRA checkpoint").

Run: python grpo.py --model tiny-qwen3 --lora-rank 8 --load-in-4bit --steps 2      # the CPU
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --load-in-4bit --gpu-gb 12
     python -m pytest -q tests/model/test_qlora.py
"""

import tempfile

import torch

from training.model.pretrained import quiet_bars

QUANT_TYPES = ("nf4", "fp4")  # --bnb-4bit-quant-type (TRL's ModelConfig choices)
BLOCK, NESTED_BLOCK = 64, 256  # weights per absmax; absmaxes per fp32 scale under nested quantization


def bits_per_weight(nested=False) -> float:
    """Bits a quantized weight takes with its scales: 4 + 32 / 64 (an fp32 absmax per block) = 4.5; nested,
    4 + 8 / 64 + 32 / (64 * 256) = 4.127 (the absmaxes in 8 bits, an fp32 scale per 256 of them)."""
    return 4 + (8 / BLOCK + 32 / (BLOCK * NESTED_BLOCK) if nested else 32 / BLOCK)


def max_step(quant_type) -> float:
    """Half the widest gap between two neighbouring codes of `quant_type` (bitsandbytes' table), in units of
    a block's absmax: the most a quantized weight is off (nearest-code rounding)."""
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type(quant_type, device="cpu").sort().values.diff().max().item() / 2


def four_bit_problem(cfg):
    """Why the quantization flags cannot run, as one sentence naming them, or None: --load-in-4bit without
    --lora-rank (a 4-bit weight cannot take an update), or bitsandbytes not installed."""
    if not getattr(cfg, "load_in_4bit", False):
        return None
    if getattr(cfg, "lora_rank", 0) <= 0:
        return (
            "--load-in-4bit needs --lora-rank R: the 4-bit base is frozen and only LoRA's adapters train "
            "(QLoRA); a 4-bit weight cannot take full fine-tuning's updates"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return "--load-in-4bit needs bitsandbytes: pip install -r requirements.txt"
    return None


def four_bit(cfg, compute):
    """transformers' BitsAndBytesConfig of --load-in-4bit, --bnb-4bit-quant-type and --use-bnb-nested-quant
    (TRL's get_quantization_config, with the compute dtype `compute`: the run's precision), or None."""
    if not getattr(cfg, "load_in_4bit", False):
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.use_bnb_nested_quant,
        bnb_4bit_compute_dtype=compute,
    )


def placement(device):
    """from_pretrained's device_map for one device: everything on it."""
    d = torch.device(device)
    return {"": f"cuda:{d.index or 0}" if d.type == "cuda" else d.type}


def load_kwargs(bnb, device) -> dict:
    """from_pretrained's keywords that read a model in 4 bits onto `device` (none without `bnb`)."""
    return {} if bnb is None else {"quantization_config": bnb, "device_map": placement(device)}


def is_4bit(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False))


def unpacked(model):
    """`model` with bitsandbytes' CPU repacking off in every 4-bit layer (departure 3)."""
    from bitsandbytes.nn import Linear4bit

    for m in model.modules():
        if isinstance(m, Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def quantized(model, bnb, device, dtype, attn_implementation):
    """`model` (a plain 16/32-bit model) read back with its linear layers in 4 bits on `device`, the rest in
    `dtype` (departure 1): saved to a temporary directory, then from_pretrained with quantization_config.
    A model that is 4-bit already is returned as it is."""
    from transformers import AutoModelForCausalLM

    if is_4bit(model):
        return unpacked(model)
    with tempfile.TemporaryDirectory(prefix="flowtracer-4bit-") as tmp, quiet_bars():
        model.save_pretrained(tmp)
        generation, source = model.generation_config, model.config._name_or_path
        del model  # a 4B model: its 16-bit copy goes before the 4-bit one is read
        out = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=dtype, attn_implementation=attn_implementation, **load_kwargs(bnb, device)
        )
    out.generation_config = generation
    out.config._name_or_path = out.name_or_path = source  # peft's records: not the temporary directory
    return unpacked(out)


def quantized_bytes(model):
    """(bytes of the 4-bit weights with their scales, their count of weights, bytes of every other
    parameter) of a 4-bit model, as allocated."""
    from bitsandbytes.nn import Params4bit

    four = n = rest = 0
    for p in model.parameters():
        if isinstance(p, Params4bit):
            st = p.quant_state
            parts = [p, st.absmax] + ([st.state2.absmax, st.state2.code] if st.nested else [])
            four += sum(t.numel() * t.element_size() for t in parts)
            n += st.shape.numel()
        else:
            rest += p.numel() * p.element_size()
    return four, n, rest


def base_line(model, bnb) -> str:
    """One line: the base is 4-bit, its code, the layers and bytes quantized, what stays in 16/32 bits."""
    from bitsandbytes.nn import Linear4bit

    layers = sum(isinstance(m, Linear4bit) for m in model.modules())
    four, n, rest = quantized_bytes(model)
    nested = bnb.bnb_4bit_use_double_quant
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return (
        f"base: 4-bit {bnb.bnb_4bit_quant_type}{' (nested)' if nested else ''} (bitsandbytes), {layers} "
        f"linear layers, {n / 1e6:.1f}M weights in {four / 1e9:.3f} GB ({8 * four / n:.2f} bits a weight "
        f"with their scales); the rest in {str(dtype).removeprefix('torch.')}, {rest / 1e9:.3f} GB; "
        f"compute in {str(bnb.bnb_4bit_compute_dtype).removeprefix('torch.')}"
    )
