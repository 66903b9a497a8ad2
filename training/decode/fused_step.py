"""The decode engine's step as one function of tensors (training/decode/engine.py): the decoder's forward of
one new token per row over the static KV cache, written out over decode_weights' merged projections, with its
own GQA attention over each row's filled length. On CUDA Engine compiles it whole (torch.compile,
fullgraph=True) and captures it in a CUDA graph; on the CPU it runs eagerly.

For b rows with tokens x (b,) at positions n (b,), the cache left-compacted (row r's keys fill slots
0 .. n_r - 1, so a token's position is its slot):
    h = E[x]                                                               (b, D)
    each layer:  a = rms(h) w1;  [q | k | v] = a W_qkv^T (+ LoRA's (a A^T) B^T)  (b, Hq hd + 2 Hkv hd)
                 q, k = rms(q) wq, rms(k) wk, per head (Qwen3's q/k norms; Llama has none)
                 q, k = rope(q, n), rope(k, n);  K[r, :, n_r] = k_r, V[r, :, n_r] = v_r
                 o = softmax(q K^T / sqrt(hd)) V over row r's first m_r keys  (b, Hq hd); a K, V head
                     serves Hq / Hkv query heads (GQA)
                 h = h + o W_o^T;  a = rms(h) w2;  [g | u] = a W_gu^T;  h = h + (silu(g) u) W_down^T
    logits = rms(h) w W_head^T                                             (b, V) in the weights' dtype
with rms(x) = x / sqrt(mean(x^2) + eps) in fp32, rounded back (HF's RMSNorm), and rope HF's rotary embedding
(cos, sin of n inv_freq, scaled by its attention_scaling). m_r = n_r + 1, the keys filled with this step's;
the engine passes m_r = 1 for a row that has finished (it writes pad: one key block read, not all of them).

The attention (ATTENTIONS; Engine picks one per engine and names a fallback in one line):
  flex  torch's FlexAttention, enable_gqa, over a BlockMask made on the device each step from m: row r holds
        ceil(m_r / BLOCK) key blocks and its mask_mod cuts at m_r. Compiled (CUDA) it is a split-KV decoding
        kernel that reads each row's filled blocks only, the Hq / Hkv query heads of a K, V head together.
  sdpa  scaled_dot_product_attention with a (b, 1, 1, S) length mask, the query heads of a K, V head packed
        as the queries of one head (no K, V repeated to Hq heads): every row reads all S keys, masked. The
        CPU's (flex's eager path materialises its scores through vmap: 17 ms a call against SDPA's 0.1 ms at
        the tiny shape here), and CUDA's where flex cannot run.
No bool padding mask and no key-length buckets: the prompt's keys are copied left-compacted (Engine.steps).

Run: python -m pytest -q tests/decode/test_fused_decode.py
     python benchmarks/decode_ops.py            # the aten operators of one decode step, before and after
"""

import torch
import torch.nn.functional as F

ATTENTIONS = ("flex", "sdpa")
BLOCK = 128  # FlexAttention's key block (its default; the decoding kernel's sparse block size)


def flex_problem():
    """Why this torch cannot run FlexAttention with enable_gqa, as one clause, or None."""
    try:
        import inspect

        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no FlexAttention ({e})"
    if "enable_gqa" not in inspect.signature(flex_attention).parameters:
        return f"torch {torch.__version__}'s FlexAttention has no enable_gqa"
    return None


