"""The bytes each part of one GRPO step holds, counted op by op: a decoder layer's saved tensors
(layer_saved), what the update's forward keeps for backward (kept, update_kept) and the shared prompt's own
backward (prompt_stage), the attention capture's
workspace (capture_workspace) and generation's KV cache and prefill (generation, prefilled_rows, and a chunk
beside the run's decode engine: engine_generation; the engine's copy of the weights: decode_copy).
training/memory/phases.py's estimate adds them into its phases; each function's docstring has its terms.
Shapes: L layers, D hidden, I intermediate, V vocabulary, Hq / Hkv query / key-value heads of hd each;
P prompt, R response, T = P + R tokens; matmul_bytes the bytes of a matmul's output, residual_bytes those of
the residual stream (shapes.Shapes).

Run: python eval.py memory --model qwen3-4b-random    (the estimate these terms make up)
"""

from flowtracer import auto_chunk
from training.decode.decode_weights import GROUPS, config_problem


def generation(mc, g, G, P, R, matmul_bytes, residual_bytes, shared=True, math=False):
    """{"KV cache", "workspace"} at generation's peak for a chunk of g rows, the larger of the prefill (the
    rows' prompts, P wide, at the last layer: its attention with the (rows, P, P) bool mask and sdpa's float
    copy, q, output and K, V repeated to the query heads, or its MLP) and the decode: HF generate's cache
    grown to T = P + R by concatenation (one layer's K copied on top); with prefix sharing, the first decode
    step, which moves each layer's cache of the rows (copied from its prompt's, P wide) into one reserved at
    T, beside that layer's cache of the prompts (reserved at T); and the copy to the rows (rollout.generate
    frees a chunk's cache before the next chunk's prefill). Sampling takes 5 of (g, V) fp32. The prefills
    keep one position's logits (logits_to_keep=1), (k, 1, V), made after the layers' peak has passed: the
    full (k, P, V) ones, 0.3 GB a 1K prompt for Qwen3 in bf16, are never made. math: the prefill's attention
    runs on SDPA's math kernel (math_scores)."""
    L, V, Hkv = mc.num_hidden_layers, mc.vocab_size, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    T, k = P + R, prefilled_rows(g, G, shared)
    kv = lambda rows, t: 2 * L * Hkv * hd * t * rows * matmul_bytes  # noqa: E731
    prefill = prefill_workspace(mc, k, P, matmul_bytes, residual_bytes, math)
    if k < g:  # prefix sharing: each prompt's cache reserved at T
        peaks = [
            (kv(k, T), prefill),
            (kv(k, T) + kv(g, P), 0),
            (kv(g, T) + (kv(g, P) + kv(k, T)) // L, 5 * g * V * 4),
        ]
    else:
        peaks = [(kv(g, P), prefill), (kv(g, T), Hkv * hd * T * g * matmul_bytes + 5 * g * V * 4)]
    cache, workspace = max(peaks, key=sum)
    return {"KV cache": cache, "workspace": workspace}


def engine_generation(mc, g, G, P, matmul_bytes, residual_bytes, math=False):
    """{"KV cache", "workspace"} of a chunk of g rows decoded by the run's engine (training/decode/engine.py),
    beside its buffers (counted by the caller: they are reserved for the run): each distinct prompt's cache, P
    wide (rollout.generate reserves no room for the engine), prefilled (prefill_workspace), then copied into
    the buffers a layer's keys (or values) at a time, (g, Hkv, P, d), and kept through the decode, whose steps
    hold sampling's 5 (g, V) fp32. G: the rows of a prompt (1: held-out evaluation). math: as generation's."""
    L, Hkv = mc.num_hidden_layers, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    k, kv = prefilled_rows(g, G), lambda rows: Hkv * hd * P * rows * matmul_bytes  # noqa: E731 one layer's K
    peaks = [
        (2 * L * kv(k), prefill_workspace(mc, k, P, matmul_bytes, residual_bytes, math)),
        (2 * L * kv(k) + kv(g), 0),
        (2 * L * kv(k), 5 * g * mc.vocab_size * 4),
    ]
    cache, workspace = max(peaks, key=sum)
    return {"KV cache": cache, "workspace": workspace}


def decode_copy(mc, linears, adapted, rank, weight_bytes):
    """Bytes of the decode engine's copies of the weights (training/decode/decode_weights.py), 0 where its
    fused step cannot read the model (config_problem). Full fine-tuning (no `adapted`): per layer Q, K and V
    merged, (Hq + 2 Hkv) hd x D, and gate and up merged, 2 I x D. LoRA: per layer and group (GROUPS) its
    adapters' low-rank pair, A (r a, in) and the block-diagonal B (out, r a), a the group's adapted linears.
    A stacked group's biases (Q, K, V's where attention_bias) are a copy too. linears: one decoder layer's
    ((name, in, out), ...) (shapes.counts); adapted: the names LoRA adapts; all in the weights' width."""
    if config_problem(mc):
        return 0
    size = {n: (i, o) for n, i, o in linears}
    per_layer = 0
    for g in GROUPS:
        inp, out = size[g[0]][0], sum(size[n][1] for n in g)
        r = rank * sum(n in adapted for n in g)
        per_layer += r * (inp + out) + (not adapted and len(g) > 1) * out * inp
        per_layer += (len(g) > 1 and getattr(mc, "attention_bias", False) and "q_proj" in g) * out
    return mc.num_hidden_layers * per_layer * weight_bytes


def prefill_workspace(mc, k, P, matmul_bytes, residual_bytes, math=False):
    """Bytes a prefill of k prompts, P wide, holds beside its cache at its peak, the last layer: the hidden
    states, positions and masks, its attention (the (k, P, P) bool mask and sdpa's float copy, q, output, K
    and V repeated to the query heads; on SDPA's math kernel its scores too, math_scores) or its MLP, and one
    position's logits (logits_to_keep=1)."""
    D, I, Hq, Hkv = mc.hidden_size, mc.intermediate_size, mc.num_attention_heads, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or D // Hq
    attn = k * P * (P * (1 + matmul_bytes) + Hq * hd * matmul_bytes * (2 + 2 * (Hq > Hkv)) + 4 * Hq)
    attn += math * math_scores(k, Hq, P, P)  # the math kernel's
    mlp = k * P * (P + 3 * I * matmul_bytes)
    hidden = k * P * (3 * D * residual_bytes + 2 * hd * residual_bytes + 32)  # + ids, positions, masks
    return hidden + max(attn, mlp) + 5 * k * mc.vocab_size * 4


def prefilled_rows(g, G, shared=True):
    """The rows rollout.generate prefills at once in a chunk of g rows (and the prompts the update reads in a
    micro-batch of g): with prefix sharing (--share-prefix) each distinct prompt once, else all g."""
    return g if not shared else g // G if g % G == 0 else min(g, g // G + 2)


def kept(mc, n, layer_bytes, residual_bytes, checkpointed, lora=()):
    """Bytes per token the training forward keeps for backward after n decoder layers (with the final norm
    at n = L). Each layer: checkpointed, its input (b, T, D); else its layer_saved, and in fp32 its output
    too (the next RMSNorm saves it; in bf16 that norm saves a fp32 copy, counted in layer_saved). Then the
    hidden state (n < L), or the final norm's fp32 input, normalised value and output (n = L); under LoRA
    (`lora`: its adapted linears) the frozen norm keeps no normalised value."""
    D = mc.hidden_size
    per_layer = D * residual_bytes if checkpointed else layer_bytes + 4 * D * (residual_bytes == 4)
    last = D * residual_bytes if n < mc.num_hidden_layers else 4 * D + (1 + (not lora)) * D * residual_bytes
    return n * per_layer + last


def update_kept(
    mc,
    n,
    b,
    k,
    P,
    T,
    matmul_bytes,
    residual_bytes,
    checkpointed,
    lora=((), 0, False),
    math=False,
    eager=False,
):
    """Bytes the update's forward over b rows of T tokens keeps after n decoder layers: one pass (kept), or,
    with k < b distinct prompts (policy.response_states), the prompt pass over k x P tokens, the response
    pass over b x (T - P) queries, and per layer the keys and values the responses read: unchecked, sdpa's of
    the b x P prompt columns (GQA: repeated to the query heads); checkpointed, PromptKV's of the k prompts,
    which wait for the layers' replay in backward (the b rows' copies are made inside the replayed layer).
    math: the attention runs on SDPA's math kernel; eager: the model's own eager attention (layer_saved)."""
    if k == b:
        per_token = layer_saved(mc, T, matmul_bytes, residual_bytes, lora=lora, math=math, eager=eager)
        return b * T * kept(mc, n, per_token, residual_bytes, checkpointed, lora[0])
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    heads = mc.num_key_value_heads if checkpointed else max(mc.num_attention_heads, mc.num_key_value_heads)
    kv = 2 * matmul_bytes * hd * (k if checkpointed else b) * heads  # PromptKV's of the k prompts; sdpa's
    prompt, rows = (
        layer_saved(mc, t, matmul_bytes, residual_bytes, lora=lora, math=math, eager=eager) for t in (P, T)
    )
    return (
        k * P * kept(mc, n, prompt, residual_bytes, checkpointed, lora[0])
        + n * P * kv
        + b * (T - P) * kept(mc, n, rows, residual_bytes, checkpointed, lora[0])
    )


def prompt_stage(
    mc, b, k, P, R, matmul_bytes, residual_bytes, weight_bytes, checkpointed, lora=((), 0, False), math=False
):
    """(activations, workspace): bytes the shared prompt's own backward holds at its first layer (policy.py
    departure 3: the response pass is differentiated and freed before it). Activations: what the prompt pass
    over k prompts of P tokens keeps (kept, its final norm's backward run), its keys and values' gradients
    from the response pass, (k, Hkv, P, hd) each a layer, and under checkpointing PromptKV's keys and values
    themselves, and the responses' embeddings' gradient, (b, R, D), for the one lookup's backward at the end.
    Workspace: that layer recomputed (checkpointed) and its backward, one weight's gradient made; or the
    lookup's backward, the embedding's dense (V, D) gradient beside its input's (k P + b R, D)."""
    D, I, V, L = mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.num_hidden_layers
    Hq, Hkv = mc.num_attention_heads, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or D // Hq
    per_token = layer_saved(mc, P, matmul_bytes, residual_bytes, lora=lora, math=math)
    final = 4 * D + (1 + (not lora[0])) * D * residual_bytes  # the final norm's, as kept counts it
    kv = L * P * 2 * matmul_bytes * hd * k * Hkv  # every layer's keys and values of the k prompts
    activations = (
        k * P * (kept(mc, L, per_token, residual_bytes, checkpointed, lora[0]) - final)
        + kv * (1 + checkpointed)
        + b * R * D * residual_bytes
    )
    layer = k * P * (checkpointed * per_token + 3 * I * matmul_bytes + 2 * D * 4)
    layer += I * D * (weight_bytes + matmul_bytes) * (not lora[0]) + math * math_scores(k, Hq, P, P)
    lookup = (V * D * weight_bytes * (not lora[0]) + (k * P + b * R) * D * residual_bytes) * (not lora[0])
    return max((activations, layer), (0, lookup), key=sum)


def capture_workspace(b, T, Hq, Hkv, hd, Tq=None, fused=False):
    """Bytes flowtracer.Capture.take holds beside its (b, T, T) buffer. add_head_mean (the CPU's): fp32 q
    (Tq queries: T, or R after a shared prompt), k, two fp32 score blocks of <= 2^25 floats (auto_chunk; a
    chunk's are freed before the next chunk's are made), two (b, c, T) sums. fused (CUDA: the Triton kernel
    of gpu_kernels/head_mean.py): its two (b, Hq, Tq) fp32 row statistics, no score block."""
    if fused:
        return 2 * b * Hq * (Tq or T) * 4
    c = min(Tq or T, auto_chunk(b, Hq, T))  # query rows per block
    return 4 * (b * (Tq or T) * Hq * hd + b * T * Hkv * hd + 2 * b * Hq * T * c + 2 * b * T * c)


def layer_saved(
    mc, T, matmul_bytes, residual_bytes, padded=True, lora=((), 0, False), math=False, eager=False
):
    """Bytes per token that one decoder layer (HF Qwen3 / Llama, sdpa) saves for its backward, i.e. what the
    recomputation in backward re-creates under checkpointing. Counted op by op (autograd saves an operand
    only where the other one needs a gradient): each RMSNorm its fp32 input (or fp32 copy), the normalised
    value and its output; the per-head q/k norms of Qwen3 their input and normalised value; sdpa its q,
    k and v (k, v repeated to the Hq heads when a padding mask is passed), output, logsumexp and the
    mask as a (b, 1, T, T) float; the SwiGLU MLP gate, silu, up and their product, (I,) each.
    Equal to memtrace.track_peak's count on the CPU for both dtypes (tests/memory/test_phases.py).
    lora = (the adapted linears' [(in, out)], rank, cuda): frozen norm weights keep no normalised value, and
    each adapter keeps its A's output (r); on CUDA peft casts each adapter's input to fp32 and autocast back
    to bf16, a copy of the input per adapter, where the frozen base's matmul keeps none (departure 5).
    math: sdpa runs its math kernel, which saves other tensors (sdpa_saved). eager: the model runs its own
    eager attention (flowtracer's "eager_capture": Gemma-2, GPT-OSS), which keeps its probabilities
    (eager_saved); the rest of the layer is counted as Qwen3's / Llama's (Gemma-2's four norms and GELU,
    GPT-OSS's experts are not held to a count)."""
    D, I, Hq, Hkv = mc.hidden_size, mc.intermediate_size, mc.num_attention_heads, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or D // Hq
    q, k, qwen, gqa = Hq * hd, Hkv * hd, mc.model_type == "qwen3", padded and Hq > Hkv
    # each norm: its fp32 input (or fp32 copy), the normalised value (its input's width), its output
    norms = (4 * D * (residual_bytes != 4) + residual_bytes * D + matmul_bytes * D) + (
        4 * D + residual_bytes * D + matmul_bytes * D
    )  # input, post-attn
    qk_norms = qwen * (4 + matmul_bytes) * (q + k)
    sdpa = (
        eager_saved(mc, q, T, matmul_bytes)
        if eager
        else sdpa_saved(q, k, Hq, T, matmul_bytes, gqa, padded, math)
    )
    rsqrt = 4 * (2 + qwen * (Hq + Hkv))
    lin, r, cuda = lora
    if lin:  # LoRA's terms (departure 5)
        norms -= 2 * residual_bytes * D
        qk_norms -= qwen * matmul_bytes * (q + k)
        adapters = len(lin) * r * matmul_bytes + cuda * matmul_bytes * (sum(i for i, _ in lin) - 2 * D - I)
        return norms + qk_norms + sdpa + rsqrt + 4 * I * matmul_bytes + adapters
    return norms + qk_norms + sdpa + rsqrt + 4 * I * matmul_bytes


def sdpa_saved(q, k, Hq, T, matmul_bytes, gqa, padded, math=False):
    """Bytes per token (per query) sdpa saves for its backward; q, k: the query and key widths (Hq hd,
    Hkv hd). A fused kernel (flash, memory-efficient, cuDNN, the CPU's flash): q, k and v (k, v repeated to
    the Hq heads when a padding mask is passed: gqa), its output, the logsumexp and the mask as a float.
    The math kernel (torch's _scaled_dot_product_attention_math; the fallback where no fused kernel takes
    the dtype: bf16 below compute capability 8.0, trainable.precision): q and k scaled and v in fp32 (bf16 and
    fp16 inputs are upcast: torch's allow_fp16_bf16_reduction_math_sdp is off by default) at the Hq heads,
    the output, and the probabilities (b, Hq, Tq, T) in fp32: 4 Hq T per query, the score matrices."""
    if math:
        return 3 * 4 * q + matmul_bytes * q + 4 * Hq * T
    return matmul_bytes * (q + (2 * q if gqa else 2 * k) + q + padded * T) + 4 * Hq


def eager_saved(mc, q, T, matmul_bytes):
    """Bytes per query the model's own eager attention saves for its backward (eager_attention_forward of
    its modeling file, under "eager_capture"), counted op by op: q, K and V repeated to the Hq heads, and
    the output, q wide each; then the probabilities, (b, Hq, Tq, T): softmax's fp32 output and its cast to
    the matmul dtype (Llama's eager, Gemma-2's), after Gemma-2's soft-cap the tanh's output too; GPT-OSS's
    softmax runs in the matmul dtype over the T keys and its sink, and keeps the max's int64 indices.
    Equal to track_peak's count of Gemma-2's and GPT-OSS's attention in both dtypes (tests/
    test_eager_capture.py)."""
    Hq, mb = mc.num_attention_heads, matmul_bytes
    if mc.model_type == "gpt_oss":  # sinks: one more logit a row, softmax in the matmul dtype
        return 4 * q * mb + Hq * (T + 1) * mb + 8 * Hq
    softcap = getattr(mc, "attn_logit_softcapping", None) is not None  # Gemma-2: tanh keeps its output
    return 4 * q * mb + Hq * T * (4 + mb * (mb != 4) + softcap * mb)


def math_scores(b, Hq, Tq, T):
    """Bytes of the score matrices SDPA's math kernel makes beside what it saves (sdpa_saved), for b rows of
    Tq queries over T keys: in the forward the fp32 scores and their softmax, (b, Hq, Tq, T) each; in the
    backward the gradients of the probabilities and of the scores, as many."""
    return 2 * b * Hq * Tq * T * 4
