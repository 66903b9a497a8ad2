"""FlowTracer: answer-targeted information flow on the attention DAG, and the credit it gives.

Paper (FlowTracer): "How Does Reasoning Flow? Tracing Attention-Induced Information Flow for Targeted RL in
LLMs" (Dong, Li et al., Shanghai Jiao Tong University and Alibaba), §3.1-3.3 and App. C.2.

    Capture           eq. 1's maps, taken inside a forward that runs anyway: grpo.py's training forward is
                      given one (token_logprobs(..., capture=cap)), then cap.maps(mask) is W (B, T, T)
    trace_flow        eq. 1-4: DAG weights W, answer reachability h, reweighted W', flow f, throughput tau
    flow_credit       eq. 5-6: gamma on the top 40% response tokens by throughput, 1 elsewhere: a Credit
    register_attention   names the attention "sdpa_capture" (it fills a Capture) and its mask (no empty
                      rows) to transformers, and "eager_capture" (the model's own eager attention fills it:
                      Gemma-2, GPT-OSS); training/model/load.py's load_model calls it for every model
    The same maps from a forward of their own (attention_graph: the probes, the baselines) or from a forward
    you do not call yourself (capturing: TRL's): training/credit/attention.py.
One default micro-batch of grpo.py reads, in order: Capture -> token_logprobs -> cap.maps -> trace_flow ->
flow_credit -> the loss. The batch and its question, response and answer tokens: training/decode/rollout.py.

The math, for one sequence of T tokens (i < k always; nothing flows backwards in time):

    W_ik  = attn[k, i]                        eq. 1   how much token k reads from token i
    h(a)  = 1 for answer tokens a             eq. 2   answer tokens are absorbing (the sink)
    h(i)  = sum_k W_ik h(k) otherwise                 so (I - M) h = 1_A, M = W without the answer rows
    W'_ik = W_ik h(k) / h(i)                  eq. 3   Theorem 3.1: sum_k W'_ik = 1 wherever h(i) > 0
    f(k)  = s(k) + sum_i f(i) W'_ik           eq. 4   s = 1/|Q| on the question tokens with h > 0
    tau(k)= f(k) + sum_j f(k) W'_kj                   = 2 f(k) off the answer (Theorem 3.1), f(k) on it

Substituting g = f / h into eq. 4 gives g(k) = s(k)/h(k) + sum_i M_ik g(i), i.e. (I - M^T) g = s / h.
So h is ONE backward triangular solve, g is ONE forward triangular solve, and f = h * g; W' is never
materialised. (I - M) is unit upper-triangular (M is strictly upper-triangular), so both solves are exact
and need no pivoting; no Python loop runs over tokens.

Departures from the paper (numbered):
 1. Numerics: h decays geometrically along chains of local attention and underflows fp32 within a few
    hundred tokens, so both solves run in fp64. Nodes with h < H_FLOOR (1e-250) are treated as unreachable
    (h = 0), which keeps g = f/h below 1e250 and rules out inf/NaN. With softmax attention every answer token
    attends every earlier token directly, so h(i) >= W_ia is far above the floor in practice (tested at 8K).
 2. The paper leaves ties and the region boundaries implicit. Here: ties in the top-k ranking go to the
    earlier token; the question is the prompt minus special tokens (BOS, chat markers;
    training/decode/rollout.py); the answer is the content of the last \\boxed{...} (else the last
    <answer>...</answer>).
 3. A sequence with no answer region, or no path from the question to the answer, gets all-1 weights
    (plain GRPO) and a fallback flag, instead of undefined flow.
 4. "Middle layers (L/3 ~ 2L/3)" is read as range(L // 3, 2L // 3): layers 10..19 of the 30-layer SmolLM2,
    12..23 of the 36-layer Qwen3-4B; 2L/3 is excluded so that early, middle and late partition the layers.
    The paper contradicts itself: §4.3 / Fig. 6 split Qwen3-4B into early 0-15, middle 15-25, late 25-35
    (15 and 25 listed twice). The presets fig6-early | fig6-middle | fig6-late read them as [0, 15), [15, 25),
    [25, 36), a partition, the boundaries scaled to round(15 L / 36), round(25 L / 36) on an L-layer model
    (13 and 21 of SmolLM2's 30). The default stays C.2's "middle", the one the main runs use.
 5. App. C.2 runs the eager attention path to materialise all maps; attention_graph recomputes only the chosen
    layers' maps in query chunks (equal to eager to 1e-5 in the tests, far less memory; see below), on CUDA
    in two fused Triton kernels that never hold an (H, T, T) tensor (gpu_kernels/head_mean.py), chosen once
    per run where they can run (head_mean_kernel, below: CUDA, Triton, a C compiler; else add_head_mean,
    the PyTorch reference in flowtracer.py, and one line saying why). Padding query rows and
    padding keys are zero (eager gives padding queries uniform rows). A model SDPA cannot compute
    (Gemma-2, GPT-OSS) keeps App. C.2's eager path: its own probabilities (eager_capture_attention).

Run the tests: python -m pytest -q tests/test_flowtracer.py
Time it:       python benchmarks/flow_speed.py
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

H_FLOOR = 1e-250  # departure 1: below this, h counts as 0 (unreachable); fp64 goes down to ~1e-308


# ----------------------------------------------------------------------------- eq. 1: the graph from a model
# How, without the L*H*T*T tensor of eager attention's output_attentions=True: an attention function
# "sdpa_capture" (transformers' AttentionInterface) returns sdpa's output and, when the forward was given a
# Capture, recomputes the chosen layers' softmax(Q K^T * scaling + mask) in fp32 and sums its heads into one
# (B, T, T) buffer on the Capture. Q and K arrive after q/k-norm (Qwen3) and RoPE. A model that SDPA cannot
# compute (Gemma-2's logit soft-capping, GPT-OSS's attention sinks) runs "eager_capture" instead: its own
# eager attention, whose probabilities the chosen layers hand to the Capture as they are. register_attention
# (below) names both to transformers; nothing is registered on import. Which one a model runs:
# training/credit/attention.py's capture_impl, the one place.
IMPL = "sdpa_capture"
EAGER_IMPL = "eager_capture"
LAYER_SPECS = (
    "None or 'middle' (L//3 .. 2L//3-1), 'early' (0 .. L//3-1), 'late' (2L//3 .. L-1), 'all', "
    "'fig6-early' | 'fig6-middle' | 'fig6-late' (Fig. 6: 0-14, 15-24, 25-35 of 36, scaled), "
    "or 'A:B'"
)
FIG6 = (15, 25)  # Fig. 6's stage boundaries in Qwen3-4B's 36 layers (§4.3; departure 4)


def select_layers(spec, num_layers):
    """Layer indices for a spec; see LAYER_SPECS. 'A:B' uses Python slice semantics (negatives, open ends)."""
    L = num_layers
    b1, b2 = ((b * L + 18) // 36 for b in FIG6)  # round(b L / 36), halves up; exact at L = 36
    named = {
        None: (L // 3, 2 * L // 3),
        "middle": (L // 3, 2 * L // 3),
        "early": (0, L // 3),
        "late": (2 * L // 3, L),
        "all": (0, L),
        "fig6-early": (0, b1),
        "fig6-middle": (b1, b2),
        "fig6-late": (b2, L),
    }
    if spec is None or (isinstance(spec, str) and spec in named):
        layers = list(range(*named[spec]))
    elif isinstance(spec, str) and spec.count(":") == 1:
        try:
            a, b = (int(s) if s.strip() else None for s in spec.split(":"))
        except ValueError:
            raise ValueError(f"bad layer spec {spec!r}; expected {LAYER_SPECS}") from None
        layers = list(range(L))[a:b]
    else:
        raise ValueError(f"bad layer spec {spec!r}; expected {LAYER_SPECS}")
    if not layers:
        raise ValueError(f"layer spec {spec!r} selects no layer of a {L}-layer model; expected {LAYER_SPECS}")
    return layers


class Capture:
    """The chosen layers' head-mean attention of ONE forward, handed to that forward as a keyword argument:

        cap = Capture(select_layers("middle", L))
        model(input_ids, attention_mask=mask, flow_capture=cap)    # transformers passes it to every layer
        W = cap.maps(mask)                                         # (B, T, T) layer mean, zero on padding

    The attention function calls `take` on each layer; the maps travel on this object. Gradient checkpointing
    replays a checkpointed layer in backward with the same keywords: a layer taken already adds nothing then.
    A second forward given the same Capture is refused (make a new one per forward), but for the prompt and
    response passes of one forward that reads each prompt once (expand_prompts, training/policy.py).
    `head_mean`: the function that sums a layer's head means into the buffer (add_head_mean, or
    head_mean_kernel's choice on CUDA).
    `stop_after_last`: raise after the last chosen layer (attention_graph needs no later layer)."""

    def __init__(self, layers, chunk=None, stop_after_last=False, head_mean=None):
        if not layers:
            raise ValueError("a Capture needs at least one layer (select_layers gives them)")
        self.layers, self.last, self.chunk, self.stop = set(layers), max(layers), chunk, stop_after_last
        self.head_mean = head_mean or add_head_mean
        self.W = None  # (B, T, T) fp32: sum over the layers taken of their head means
        self.seen = set()  # layers taken (a replay in backward takes nothing new)

    def take(self, layer, query, key, attention_mask, scaling, probs=None):
        """Called by capture_attention with the layer's Q (B, H, T, d) and K (B, Hkv, S, d), after RoPE; by
        eager_capture_attention also with `probs` (B, H, T, S), the probabilities the model's own eager
        attention computed: their head mean is summed as they are, not recomputed."""
        if layer not in self.layers:
            return
        if layer in self.seen:
            if torch._C._current_graph_task_id() >= 0:  # inside backward: gradient checkpointing's replay
                return
            raise RuntimeError(
                "this Capture has taken a forward already: make a new Capture for each forward"
            )
        (B, H, T, _), S = query.shape, key.shape[2]  # T queries: the last T of S (a cached prefix)
        if self.W is None:
            self.W = torch.zeros(B, S, S, dtype=torch.float32, device=query.device)  # (B, S, S)
        if tuple(self.W.shape) != (B, S, S):
            raise RuntimeError(
                f"a forward of {B} x {S} tokens reached a Capture of {tuple(self.W.shape)}: "
                "make a new Capture for each forward"
            )
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if probs is not None:  # the model's own probabilities (eager_capture_attention)
            self.W[:, S - T : S, :S] += probs.detach().sum(1, dtype=torch.float32).div_(H)  # (B, T, S)
        else:
            self.head_mean(
                self.W[:, S - T : S, :S],
                query.detach(),
                key.detach(),
                attention_mask,
                scale,
                self.chunk or auto_chunk(B, H, S),
            )
        self.seen.add(layer)
        if self.stop and layer == self.last:
            raise _Stop

    def expand_prompts(self, which, width):
        """The two-pass forward that reads each distinct prompt once (training/policy.py): after the prompt
        pass, this Capture holds (k, P, P) maps of the k prompts; they become the top-left of each row b's
        (B, T, T) maps (prompt which[b]), T = width, and the response pass, given this same Capture, adds
        the rows from P on."""
        if self.seen != self.layers or self.W is None:
            raise RuntimeError(
                f"the prompt pass captured {len(self.seen)} of {len(self.layers)} chosen layers"
            )
        P = self.W.shape[-1]
        prompts, self.W = self.W, self.W.new_zeros(len(which), width, width)  # (B, T, T)
        self.W[:, :P, :P] = prompts[which]  # (B, P, P)
        self.seen = set()  # the response pass

    def maps(self, attention_mask):
        """(B, T, T) the layer mean of the head means, zero on padding rows and columns: eq. 1's W. Made in
        place from the buffer (no second (B, T, T) exists), so it can be read once."""
        if self.seen != self.layers or self.W is None:
            raise RuntimeError(
                f"captured {len(self.seen)} of {len(self.layers)} chosen layers, or the maps "
                "were read already"
            )
        if tuple(attention_mask.shape) != tuple(self.W.shape[:2]):
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} does not fit the captured "
                f"forward {tuple(self.W.shape[:2])}"
            )
        m = attention_mask.to(self.W.device).float()  # (B, T) 0 / 1
        W, self.W = self.W, None
        return W.div_(len(self.layers)).mul_(m[:, :, None]).mul_(m[:, None, :])  # (B, T, T)


# ----------------------------------------------------------------------------- eq. 1 in PyTorch: the head
# mean What Capture.take sums each chosen layer with: add_head_mean, the reference, on every device; its fast
# twin is the fused Triton kernel gpu_kernels/head_mean.py (head_mean_triton, tested against it), which
# head_mean_kernel picks once per run where it can run (CUDA, Triton, a C compiler; departure 5).
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


def head_mean_kernel(device):
    """The function a Capture sums each layer's head means with on `device`, chosen once
    (training/run/setup.py's setup) and said in one line: the fused Triton kernels (gpu_kernels/head_mean.py)
    where they can run, else
    add_head_mean, the reference, with the reason (gpu_kernels/availability.py)."""
    if torch.device(device).type != "cuda":  # the kernels are built for CUDA: nothing to ask
        return add_head_mean
    from gpu_kernels.availability import unavailable  # Triton is imported only where it may run

    why = unavailable(device)
    if why is None:
        from gpu_kernels.head_mean import head_mean_triton

        print("flow credit: head-mean maps by the fused Triton kernel (gpu_kernels/head_mean.py)")
        return head_mean_triton
    print(f"flow credit: head-mean maps by add_head_mean, not the fused Triton kernel: {why}")
    return add_head_mean


class _Stop(Exception):
    """Raised after the last chosen layer to end the forward pass early."""


def capture_attention(module, query, key, value, attention_mask, scaling=None, flow_capture=None, **kwargs):
    """AttentionInterface function: sdpa's output, and the head-mean map of this layer into `flow_capture`
    when the forward was given one (Capture.take)."""
    if flow_capture is not None:
        flow_capture.take(getattr(module, "layer_idx", None), query, key, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def eager_capture_attention(
    module, query, key, value, attention_mask, scaling=None, flow_capture=None, **kwargs
):
    """AttentionInterface function for a model whose attention SDPA cannot compute: the model's own eager
    attention (`eager_attention_forward` of its modeling file: soft-capping, sinks, the sliding window's
    mask, as the model computes them) on every layer, and into `flow_capture`, when the forward was given
    one, the head mean of the probabilities it returns (Capture.take's probs; the chosen layers only). The
    map is then the attention the model computes, in its dtype (bf16 probabilities under bf16), after its
    attention dropout where a config trains with one (Gemma-2's and GPT-OSS's: 0), sinks' mass left out
    (GPT-OSS: rows sum to < 1, which trace_flow takes)."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, probs = eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if flow_capture is not None:
        flow_capture.take(getattr(module, "layer_idx", None), query, key, attention_mask, scaling, probs)
    return out, probs


def sdpa_mask_no_empty_rows(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, **kwargs):
    """transformers' sdpa mask, (B, 1, q, kv) bool or None (causal, no padding), except that a query may
    always read its own key. A left-padding query (data.build_batch, HF generate's prompts) reads no key
    otherwise: the row is fully masked, and transformers 5.23 no longer repairs it. torch's CPU kernels give 0
    for such a row, some GPU kernels NaN, which reaches the gradient through 0 * NaN. A real token reads its
    own key already, so its row, and every output that is read, is unchanged; a padding row's output (its
    own value) is never read."""
    mask = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, **kwargs)
    if mask is None:
        return None
    q = torch.arange(q_length, device=mask.device)[:, None] + q_offset  # (q, 1) positions in the cache
    kv = torch.arange(kv_length, device=mask.device)[None, :] + kv_offset  # (1, kv)
    return mask | (q == kv)  # (B, 1, q, kv)


def register_attention():
    """Register "sdpa_capture" with transformers, once per process: the attention function (sdpa's output,
    plus the maps when a forward is given a Capture) and its mask function (sdpa's, no empty rows); and
    "eager_capture" (the model's eager attention, plus the maps) with transformers' eager mask. Called by
    training/model/load.py's load_model before it loads a model, and by use_capture_attention; importing
    this module registers nothing. Only these two names are registered: a model under transformers'
    "sdpa" or "eager" keeps transformers' own (tests/credit/test_attention.py)."""
    AttentionInterface.register(IMPL, capture_attention)
    AttentionMaskInterface.register(IMPL, sdpa_mask_no_empty_rows)
    AttentionInterface.register(EAGER_IMPL, eager_capture_attention)
    AttentionMaskInterface.register(EAGER_IMPL, eager_mask)


# ----------------------------------------------------------------------------- eq. 1-4: the flow
class Flow(NamedTuple):
    h: torch.Tensor  # (B, T) answer reachability, eq. 2 (1 on the answer, 0 where unreachable)
    flow: torch.Tensor  # (B, T) f, eq. 4: share of the question->answer flow through each token
    throughput: torch.Tensor  # (B, T) tau = f + outflow = 2f off the answer, f on it (Theorem 3.1)


def dag_weights(attn: torch.Tensor, answer_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """M_ik = attn[k, i] for i < k (eq. 1) in fp64, answer rows and padding cut out. (B, T, T) view."""
    v = attention_mask.bool()  # (B, T) real tokens
    return _neg_dag(attn, answer_mask.bool() & v, v).neg_().tril_(diagonal=-1).mT  # neg first: no -0.0


def _neg_dag(attn, answer_mask, valid):
    """-M in query-major layout, in one fp64 copy: A[b, k, i] = -W_ik below the diagonal. The diagonal and
    the upper triangle are left as they are: the unitriangular solves never read them. This is
    memory-bound, so each full pass over the T x T matrix counts: one copy, one sign + answer cut."""
    A = attn.to(torch.float64, copy=True)  # (B, T, T) query k, key i; a copy
    A.mul_(-(valid & ~answer_mask).to(A.dtype).unsqueeze(-2))  # key i: answers pass nothing on; sign
    if not bool(valid.all()):
        A.mul_(valid.to(A.dtype).unsqueeze(-1))  # query k: padding reads nothing
    return A


def reweight(M: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """W'_ik = W_ik h(k) / h(i) where h(i) > 0, else 0 (eq. 3). For inspection; trace_flow never builds it."""
    inv = torch.where(h > 0, 1.0 / h.clamp_min(H_FLOOR), torch.zeros_like(h))  # (B, T)
    return M * inv.unsqueeze(-1) * h.unsqueeze(-2)  # (B, T, T)


def trace_flow(
    attn: torch.Tensor,
    question_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> Flow:
    """Answer-targeted flow on the attention DAG (eq. 1-4). Vectorised, fp64, no loop over tokens.

    attn:          (T, T) or (B, T, T) head-averaged attention as transformers returns it:
                   attn[..., k, i] is the weight of query k on key i. W_ik = attn[k, i] for i < k only;
                   the diagonal and everything above it are ignored (eq. 1).
    question_mask: (T,) or (B, T) bool, the source region Q. Unit flow enters uniformly at the question
                   tokens that can reach the answer (h > 0), 1/|Q'| each.
    answer_mask:   (T,) or (B, T) bool, the answer region A. Absorbing: h = 1 there (eq. 2), and answer
                   tokens pass no flow on, so the flow reaching the answer is exactly the flow injected (1).
    attention_mask: optional (T,) or (B, T), 1 / True on real tokens; padding (0) is cut from the graph.

    Returns Flow(h, flow, throughput), fp64, shaped like the masks, where
      h     solves h(i) = sum_{k>i} W_ik h(k) off the answer (eq. 2);
      flow  solves f(k) = s(k) + sum_{i<k} f(i) W'_ik with W'_ik = W_ik h(k)/h(i) (eq. 3-4);
      throughput tau(k) = f(k) + sum_j f(k) W'_kj. By Theorem 3.1 (sum_j W'_kj = 1 wherever h(k) > 0),
            tau = 2f at every non-answer node with h > 0; on the absorbing answer nodes tau = f.
    Padding, tokens after the answer and nodes that cannot reach the answer get h = 0 and flow = 0.
    If no question token reaches the answer (no answer, answer before the question, T = 1), all flow is 0;
    flow_credit then falls back to uniform credit.
    """
    if attn.dim() not in (2, 3) or attn.shape[-1] != attn.shape[-2]:  # the inputs, checked first
        raise ValueError(f"attn must be (T, T) or (B, T, T), got shape {tuple(attn.shape)}")
    single = attn.dim() == 2
    attention_mask = torch.ones_like(question_mask) if attention_mask is None else attention_mask
    for name, m in dict(
        question_mask=question_mask, answer_mask=answer_mask, attention_mask=attention_mask
    ).items():
        if tuple(m.shape) != tuple(attn.shape[:-1]):
            raise ValueError(f"{name} must have shape {tuple(attn.shape[:-1])}, got {tuple(m.shape)}")
    if not bool((attn >= 0).all()):  # one pass: False for NaN and for negatives
        if torch.isnan(attn).any():
            raise ValueError("attn contains NaN: check the model's forward pass (fp16 overflow?)")
        raise ValueError(f"attn must be non-negative (probabilities), min is {attn.min().item():.3g}")
    if single:
        attn, question_mask, answer_mask, attention_mask = (
            x.unsqueeze(0) for x in (attn, question_mask, answer_mask, attention_mask)
        )
    v = attention_mask.bool()  # (B, T) real tokens
    q, a = question_mask.bool(), answer_mask.bool() & v

    A = _neg_dag(attn, a, v)  # (B, T, T) A[k, i] = -W_ik, eq. 1
    # eq. 2: (I - M) h = 1_A. unitriangular=True reads only the strict upper part of -M (A.mT) and takes
    # the diagonal as 1: that is I - M. Below H_FLOOR, h counts as 0 (departure 1).
    h = torch.linalg.solve_triangular(
        A.mT, a.to(A.dtype).unsqueeze(-1), upper=True, unitriangular=True
    ).squeeze(-1)  # (B, T)
    h = torch.where(h > H_FLOOR, h, torch.zeros_like(h))

    src = (q & v & (h > 0)).to(h.dtype)  # (B, T) question tokens that reach A
    s = src / src.sum(-1, keepdim=True).clamp_min(1.0)  # (B, T) unit injection, 1/|Q'| each
    rhs = torch.where(h > 0, s / h.clamp_min(H_FLOOR), torch.zeros_like(h))  # (B, T) s / h
    g = torch.linalg.solve_triangular(
        A,
        rhs.unsqueeze(-1),  # A = -M^T, lower
        upper=False,
        unitriangular=True,
    ).squeeze(-1)  # (B, T) (I - M^T) g = s/h
    f = h * g  # (B, T) eq. 4
    # g(k) = s(k)/h(k) + sum_i attn[k, i] g(i) and attention rows sum to <= 1, so g <= max(s/h) < 1/H_FLOOR:
    # no overflow, and unreachable nodes (h = 0) get f = 0 without being cut from the matrix.
    if not bool(torch.isfinite(f).all()):
        raise FloatingPointError("flow is not finite: are the attention rows probabilities (sum <= 1)?")
    tau = torch.where(a, f, 2.0 * f)  # (B, T) Theorem 3.1
    out = Flow(h, f, tau)
    return Flow(*(x.squeeze(0) for x in out)) if single else out


# ----------------------------------------------------------------------------- eq. 5-6: the credit
class Credit(NamedTuple):
    """The credit of B rows on the columns from prompt_width on, (B, R) with R = T - prompt_width: every
    credit gives this record (flow_credit here, baselines.assign and baselines.OtherCredit for the others)."""

    weight: torch.Tensor  # (B, R) gamma_{i,t}: gamma on selected response tokens, 1 on the rest, 0 off it
    scores: torch.Tensor  # (B, R) float32 what ranked the tokens (flow: the throughput tau)
    fallback: torch.Tensor  # (B,) bool: no answer / no path -> all-1 weights (plain GRPO)


def flow_credit(
    throughput: torch.Tensor,
    response_mask: torch.Tensor,
    top_frac: float = 0.4,
    gamma: float = 1.5,
    largest: bool = True,
    prompt_width: int = 0,
) -> Credit:
    """Per-token GRPO weights from flow throughput (eq. 6; top_frac 0.4 and gamma 1.5 as in Table 5/7).

    In each sequence with n response tokens, the ceil(top_frac * n) tokens with the highest throughput
    (lowest with largest=False: the Bottom-k ablation of Table 5) get `gamma`, the other response tokens 1,
    tokens off the response 0. Ties go to the earlier token. A sequence whose response carries no flow
    (no answer region, or no path from the question to the answer) gets all-1 weights and fallback=True.
    throughput, response_mask: (T,) or (B, T); the Credit holds the columns from prompt_width on (the
    response columns of a data.Batch; 0: every column).
    """
    if not 0.0 <= top_frac <= 1.0:
        raise ValueError(f"top_frac must be in [0, 1], got {top_frac}")
    single = throughput.dim() == 1
    tau, resp = (throughput, response_mask) if not single else (throughput[None], response_mask[None])
    resp = resp.bool()
    if torch.isnan(tau).any():
        raise ValueError("throughput contains NaN")
    n = resp.sum(-1)  # (B,)
    k = torch.ceil(top_frac * n.double() - 1e-9).long()  # (B,) ceil without float fuzz
    r, _ = rank(tau.double() if largest else -tau.double(), resp)  # (B, T) 0 = the highest
    chosen = (r < k.unsqueeze(-1)) & resp  # (B, T)
    fallback = ~((tau > 0) & resp).any(-1)  # (B,) no flow reaches the response
    chosen &= ~fallback.unsqueeze(-1)
    w = resp.to(torch.float32) + (gamma - 1.0) * chosen.to(torch.float32)  # (B, T)
    P = prompt_width
    out = Credit(w[:, P:], tau[:, P:].float(), fallback)  # (B, R), (B, R), (B,)
    return Credit(*(x.squeeze(0) for x in out)) if single else out


def rank(key, m):
    """((B, T) rank of each token of m by descending key within its row, 0 the highest, ties to the earlier
    token; (B, T) the order, token ids by rank). Tokens off m rank after every token of m."""
    key = torch.where(m, key, torch.full_like(key, -math.inf))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # (B, T) stable: earlier wins ties
    ar = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ar), order
