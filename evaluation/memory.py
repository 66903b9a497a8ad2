"""What one GRPO step holds in memory, and how Qwen3-4B fits on one 80 GB GPU.

The step of grpo.py (16 prompts x 8, 1,024 new tokens, micro-batch 8) in five phases, each with its peak:
  generation      weights + optimizer states + KV cache (2 L Hkv hd T g bf16: 147 KB per token for Qwen3-4B),
                  at the prefill, the copy of each prompt's cache to its rows, or the last decode step
  update forward  + gradients (from the 2nd micro-batch on) + what the forward keeps for backward (kept:
                  each layer's input under --grad-checkpointing, else its layer_saved: 68 GB more for
                  Qwen3-4B at 1K; a prompt its rows share once, update_kept) + either the attention capture
                  (a (b, T, T) fp32 buffer; on the CPU fp32 score blocks of <= 2^25 floats, auto_chunk; on
                  CUDA the fused kernel's row statistics) or the log-prob chunks (3 x (b, 128, V))
  credit          fused: + the captured maps (one buffer: Capture.maps works in place) and trace_flow's fp64
                  copy, (b, T, T) each; a separate pass (credit.separate_pass): before the update, the
                  signal's own forward and its (n, T, T) maps, n = b rows a forward for a signal whose rows
                  are scored alone (credit.ROWWISE, the scores of all B kept), else all B
  backward        + one decoder layer recomputed (layer_saved, counted op by op), one log-prob chunk, or the
                  reference model's forward (--beta > 0, whose weights are resident in every phase)
  optimizer step  weights + gradients + states (+ torch's foreach AdamW: one fp32 copy of v on CUDA)
--num-iterations > 1 keeps the old log-probs, (B, R) fp32, through the update; --beta > 0 the reference's.
On CUDA the decode engine (training/engine.py) is kept for the run with its graphs, so its K, V buffers,
2 L Hkv hd S e bf16, stay resident in every phase: S is the run's widest prompt (`widest`: its training
prompts after --max-prompt-tokens and its held-out ones, Run.widest_prompt) + R, in multiples of 64, and e the
rows preflight.make_engine reserves at setup, min(gen_chunk, max(B, held-out questions)) (engine_rows);
held-out evaluation decodes in the same buffers (no second cache), its chunk counted beside the rollout's in
generation (footprint.engine_generation: a chunk's prompts' cache beside the engine). Or, where plan() picks
the layout "released" (LAYOUTS), the engine is freed after each rollout (training/backoff.py) and the update's
phases hold none of it.
estimate() computes them from the config (parameters counted on the meta device), nothing allocated; the
terms of a layer, the update's forward, the capture and generation are counted in evaluation/footprint.py;
memtrace.py measures a real step (track_peak counts its live tensor storages on the CPU; on a GPU,
torch.cuda.max_memory_allocated); tests/test_memory.py holds the estimate within 10% of the count.
On a GPU the tensors are not all: margin() adds the CUDA context and cuBLAS workspace (1 GB) and the
allocator's fragmentation, up to one chunk's prompt cache (see margin); fit() keeps tensors + margin under
80 GB.
The disk: a checkpoint holds the weights and the optimizer state (checkpoint.checkpoint_bytes), and from the
second save two coexist (grpo.py checks the free space at setup).

The scheme that fits Qwen3-4B (bf16 weights, gradients and AdamW states + a bf16 Kahan compensation,
10 B/param) and why the fp32 design does not (16 B/param + autocast's bf16 weight cache): docs/method.md.

Departures (numbered):
 1. A separate credit pass is counted as attention.attention_graph's forward and trace_flow (flow,
    attention) or a plain forward (other signals); the own forwards of OAR, fai and gradient are not.
 2. Every response is taken at max_new_tokens and every row trained (the worst step); the padded prompt
    width is --prompt-tokens (default 256, a math problem with its template), not max_prompt_tokens.
 3. On CUDA, trace_flow's triangular solve is given one more fp64 (b, T, T) copy than on the CPU (cuBLAS
    trsm layout). The autocast (fp32 weights) path is counted, not validated. The margin (context,
    workspace, fragmentation) is assumed, not measured.
 4. Validated on one H100 (2026-11-25, main at 9550070, `python benchmarks/gpu_headline.py --max-new-tokens
    1024 --rounds 2`, docs/gpu.md): every phase within 0.2% of torch.cuda.max_memory_allocated but the
    backward, 44.24 GB against 50.39. Two terms it held are counted since (estimate, backward: `held`, `dq`):
    the tied head's (V, D) gradient through the decoder backward (+0.78 GB; the CPU's tiny V hid it) and the
    fused attention backward's fp32 dQ buffer (+0.13 GB): 45.10 GB, 0.895. The other ~5.2 GB are not pinned
    down, and no factor stands in for them. Ruled out by reading and by the phases that do match: the SDPA
    math fallback (its (b, H, T, T) fp32 scores would show in the forward too, which matches), the autocast
    cache (bf16 weights: nothing to cast), fp32 gradients (they would show in every phase). Not ruled out:
    the workspace cuDNN's attention backward takes from the caching allocator (the H100's default backend
    for a masked bf16 sdpa with grad; its size is cuDNN's choice, up to b H Tq T 2 = 0.67 GB a layer for a
    dP workspace, not known here). To pin it, on the GPU: `python eval.py memory --model qwen3-4b-random
    --measure --snapshot runs/backward.pickle` (memtrace.cuda_peak records the backward, held_at_peak
    prints the blocks live at its peak by site).
 5. LoRA (--lora-rank, scheme "lora"): the frozen base's weights (bf16 on CUDA, fp32 on the CPU), the fp32
    adapters with their gradients and fp32 AdamW states, autocast's bf16 copies of the adapters on CUDA; no
    (V, D) head or embedding gradient; per layer each adapter's A output (r) kept for backward, and the
    normalised values the frozen RMSNorms no longer keep left out (layer_saved). Held within 10% of a CPU
    step (tests/test_budget.py); on CUDA peft casts each adapter's input to fp32 and autocast casts it back,
    a bf16 copy per adapted linear where the frozen base keeps none: counted, not measured on a GPU.
 6. --precision (policy.precision, on a card of compute capability `cap`: eval.py memory --capability, else
    the visible GPU's, else 8.0): the weights' bytes in its dtype (fp16 and bf16 2, fp32 4), matmul outputs
    and autocast's copies only under an autocast; and the attention kernel the card runs. Below 8.0 SDPA's
    fused kernels refuse bf16 and its math kernel runs: it keeps fp32 q, k, v and the probabilities,
    (b, Hq, Tq, T), for backward (footprint.sdpa_saved), and makes the scores and their softmax in the
    forward and two gradients of that size in the backward (footprint.math_scores), where a fused kernel
    keeps a logsumexp and an fp32 dQ. fp16 and fp32 there run the memory-efficient kernel: counted as the
    fused one. Not measured on such a card.
The card: fit() and report() budget one 80 GB GPU (GPU) unless --gpu-gb says otherwise; plan() picks the
sizes and the engine's layout grpo.py's setup uses on CUDA (training/run.py's size_to_card, before the weights
load; report() prints its table: planned()), within (1 - RESERVE) of the card, and what_fits() names what
would fit a card too small. Where the estimate proves wrong on the card, grpo.py backs off
(training/backoff.py) instead of losing the run.

Run: python eval.py memory --model qwen3-4b-random                       # the table, in a second
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 24   # LoRA on a 24 GB card
     python eval.py memory --model qwen3-4b-random --lora-rank 16 --gpu-gb 16 --capability 7.5   # a T4: fp16
     python eval.py memory --model qwen3-4b-random --max-new-tokens 8192 --gen-chunk 16 --micro-batch 4
     python eval.py memory --model tiny-qwen3 --measure --max-new-tokens 64   # estimate vs a real step
"""
import dataclasses
import functools
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch

