"""The parts of the decode engine's step that a CUDA graph can hold (training/decode/engine.py), beside the
fused forward (training/decode/fused_step.py): the sampler and the static cache the model's own forward
writes into where the fused step cannot run.

A static KV cache. Buffers (L, rows, Hkv, S, d) for S = the widest prompt + max_new_tokens, written in place,
each row at its own slot n_r (the prompt's keys are copied left-compacted: slot = position). No concatenation
and the same shapes at every step. Why: with a new key length every step, cuDNN's attention built a new plan
each time (half the step's CPU time on the H100: docs/gpu.md). Fixed shapes are also what a graph needs.
SlotLayer is that cache as transformers' Cache layer, for the model's own forward (the fallback step): it
reads all S keys under a (b, 1, 1, S) length mask.

Sampling without a sync. Top-k on the step's 16-bit logits (no fp32 copy of the (b, V) vocabulary), the
temperature, top-p and the draw in fp32 on the k kept, the draw by an exponential race (argmax p / E,
E ~ Exp(1): the chosen token is j with probability p_j), not torch.multinomial; a finished row writes pad
inside the step; the host reads EOS every `check_every` steps (16). Why: rollout.decode (and HF's loop) read
EOS on the host every step, so the CPU waited for the GPU to finish each step before it could launch the
next, and the GPU then waited for the CPU's launches.

Run: python -m pytest -q tests/decode/test_engine_runtime.py
"""

import torch
from torch.nn.attention import SDPBackend
from transformers.cache_utils import CacheLayerMixin

# S is a multiple of ALIGN (mem-efficient SDPA copies a mask whose length is not a multiple of 16)
ALIGN = 64
FAST = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]  # the model step's attention kernels


def sample(logits, temperature, top_k, top_p):
    """(B,) one token per row drawn from HF's warped distribution of logits (B, V), any float dtype: p =
    softmax of logits / T over the top-k, less the tail that top-p cuts; drawn as argmax_j p_j / E_j,
    E_j ~ Exp(1) (engine.py's departure 1). The top-k runs on the logits as they come (bf16 on a GPU: the
    same k tokens as on their fp32 copy, dividing by T > 0 keeps the order), the rest in fp32 on the k kept.
    Tensor work only: no host sync, so a CUDA graph can hold it."""
    k = min(top_k or logits.shape[-1], logits.shape[-1])
    v, i = torch.topk(logits, k)  # (B, k), descending
    v = v.float() / temperature  # (B, k) as HF's TemperatureLogitsWarper on the fp32 copy
    if top_p < 1.0:
        p = torch.softmax(v, dim=-1)  # (B, k)
        tail = p.flip(-1).cumsum(-1).flip(-1)  # (B, k) mass of j and all below it
        cut = tail <= 1 - top_p  # HF's rule, in descending order
        cut[:, 0] = False  # the top token always stays
        v = v.masked_fill(cut, float("-inf"))
    p = torch.softmax(v, dim=-1)  # (B, k)
    e = torch.empty_like(p).exponential_().clamp_min_(torch.finfo(p.dtype).tiny)  # (B, k) Exp(1)
    return i.gather(-1, (p / e).argmax(-1, keepdim=True)).squeeze(-1)  # (B,)


class SlotLayer(CacheLayerMixin):
    """One layer's static cache for transformers' models: keys and values (b, Hkv, S, d) are views of the
    engine's buffers; each forward writes row r's one new position at its slot n[r] (n, (b,), a view of the
    engine's lengths that the step advances) in place and hands back the whole view: attention reads S keys,
    the step's length mask hides the unfilled."""

    is_compileable, is_sliding = True, False

    def __init__(self, keys, values, n):
        super().__init__()
        self.keys, self.values, self.n, self.is_initialized = keys, values, n, True
        self.rows = torch.arange(keys.shape[0], device=keys.device)  # (b,)

    def lazy_initialization(self, key_states, value_states):
        raise RuntimeError("SlotLayer is built over the engine's buffers")

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys[self.rows, :, self.n] = key_states[:, :, 0].to(self.keys.dtype)  # (b, Hkv, d) at n_r
        self.values[self.rows, :, self.n] = value_states[:, :, 0].to(self.values.dtype)
        return self.keys, self.values

    def get_seq_length(self):
        return self.n[:1]  # a tensor, as transformers' StaticLayer returns (unread: positions are given)

    def get_mask_sizes(self, query_length):
        return self.keys.shape[-2], 0

    def get_max_length(self):
        return self.keys.shape[-2]


def attention_kernels(mc, keys, b, s):
    """The SDPA kernels of the model step, checked once per engine with torch's own tests on its shapes
    (transformers' decode query, (b, Hkv, H / Hkv, d) over (b, Hkv, s, d) keys, a (b, 1, 1, s) mask):
    flash and memory-efficient; the math kernel only when neither can run, with one line (and torch's
    warnings saying why)."""
    dt, dev = keys.dtype, keys.device
    H, Hkv, d = mc.num_attention_heads, mc.num_key_value_heads, keys.shape[-1]
    q = torch.zeros(b, Hkv, H // Hkv, d, dtype=dt, device=dev)  # (b, Hkv, H / Hkv, d)
    k = torch.zeros(b, Hkv, s, d, dtype=dt, device=dev)  # (b, Hkv, s, d)
    p = torch.backends.cuda.SDPAParams(
        q, k, k, torch.ones(b, 1, 1, s, dtype=torch.bool, device=dev), 0.0, False, False
    )
    cuda = torch.backends.cuda
    if cuda.can_use_flash_attention(p) or cuda.can_use_efficient_attention(p):
        return FAST
    cuda.can_use_flash_attention(p, True)  # again, debug on: torch says why
    cuda.can_use_efficient_attention(p, True)
    print(
        f"engine: neither flash nor memory-efficient attention can run the decode step ({dt}, head dim "
        f"{d}): it runs on SDPA's math kernel, slower",
        flush=True,
    )
    return FAST + [SDPBackend.MATH]
