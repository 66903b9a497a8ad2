"""The decode-only view of the weights that the engine's fused step reads (training/decode/fused_step.py).

    w = decode_weights.make(model)       # Engine.make: the copies allocated and filled
    decode_weights.refresh(w, model)     # Engine.reserve, each rollout: filled again, in place

A decoder layer's projections in four groups (GROUPS), each one `Proj` the step applies as y = x W^T (+ bias)
(+ (x A^T) B^T):
  full fine-tuning  Q, K and V merged into one (Hq hd + 2 Hkv hd, D) matrix, gate and up into one (2 I, D):
                    one matmul where the model runs three, and one where it runs two, each wider (K's and
                    V's own are 1,024 x 2,560 at Qwen3-4B: few tiles for a GPU's SMs at 64 rows; the gain
                    is not measured: no GPU). The merged matrices are copies; o_proj, down_proj, the norms,
                    the embedding and the head are the model's own tensors (the optimizer steps them in
                    place).
  LoRA (peft)       the frozen base's own matrices (no copy), and a group's adapters as one low-rank pair:
                    A the adapters' A stacked, (sum r, D), B their s B block-diagonal, (out, sum r), so Q, K
                    and V's three adapters are two small matmuls, not six (departure 2).
`refresh` fills the copies again from the model at each Engine.reserve (rollout.generate reserves at every
call, so after every optimizer step), in place, so the graphs captured over them stay valid. The training
weights (full fine-tuning's, or LoRA's frozen base and fp32 adapters) are only read.

The copies are in the weights' dtype (LoRA: the frozen base's; its adapters cast to it, as autocast casts
them in the training forward), and so is the step (departure 1). Memory: copy_bytes(w, model), resident while
the engine's buffers are; training/memory/terms.py's decode_copy counts it from the config (equal:
tests/decode/test_fused_decode.py).

Departures (numbered):
  1. Autocast does not enter the fused step: it computes in the weights' dtype. The default schemes (bf16
     weights; LoRA's bf16 base under a bf16 autocast; fp32 on the CPU) are unchanged by it; fp32 weights
     under a bf16 autocast (--optimizer adamw --precision bf16) decode in fp32, as exact as the weights,
     where autocast's forward would round to bf16 (the update's forward recomputes every log-prob).
  2. LoRA's adapters are not merged into a copy of the base (W + s B A): that copy is every adapted
     linear again, and on a 24 GB card it took the plan from gen_chunk 32 to 16 with the engine released
     for the update (`python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24`, with and
     without it: docs/gpu.md), where the low-rank pairs change nothing. The cost is the base's unmerged
     projections (seven matmuls a layer, not four) and four low-rank pairs a layer.

Run: python -m pytest -q tests/decode/test_fused_decode.py
"""

from typing import NamedTuple

import torch

FUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # model_type: a Llama decoder layer (Qwen3's q/k norms)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load; dynamic ones change it
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
PROJECTIONS = tuple(n for g in GROUPS for n in g)


class Proj(NamedTuple):
    """A group of projections over one input, applied as one: y = [x W_1^T | x W_2^T ...] + bias
    + (x A^T) B^T (fused_step.proj)."""

    ws: tuple  # ((out_i, in),) one merged copy, or the model's own matrices (LoRA, or a group of one)
    bias: torch.Tensor | None  # (sum out_i,) a copy, or None (no bias)
    A: torch.Tensor | None  # (sum r, in) the group's adapters' A stacked (LoRA), None: no adapter
    B: torch.Tensor | None  # (sum out_i, sum r) their s B, block-diagonal


class Layer(NamedTuple):
    """One decoder layer as the fused step reads it (D hidden, I intermediate, Hq / Hkv heads of hd)."""

    ln1: torch.Tensor  # (D,) input_layernorm's weight
    qkv: Proj  # Q, K, V: out Hq hd + 2 Hkv hd
    q_norm: torch.Tensor | None  # (hd,) Qwen3's per-head RMSNorm of q; None: none (Llama)
    k_norm: torch.Tensor | None  # (hd,) of k
    o: Proj  # o_proj: (D, Hq hd)
    ln2: torch.Tensor  # (D,) post_attention_layernorm's weight
    gate_up: Proj  # gate, up: out 2 I
    down: Proj  # down_proj: (D, I)


class Weights(NamedTuple):
    """The whole decode-only view of a model: its layers, and what the step needs of its config."""

    embed: torch.Tensor  # (V, D) the model's embedding
    layers: list  # [Layer] x L
    norm: torch.Tensor  # (D,) the final norm's weight
    head: torch.Tensor  # (V, D) the LM head's weight (tied: the embedding)
    inv_freq: torch.Tensor  # (hd / 2,) fp32, the rotary embedding's frequencies
    rope_scale: float  # the rotary embedding's attention_scaling (1 but for yarn-like types)
    eps: float  # RMSNorm's epsilon
    Hq: int  # query heads
    Hkv: int  # key-value heads
    hd: int  # head dim


