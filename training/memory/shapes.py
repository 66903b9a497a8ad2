"""One GRPO step's shapes and byte widths (Shapes), as training/memory/phases.py's estimate reads them once:
from cfg, the model's config (its parameters and one decoder layer's linears, counted on a model built on the
meta device: param_counts, lora_linears) and the precision (trainable.precision, phases.py departure 6); and
the sizes a step is counted at where --gen-chunk or --micro-batch is left at 0 (SIZES, largest) and the rows
the run's decode engine is reserved for (engine_rows).

    s = read_shapes(cfg, mc, device, prompt_tokens, cap)   # Shapes: L, D, I, V, Hq, Hkv, hd, P, R, T, B, g, b
    ...

The step counted is the worst one (phases.py departure 2): every response max_new_tokens long (R), the
prompt padded to --prompt-tokens (P). LoRA (phases.py departure 5): the frozen base's weights, the fp32
adapters of the linears --lora-targets names; --load-in-4bit (departure 8): the decoder layers' linear weights
in 4 bits with their scales, and one of them dequantized at a time.

Run: python eval.py memory --model qwen3-4b-random      (the estimate these shapes make)
     python -m pytest -q tests/memory/test_phases*.py tests/memory/test_budget.py
"""

import dataclasses
import functools
import json
from types import SimpleNamespace
from typing import NamedTuple

import torch

from flowtracer import EAGER_IMPL
from training.credit.attention import capture_impl
from training.decode.rollout import prefix_problem
from training.memory.terms import decode_copy, prefilled_rows
from training.model import quantize
from training.model.trainable import precision

# A size left at 0 (grpo.Config's --gen-chunk, --micro-batch): what the CPU runs, and where a plan on CUDA
# starts (training/memory/budget.py: these and the powers of two below them)
SIZES = {"gen_chunk": 64, "micro_batch": 8}


def largest(cfg):
    """cfg with each size left at 0 at SIZES' (the CPU's sizes; the largest a plan tries): a copy; cfg
    itself where none is 0."""
    zero = {k: v for k, v in SIZES.items() if getattr(cfg, k) == 0}
    if not zero:
        return cfg
    return (
        dataclasses.replace(cfg, **zero)
        if dataclasses.is_dataclass(cfg)
        else SimpleNamespace(**{**vars(cfg), **zero})
    )


def engine_rows(cfg, n_eval=0):
    """The rows the run's decode engine is reserved for (training/memory/preflight.py's make_engine): a chunk
    of the rollout's B rows or of held-out evaluation's n_eval questions, the wider, at most gen_chunk (a
    gen_chunk left at 0: SIZES')."""
    return min(cfg.gen_chunk or SIZES["gen_chunk"], max(cfg.prompts_per_step * cfg.group_size, n_eval))


# ----------------------------------------------------------------------------- the model, from its config
def param_counts(mc):
    """(N, N cast by autocast, largest tensor) for a config, from a model built on the meta device."""
    return counts(mc.to_json_string())[:3]


@functools.cache
def counts(config_json):
    """param_counts, the LoRA'd linears' ((name, in, out), ...) and every module's name, of a config (JSON:
    hashable, so a plan's many estimates build the meta model once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    mc = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(mc)
    ps = list(m.parameters())  # tied weights appear once
    emb = m.get_input_embeddings().weight
    cast = sum(p.numel() for p in ps if p.ndim == 2 and (p is not emb or mc.tie_word_embeddings))
    head = m.get_output_embeddings()
    linears = tuple(
        (n.rsplit(".", 1)[-1], x.in_features, x.out_features)
        for n, x in m.named_modules()
        if isinstance(x, torch.nn.Linear) and x is not head and ".layers.0." in f".{n}"
    )
    return (
        sum(p.numel() for p in ps),
        cast,
        max(p.numel() for p in ps),
        linears,
        frozenset(n.rsplit(".", 1)[-1] for n, _ in m.named_modules()),
    )


def adapted_names(cfg, mc):
    """The names of one decoder layer's linears that --lora-targets adapts (all-linear: every one)."""
    _, _, _, layer, _ = counts(mc.to_json_string())
    names = {t.strip().rsplit(".", 1)[-1] for t in cfg.lora_targets.split(",") if t.strip()}
    return {n for n, _, _ in layer if cfg.lora_targets == "all-linear" or n in names}


def lora_linears(cfg, mc):
    """[(in, out)] of one decoder layer's linears that get adapters under --lora-targets (all-linear: every
    one, the LM head is not in a layer; a target outside the layers, lm_head, is not counted); ValueError
    naming a target that no module of the model is called (a run grpo.py refuses: lora.lora_problem)."""
    names = (
        None
        if cfg.lora_targets == "all-linear"
        else {t.strip().rsplit(".", 1)[-1] for t in cfg.lora_targets.split(",") if t.strip()}
    )
    _, _, _, layer, modules = counts(mc.to_json_string())
    unknown = sorted((names or set()) - modules)
    if unknown:
        raise ValueError(
            f"--lora-targets {cfg.lora_targets}: no module of a {mc.model_type} model is called "
            f"{', '.join(map(repr, unknown))} (a decoder layer's linears: "
            f"{', '.join(sorted({n for n, _, _ in layer}))}; or all-linear)"
        )
    got = [(i, o) for n, i, o in layer if names is None or n in names]
    widest = max((min(i, o) for i, o in got), default=0)
    if got and getattr(cfg, "lora_rank", 0) > widest:  # grpo.py refuses it (lora.lora_problem)
        raise ValueError(
            f"--lora-rank {cfg.lora_rank} is more than any adapted layer's rank, min(d_in, d_out) <= {widest}"
        )
    return got


