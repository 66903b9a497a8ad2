"""FlowTracer: answer-targeted information flow on the attention DAG, and the credit it gives.

Paper (FlowTracer): "How Does Reasoning Flow? Tracing Attention-Induced Information Flow for Targeted RL in
LLMs" (Dong, Li et al., Shanghai Jiao Tong University and Alibaba), §3.1-3.3 and App. C.2.

    attention_graph   one no-grad forward pass -> head/layer-mean attention (§3.3, App. C.2)
    Capture           the same maps, taken inside a forward that runs anyway: grpo.py's training forward is
                      given one (policy.token_logprobs(..., capture=cap)); `capture` does it for TRL's forward
    trace_flow        eq. 1-4: DAG weights W, answer reachability h, reweighted W', flow f, throughput tau
    flow_credit       eq. 5-6: gamma on the top 40% response tokens by throughput, 1 elsewhere
    The batch and its question, response and answer tokens: training/rollout.py (Batch, build_batch, take).

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
    earlier token; the question is the prompt minus special tokens (BOS, chat markers; training/rollout.py);
    the answer is the content of the last \\boxed{...} (else the last <answer>...</answer>).
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
    in two fused Triton kernels that never hold an (H, T, T) tensor (gpu_kernels/head_mean.py).
    Padding query rows and padding keys are zero (eager gives padding queries uniform rows).

Run the tests: python -m pytest -q tests/test_flowtracer.py
Time it:       python benchmarks/flow_speed.py
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

try:                 # CUDA: the head-mean map in two fused Triton kernels (gpu_kernels/head_mean.py)
    from gpu_kernels.head_mean import head_mean_triton
except ImportError:  # no Triton: add_head_mean, the reference, serves every device
    head_mean_triton = None

H_FLOOR = 1e-250  # departure 1: below this, h counts as 0 (unreachable); fp64 goes down to ~1e-308


# ----------------------------------------------------------------------------- eq. 1: the graph from a model
# How, without the L*H*T*T tensor of eager attention's output_attentions=True: an attention function
# "flowtracer" (transformers' AttentionInterface) returns sdpa's output and, when the forward was given a
# Capture, recomputes the chosen layers' softmax(Q K^T * scaling + mask) in fp32 and sums its heads into one
# (B, T, T) buffer on the Capture. Q and K arrive after q/k-norm (Qwen3) and RoPE.
IMPL = "flowtracer"
LAYER_SPECS = ("None or 'middle' (L//3 .. 2L//3-1), 'early' (0 .. L//3-1), 'late' (2L//3 .. L-1), 'all', "
               "'fig6-early' | 'fig6-middle' | 'fig6-late' (Fig. 6: 0-14, 15-24, 25-35 of 36, scaled), "
               "or 'A:B'")
FIG6 = (15, 25)  # Fig. 6's stage boundaries in Qwen3-4B's 36 layers (§4.3; departure 4)


def select_layers(spec, num_layers):
    """Layer indices for a spec; see LAYER_SPECS. 'A:B' uses Python slice semantics (negatives, open ends)."""
    L = num_layers
    b1, b2 = ((b * L + 18) // 36 for b in FIG6)                  # round(b L / 36), halves up; exact at L = 36
    named = {None: (L // 3, 2 * L // 3), "middle": (L // 3, 2 * L // 3), "early": (0, L // 3),
             "late": (2 * L // 3, L), "all": (0, L), "fig6-early": (0, b1), "fig6-middle": (b1, b2),
             "fig6-late": (b2, L)}
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
    """The chosen layers' head-mean attention of one forward, handed to that forward as a keyword argument:

        cap = Capture(select_layers("middle", L))
        model(input_ids, attention_mask=mask, flow_capture=cap)    # transformers passes it to every layer
        cap.maps(mask)                                             # (B, T, T) layer mean, zero on padding

    The attention function calls `take` on each layer; the maps travel on this object, by value. Gradient
    checkpointing's replay rule lives here: backward replays a checkpointed layer with the same keywords, and
    a layer already taken in this pass adds nothing (`seen`). `stop_after_last`: raise after the last chosen
    layer (attention_graph's own pass needs neither the later layers nor the LM head)."""
    def __init__(self, layers, chunk=None, stop_after_last=False):
        self.layers, self.last, self.chunk, self.stop = set(layers), max(layers), chunk, stop_after_last
        self.buf = None         # (B, T, T) fp32: sum over the layers taken of their head means
        self.seen = set()       # layers taken in this pass (the replay rule)
        self.calls = 0          # layers taken in all passes
        self.passes = 1         # forwards that each take every chosen layer (2 with a shared prompt)

    def take(self, layer, query, key, attention_mask, scaling):
        """Called by flowtracer_attention with the layer's Q (B, H, T, d) and K (B, Hkv, S, d), after RoPE."""
        if layer not in self.layers or layer in self.seen:
            return
        (B, H, T, _), S = query.shape, key.shape[2]       # T queries: the last T of S (a cached prefix)
        if self.buf is None:
            self.buf = torch.zeros(B, S, S, dtype=torch.float32, device=query.device)
        if self.buf.shape[0] != B or self.buf.shape[-1] < S:
            raise RuntimeError(f"a forward of {B} x {S} tokens reached a Capture of {tuple(self.buf.shape)}: "
                               "between a shared prompt's two passes call Capture.expand_prompts")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        fill = head_mean_triton if query.is_cuda and head_mean_triton is not None else add_head_mean
        fill(self.buf[:, S - T:S, :S], query.detach(), key.detach(), attention_mask, scale,
             self.chunk or auto_chunk(B, H, S))
        self.seen.add(layer)
        self.calls += 1
        if self.stop and layer == self.last:
            raise _Stop

    def expand_prompts(self, which, width):
        """Between policy.response_states' two passes: the (k, P, P) maps of the k distinct prompts become
        the top left of the rows' (B, T, T) maps (row b read prompt which[b]); the response pass fills the
        rest."""
        if self.buf is not None:
            P, buf = self.buf.shape[-1], self.buf.new_zeros(len(which), width, width)   # (B, T, T)
            buf[:, :P, :P] = self.buf[which]                                            # (B, P, P)
            self.buf, self.seen, self.passes = buf, set(), self.passes + 1

    def maps(self, attention_mask):
        """(B, T, T) the layer mean of the head means, zero on padding rows and columns: eq. 1's W. Made in
        place from the buffer (no second (B, T, T) exists), so it can be read once."""
        if self.calls != len(self.layers) * self.passes or self.buf is None:
            raise RuntimeError(f"captured {self.calls} of {len(self.layers)} chosen layers x "
                               f"{self.passes} forward(s), or the maps were read already")
        m = attention_mask.to(self.buf.device).float()                                  # (B, T) 0 / 1
        W, self.buf = self.buf, None
        return W.div_(len(self.layers)).mul_(m[:, :, None]).mul_(m[:, None, :])          # (B, T, T)


class _Stop(Exception):
    """Raised after the last chosen layer to end the forward pass early."""


def add_head_mean(buf, query, key, attention_mask, scaling, chunk):
    """buf (B,T,S) += sum over heads / H of softmax(Q K^T * scaling + mask), query chunk by chunk, in fp32.
    The T queries are the last T of the S keys (S > T: the first S - T come from a KV cache). GQA: the G
    query heads of a KV head are folded into the rows, (G c, D) @ (D, S), so no key is copied G times."""
    (B, H, T, D), (Hkv, S) = query.shape, key.shape[1:3]
    q = query.float().view(B, Hkv, H // Hkv, T, D)  # (B, Hkv, G, T, D): query heads grouped by their KV head
    kT = key.float().mT                             # (B, Hkv, D, S), a view
    with torch.autocast(query.device.type, enabled=False):    # fp32 also under the run's bf16 autocast
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            score = (q[:, :, :, s:e].reshape(B, Hkv, -1, D) @ kT).view(B, Hkv, H // Hkv, e - s, S)
            score.mul_(scaling)                                                     # (B, Hkv, G, c, S)
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


def flowtracer_attention(module, query, key, value, attention_mask, scaling=None, flow_capture=None,
                         **kwargs):
    """AttentionInterface function: sdpa's output, and the head-mean map of this layer into `flow_capture`
    when the forward was given one (Capture.take)."""
    if flow_capture is not None:
        flow_capture.take(getattr(module, "layer_idx", None), query, key, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(IMPL, flowtracer_attention)
AttentionMaskInterface.register(IMPL, sdpa_mask)  # the model builds sdpa's masks for "flowtracer"


def auto_chunk(B, H, T, budget=2 ** 25):
    """Query rows per chunk so that one (B, H, chunk, T) fp32 score block stays under `budget` floats."""
    return max(1, min(T, budget // max(1, B * H * T)))


def _check_inputs(input_ids, attention_mask, chunk):
    if input_ids.ndim != 2 or attention_mask is None or attention_mask.shape != input_ids.shape:
        raise ValueError("attention capture needs input_ids and attention_mask, both (B, T)")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    if (attention_mask.sum(-1) == 0).any():
        raise ValueError("attention capture got a row with no valid token (attention_mask all zero)")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive number of query rows (or None), got {chunk!r}")


class capture:
    """Context manager for a forward that you do not call yourself (TRL's training forward): `model`'s next
    decoder forwards are given a Capture (a pre-hook adds flow_capture=...), under the "flowtracer" attention.
    After the block, `.attn` is the (B, T, T) layer mean, zero on padding, as attention_graph returns it.

        with capture(model, mask, "middle") as cap:
            out = model(input_ids, attention_mask=mask, ...)   # the training forward, with grad
        cap.attn  # (B, T, T), cap.calls == number of chosen layers
    Where you call the forward yourself, pass a Capture instead (policy.token_logprobs(..., capture=cap))."""
    def __init__(self, model, attention_mask, layers=None, chunk=None):
        self.model, self.mask = model, attention_mask.long()
        self.state = Capture(select_layers(layers, model.config.num_hidden_layers), chunk)
        self.attn, self.calls = None, 0

    def __enter__(self):
        self.old = use_flowtracer_attention(self.model)
        give = lambda module, args, kwargs: (args, {**kwargs, "flow_capture": self.state})  # noqa: E731
        self.hook = self.model.get_decoder().register_forward_pre_hook(give, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        if self.old != IMPL:
            self.model.set_attn_implementation(self.old)
        self.calls = self.state.calls
        if exc[0] is None:
            self.attn = self.state.maps(self.mask)
        return False


def use_flowtracer_attention(model):
    """Switch `model` to the "flowtracer" attention function (sdpa + the capture); returns the old name."""
    old = model.config._attn_implementation
    if old != IMPL:
        model.set_attn_implementation(IMPL)
    if model.config._attn_implementation != IMPL:
        raise ValueError(f"{type(model).__name__} cannot switch to a custom AttentionInterface function")
    return old


@torch.no_grad()
def attention_graph(model, input_ids, attention_mask, layers=None, chunk=None):
    """(B, T, T) float32: attention probabilities averaged over all heads of the chosen layers (Eq. 1).

    out[b, k, i] = weight of query k on key i; zero for i > k, for padding keys and for padding query rows.
    `layers`: a spec for select_layers (default: middle layers). `chunk`: query rows per softmax block.
    Its own no-grad forward, which stops after the last chosen layer (a Capture with stop_after_last);
    the training forward takes the same maps on its way (grpo.update)."""
    _check_inputs(input_ids, attention_mask, chunk)
    cap = Capture(select_layers(layers, model.config.num_hidden_layers), chunk, stop_after_last=True)
    mask = attention_mask.to(input_ids.device).long()  # (B, T)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T), as HF generate
    old_impl, was_training = use_flowtracer_attention(model), model.training
    try:
        model.eval()
        model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
              flow_capture=cap)
        raise RuntimeError("the forward pass ended without reaching the last chosen layer")
    except _Stop:
        pass
    finally:
        if old_impl != IMPL:
            model.set_attn_implementation(old_impl)
        model.train(was_training)
    return cap.maps(mask)  # layer mean, zero on padding


# ----------------------------------------------------------------------------- eq. 1-4: the flow
class Flow(NamedTuple):
    h: torch.Tensor           # (B, T) answer reachability, eq. 2 (1 on the answer, 0 where unreachable)
    flow: torch.Tensor        # (B, T) f, eq. 4: share of the question->answer flow through each token
    throughput: torch.Tensor  # (B, T) tau = f + outflow = 2f off the answer, f on it (Theorem 3.1)


def dag_weights(attn: torch.Tensor, answer_mask: torch.Tensor, valid_mask: torch.Tensor) -> torch.Tensor:
    """M_ik = attn[k, i] for i < k (eq. 1) in fp64, answer rows and padding cut out. (B, T, T) view."""
    return _neg_dag(attn, answer_mask, valid_mask).neg_().tril_(diagonal=-1).mT  # neg first: no -0.0


def _neg_dag(attn, answer_mask, valid_mask):
    """-M in query-major layout, in one fp64 copy: A[b, k, i] = -W_ik below the diagonal. The diagonal and
    the upper triangle are left as they are: the unitriangular solves never read them. This is
    memory-bound, so each full pass over the T x T matrix counts: one copy, one sign + answer cut."""
    A = attn.to(torch.float64, copy=True)                          # (B, T, T) query k, key i; a copy
    A.mul_(-(valid_mask & ~answer_mask).to(A.dtype).unsqueeze(-2))  # key i: answers pass nothing on; sign
    if not bool(valid_mask.all()):
        A.mul_(valid_mask.to(A.dtype).unsqueeze(-1))                # query k: padding reads nothing
    return A


def _solve_h(negM, answer_mask):
    rhs = answer_mask.to(negM.dtype).unsqueeze(-1)                                # (B, T, 1)
    # unitriangular=True reads only the strict upper part of -M and takes the diagonal as 1: that is I - M.
    h = torch.linalg.solve_triangular(negM, rhs, upper=True, unitriangular=True).squeeze(-1)  # (B, T)
    return torch.where(h > H_FLOOR, h, torch.zeros_like(h))


def reweight(M: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """W'_ik = W_ik h(k) / h(i) where h(i) > 0, else 0 (eq. 3). For inspection; trace_flow never builds it."""
    inv = torch.where(h > 0, 1.0 / h.clamp_min(H_FLOOR), torch.zeros_like(h))  # (B, T)
    return M * inv.unsqueeze(-1) * h.unsqueeze(-2)                             # (B, T, T)


def _check(attn, question_mask, answer_mask, valid_mask):
    if attn.dim() not in (2, 3) or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be (T, T) or (B, T, T), got shape {tuple(attn.shape)}")
    for name, m in dict(question_mask=question_mask, answer_mask=answer_mask, valid_mask=valid_mask).items():
        if m is not None and tuple(m.shape) != tuple(attn.shape[:-1]):
            raise ValueError(f"{name} must have shape {tuple(attn.shape[:-1])}, got {tuple(m.shape)}")
    if not bool((attn >= 0).all()):                 # one pass: False for NaN and for negatives
        if torch.isnan(attn).any():
            raise ValueError("attn contains NaN: check the model's forward pass (fp16 overflow?)")
        raise ValueError(f"attn must be non-negative (probabilities), min is {attn.min().item():.3g}")


def trace_flow(attn: torch.Tensor, question_mask: torch.Tensor, answer_mask: torch.Tensor,
               valid_mask: torch.Tensor | None = None) -> Flow:
    """Answer-targeted flow on the attention DAG (eq. 1-4). Vectorised, fp64, no loop over tokens.

    attn:          (T, T) or (B, T, T) head-averaged attention as transformers returns it:
                   attn[..., k, i] is the weight of query k on key i. W_ik = attn[k, i] for i < k only;
                   the diagonal and everything above it are ignored (eq. 1).
    question_mask: (T,) or (B, T) bool, the source region Q. Unit flow enters uniformly at the question
                   tokens that can reach the answer (h > 0), 1/|Q'| each.
    answer_mask:   (T,) or (B, T) bool, the answer region A. Absorbing: h = 1 there (eq. 2), and answer
                   tokens pass no flow on, so the flow reaching the answer is exactly the flow injected (1).
    valid_mask:    optional (T,) or (B, T) bool; False (padding) nodes are cut from the graph.

    Returns Flow(h, flow, throughput), fp64, shaped like the masks, where
      h     solves h(i) = sum_{k>i} W_ik h(k) off the answer (eq. 2);
      flow  solves f(k) = s(k) + sum_{i<k} f(i) W'_ik with W'_ik = W_ik h(k)/h(i) (eq. 3-4);
      throughput tau(k) = f(k) + sum_j f(k) W'_kj. By Theorem 3.1 (sum_j W'_kj = 1 wherever h(k) > 0),
            tau = 2f at every non-answer node with h > 0; on the absorbing answer nodes tau = f.
    Padding, tokens after the answer and nodes that cannot reach the answer get h = 0 and flow = 0.
    If no question token reaches the answer (no answer, answer before the question, T = 1), all flow is 0;
    flow_credit then falls back to uniform credit.
    """
    single = attn.dim() == 2
    valid_mask = torch.ones_like(question_mask, dtype=torch.bool) if valid_mask is None else valid_mask
    _check(attn, question_mask, answer_mask, valid_mask)
    if single:
        attn, question_mask, answer_mask, valid_mask = (x.unsqueeze(0) for x in
                                                        (attn, question_mask, answer_mask, valid_mask))
    q, a, v = question_mask.bool(), answer_mask.bool() & valid_mask.bool(), valid_mask.bool()

    A = _neg_dag(attn, a, v)                                        # (B, T, T) A[k, i] = -W_ik, eq. 1
    h = _solve_h(A.mT, a)                                           # (B, T) eq. 2: (I - M) h = 1_A

    src = (q & v & (h > 0)).to(h.dtype)                                # (B, T) question tokens that reach A
    s = src / src.sum(-1, keepdim=True).clamp_min(1.0)              # (B, T) unit injection, 1/|Q'| each
    rhs = torch.where(h > 0, s / h.clamp_min(H_FLOOR), torch.zeros_like(h))  # (B, T) s / h
    g = torch.linalg.solve_triangular(A, rhs.unsqueeze(-1),                  # A = -M^T, lower
                                      upper=False, unitriangular=True).squeeze(-1)  # (B, T) (I - M^T) g = s/h
    f = h * g                                                       # (B, T) eq. 4
    # g(k) = s(k)/h(k) + sum_i attn[k, i] g(i) and attention rows sum to <= 1, so g <= max(s/h) < 1/H_FLOOR:
    # no overflow, and unreachable nodes (h = 0) get f = 0 without being cut from the matrix.
    if not bool(torch.isfinite(f).all()):
        raise FloatingPointError("flow is not finite: are the attention rows probabilities (sum <= 1)?")
    tau = torch.where(a, f, 2.0 * f)                                # (B, T) Theorem 3.1
    out = Flow(h, f, tau)
    return Flow(*(x.squeeze(0) for x in out)) if single else out


# ----------------------------------------------------------------------------- eq. 5-6: the credit
class Credit(NamedTuple):
    gamma: torch.Tensor     # (B, T) gamma_{i,t}: gamma on selected response tokens, 1 on the rest, 0 off it
    fallback: torch.Tensor  # (B,) bool: no answer / no path -> all-1 weights (plain GRPO)


def flow_credit(throughput: torch.Tensor, response_mask: torch.Tensor, top_frac: float = 0.4,
                gamma: float = 1.5, largest: bool = True) -> Credit:
    """Per-token GRPO weights from flow throughput (eq. 6; top_frac 0.4 and gamma 1.5 as in Table 5/7).

    In each sequence with n response tokens, the ceil(top_frac * n) tokens with the highest throughput
    (lowest with largest=False: the Bottom-k ablation of Table 5) get `gamma`, the other response tokens 1,
    tokens off the response 0. Ties go to the earlier token. A sequence whose response carries no flow
    (no answer region, or no path from the question to the answer) gets all-1 weights and fallback=True.
    """
    if not 0.0 <= top_frac <= 1.0:
        raise ValueError(f"top_frac must be in [0, 1], got {top_frac}")
    single = throughput.dim() == 1
    tau, resp = (throughput, response_mask) if not single else (throughput[None], response_mask[None])
    resp = resp.bool()
    if torch.isnan(tau).any():
        raise ValueError("throughput contains NaN")
    n = resp.sum(-1)                                                    # (B,)
    k = torch.ceil(top_frac * n.double() - 1e-9).long()                 # (B,) ceil without float fuzz
    key = tau.double() if largest else -tau.double()
    key = torch.where(resp, key, torch.full_like(key, -math.inf))       # (B, T) off-response ranks last
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # (B, T) stable: earlier wins ties
    ar = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ar)              # (B, T) rank of each token
    chosen = (rank < k.unsqueeze(-1)) & resp                            # (B, T)
    fallback = ~((tau > 0) & resp).any(-1)                              # (B,) no flow reaches the response
    chosen &= ~fallback.unsqueeze(-1)
    w = resp.to(torch.float32) + (gamma - 1.0) * chosen.to(torch.float32)  # (B, T)
    return Credit(w.squeeze(0), fallback.squeeze(0)) if single else Credit(w, fallback)