def unwrap(model):
    """The transformers model under peft's wrapper (a PeftModel's base model), else `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def adapters(module):
    """The active LoRA adapters of a projection (peft's lora.Linear): [] for a plain nn.Linear, for a merged
    or disabled layer (its base weight is then the one that runs)."""
    if not hasattr(module, "lora_A") or module.disable_adapters or module.merged:
        return []
    return [a for a in module.active_adapters if a in module.lora_A]


def base(module):
    """The nn.Linear under a projection (peft's base_layer), or the projection itself."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def config_problem(mc):
    """Why the fused step cannot decode a model of config `mc`, as one clause, or None: a Llama-like decoder
    (FUSED_TYPES: RMSNorms, RoPE, a SiLU-gated MLP without bias, Qwen3's q/k norms) whose rotary embedding is
    fixed at load (STATIC_ROPE). training/memory/terms.decode_copy reads it too."""
    if mc.model_type not in FUSED_TYPES:
        return f"model type {mc.model_type!r} is not one of {FUSED_TYPES}"
    if getattr(mc, "hidden_act", "silu") != "silu" or getattr(mc, "mlp_bias", False):
        return f"an MLP other than SiLU-gated without bias ({mc.hidden_act})"
    rope = (getattr(mc, "rope_parameters", None) or getattr(mc, "rope_scaling", None) or {}).get(
        "rope_type", "default"
    )
    if rope not in STATIC_ROPE:
        return f"rope type {rope!r} changes with the sequence's length"
    return None


def supported(model):
    """Why the fused step cannot decode `model`, as one clause, or None: its config (config_problem), plain
    linear weights, and LoRA adapters (peft's plain LoRA: no DoRA or other variant) on its projections
    only."""
    if why := config_problem(model.config):
        return why
    for name, module in unwrap(model).named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if hasattr(module, "lora_A") and leaf not in PROJECTIONS:
            return f"a LoRA adapter on {name}, not a decoder projection"
        if leaf in PROJECTIONS:
            if any(a in getattr(module, "lora_variant", {}) for a in adapters(module)):
                return f"{name}'s adapter is a LoRA variant (DoRA), not plain LoRA"
            if type(base(module)) is not torch.nn.Linear:
                return f"{name} is a {type(base(module)).__name__}, not a plain linear layer"
    return None


def group(modules, merge, held=None):
    """The Proj of `modules` (one input, outputs stacked): new, or `held`'s copies filled again in place.
    merge: stack a group's matrices into one copy (full fine-tuning), else read the model's own (LoRA)."""
    ws = [base(m).weight for m in modules]  # (out_i, in)
    on = [(m, a) for m in modules for a in adapters(m)]  # the group's adapters
    if held is None:
        out, rank = sum(w.shape[0] for w in ws), sum(m.lora_A[a].weight.shape[0] for m, a in on)
        stacked = len(ws) > 1
        held = Proj(
            (ws[0].new_empty(out, ws[0].shape[1]),) if merge and stacked else tuple(ws),
            ws[0].new_empty(out) if stacked and base(modules[0]).bias is not None else None,
            ws[0].new_empty(rank, ws[0].shape[1]) if on else None,
            ws[0].new_zeros(out, rank) if on else None,
        )
    if len(held.ws) < len(ws):  # the merged copy
        torch.cat(ws, out=held.ws[0])
    if held.bias is not None and len(ws) > 1:
        torch.cat([base(m).bias for m in modules], out=held.bias)
    row, col = 0, 0  # module m's adapter a: B's rows of m's outputs, its columns of a's rank
    for m, w in zip(modules, ws):
        for a in adapters(m):
            r = m.lora_A[a].weight.shape[0]
            held.A[col : col + r] = m.lora_A[a].weight  # (r, in), in the base's dtype
            held.B[row : row + w.shape[0], col : col + r] = m.lora_B[a].weight * m.scaling[a]  # (out, r)
            col += r
        row += w.shape[0]
    if held.bias is None and len(ws) == 1:  # a group of one: its own bias
        held = held._replace(bias=base(modules[0]).bias)
    return held


def projections(layer):
    """A decoder layer's four groups of projections, as GROUPS names them."""
    a, f = layer.self_attn, layer.mlp
    return [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [f.gate_proj, f.up_proj], [f.down_proj]]


@torch.no_grad()
def make(model) -> Weights:
    """The fused step's weights of `model` (supported: None), its copies new: merged where no projection
    has an adapter (full fine-tuning), the base's own with low-rank pairs under LoRA (departure 2)."""
    m, mc = unwrap(model), model.config
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    merge = not any(adapters(p) for layer in m.model.layers for g in projections(layer) for p in g)
    layers = []
    for layer in m.model.layers:
        qkv, o, gate_up, down = (group(g, merge) for g in projections(layer))
        qn = getattr(layer.self_attn, "q_norm", None)
        layers.append(
            Layer(
                layer.input_layernorm.weight,
                qkv,
                None if qn is None else qn.weight,
                None if qn is None else layer.self_attn.k_norm.weight,
                o,
                layer.post_attention_layernorm.weight,
                gate_up,
                down,
            )
        )
    rot = m.model.rotary_emb
    return Weights(
        m.model.embed_tokens.weight,
        layers,
        m.model.norm.weight,
        m.get_output_embeddings().weight,
        rot.inv_freq.float(),
        float(getattr(rot, "attention_scaling", 1.0)),
        float(mc.rms_norm_eps),
        mc.num_attention_heads,
        mc.num_key_value_heads,
        hd,
    )


@torch.no_grad()
def refresh(w, model):
    """The copies of `w` filled again from `model`'s weights as they are now (after an optimizer step), in
    place: the same storage, so a graph captured over them reads the new weights. Returns w."""
    for layer, held in zip(unwrap(model).model.layers, w.layers):
        for g, p in zip(projections(layer), (held.qkv, held.o, held.gate_up, held.down)):
            group(g, len(p.ws) < len(g), p)
    return w


def copy_bytes(w, model) -> int:
    """Bytes the copies of `w` hold beyond the model's own tensors (merged matrices, stacked biases, LoRA's
    low-rank pairs)."""
    mine = {p.data_ptr() for p in unwrap(model).parameters()}
    held = [t for layer in w.layers for p in layer if isinstance(p, Proj) for t in (*p.ws, p.bias, p.A, p.B)]
    return sum(t.nbytes for t in held if t is not None and t.data_ptr() not in mine)