# ----------------------------------------------------------------------------- the step, read once
class Shapes(NamedTuple):
    """One step's shapes and byte widths, as estimate reads them once from cfg, the model's config and the
    precision (trainable.precision). The model: L layers, D hidden, I intermediate, V vocabulary, Hq / Hkv
    query / key-value heads of hd each. The run: P prompt + R response = T tokens a row; B rows a step."""

    L: int
    D: int
    I: int
    V: int
    Hq: int
    Hkv: int
    hd: int
    P: int
    R: int
    T: int
    B: int
    g: int  # rows of a generate call (gen_chunk)
    b: int  # rows of a micro-batch (micro_batch)
    c: int  # positions of a log-prob chunk (logprob_chunk)
    k: int  # the distinct prompts a micro-batch's forward reads (--share-prefix: once)
    Tq: int  # queries of a row's last pass: T, or R after a shared prompt
    weight_bytes: int  # a weight and its gradient (LoRA: the frozen base's)
    residual_bytes: int  # the residual stream: the embedding's output, plus each sublayer's
    matmul_bytes: int  # a matmul's output: 2 under an autocast or bf16 weights, else 4
    cuda: bool
    kahan: bool  # bf16 weights and AdamW states + Kahan compensation (policy.py departure 1)
    lora: bool  # frozen base, fp32 adapters (departure 5)
    math: bool  # SDPA's math kernel: no fused kernel takes the dtype on this card
    eager: bool  # the model's own eager attention (capture_impl): each layer keeps its probabilities
    shared_rollout: bool  # rollouts read each prompt once: --share-prefix, no sliding window (prefix_problem)
    autocast: bool  # a bf16 / fp16 autocast over the forward
    adapters: tuple  # layer_saved's LoRA: (one layer's adapted (in, out), rank, autocast on)
    adapter_params: int  # every adapter's parameters (fp32)
    decode_copy: int  # bytes of the decode engine's merged copy of the weights (terms.decode_copy)
    four_bit: int = 0  # --load-in-4bit: the decoder layers' linear weights stored in 4 bits (0: none)
    four_bit_bytes: float = 0.0  # bytes one of them takes with its scales (quantize.bits_per_weight / 8)
    four_bit_tables: int = 0  # nested quantization's code table, 256 fp32 per linear layer
    dequant: int = 0  # bytes of one layer's largest weight dequantized for a matmul (a forward, a backward)


def read_shapes(cfg, mc, device, prompt_tokens, cap=None) -> Shapes:
    """The Shapes of cfg's shapes on `device` (a card of compute capability `cap`; None: the device's own)."""
    L, D, I, V = mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size
    Hq, Hkv = mc.num_attention_heads, mc.num_key_value_heads
    prec = precision(cfg, device, cap)  # dtypes, scheme, the attention kernel (departure 6)
    kahan, lora = prec.scheme == "kahan", prec.scheme == "lora"
    P, R, B = prompt_tokens, cfg.max_new_tokens, cfg.prompts_per_step * cfg.group_size
    b = min(cfg.micro_batch, B)
    k = prefilled_rows(b, cfg.group_size, cfg.share_prefix)  # prompts it reads per micro-batch
    adapted = lora_linears(cfg, mc) if lora else []  # one layer's adapted linears
    rank = getattr(cfg, "lora_rank", 0)
    layer = counts(mc.to_json_string())[3]  # one decoder layer's linears, (name, in, out)
    four = lora and getattr(cfg, "load_in_4bit", False)  # phases.py departure 8
    nested = getattr(cfg, "use_bnb_nested_quant", False)
    autocast = prec.autocast is not None
    return Shapes(
        L,
        D,
        I,
        V,
        Hq,
        Hkv,
        getattr(mc, "head_dim", None) or D // Hq,
        P,
        R,
        P + R,
        B,
        g=min(cfg.gen_chunk, B),
        b=b,
        c=min(cfg.logprob_chunk, R),
        k=k,
        Tq=R if k < b else P + R,
        weight_bytes=prec.weights.itemsize,
        residual_bytes=prec.weights.itemsize,
        matmul_bytes=2 if prec.autocast or kahan else 4,
        cuda=torch.device(device).type == "cuda",
        kahan=kahan,
        lora=lora,
        math=prec.math_sdpa,
        eager=capture_impl(mc) == EAGER_IMPL,  # Gemma-2, GPT-OSS: no SDPA in transformers (terms.eager_saved)
        shared_rollout=cfg.share_prefix and prefix_problem(mc) is None,  # else HF generate, no engine
        autocast=autocast,
        adapters=(adapted, rank, autocast and not four),  # peft's 4-bit layers cast no input under autocast
        adapter_params=L * rank * sum(i + o for i, o in adapted),
        decode_copy=0  # a 4-bit linear is not one the fused step reads (decode_weights.supported)
        if four
        else decode_copy(
            mc, layer, adapted_names(cfg, mc) if lora else (), rank if lora else 0, prec.weights.itemsize
        ),
        four_bit=four * L * sum(i * o for _, i, o in layer),
        four_bit_bytes=four * quantize.bits_per_weight(nested) / 8,
        four_bit_tables=four * nested * L * len(layer) * 256 * 4,
        dequant=four * max((i * o for _, i, o in layer), default=0) * (2 if autocast else 4),
    )