def rms(x, w, eps):
    """HF's RMSNorm (Llama, Qwen3): x normalised over its last dim in fp32, rounded back, times w."""
    f = x.float()
    return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, cos, sin):
    """HF's rotary embedding of x (b, H, hd) with the rows' cos, sin (b, 1, hd)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


def length_mask(kind, m, S):
    """What every layer's attention reads this step, made once: flex's BlockMask of row r's first m_r keys,
    or sdpa's bool mask (b, 1, 1, S). m (b,) the keys each row attends."""
    if kind == "sdpa":
        return (torch.arange(S, device=m.device) < m[:, None])[:, None, None]  # (b, 1, 1, S)
    from torch.nn.attention.flex_attention import BlockMask

    b, nb = m.shape[0], -(-S // BLOCK)
    num = ((m + BLOCK - 1) // BLOCK).to(torch.int32).view(b, 1, 1)  # (b, 1, 1) key blocks a row reads
    idx = torch.arange(nb, device=m.device, dtype=torch.int32).expand(b, 1, 1, nb)  # (b, 1, 1, nb) in order
    return BlockMask.from_kv_blocks(
        num,
        idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=lambda r, h, q, kv: kv < m[r],
        seq_lengths=(1, S),
    )


def attention(kind, q, K, V, mask):
    """(b, Hq hd): each query head's softmax(q K^T / sqrt(hd)) V over the keys `mask` shows (length_mask);
    q (b, Hq, hd), K, V (b, Hkv, S, hd), query head i reading K, V head i // (Hq / Hkv) (HF's repeat_kv)."""
    b, Hq, hd = q.shape
    if kind == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        o = flex_attention(q[:, :, None], K, V, block_mask=mask, enable_gqa=True)  # (b, Hq, 1, hd)
    else:
        Hkv = K.shape[1]
        o = F.scaled_dot_product_attention(
            q.view(b, Hkv, Hq // Hkv, hd), K, V, attn_mask=mask
        )  # (b, Hkv, g, hd)
    return o.reshape(b, Hq * hd)


def proj(x, p):
    """(b, sum out) x (b, in) through a decode_weights.Proj: [x W_1^T | x W_2^T ...] + bias, plus LoRA's
    (x A^T) B^T: one low-rank pair for the group's adapters."""
    if len(p.ws) == 1:
        y = F.linear(x, p.ws[0], p.bias)  # as nn.Linear
    else:  # LoRA: the base's own matrices
        y = torch.cat([F.linear(x, w) for w in p.ws], -1)
        y = y if p.bias is None else y + p.bias
    return y if p.A is None else y + F.linear(F.linear(x, p.A), p.B)


def logits(w, x, n, m, keys, values, kind):
    """(b, V) the next token's logits of each row, in the weights' dtype, its K, V written at slot n_r of
    each layer's buffers. w: decode_weights.Weights; x, n, m (b,): tokens, positions (= the slots they are
    written to), keys each row attends; keys, values (L, b, Hkv, S, hd); kind: ATTENTIONS'."""
    b, S, Hq, Hkv, hd = x.shape[0], keys.shape[-2], w.Hq, w.Hkv, w.hd
    mask = length_mask(kind, m, S)
    h = w.embed[x]  # (b, D)
    f = n[:, None].float() * w.inv_freq  # (b, hd / 2) as HF's rotary embedding, in fp32
    e = torch.cat((f, f), -1)[:, None]  # (b, 1, hd)
    cos, sin = (e.cos() * w.rope_scale).to(h.dtype), (e.sin() * w.rope_scale).to(h.dtype)
    rows = torch.arange(b, device=x.device)  # (b,)
    layer_of = torch.arange(len(w.layers), device=x.device)[:, None].expand(-1, b)  # (L, b)
    for i, layer in enumerate(w.layers):
        a = rms(h, layer.ln1, w.eps)  # (b, D)
        q, k, v = proj(a, layer.qkv).split([Hq * hd, Hkv * hd, Hkv * hd], -1)
        q, k, v = q.view(b, Hq, hd), k.view(b, Hkv, hd), v.view(b, Hkv, hd)
        if layer.q_norm is not None:  # Qwen3
            q, k = rms(q, layer.q_norm, w.eps), rms(k, layer.k_norm, w.eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        keys[layer_of[i], rows, :, n] = k  # (b, Hkv, hd) at slot n_r of row r: one index_put_ on the
        values[layer_of[i], rows, :, n] = v  # buffer itself (compiled, a write in place, not a copy)
        h = h + proj(attention(kind, q, keys[i], values[i], mask), layer.o)
        g, u = proj(rms(h, layer.ln2, w.eps), layer.gate_up).chunk(2, -1)  # (b, I) each
        h = h + proj(F.silu(g) * u, layer.down)
    return F.linear(rms(h, w.norm, w.eps), w.head)  # (b, V)
