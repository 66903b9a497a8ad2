"""What one GRPO step holds in memory, phase by phase, counted from the model's config (nothing allocated).

The step of grpo.py (16 prompts x 8, 1,024 new tokens, micro-batch 8) in five phases, each with its peak:
  generation      weights + optimizer states + KV cache (2 L Hkv hd T g bf16: 147 KB per token for Qwen3-4B),
                  at the prefill, the copy of each prompt's cache to its rows, or the last decode step
  update forward  + gradients (from the 2nd micro-batch on) + what the forward keeps for backward (kept:
                  each layer's input under --grad-checkpointing, else its layer_saved: 68 GB more for
                  Qwen3-4B at 1K; a prompt its rows share once, update_kept) + either the attention capture
                  (a (b, T, T) fp32 buffer; on the CPU fp32 score blocks of <= 2^25 floats, auto_chunk; on
                  CUDA the fused kernel's row statistics) or the log-prob chunks (3 x (b, 128, V))
  credit          fused: + the captured maps (one buffer: Capture.maps works in place) and trace_flow's fp64
                  copy, (b, T, T) each; a separate pass (baselines.separate_pass): before the update, the
                  signal's own forward and its (n, T, T) maps, n = b rows a forward for a signal whose rows
                  are scored alone (baselines.ROWWISE, the scores of all B kept), else all B
  backward        + one decoder layer recomputed (layer_saved, counted op by op), one log-prob chunk, or the
                  reference model's forward (--beta > 0, whose weights are resident in every phase)
  optimizer step  weights + gradients + states (+ torch's foreach AdamW: one fp32 copy of v on CUDA)
--num-iterations > 1 keeps the old log-probs, (B, R) fp32, through the update; --beta > 0 the reference's.
On CUDA the decode engine (training/decode/engine.py) is kept for the run with its graphs, so its K, V
buffers, 2 L Hkv hd S e bf16, and its fused step's copy of the weights (Q, K, V merged and gate, up merged,
L (Hq + 2 Hkv) hd D + 2 L I D in bf16: terms.decode_copy) stay resident in every phase: S is the run's
widest prompt (`widest`: its training prompts after --max-prompt-tokens and its held-out ones) + R, in
multiples of 64, and e the rows preflight.make_engine reserves at setup, min(gen_chunk, max(B, held-out
questions)) (engine_rows); held-out evaluation decodes in the same buffers (no second cache), its chunk
counted beside the rollout's in generation (terms.engine_generation: a chunk's prompts' cache beside the
engine). Or, where the plan (training/memory/budget.py) picks the layout "released", the engine is freed
after each rollout (grpo.py's update back-off seam) and the update's phases hold none of it.
`estimate` reads the step's shapes and byte widths once (Shapes: training/memory/shapes.py), then adds what
every phase holds (resident) to each phase's own terms, counted in training/memory/terms.py;
evaluation/memtrace.py measures a real step (track_peak counts its live tensor storages on the CPU; on a
GPU, torch.cuda.max_memory_allocated), and tests/memory/test_phases.py holds the estimate within 10% of the
count.

The scheme that fits Qwen3-4B (bf16 weights, gradients and AdamW states + a bf16 Kahan compensation,
10 B/param) and why the fp32 design does not (16 B/param + autocast's bf16 weight cache): docs/method.md.

Departures (numbered):
 1. A separate credit pass is counted as attention.attention_graph's forward and trace_flow (flow,
    attention) or a plain forward (other signals); the own forwards of OAR, fai and gradient are not.
 2. Every response is taken at max_new_tokens and every row trained (the worst step); the padded prompt
    width is --prompt-tokens (default 256, a math problem with its template), not max_prompt_tokens.
 3. On CUDA, trace_flow's triangular solve is given one more fp64 (b, T, T) copy than on the CPU (cuBLAS
    trsm layout). The autocast (fp32 weights) path is counted, not validated.
 4. The backward on CUDA is not held to a measure: on one H100 it allocated more than this counts, beyond
    10%, where every other phase matched. docs/gpu.md has the numbers and the two terms counted since
    (backward_phase's `head_grad` and `dq`) under "Measured on one H100", and what is ruled out and what is
    not under "The backward's missing 5.3 GB". No factor stands in for the rest (training/memory/budget.py
    keeps a reserve). To pin it, on the GPU:
    `python eval.py memory --model qwen3-4b-random --measure --snapshot runs/backward.pickle`
    (memtrace.cuda_peak records the backward, held_at_peak prints the blocks live at its peak by site).
 5. LoRA (--lora-rank, scheme "lora"): the frozen base's weights (bf16 on CUDA, fp32 on the CPU), the fp32
    adapters with their gradients and fp32 AdamW states, autocast's bf16 copies of the adapters on CUDA; no
    (V, D) head or embedding gradient; per layer each adapter's A output (r) kept for backward, and the
    normalised values the frozen RMSNorms no longer keep left out (layer_saved). Held within 10% of a CPU
    step (tests/memory/test_phases.py); on CUDA peft casts each adapter's input to fp32 and autocast casts
    it back, a bf16 copy per adapted linear where the frozen base keeps none: counted, not measured on a GPU.
 6. --precision (trainable.precision, on a card of compute capability `cap`: eval.py memory --capability, else
    the visible GPU's, else 8.0): the weights' bytes in its dtype (fp16 and bf16 2, fp32 4), matmul outputs
    and autocast's copies only under an autocast; and the attention kernel the card runs. Below 8.0 SDPA's
    fused kernels refuse bf16 and its math kernel runs: it keeps fp32 q, k, v and the probabilities,
    (b, Hq, Tq, T), for backward (terms.sdpa_saved), and makes the scores and their softmax in the
    forward and two gradients of that size in the backward (terms.math_scores), where a fused kernel
    keeps a logsumexp and an fp32 dQ. fp16 and fp32 there run the memory-efficient kernel: counted as the
    fused one. Not measured on such a card.
 7. A model that transformers runs without SDPA (Gemma-2, GPT-OSS: the attention "eager_capture") keeps each
    layer's probabilities for backward (terms.eager_saved, held to the count of their attention), and makes
    its scores and their gradients as SDPA's math kernel does (math_scores); the rest of such a layer
    (Gemma-2's four norms and GELU, GPT-OSS's experts) is counted as Qwen3's, not held to a measure. Its
    sliding-window layers send the rollouts to HF generate (rollout.prefix_problem): no shared prefix, no
    engine.
 8. --load-in-4bit (training/model/quantize.py): the decoder layers' linear weights at
    quantize.bits_per_weight (4 bits + an fp32 absmax per 64 weights; nested, the absmaxes in 8 bits), the
    embedding, norms and head in the precision's bytes; each forward and backward holds one layer's largest
    weight dequantized in the compute dtype for its matmul (bitsandbytes: dequantize, then a plain matmul;
    its fused kernel for a few rows holds none), counted once in every phase that runs a forward. peft's
    4-bit layers cast no adapter input under autocast (departure 5's per-adapter copy is not counted); the
    4-bit weights keep nothing for backward (MatMul4Bit dequantizes again). Held within 10% of a CPU step
    (tests/model/test_qlora.py); not measured on a GPU.

Run: python eval.py memory --model qwen3-4b-random      (the table of this estimate, in a second)
     python eval.py memory --model tiny-qwen3 --measure --max-new-tokens 64   # estimate vs a real step
"""

