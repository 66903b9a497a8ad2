"""The head-mean attention maps in PyTorch: the reference the fused kernels (head_mean.py) are tested against,
and the path of every device where they cannot run (the CPU; a GPU without Triton or a C compiler).

    add_head_mean(buf, query, key, attention_mask, scaling, chunk)   buf (B, T, S) += the layer's head mean
    auto_chunk(B, H, T)                                              its query rows per block

flowtracer.Capture sums each chosen layer's head means into one buffer with it, or with the fused kernel
where training/credit.py's head_mean_kernel chose that at setup (eq. 1's W, flowtracer.py departure 5).

Test: python -m pytest -q tests/test_head_mean_kernel.py tests/test_attention_graph.py
"""

import torch


def add_head_mean(buf, query, key, attention_mask, scaling, chunk):
    """buf (B,T,S) += sum over heads / H of softmax(Q K^T * scaling + mask), query chunk by chunk, in fp32.
    The T queries are the last T of the S keys (S > T: the first S - T come from a KV cache). GQA: the G
    query heads of a KV head are folded into the rows, (G c, D) @ (D, S), so no key is copied G times."""
    (B, H, T, D), (Hkv, S) = query.shape, key.shape[1:3]
    q = query.float().view(B, Hkv, H // Hkv, T, D)  # (B, Hkv, G, T, D): query heads grouped by their KV head
    kT = key.float().mT  # (B, Hkv, D, S), a view
    with torch.autocast(query.device.type, enabled=False):  # fp32 also under the run's bf16 autocast
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            score = (q[:, :, :, s:e].reshape(B, Hkv, -1, D) @ kT).view(B, Hkv, H // Hkv, e - s, S)
            score.mul_(scaling)  # (B, Hkv, G, c, S)
            if attention_mask is None:  # no padding: sdpa's mask builder left the causal mask to is_causal
                allowed = torch.ones(e - s, S, dtype=torch.bool, device=q.device).tril(s + S - T)  # (c, S)
                score.masked_fill_(~allowed, torch.finfo(score.dtype).min)
            elif attention_mask.dtype == torch.bool:  # (B or 1, 1, T, S), True = attend
                score.masked_fill_(~attention_mask[:, :, None, s:e], torch.finfo(score.dtype).min)
            else:  # additive float mask (0 / large negative)
                score.add_(attention_mask[:, :, None, s:e].float())
            p = torch.softmax(score, dim=-1)  # (B, Hkv, G, c, S); fully masked rows are uniform, zeroed later
            buf[:, s:e] += p.sum(dim=(1, 2)) / H  # (B, c, S)
            del score, p  # freed before the next chunk's score is made: two blocks at most, not three


def auto_chunk(B, H, T, budget=2**25):
    """Query rows per chunk so that one (B, H, chunk, T) fp32 score block stays under `budget` floats."""
    return max(1, min(T, budget // max(1, B * H * T)))