from evaluation.footprint import (
    capture_workspace,
    engine_generation,
    generation,
    layer_saved,
    math_scores,
    prefill_rows,
    update_kept,
)
from flowtracer import select_layers as select
from training import credit, models, signals
from training.budget import SIZES, largest
from training.checkpoint import STATE_BYTES, checkpoint_bytes
from training.policy import precision, precision_problem, scheme

GB, GiB = 1e9, 2 ** 30
GPU = 80 * GB               # one 80 GB GPU (A100 / H100), the paper's
CONTEXT = 1 * GB            # CUDA context + cuBLAS / cuBLASLt workspaces, beside the tensors (assumed)
RESERVE = 0.1               # the share of a card a plan leaves free (departure 4: the backward's estimate
                            # 10.5% below the H100's measure, not pinned down); report() and run.size_to_card
                            # plan (1 - RESERVE) of it: a 16 GB T4 (15.8e9 bytes exposed) gets <= 14.4 GB
PHASES = ("generation", "update forward", "credit", "backward", "optimizer step")


# ----------------------------------------------------------------------------- the accounting (analytic)
COMPONENTS = ("weights", "grads", "optimizer", "cast cache", "KV cache", "activations", "logits", "attention",
              "workspace")


def model_config(name):
    """The HF config of a model name, without its weights where possible (qwen3-4b: models.py's copy)."""
    from transformers import AutoConfig
    if name in models.RANDOM_MODELS:
        return models.qwen3_4b_config() if name == "qwen3-4b-random" else models.tiny_config(name, 260)
    if "qwen3-4b" in name.lower() and not os.path.isdir(name):
        return models.qwen3_4b_config()
    if os.path.isdir(name) and not models.adapter_dir(name):
        return AutoConfig.from_pretrained(name)
    return models.load_config(name)            # a GGUF file's metadata, a LoRA checkpoint's base, a hub name