import os
from typing import NamedTuple

from flowtracer import select_layers
from training.credit import baselines, scoring
from training.memory.shapes import engine_rows, largest, param_counts, read_shapes
from training.memory.terms import (
    capture_workspace,
    engine_generation,
    generation,
    layer_saved,
    math_scores,
    prompt_stage,
    update_kept,
)
from training.model import load
from training.model.trainable import STATE_BYTES

PHASES = ("generation", "update forward", "credit", "backward", "optimizer step")
COMPONENTS = (
    "weights",
    "grads",
    "optimizer",
    "cast cache",
    "KV cache",
    "activations",
    "logits",
    "attention",
    "workspace",
)


# ----------------------------------------------------------------------------- the model, from its config
def model_config(name):
    """The HF config of a model name, without its weights where possible (qwen3-4b: load.py's copy)."""
    from transformers import AutoConfig

    if name in load.RANDOM_MODELS:
        return load.qwen3_4b_config() if name == "qwen3-4b-random" else load.tiny_config(name, 260)
    if "qwen3-4b" in name.lower() and not os.path.isdir(name):
        return load.qwen3_4b_config()
    if os.path.isdir(name) and not load.adapter_dir(name):
        return AutoConfig.from_pretrained(name)
    return load.load_config(name)  # a GGUF file's metadata, a LoRA checkpoint's base, a hub name


