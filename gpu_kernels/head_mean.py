"""One layer's head-mean attention map in two fused Triton kernels: FlowTracer's eq. 1 without an (H, T, T).

Paper (FlowTracer): "How Does Reasoning Flow? Tracing Attention-Induced Information Flow for Targeted RL in
LLMs", eq. 1 and App. C.2: W_ik = attn[k, i], query k's attention on key i averaged over every head of the
middle layers. For one layer, with G = H / Hkv query heads per KV head (GQA), this adds to buf (B, T, S) fp32

    buf[b, t, j] += 1/H sum_h softmax_j( q[b, h, t] . k[b, h // G, j] * scaling + mask[b, t, j] )

which is flowtracer.add_head_mean's contract, with its arguments (that PyTorch path stays the CPU's, and the
reference). The T queries are the last T of the S keys: query t sits at key position t + S - T (S > T when a
cached prompt precedes). The caller divides by the number of layers later.

Why: add_head_mean materialises (B, H, chunk, S) fp32 probability blocks and loops over query chunks in
Python, and on a GPU that, not the arithmetic, made flow credit cost far more of the update than FlowTracer's
Table 6 reports (docs/gpu.md has the figures). The arithmetic is small (QK^T of the middle layers); here the
probabilities live in registers and buf is read and written once per layer.

Tiling (the recompute of FlashAttention's backward; FlagAttention's total_attention normalises a recomputed
QK^T the same way, with the forward's log-sum-exp):
  pass 1  _row_stats: a program per (query tile of BM rows, row b, head h) walks the key tiles up to the
          tile's causal limit with the online softmax and stores each query's max m and 1/l, l = sum_j
          2^(s_j - m), in the log2 domain: two (B, H, T) fp32 tensors, the only extra memory.
  pass 2  _head_mean: a program per output tile (key tile of BN, query tile of BM, row b). For each KV head
          it loads the K tile once; for each of the G query heads of that KV head it recomputes s = q k^T
          and adds p = 2^(s - m) / l into one (BM, BN) fp32 accumulator; after all H heads it adds acc / H
          to buf's tile (read and written once). Tiles wholly after their queries' causal limit skip the
          QK^T work.

Departures from add_head_mean (numbered):
 1. Causality is structural: query t never reads a key after position t + S - T, whatever the mask says.
    Every mask a decoder gets from transformers (sdpa_mask: causal AND padding) excludes those keys anyway;
    a mask that lets a query see later keys (prefix-LM, bidirectional) is not supported.
 2. A query row with no key left (left padding) gets 1/S on every key, as torch's softmax of S equal
    -3.4e38 scores gives it (capture and attention_graph zero such rows afterwards). An additive float
    mask masks a key where it is <= -1e30 (transformers fills with the dtype's min, -3.4e38 in fp32 and
    bf16) and is added to the score elsewhere; with -inf masks torch gives NaN on such rows, this 1/S.
    (flowtracer's models build bool masks, so additive masks only come from callers that pass their own.)
 3. fp32 inputs multiply in fp32 with input_precision="ieee" (no TF32), as torch's default matmul; bf16
    (fp16) inputs multiply exactly into fp32 accumulators, as add_head_mean's q.float() @ k.float(). Sums
    run in another order, so the two paths agree to fp32 rounding (1e-5 in the tests), not bit for bit.
 4. Pass 1 reads a K tile once per query head, as FlashAttention's forward does (the G programs of one KV
    head run side by side and meet the tile in L2); pass 2, where each output tile sums all H heads, reads
    it once for its G heads.
 5. `chunk` is taken for add_head_mean's signature and ignored: the tiles (block_m, block_n) bound memory.
 6. Under the interpreter, bf16 and fp16 operands are cast to fp32 before tl.dot: its dot multiplies
    bf16's raw bit patterns (an interpreter limit that upstream Triton does not fix). The products are the
    same exact values; compiled, the tensor cores take bf16 as it is.

The kernels run compiled on CUDA tensors, and on CPU tensors only under Triton's interpreter, which takes
over where TRITON_INTERPRET=1 was in the environment before triton was first imported (triton.language's
own zeros, sum, max are @triton.jit functions too, decorated at that import).
Run its tests: python -m pytest -q tests/gpu_kernels/test_head_mean.py   (the CPU cases run in a child pytest
with TRITON_INTERPRET=1; TRITON_INTERPRET=1 python -m pytest ... runs them in one process)
"""

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x log2 e): the kernels work in the log2 domain
MASKED = tl.constexpr(-1e30)  # departure 2: an additive mask value at or below this masks
NO_MASK, BOOL_MASK, FLOAT_MASK = 0, 1, 2  # the three kinds of attention_mask add_head_mean takes