def param_counts(mc):
    """(N, N cast by autocast, largest tensor) for a config, from a model built on the meta device."""
    return counts(mc.to_json_string())[:3]


@functools.cache
def counts(config_json):
    """param_counts, the LoRA'd linears' ((name, in, out), ...) and every module's name, of a config (JSON:
    hashable, so plan's many estimates build the meta model once)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    import json
    mc = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(mc)
    ps = list(m.parameters())                                   # tied weights appear once
    emb = m.get_input_embeddings().weight
    cast = sum(p.numel() for p in ps if p.ndim == 2 and (p is not emb or mc.tie_word_embeddings))
    head = m.get_output_embeddings()
    linears = tuple((n.rsplit(".", 1)[-1], x.in_features, x.out_features) for n, x in m.named_modules()
                    if isinstance(x, torch.nn.Linear) and x is not head and ".layers.0." in f".{n}")
    return sum(p.numel() for p in ps), cast, max(p.numel() for p in ps), linears, \
        frozenset(n.rsplit(".", 1)[-1] for n, _ in m.named_modules())


def lora_linears(cfg, mc):
    """[(in, out)] of one decoder layer's linears that get adapters under --lora-targets (all-linear: every
    one, the LM head is not in a layer; a target outside the layers, lm_head, is not counted); ValueError
    naming a target that no module of the model is called (a run grpo.py refuses: policy.lora_problem)."""
    names = None if cfg.lora_targets == "all-linear" else \
        {t.strip().rsplit(".", 1)[-1] for t in cfg.lora_targets.split(",") if t.strip()}
    _, _, _, layer, modules = counts(mc.to_json_string())
    unknown = sorted((names or set()) - modules)
    if unknown:
        raise ValueError(f"--lora-targets {cfg.lora_targets}: no module of a {mc.model_type} model is called "
                         f"{', '.join(map(repr, unknown))} (a decoder layer's linears: "
                         f"{', '.join(sorted({n for n, _, _ in layer}))}; or all-linear)")
    got = [(i, o) for n, i, o in layer if names is None or n in names]
    widest = max((min(i, o) for i, o in got), default=0)
    if got and getattr(cfg, "lora_rank", 0) > widest:             # grpo.py refuses it (policy.lora_problem)
        raise ValueError(f"--lora-rank {cfg.lora_rank} is more than any adapted layer's rank, "
                         f"min(d_in, d_out) <= {widest}")
    return got


def engine_rows(cfg, n_eval=0):
    """The rows the run's decode engine is reserved for (training/preflight.py's make_engine): a chunk of
    the rollout's B rows or of held-out evaluation's n_eval questions, the wider, at most gen_chunk."""
    return min(cfg.gen_chunk or SIZES["gen_chunk"], max(cfg.prompts_per_step * cfg.group_size, n_eval))


def estimate(cfg, mc, device="cuda", prompt_tokens=256, widest=None, n_eval=None, release=False,
             cap=None) -> dict:
    """{phase: {component: bytes}} for one GRPO step of cfg's shapes (every response max_new_tokens long,
    every row trained) on `device` under policy.precision (departure 6; cap: the card's compute capability,
    None: the device's own); nothing is allocated. The docstring has each term.
    widest: the widest prompt the decode engine is reserved for (Run.widest_prompt); None: prompt_tokens.
    n_eval: the held-out questions of --eval-every (setup's count; None: cfg.eval_size when --eval-every is
    on, else 0). release: the engine released for the update (plan's layout "released"), else resident.
    A size left at 0 is counted at SIZES' (largest)."""
    cfg = largest(cfg)
    N, N_cast, N_max = param_counts(mc)
    L, D, I, V = mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size
    Hq, Hkv = mc.num_attention_heads, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or D // Hq
    prec = precision(cfg, device, cap)          # dtypes, scheme, the attention kernel (departure 6)
    cuda, kahan, lora = torch.device(device).type == "cuda", prec.scheme == "kahan", prec.scheme == "lora"
    wb = prec.weights.itemsize                  # bytes of a weight and of its gradient (lora: the base's)
    rb = wb                                     # the residual stream: embedding output, + bf16 sublayers
    cb = 2 if prec.autocast or kahan else 4     # matmul outputs (bf16 / fp16 autocast)
    math = prec.math_sdpa                       # SDPA's math kernel: fp32 scores (b, Hq, Tq, T)
    P, R = prompt_tokens, cfg.max_new_tokens
    T, B = P + R, cfg.prompts_per_step * cfg.group_size
    g, b, c = min(cfg.gen_chunk, B), min(cfg.micro_batch, B), min(cfg.logprob_chunk, R)
    separate = credit.separate_pass(cfg)                            # credit's own pass before the update
    maps = signals.NEEDS.get(cfg.credit) == "attn"                  # the signal reads attention maps
    layers = maps and not separate                                  # the fused pass captures the maps
    lin = lora_linears(cfg, mc) if lora else []                     # one layer's adapted linears (in, out)
    r = getattr(cfg, "lora_rank", 0)
    lk = (lin, r, prec.autocast is not None)                        # what layer_saved needs of LoRA
    n_a = L * r * sum(i + o for i, o in lin)                        # adapter parameters, fp32
    cast = 2 * (n_a if lora else N_cast) if prec.autocast and not kahan else 0   # autocast's copies
    state = STATE_BYTES[prec.scheme]            # AdamW m, v (+ Kahan compensation), as a checkpoint holds
    S = 64 * -(-((widest or P) - 1 + R) // 64)                      # the decode engine's positions (ALIGN)
    n_eval = (cfg.eval_size if getattr(cfg, "eval_every", 0) else 0) if n_eval is None else n_eval
    e = engine_rows(cfg, n_eval)                                    # rows as preflight.make_engine reserves
    engine = cuda * cfg.share_prefix * 2 * L * Hkv * hd * S * e * cb  # its K, V buffers, reserved for the run
    trained = n_a if lora else N                                    # what has gradients and AdamW states
    w = dict(weights=N * wb * (1 + (cfg.beta > 0 and not lora)) + n_a * 4,
             grads=trained * (4 if lora else wb), optimizer=trained * state,
             **{"cast cache": cast, "KV cache": 0 if release else engine})   # released: not in the update
    # (+ the reference policy when beta > 0; under LoRA it is the same weights with the adapters off)
    zero = dict.fromkeys(COMPONENTS, 0)
    decodes = [(g, cfg.group_size), (min(cfg.gen_chunk, n_eval), 1)]            # the rollout's, held-out's
    gens = [{**zero, **w, "grads": 0,
             **(generation(mc, rows, n, P, R, cb, rb, cfg.share_prefix, math) if not engine
                else engine_generation(mc, rows, n, P, cb, rb, math))}
            for rows, n in decodes if rows]
    for x in gens:
        x["KV cache"] += engine                                    # the engine's buffers beside the chunk
    gen = max(gens, key=lambda x: sum(x.values()))                      # the larger of the two decodes
    ls, ckpt = layer_saved(mc, T, cb, rb, lora=lk, math=math), cfg.grad_checkpointing   # the forward keeps
    k = prefill_rows(b, cfg.group_size, cfg.share_prefix)                  # prompts it reads per micro-batch
    acts = update_kept(mc, L, b, k, P, T, cb, rb, ckpt, lk, math)
    Tq = T - P if k < b else T                                            # queries of the last pass, a row
    old = B * R * 4 * ((cfg.num_iterations > 1) + (cfg.beta > 0))       # old, reference log-probs (B, R) fp32
    batch = B * T * (2 * 8 + 3) + b * Tq * T * (Hq > Hkv) + old          # ids, masks; sdpa's bool mask
    layer_fwd = b * Tq * (3 * I * cb + 2 * D * 4 + T * cb)              # + sdpa's float mask
    layer_fwd += b * Tq * 2 * max([o for _, o in lin], default=0) * cb   # LoRA: B's output, scaled, transient
    layer_fwd += math_scores(b, Hq, Tq, T) * math                         # the math kernel's scores, probs
    cap_ws = capture_workspace(b, T, Hq, Hkv, hd, Tq, fused=cuda)
    logits = 3 * b * c * V * 4                                            # log-softmax, exp, product (fp32)
    # the forward's peak, (activations, logits, workspace) of the largest: the log-prob chunks after the
    # layers, the last layer's forward, or the capture of the last captured layer (its fp32 score blocks);
    # the layer mean at the capture's end is made in place (Capture.maps), in the buffer counted below
    last = max(select(cfg.layers, L)) + 1
    paths = [(acts, logits, 0), (update_kept(mc, L - 1, b, k, P, T, cb, rb, ckpt, lk, math), 0, layer_fwd),
             (layers * update_kept(mc, last, b, k, P, T, cb, rb, ckpt, lk, math), 0, layers * cap_ws)]
    a_fwd, l_fwd, ws_fwd = max(paths, key=sum)
    fwd = {**zero, **w, "activations": a_fwd, "attention": b * T * T * 4 if layers else 0, "logits": l_fwd,
           "workspace": batch + ws_fwd}
    fp64 = (8 + 8 * cuda) * (cfg.credit == "flow")                         # trace_flow's fp64 copies
    if separate:     # credit.assign before the update, no grad: the signal's own forward, n rows at a time
        n = b if cfg.credit in credit.ROWWISE else B                # (credit.signal_scores); scores (B, T)
        cap_all = maps * capture_workspace(n, T, Hq, Hkv, hd, fused=cuda)           # the rows' capture
        own = n * T * (3 * D * rb + T) + max(n * T * (3 * I * cb + T * cb), cap_all)    # hidden, bool mask
        credit_ph = {**zero, **w, "grads": 0, "attention": maps * n * T * T * 4,       # the maps, (n, T, T)
                     "workspace": B * T * (19 + 4 * (n < B)) + n * T * 19 * (n < B)    # + a micro-batch's
                     + max(own, maps * n * T * T * fp64)}                              # forward or trace_flow
    else:            # the captured maps (Capture.maps: in place) and trace_flow's fp64 copy, (b, T, T)
        credit_ph = {**zero, **w, "cast cache": 0, "activations": acts,
                     "attention": layers * b * T * T * (4 + fp64), "workspace": batch}
    # backward's peak, (activations, logits, workspace) of the largest: one log-prob chunk recomputed, its
    # gradient and the head's; the last layer (recomputed under checkpointing) and its gradients beside what
    # the layers keep (the final norm's backward has run); the reference model's forward (beta > 0). The maps
    # (b, T, T) are gone by then: grpo.update hands them to trace_flow and keeps only gamma.
    # `held`: autograd sums the LM head's gradient over the log-prob chunks in one (V, D) buffer, which the
    # weight's AccumulateGrad takes only once every use of the weight has delivered its part: after the last
    # chunk, so from the second chunk on; and with a tied embedding (Qwen3-4B, SmolLM2) only after the
    # embedding's backward, the graph's last node, so through the whole decoder backward too (0.78 GB for
    # Qwen3-4B in bf16; counted on the CPU: tests/test_memory.py, test_the_tied_head_gradient_waits_...).
    # `dq`: on CUDA a fused attention backward (cuDNN's, FlashAttention's, the memory-efficient one) sums dQ
    # over the key blocks in an fp32 buffer of the queries' size (cuDNN frontend: dQ_accum), 0.13 GB here.
    # LoRA: the head and the embedding are frozen, no (V, D) gradient; the adapters' gradients are small.
    held, tied = V * D * wb * (not lora), bool(getattr(mc, "tie_word_embeddings", False))
    dq = cuda * b * Hq * Tq * hd * 4 * (not math)                         # the math kernel: its dP, dS
    dq += math_scores(b, Hq, Tq, T) * math
    final = b * Tq * (4 * D + (1 + (not lora)) * D * rb)                  # LoRA: no normalised value kept
    chunk = max(3 * b * c * V * 4, b * c * V * (4 + cb * (cb != 4)) + held) + (R > c) * held
    paths = [(acts, chunk, 0),
             (acts - final, tied * held, b * Tq * (ckpt * ls + 3 * I * cb + 2 * D * 4)
              + I * D * (wb + cb) * (not lora)
              + dq + ckpt * (Tq < T) * b * P * 2 * cb * hd * max(Hq, Hkv)),   # + its replay's prompt K, V
             (acts, 0, (cfg.beta > 0) * (2 * b * T * D * rb + layer_fwd + logits + cast))]
    a_bwd, l_bwd, ws_bwd = max(paths, key=sum)
    bwd = {**zero, **w, "cast cache": 0, "activations": a_bwd, "attention": 0, "logits": l_bwd,
           "workspace": batch + ws_bwd}
    # torch's AdamW: foreach on CUDA (one fp32 copy of v), fused on the CPU (none: policy.make_optimizer)
    temp = 0 if kahan and cuda else N_max * wb if kahan else (n_a if lora else N) * 4 if cuda else 0
    opt = {**zero, **w, "cast cache": 0, "workspace": B * T * 19 + temp}
    return dict(zip(PHASES, (gen, fwd, credit_ph, bwd, opt)))


def table(est, title, unit=GB) -> str:
    """The estimate as a fixed-width table, one row per phase (unit GB = 1e9 bytes, or MB = 1e6)."""
    head = f"{'phase':15s}" + "".join(f"{k:>12s}" for k in (*COMPONENTS, "total"))
    rows = [f"{ph:15s}" + "".join(f"{v / unit:12.2f}" for v in (*comp.values(), sum(comp.values())))
            for ph, comp in est.items()]
    return "\n".join([title, head, *rows])


def margin(cfg, mc, prompt_tokens=256, n_eval=None) -> dict:
    """{cost: bytes} a GPU needs beyond the estimate's tensors (assumed, not measured): the CUDA context and
    cuBLAS workspace, and the allocator's fragmentation, at most one chunk's bf16 prompt cache (P wide). The
    allowance was one whole KV cache (P + R) while the decode cache grew (by concatenation, or an engine
    regrown by a wider prompt): freed blocks too small to reuse. The engine's buffers are now reserved once
    for the run and never freed, so they leave none; what a chunk still allocates and frees is the
    prefill's cache of its prompts, copied to its rows (P wide, freed before the next chunk), and under
    expandable_segments (policy.device_of) its freed pages are reused. A chunk of held-out evaluation
    (n_eval: as estimate's) prefills each of its rows' prompts, min(gen_chunk, n_eval) of them."""
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    n_eval = (cfg.eval_size if getattr(cfg, "eval_every", 0) else 0) if n_eval is None else n_eval
    g = engine_rows(cfg, n_eval)
    kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * hd * prompt_tokens * g * 2
    return {"CUDA context + cuBLAS workspace": CONTEXT, "fragmentation <= one prompt cache": kv}


def fit(cfg, mc, device="cuda", prompt_tokens=256, budget=GPU, cap=None):
    """The largest gen_chunk (every phase fitting at micro_batch 1: on CUDA the engine's buffers are kept),
    then micro_batch with it (powers of two up to cfg's), whose phases and margin stay under `budget`, or None
    where even 1 does not fit. A size left at 0 starts from SIZES'."""
    def top(cfg, field, phases):
        n = getattr(cfg, field)
        while n >= 1:
            c = SimpleNamespace(**{**vars(cfg), field: n})
            est = estimate(c, mc, device, prompt_tokens, cap=cap)
            extra = sum(margin(c, mc, prompt_tokens).values())
            if all(sum(est[k].values()) + extra <= budget for k in phases):
                return n
            n = n // 2 if n & (n - 1) == 0 else 2 ** (n.bit_length() - 1)
        return None
    cfg = largest(cfg)
    one = SimpleNamespace(**{**vars(cfg), "micro_batch": 1})        # the decode engine's buffers stay
    g = top(one, "gen_chunk", PHASES)                               # through the update: all phases count
    return g, top(SimpleNamespace(**{**vars(cfg), "gen_chunk": g or 1}), "micro_batch", PHASES[1:4])


class Plan(NamedTuple):
    gen_chunk: int | None       # rows per generate call that fit (None: no size tried fits)
    micro_batch: int | None     # rows per forward / backward that fit (None: as gen_chunk)
    phase: str                  # the phase of the peak: of the sizes chosen, or of the smallest tried
    peak: float                 # that peak in bytes, the margin included
    tried: tuple                # (gen_chunk, micro_batch) the peak is of
    release: bool = False       # the engine released for the update (LAYOUTS[1]); False: resident through it


# the decode engine through the update: kept (its graphs captured once a run), or freed after each rollout,
# reserved and its graphs captured again before the next
LAYOUTS = ("resident", "released")


def sizes(cfg, field):
    """The sizes tried for a flag: its value alone where one was given, and at 0 SIZES' and the powers of
    two below it."""
    n = getattr(cfg, field)
    return [n] if n else [SIZES[field]] + [2 ** k for k in range(SIZES[field].bit_length() - 2, -1, -1)]


def plan(cfg, mc, device, prompt_tokens, budget, n_eval=None, cap=None) -> Plan:
    """The gen_chunk, micro_batch and engine layout whose step fits `budget` bytes in every phase, the margin
    included: cfg's sizes where given, the sizes tried for each left at 0 (sizes); each with the engine
    resident
    through the update (on CUDA its buffers, sized by gen_chunk, stay) and, where it has one, released for
    it (the update's phases without them). Of those that fit, the one whose smaller fraction of cfg's sizes
    is largest (both halved alike), then the larger gen_chunk, then the engine resident: a released engine
    is captured again every step, so it is picked only where it lets larger sizes fit. run.setup sizes a
    run with it; n_eval: its held-out questions, cap: the card's compute capability (estimate's)."""
    best, low = None, None
    layouts = (False, True) if torch.device(device).type == "cuda" and cfg.share_prefix else (False,)
    top_g, top_m = sizes(cfg, "gen_chunk")[0], sizes(cfg, "micro_batch")[0]
    for g in sizes(cfg, "gen_chunk"):
        for release in layouts:
            for m in sizes(cfg, "micro_batch"):
                c = SimpleNamespace(**{**vars(cfg), "gen_chunk": g, "micro_batch": m})
                est = estimate(c, mc, device, prompt_tokens, n_eval=n_eval, release=release, cap=cap)
                ph, top = peak(est)
                top += sum(margin(c, mc, prompt_tokens, n_eval).values())
                if low is None or top < low[1]:
                    low = (ph, top, (g, m), release)
                if top <= budget:
                    key = (min(g / top_g, m / top_m), g, not release)
                    if best is None or key > best[0]:
                        best = (key, Plan(g, m, ph, top, (g, m), release))
                    break                               # the largest micro_batch at this gen_chunk, layout
    return best[1] if best else Plan(None, None, *low)


def planned(cfg, mc, device, prompt_tokens, n_eval=None, cap=None):
    """(cfg at the sizes grpo.py would run, its Plan, the card in bytes) on CUDA, as run.size_to_card plans
    them: --gpu-gb (else one 80 GB GPU) less RESERVE, the sizes left at 0 chosen; cfg at its largest sizes
    where nothing fits. Elsewhere (cfg at the CPU's sizes, None, None): the CPU is not sized."""
    if torch.device(device).type != "cuda":
        return largest(cfg), None, None
    card = getattr(cfg, "gpu_gb", 0) * GB or GPU
    p = plan(cfg, mc, device, prompt_tokens, card * (1 - RESERVE), n_eval, cap)
    if p.gen_chunk is None:
        return largest(cfg), p, card
    sizes_ = {"gen_chunk": p.gen_chunk, "micro_batch": p.micro_batch}
    return (dataclasses.replace(cfg, **sizes_) if dataclasses.is_dataclass(cfg) else
            SimpleNamespace(**{**vars(cfg), **sizes_})), p, card


def what_fits(cfg, mc, device, prompt_tokens, budget, n_eval=None, cap=None) -> str:
    """What would fit `budget` where cfg does not, as the end of grpo.py's error line: the sizes given
    chosen instead (a smaller --micro-batch, --gen-chunk, or 0), --lora-rank 16 (full fine-tuning), a smaller
    model."""
    out = []
    p = plan(SimpleNamespace(**{**vars(cfg), "gen_chunk": 0, "micro_batch": 0}), mc, device, prompt_tokens,
             budget, n_eval=n_eval, cap=cap)
    if p.gen_chunk is not None and (cfg.gen_chunk or cfg.micro_batch):
        out.append(f"--gen-chunk {p.gen_chunk} --micro-batch {p.micro_batch} would fit")
    if getattr(cfg, "lora_rank", 0) == 0:
        lora = SimpleNamespace(**{**vars(cfg), "lora_rank": 16, "optimizer": "auto", "gen_chunk": 0,
                                  "micro_batch": 0})                                  # kahan is not LoRA's
        q = plan(lora, mc, device, prompt_tokens, budget, n_eval=n_eval, cap=cap)
        out.append(f"--lora-rank 16 would fit (gen_chunk {q.gen_chunk}, micro_batch {q.micro_batch}, peak "
                   f"{q.peak / GB:.1f} GB)" if q.gen_chunk else f"--lora-rank 16 needs {q.peak / GB:.1f} GB")
    return "; ".join(out + ["or a smaller model, or fewer --max-new-tokens"])


def layout_line(cfg, mc, device, prompt_tokens, release, unit=GB, name="GB", cap=None):
    """One line: the engine's layout in force and what the other would give at the same sizes."""
    kept, freed = (estimate(cfg, mc, device, prompt_tokens, release=r, cap=cap) for r in (False, True))
    cache = kept["backward"]["KV cache"]                                  # the engine's K, V buffers
    (kph, ktop), (fph, ftop) = peak(kept), peak(freed)
    if release:
        return (f"engine: released for the update ({cache / unit:.2f} {name} freed after each rollout, "
                f"reserved and its graphs captured again before the next); resident it would peak at "
                f"{ktop / unit:.2f} {name} in {kph}")
    return (f"engine: resident through the update (its graphs captured once); released for it, the update's "
            f"phases would hold {cache / unit:.2f} {name} less (its cache) and the step peak at "
            f"{ftop / unit:.2f} {name} in {fph}, its graphs captured again every step")


def report(cfg, prompt_tokens=256, measured=None, device="cuda", cap=None) -> str:
    """The table of `python eval.py memory`, the schemes side by side, and the fit; last line the peak. On
    CUDA the table is of the plan grpo.py would run (planned: the sizes and the engine's layout). cap: the
    card's compute capability (eval.py memory --capability; None: the device's own)."""
    mc = model_config(cfg.model)
    cfg, p, card = planned(cfg, mc, device, prompt_tokens, cap=cap)
    release = bool(p and p.gen_chunk and p.release)
    est = estimate(cfg, mc, device, prompt_tokens, release=release, cap=cap)
    unit, name = (GB, "GB") if peak(est)[1] >= GB else (1e6, "MB")
    T = prompt_tokens + cfg.max_new_tokens
    which = "" if p is None else f", the plan for {card / GB:g} GB" if p.gen_chunk else ", as given"
    out = [precision(cfg, device, cap).line,
           table(est, f"{cfg.model} on {device}, scheme {scheme(cfg, device, cap)}: {cfg.prompts_per_step} x "
                      f"{cfg.group_size} rows of {prompt_tokens} + {cfg.max_new_tokens} = {T} tokens, "
                      f"gen_chunk {cfg.gen_chunk}, micro_batch {cfg.micro_batch}, "
                      f"logprob_chunk {cfg.logprob_chunk}{which} ({name})", unit)]
    if measured:
        out.append(f"measured ({'torch.cuda.max_memory_allocated' if device != 'cpu' else 'track_peak'}):")
        out += [f"  {ph:15s} estimate {sum(c.values()) / unit:10.2f}  measured {measured[ph] / unit:10.2f}  "
                f"ratio {sum(c.values()) / measured[ph]:.3f}" for ph, c in est.items()]
    if p is not None and cfg.share_prefix:
        out.append(layout_line(cfg, mc, device, prompt_tokens, release, unit, name, cap))
    for other in ("adamw", "kahan", "lora"):
        c = {"optimizer": other, "lora_rank": 0} if other != "lora" else {"lora_rank": cfg.lora_rank or 16,
                                                                          "optimizer": "auto"}
        c = SimpleNamespace(**{**vars(cfg), **c})
        c.precision = "auto" if precision_problem(c) else c.precision     # fp16 is LoRA's, bf16 kahan's
        q = peak(estimate(c, mc, device, prompt_tokens, release=release, cap=cap))
        out.append(f"scheme {other:6s}: peak {q[1] / unit:.2f} {name} in {q[0]}"
                   + (f" (--lora-rank {c.lora_rank})" if other == "lora" else ""))
    ph, top = peak(est)
    if p is not None:
        m = margin(cfg, mc, prompt_tokens)
        out.append(f"budget {card / GB:.0f} GB, margin assumed {sum(m.values()) / GB:.2f} GB ("
                   + ", ".join(f"{k} {v / GB:.2f}" for k, v in m.items()) + "): "
                   + (f"grpo.py picks gen_chunk {p.gen_chunk}, micro_batch {p.micro_batch}, the engine "
                      f"{LAYOUTS[p.release]} (peak {p.peak / GB:.2f} GB with the margin, in {p.phase}"
                      if p.gen_chunk else "nothing fits (" + what_fits(cfg, mc, device, prompt_tokens,
                                                                       card * (1 - RESERVE), cap=cap))
                   + f"; {card * (1 - RESERVE) / GB:.1f} GB planned, a {RESERVE:.0%} reserve)")
    lora = scheme(cfg, device, cap) == "lora"
    n = mc.num_hidden_layers * cfg.lora_rank * sum(i + o for i, o in lora_linears(cfg, mc)) if lora else \
        param_counts(mc)[0]
    disk = checkpoint_bytes(n, scheme(cfg, device, cap))
    out.append(f"disk: a checkpoint {disk / GB:.2f} GB (weights + optimizer state), {2 * disk / GB:.2f} GB "
               f"free from the second save on (ckpt/ beside ckpt.tmp/; grpo.py checks it at setup)")
    out.append(f"peak {top / GB:.2f} GB ({top / GiB:.2f} GiB) in {ph}")
    return "\n".join(out)


def peak(est):
    """(phase, bytes) of the largest phase total."""
    return max(((ph, sum(c.values())) for ph, c in est.items()), key=lambda x: x[1])