# ----------------------------------------------------------------------------- the phases
def estimate(
    cfg, mc, device="cuda", prompt_tokens=256, widest=None, n_eval=None, release=False, cap=None
) -> dict:
    """{phase: {component: bytes}} for one GRPO step of cfg's shapes (every response max_new_tokens long,
    every row trained) on `device` under trainable.precision (departure 6; cap: the card's compute capability,
    None: the device's own); nothing is allocated. The docstring has each phase.
    widest: the widest prompt the decode engine is reserved for (Run's widest prompt); None: prompt_tokens.
    n_eval: the held-out questions of --eval-every (setup's count; None: cfg.eval_size when --eval-every is
    on, else 0). release: the engine released for the update (the plan's layout "released"), else resident.
    A size left at 0 is counted at shapes.SIZES'."""
    cfg = largest(cfg)
    s = read_shapes(cfg, mc, device, prompt_tokens, cap)  # the shapes and byte widths, once
    n_eval = (cfg.eval_size if getattr(cfg, "eval_every", 0) else 0) if n_eval is None else n_eval
    engine = engine_bytes(cfg, s, widest or s.P, n_eval)  # the decode engine's K, V buffers
    copy = s.decode_copy * (engine > 0)  # and its copy of the weights
    held = resident(cfg, mc, s, 0 if release else engine, 0 if release else copy)  # released: no engine
    fwd = Forward.of(cfg, mc, s)  # the forward's terms, read again later
    return {
        "generation": generation_phase(cfg, mc, s, held, engine, n_eval, copy * release),
        "update forward": forward_phase(cfg, mc, s, held, fwd),
        "credit": credit_phase(cfg, s, held, fwd),
        "backward": backward_phase(cfg, mc, s, held, fwd),
        "optimizer step": optimizer_phase(mc, s, held),
    }