@triton.jit
def _allowed(t, j, mask_b, sm_t, sm_s, T, S, P, MASK_KIND: tl.constexpr):
    """(ok, bias), both (BM, BN): may query t read key j (causal, j <= t + P: departure 1; in bounds; the
    mask), and the additive mask in log2 units (0 without one)."""
    ok = (j[None, :] <= t[:, None] + P) & (j[None, :] < S) & (t[:, None] < T)  # (BM, BN)
    bias = tl.zeros(ok.shape, tl.float32)
    if MASK_KIND == 1:  # bool, True = attend
        allowed = tl.load(mask_b + t[:, None] * sm_t + j[None, :] * sm_s, mask=ok, other=0)
        ok = ok & (allowed != 0)
    if MASK_KIND == 2:  # additive float
        add = tl.load(mask_b + t[:, None] * sm_t + j[None, :] * sm_s, mask=ok, other=0.0).to(tl.float32)
        ok = ok & (add > MASKED)  # departure 2
        bias = tl.where(ok, add, 0.0) * LOG2E  # no -3.4e38 * log2(e) overflow
    return ok, bias


@triton.jit
def _scores(q, kT, ok, bias, qk_scale, MASK_KIND: tl.constexpr, DOT_FP32: tl.constexpr):
    """(BM, BN) log2-domain scores q kT * scaling * log2(e) (+ bias), -inf where not ok."""
    if DOT_FP32:  # departures 3 and 6
        s = tl.dot(q.to(tl.float32), kT.to(tl.float32), input_precision="ieee") * qk_scale
    else:  # bf16 / fp16 products are exact
        s = tl.dot(q, kT) * qk_scale  # (BM, BN) fp32 accumulators
    if MASK_KIND == 2:
        s = s + bias
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _row_stats(
    Q,
    K,
    MASK,
    M2,
    INV_L,
    sq_b,
    sq_h,
    sq_t,
    sq_d,
    sk_b,
    sk_h,
    sk_s,
    sk_d,
    sm_b,
    sm_t,
    sm_s,
    T,
    S,
    H,
    G,
    qk_scale,
    HD: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Pass 1, program (query tile, b * H + h): the online softmax statistics of each query row,
    m = max_j s_j and 1/l with l = sum_j 2^(s_j - m); a row with no allowed key gets m = 0, 1/l = 0."""
    pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: B T S may pass 2^31
    b, h = bh // H, bh % H
    P = S - T  # keys before the first query
    t = pid_m * BM + tl.arange(0, BM)  # (BM,) query rows
    d = tl.arange(0, BD)  # (BD,) head dims, >= HD masked
    q = tl.load(
        Q + b * sq_b + h * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
        mask=(t[:, None] < T) & (d[None, :] < HD),
        other=0.0,
    )  # (BM, BD)
    k_bh = K + b * sk_b + (h // G) * sk_h  # this head's KV head
    m_i = tl.full((BM,), float("-inf"), tl.float32)  # (BM,) running max
    l_i = tl.zeros((BM,), tl.float32)  # (BM,) running sum
    hi = tl.minimum(S, pid_m * BM + BM + P)  # past the tile's last causal key
    for j0 in range(0, hi, BN):
        j = j0 + tl.arange(0, BN)  # (BN,) keys
        kT = tl.load(
            k_bh + j[None, :] * sk_s + d[:, None] * sk_d, mask=(j[None, :] < S) & (d[:, None] < HD), other=0.0
        )  # (BD, BN)
        ok, bias = _allowed(t, j, MASK + b * sm_b, sm_t, sm_s, T, S, P, MASK_KIND)
        s = _scores(q, kT, ok, bias, qk_scale, MASK_KIND, DOT_FP32)  # (BM, BN)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BM,)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: avoid -inf - -inf
        l_i = l_i * tl.exp2(m_i - m_ref) + tl.sum(tl.exp2(s - m_ref[:, None]), 1)
        m_i = m_new
    out = (b * H + h) * T + t  # (BM,) into (B, H, T)
    tl.store(M2 + out, tl.where(l_i > 0, m_i, 0.0), mask=t < T)
    tl.store(INV_L + out, tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0), mask=t < T)


@triton.jit
def _head_mean(
    Q,
    K,
    MASK,
    M2,
    INV_L,
    BUF,
    sq_b,
    sq_h,
    sq_t,
    sq_d,
    sk_b,
    sk_h,
    sk_s,
    sk_d,
    sm_b,
    sm_t,
    sm_s,
    sb_b,
    sb_t,
    sb_s,
    T,
    S,
    H,
    G,
    qk_scale,
    HD: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Pass 2, program (key tile, query tile, b): buf tile += 1/H sum_h 2^(s - m) / l, heads summed in
    registers; rows with no allowed key (1/l = 0) get 1/S on every key (departure 2)."""
    pid_n, pid_m, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    P = S - T
    t = pid_m * BM + tl.arange(0, BM)  # (BM,) query rows
    j = pid_n * BN + tl.arange(0, BN)  # (BN,) keys
    d = tl.arange(0, BD)
    empty = tl.load(INV_L + b * H * T + t, mask=t < T, other=1.0) == 0.0  # (BM,) no allowed key (any head)
    acc = tl.zeros((BM, BN), tl.float32)  # sum over heads of p
    reaches = pid_n * BN <= pid_m * BM + BM - 1 + P  # some query here sees some key
    if reaches:
        ok, bias = _allowed(t, j, MASK + b * sm_b, sm_t, sm_s, T, S, P, MASK_KIND)  # once for all heads
        for hkv in range(H // G):
            kT = tl.load(
                K + b * sk_b + hkv * sk_h + j[None, :] * sk_s + d[:, None] * sk_d,
                mask=(j[None, :] < S) & (d[:, None] < HD),
                other=0.0,
            )  # (BD, BN) once for G heads
            for g in range(G):
                h = hkv * G + g
                q = tl.load(
                    Q + b * sq_b + h * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
                    mask=(t[:, None] < T) & (d[None, :] < HD),
                    other=0.0,
                )  # (BM, BD)
                m = tl.load(M2 + (b * H + h) * T + t, mask=t < T, other=0.0)  # (BM,)
                inv_l = tl.load(INV_L + (b * H + h) * T + t, mask=t < T, other=0.0)
                s = _scores(q, kT, ok, bias, qk_scale, MASK_KIND, DOT_FP32)  # (BM, BN)
                acc += tl.exp2(s - m[:, None]) * inv_l[:, None]  # (BM, BN) p of head h
    out = acc / H + tl.where(empty[:, None], 1.0 / S, 0.0)  # (BM, BN) this layer's head mean
    seen = (pid_n * BN <= t + P) | empty  # (BM,) rows this tile adds to
    write = (t[:, None] < T) & (j[None, :] < S) & seen[:, None]
    ptr = BUF + b * sb_b + t[:, None] * sb_t + j[None, :] * sb_s
    tl.store(ptr, tl.load(ptr, mask=write, other=0.0) + out, mask=write)


def interpreted():
    """True when this module was imported under TRITON_INTERPRET=1: its kernels then run on CPU tensors."""
    return isinstance(_head_mean, InterpretedFunction)


def head_mean_triton(buf, query, key, attention_mask, scaling, chunk=None, *, block_m=64, block_n=64):
    """flowtracer.add_head_mean's contract in two kernels: buf (B, T, S) fp32 += the head mean of
    softmax(Q K^T * scaling + mask). query (B, H, T, hd), key (B, Hkv, S, hd) in bf16, fp16 or fp32 (any
    strides); attention_mask None (causal), bool (B or 1, 1, T, S) True = attend, or additive float; buf may
    be a strided view (the capture's rows S - T .. S). `chunk` is ignored (departure 5)."""
    (B, H, T, hd), (Hkv, S) = query.shape, key.shape[1:3]
    if key.shape[0] != B or key.shape[3] != hd or H % Hkv or S < T:
        raise ValueError(
            f"head_mean_triton: query {tuple(query.shape)} and key {tuple(key.shape)} are not "
            f"(B, H, T, hd) and (B, Hkv, S >= T, hd) with H a multiple of Hkv"
        )
    if tuple(buf.shape) != (B, T, S) or buf.dtype != torch.float32:
        raise ValueError(
            f"head_mean_triton: buf must be ({B}, {T}, {S}) float32, got {tuple(buf.shape)} {buf.dtype}"
        )
    if T == 0:
        return buf
    if query.device.type != "cuda" and not interpreted():
        raise RuntimeError(
            "head_mean_triton: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported (or use flowtracer.add_head_mean)"
        )
    if attention_mask is None:
        kind, mask = NO_MASK, buf  # never read
    else:
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            raise ValueError(
                f"head_mean_triton: attention_mask must be (B or 1, 1, T, S), got "
                f"{tuple(attention_mask.shape)}"
            )
        mask = attention_mask.expand(B, 1, T, S)[:, 0]  # (B, T, S) view, broadcast stride 0
        kind = BOOL_MASK if mask.dtype == torch.bool else FLOAT_MASK
        mask = mask.view(torch.uint8) if kind == BOOL_MASK else mask  # the same bytes, 0 / 1
    sm = mask.stride() if kind != NO_MASK else (0, 0, 0)
    m2 = torch.empty(B, H, T, dtype=torch.float32, device=query.device)  # (B, H, T) row max, log2 domain
    inv_l = torch.empty_like(m2)  # (B, H, T) 1 / row sum
    half = query.dtype == key.dtype and query.dtype in (torch.bfloat16, torch.float16)  # tensor-core inputs
    common = dict(
        HD=hd,
        BD=max(16, triton.next_power_of_2(hd)),
        BM=block_m,
        BN=block_n,
        MASK_KIND=kind,
        DOT_FP32=not half or interpreted(),
    )  # departures 3, 6
    size = (T, S, H, H // Hkv, float(scaling) * LOG2E.value)  # qk_scale: log2 domain
    on_device = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()
    with on_device:
        _row_stats[(triton.cdiv(T, block_m), B * H)](
            query, key, mask, m2, inv_l, *query.stride(), *key.stride(), *sm, *size, **common
        )
        _head_mean[(triton.cdiv(S, block_n), triton.cdiv(T, block_m), B)](
            query,
            key,
            mask,
            m2,
            inv_l,
            buf,
            *query.stride(),
            *key.stride(),
            *sm,
            *buf.stride(),
            *size,
            **common,
        )
    return buf