def engine_bytes(cfg, s, widest, n_eval) -> int:
    """The run's decode engine's K, V buffers on CUDA (none on the CPU, without --share-prefix or on a model
    with sliding-window layers, whose rollouts HF generate decodes: Shapes.shared_rollout): 2 L Hkv hd S e in
    the width its step writes (the fused step's: the weights'; the model step's: the matmul's), S the widest
    prompt + R in multiples of 64 (engine.ALIGN), e the rows preflight.make_engine reserves (engine_rows)."""
    positions = 64 * -(-(widest - 1 + s.R) // 64)
    rows, width = engine_rows(cfg, n_eval), s.weight_bytes if s.decode_copy else s.matmul_bytes
    return s.cuda * s.shared_rollout * 2 * s.L * s.Hkv * s.hd * positions * rows * width


def resident(cfg, mc, s, engine, copy) -> dict:
    """{component: bytes} every phase holds: the weights (+ the reference model when beta > 0; under LoRA
    the reference is the same weights with the adapters off; + the decode engine's copy, `copy`), the
    gradients and the optimizer's states of what trains, autocast's copies of the weights it casts, and the
    decode engine's buffers (`engine`)."""
    N, N_cast, _ = param_counts(mc)
    trained = s.adapter_params if s.lora else N  # what has gradients and AdamW states
    cast = 2 * (s.adapter_params if s.lora else N_cast) if s.autocast and not s.kahan else 0
    state = STATE_BYTES["lora" if s.lora else "kahan" if s.kahan else "adamw"]  # as a checkpoint holds
    return {
        **dict.fromkeys(COMPONENTS, 0),
        "weights": N * s.weight_bytes * (1 + (cfg.beta > 0 and not s.lora))
        - s.four_bit * (s.weight_bytes - s.four_bit_bytes)  # 4-bit linears (departure 8)
        + s.four_bit_tables
        + s.adapter_params * 4
        + copy,
        "grads": trained * (4 if s.lora else s.weight_bytes),
        "optimizer": trained * state,
        "cast cache": cast,
        "KV cache": engine,
    }


def generation_phase(cfg, mc, s, held, engine, n_eval, copy) -> dict:
    """The larger of the rollout's decode (g rows, G a prompt) and held-out evaluation's (a chunk of n_eval
    questions, one row each): HF's cache grown by concatenation, or a chunk's prompts beside the run's
    engine, whose buffers and copy of the weights are here whatever the layout (`copy`: the copy, where the
    layout released it for the update and `held` has none). No gradients exist while it runs."""
    out = []
    for rows, n in [(s.g, cfg.group_size), (min(cfg.gen_chunk, n_eval), 1)]:  # the rollout, held-out
        if not rows:
            continue
        widths = (s.matmul_bytes, s.residual_bytes)
        chunk = (
            engine_generation(mc, rows, n, s.P, *widths, s.math or s.eager)
            if engine
            else generation(mc, rows, n, s.P, s.R, *widths, s.shared_rollout, s.math or s.eager)
        )
        phase = {**held, "grads": 0, **chunk}
        phase["weights"] += copy
        phase["KV cache"] += engine  # the engine's buffers beside the chunk
        phase["workspace"] += s.dequant  # a 4-bit layer's weight, dequantized for its matmul
        out.append(phase)
    return max(out, key=lambda x: sum(x.values()))


class Forward(NamedTuple):
    """The update forward's terms that the credit and backward phases read too (bytes)."""

    per_token: int  # what one decoder layer saves for backward, per token (layer_saved)
    kept: int  # what the forward keeps for backward after every layer (update_kept)
    batch: int  # the batch's ids and masks, sdpa's bool mask, old / reference log-probs
    layer: int  # one layer's forward workspace: its MLP, norms and sdpa's float mask
    logits: int  # a log-prob chunk's log-softmax, exp and product, fp32

    @classmethod
    def of(cls, cfg, mc, s):
        old = s.B * s.R * 4 * ((cfg.num_iterations > 1) + (cfg.beta > 0))  # old, reference log-probs, fp32
        layer = s.b * s.Tq * (3 * s.I * s.matmul_bytes + 2 * s.D * 4 + s.T * s.matmul_bytes)  # + float mask
        layer += s.b * s.Tq * 2 * max([o for _, o in s.adapters[0]], default=0) * s.matmul_bytes  # LoRA's B
        layer += math_scores(s.b, s.Hq, s.Tq, s.T) * (s.math or s.eager)  # the scores, probs (eager's too)
        return cls(
            layer_saved(
                mc, s.T, s.matmul_bytes, s.residual_bytes, lora=s.adapters, math=s.math, eager=s.eager
            ),
            kept_after(cfg, mc, s, s.L),
            s.B * s.T * (2 * 8 + 3) + s.b * s.Tq * s.T * (s.Hq > s.Hkv) + old,  # ids, masks; sdpa's
            layer,
            3 * s.b * s.c * s.V * 4,
        )


def kept_after(cfg, mc, s, n):
    """What the update's forward keeps after n decoder layers (terms.update_kept at the step's sizes)."""
    return update_kept(
        mc,
        n,
        s.b,
        s.k,
        s.P,
        s.T,
        s.matmul_bytes,
        s.residual_bytes,
        cfg.grad_checkpointing,
        s.adapters,
        s.math,
        s.eager,
    )


def captures(cfg):
    """Whether the training forward captures the attention maps (a signal that reads them, fused)."""
    return scoring.NEEDS.get(cfg.credit) == "attn" and not baselines.separate_pass(cfg)


def forward_phase(cfg, mc, s, held, fwd) -> dict:
    """The forward's peak, (activations, logits, workspace) of the largest: the log-prob chunks after the
    layers, the last layer's forward, or the capture of the last captured layer (its fp32 score blocks);
    the layer mean at the capture's end is made in place (Capture.maps), in the (b, T, T) buffer."""
    maps = captures(cfg)
    last = max(select_layers(cfg.layers, s.L)) + 1
    capture = capture_workspace(s.b, s.T, s.Hq, s.Hkv, s.hd, s.Tq, fused=s.cuda)
    paths = [
        (fwd.kept, fwd.logits, 0),
        (kept_after(cfg, mc, s, s.L - 1), 0, fwd.layer),
        (maps * kept_after(cfg, mc, s, last), 0, maps * capture),
    ]
    activations, logits, workspace = max(paths, key=sum)
    return {
        **held,
        "activations": activations,
        "attention": s.b * s.T * s.T * 4 if maps else 0,
        "logits": logits,
        "workspace": fwd.batch + workspace + s.dequant,
    }


def credit_phase(cfg, s, held, fwd) -> dict:
    """Fused: the captured maps (Capture.maps: in place) and trace_flow's fp64 copy, (b, T, T), beside what
    the forward keeps. A separate pass (baselines.assign before the update, no grad): the signal's own
    forward,
    n rows at a time (baselines.signal_scores), and its scores (B, T)."""
    T, B, fp64 = s.T, s.B, (8 + 8 * s.cuda) * (cfg.credit == "flow")  # trace_flow's fp64 copies
    if not baselines.separate_pass(cfg):
        return {
            **held,
            "cast cache": 0,
            "activations": fwd.kept,
            "attention": captures(cfg) * s.b * T * T * (4 + fp64),
            "workspace": fwd.batch,
        }
    maps = scoring.NEEDS.get(cfg.credit) == "attn"  # the signal reads attention maps
    n = s.b if cfg.credit in baselines.ROWWISE else B
    capture = maps * capture_workspace(n, T, s.Hq, s.Hkv, s.hd, fused=s.cuda)  # the rows' capture
    own = n * T * (3 * s.D * s.residual_bytes + T) + max(
        n * T * (3 * s.I * s.matmul_bytes + T * s.matmul_bytes), capture
    )  # hidden, bool mask
    return {
        **held,
        "grads": 0,
        "attention": maps * n * T * T * 4,  # the maps, (n, T, T)
        "workspace": B * T * (19 + 4 * (n < B))
        + n * T * 19 * (n < B)  # + a micro-batch's
        + max(own + s.dequant, maps * n * T * T * fp64),
    }  # forward or trace_flow


def backward_phase(cfg, mc, s, held, fwd) -> dict:
    """Backward's peak, (activations, logits, workspace) of the largest: one log-prob chunk recomputed, its
    gradient and the head's; the last layer (recomputed under checkpointing) and its gradients beside what
    the layers keep (the final norm's backward has run); the reference model's forward (beta > 0). The maps
    (b, T, T) are gone by then: grpo.update hands them to trace_flow and keeps only gamma.
    `head_grad`: autograd sums the LM head's gradient over the log-prob chunks in one (V, D) buffer, which
    the weight's AccumulateGrad takes only once every use of the weight has delivered its part: after the
    last chunk, so from the second chunk on; and with a tied embedding (Qwen3-4B, SmolLM2) only after the
    embedding's backward, the graph's last node, so through the whole decoder backward too (0.78 GB for
    Qwen3-4B in bf16; counted on the CPU: tests/memory/test_phases.py, test_the_tied_head_gradient_waits_...).
    `dq`: on CUDA a fused attention backward (cuDNN's, FlashAttention's, the memory-efficient one) sums dQ
    over the key blocks in an fp32 buffer of the queries' size (cuDNN frontend: dQ_accum), 0.13 GB here.
    LoRA: the head and the embedding are frozen, no (V, D) gradient; the adapters' gradients are small."""
    b, Tq, T, D, V, matmul = s.b, s.Tq, s.T, s.D, s.V, s.matmul_bytes
    head_grad = V * D * s.weight_bytes * (not s.lora)
    tied = bool(getattr(mc, "tie_word_embeddings", False))
    dq = s.cuda * b * s.Hq * Tq * s.hd * 4 * (not (s.math or s.eager))  # math or eager: dP, dS
    dq += math_scores(b, s.Hq, Tq, T) * (s.math or s.eager)
    final = b * Tq * (4 * D + (1 + (not s.lora)) * D * s.residual_bytes)  # LoRA: no normalised value kept
    log_softmax = b * s.c * V * (4 + matmul * (matmul != 4))  # a chunk's fp32 logits (+ their cast)
    chunk = max(3 * b * s.c * V * 4, log_softmax + head_grad) + (s.R > s.c) * head_grad
    replay = cfg.grad_checkpointing * (Tq < T) * b * s.P * 2 * matmul * s.hd * max(s.Hq, s.Hkv)  # prompt K, V
    last_layer = (
        b * Tq * (cfg.grad_checkpointing * fwd.per_token + 3 * s.I * matmul + 2 * D * 4)
        + s.I * D * (s.weight_bytes + matmul) * (not s.lora)
        + dq
        + replay
    )
    cast = held["cast cache"]  # the reference casts its own
    reference = (cfg.beta > 0) * (2 * b * T * D * s.residual_bytes + fwd.layer + fwd.logits + cast)
    shared = Tq < T  # two stages (policy.py departure 3): the head's gradient waits for no lookup
    paths = [
        (fwd.kept, chunk, 0),
        (fwd.kept - final, (not shared) * tied * head_grad, last_layer),
        (fwd.kept, 0, reference),
    ]
    if shared:  # the prompt's own backward, after the response pass's
        args = (s.matmul_bytes, s.residual_bytes, s.weight_bytes, cfg.grad_checkpointing, s.adapters, s.math)
        act, work = prompt_stage(mc, b, s.k, s.P, s.R, *args)
        paths.append((act, 0, work))
    activations, logits, workspace = max(paths, key=sum)
    return {
        **held,
        "cast cache": 0,
        "activations": activations,
        "attention": 0,
        "logits": logits,
        "workspace": fwd.batch + workspace + s.dequant,
    }


def optimizer_phase(mc, s, held) -> dict:
    """Weights, gradients and states, and the step's temporaries: torch's AdamW is foreach on CUDA (one fp32
    copy of v), fused on the CPU (none: trainable.make_optimizer); optimi's Kahan step has none on CUDA and
    one of the largest weight on the CPU (its for-loop)."""
    N, _, N_max = param_counts(mc)
    temp = (
        0
        if s.kahan and s.cuda
        else N_max * s.weight_bytes
        if s.kahan
        else (s.adapter_params if s.lora else N) * 4
        if s.cuda
        else 0
    )
    return {**held, "cast cache": 0, "workspace": s.B * s.T * 19 + temp}


def peak(est):
    """(phase, bytes) of the largest phase total."""
    return max(((ph, sum(c.values())) for ph, c in est.items()), key=lambda x: x[1])
