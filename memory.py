"""What one GRPO step holds in memory, and how Qwen3-4B fits on one 80 GB GPU.

The step of grpo.py (16 prompts x 8, 1,024 new tokens, micro-batch 8) in five phases, each with its peak:
  generation      weights + optimizer states + KV cache (2 L Hkv hd T g bf16: 147 KB per token for Qwen3-4B)
  update forward  + gradients (from the 2nd micro-batch on) + the checkpointed layer inputs (L+2 of (b, T, D))
                  + either the attention capture (a (b, T, T) fp32 buffer and fp32 score blocks of <= 2^25
                  floats, flowtracer.auto_chunk) or the log-prob chunks (3 x (b, 128, V) fp32)
  credit          + the captured maps twice (buffer, layer mean) and trace_flow's fp64 copy: (b, T, T) each
  backward        + one decoder layer recomputed (layer_saved, counted op by op) or one log-prob chunk
  optimizer step  weights + gradients + states (+ torch's foreach AdamW: one fp32 copy of v on CUDA)
estimate() computes them from the config (parameters counted on the meta device), nothing allocated;
track_peak() counts the live tensor storages of a real step (measure()) on the CPU, and measure() reads
torch.cuda.max_memory_allocated on a GPU. tests/test_memory.py holds the estimate within 10% of the count.

The fp32 design does not fit. Qwen3-4B has N = 4.02 B parameters: fp32 weights + gradients + AdamW m, v =
16 B/param = 64.4 GB; torch.autocast caches a bf16 copy of every fp32 weight it casts for the whole autocast
region (generation and each training forward: +8.0 GB, 2 B/param); torch's foreach AdamW (the CUDA default)
allocates a fp32 copy of v in the step (+16 GB). Peak 80.5 GB before any activation.

The scheme (--optimizer auto = kahan on CUDA): bf16 weights and gradients, AdamW with bf16 m and v and a
bf16 Kahan compensation buffer (torch-optimi's AdamW, kahan_sum=True): 2 + 2 + 6 = 10 B/param = 40.2 GB,
no autocast cache (the weights are bf16 already), no optimizer temporaries (optimi's Triton kernel, or its
for-loop on the CPU). The compensation c keeps what bf16 rounding drops from each update: p + c is the
weight the optimizer tracks (master_weights). At lr 1e-6 a plain bf16 AdamW loses the update (|dw| ~ 1e-6 is
below half a bf16 ulp of |w| ~ 0.02, so w + dw rounds back to w); the Kahan sum keeps it.
Why optimi: maintained, pure PyTorch (its import and the CPU test need no GPU), one call, no fp32 master copy
to keep in sync. Measured on tiny-qwen3 with the same gradients for all (tests/test_memory.py's
cumulative_updates): the relative norm of (cumulative update - fp32 AdamW's) after 20 steps at lr 1e-6 is
0.0075 for optimi Kahan and 0.999 for plain bf16 AdamW (lost); 0.023 after 200 steps, 0.08-0.09 after 500
(mostly v in bf16: with beta2 = 0.999 its 0.1% decay per step is below bf16 resolution). Aside, with torchao
0.18: bf16 stochastic rounding 14.9 after 20 steps (rounding noise ~2^-9 |w| per step), AdamW8bit on fp32
master weights 1.37 (small v quantised to 0). fp32 master weights + fp32 AdamW (DeepSpeed's 16 B/param =
64.4 GB) leave < 6 GB for the KV cache and activations. The optimizer step fused into backward would save
the 8 GB of gradients but cannot accumulate 16 micro-batches nor clip the global gradient norm.

Departures (numbered):
 1. The attention capture and trace_flow are counted for the fused flow signal (the default); signals
    with a pass of their own (attention, OAR) are not modelled.
 2. Every response is taken at max_new_tokens and every row trained (the worst step); the padded prompt
    width is --prompt-tokens (default 256, a math problem with its template), not max_prompt_tokens.
 3. On CUDA, trace_flow's triangular solve is given one more fp64 (b, T, T) copy than on the CPU (cuBLAS
    trsm layout; not measured here). The autocast (fp32 weights) path is counted, not validated.

Run: python eval.py memory --model qwen3-4b-random                       # the table, in a second
     python eval.py memory --model qwen3-4b-random --max-new-tokens 8192 --gen-chunk 16 --micro-batch 4
     python eval.py memory --model tiny-qwen3 --measure --max-new-tokens 64   # estimate vs a real step
"""
import os
import weakref
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flowtracer import auto_chunk, select_layers as select

GB, GiB = 1e9, 2 ** 30
PHASES = ("generation", "update forward", "credit", "backward", "optimizer step")


# ----------------------------------------------------------------------------- the low-memory scheme
def scheme(cfg, device) -> str:
    """'kahan' (bf16 weights, bf16 AdamW states + Kahan compensation, torch-optimi) or 'adamw' (fp32 weights,
    fp32 torch AdamW). --optimizer auto: kahan on CUDA, adamw on the CPU (the embedded path stays fp32)."""
    name = getattr(cfg, "optimizer", "auto")
    if name not in ("auto", "kahan", "adamw"):
        raise ValueError(f"--optimizer must be auto, kahan or adamw, got {name!r}")
    return ("kahan" if torch.device(device).type == "cuda" else "adamw") if name == "auto" else name


def weight_dtype(cfg, device) -> torch.dtype:
    """The dtype the policy is loaded in: bf16 under the kahan scheme, fp32 under adamw."""
    return torch.bfloat16 if scheme(cfg, device) == "kahan" else torch.float32


def make_optimizer(model, cfg, device) -> torch.optim.Optimizer:
    """AdamW (torch defaults: betas 0.9/0.999, eps 1e-8) for the scheme; see the docstring for the choice."""
    if scheme(cfg, device) == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    import optimi    # torch-optimi: pure PyTorch (for-loop / foreach / Triton), imported only when chosen
    bad = {p.dtype for p in model.parameters()} - {torch.bfloat16}
    if bad:
        raise ValueError(f"--optimizer kahan needs a bf16 model (memory.weight_dtype), got {bad}")
    return optimi.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=cfg.weight_decay, kahan_sum=True)


def master_weights(model, opt) -> dict:
    """{name: fp32 tensor}: the weights the optimizer holds, p + its Kahan compensation where it has one."""
    out = {}
    for n, p in model.named_parameters():
        comp = opt.state.get(p, {}).get("kahan_comp")
        out[n] = p.detach().float().clone() + (comp.float() if comp is not None else 0)
    return out


# ----------------------------------------------------------------------------- the live-tensor tracker
class track_peak(TorchDispatchMode):
    """Peak live tensor bytes, phase by phase, counted by storage (a view costs nothing, each storage is
    counted once, from the op that made it until it is freed). Tensors made before the block are counted
    when passed in (`*resident`: modules, optimizers, tensors) or when an op first reads them.

        with track_peak(model, opt) as tr:
            tr.phase("generation"); ...
        tr.peak  # {phase: bytes}
    """
    def __init__(self, *resident):
        super().__init__()
        self.live, self.now, self.peak, self.name = {}, 0, {}, None
        self.resident = resident

    def add(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st.data_ptr() if st.nbytes() else id(st)
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.now += st.nbytes()
        weakref.finalize(st, self.free, key)
        if self.name is not None:
            self.peak[self.name] = max(self.peak.get(self.name, 0), self.now)

    def free(self, key):
        self.now -= self.live.pop(key, 0)

    def phase(self, name):
        self.name = name
        if name is not None:
            self.peak[name] = max(self.peak.get(name, 0), self.now)

    def __enter__(self):
        for r in self.resident:
            if isinstance(r, torch.nn.Module):
                for t in [*r.parameters(), *r.buffers()]:
                    self.add(t)
                    self.add(t.grad)
            elif isinstance(r, torch.optim.Optimizer):
                for st in r.state.values():
                    for t in tree_flatten(st)[0]:
                        self.add(t)
            else:
                self.add(r)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs))[0] + tree_flatten(out)[0]:
            self.add(t)
        return out


class cuda_peak:
    """track_peak's interface on a GPU: torch.cuda.max_memory_allocated, reset at each phase; the allocator's
    max_memory_reserved of each phase goes to `reserved` (a dict given, or a new one)."""
    def __init__(self, *resident, reserved=None):
        self.peak, self.name, self.reserved = {}, None, {} if reserved is None else reserved

    def phase(self, name):
        self.close()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.name = name

    def close(self):
        if self.name is not None:
            torch.cuda.synchronize()
            self.peak[self.name] = max(self.peak.get(self.name, 0), torch.cuda.max_memory_allocated())
            self.reserved[self.name] = max(self.reserved.get(self.name, 0), torch.cuda.max_memory_reserved())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ----------------------------------------------------------------------------- the accounting (analytic)
COMPONENTS = ("weights", "grads", "optimizer", "cast cache", "KV cache", "activations", "logits", "attention",
              "workspace")


def model_config(name):
    """The HF config of a model name, without its weights where possible (qwen3-4b: models.py's copy)."""
    import models
    from transformers import AutoConfig
    if name in models.RANDOM_MODELS:
        return models.qwen3_4b_config() if name == "qwen3-4b-random" else models.tiny_config(name, 260)
    if "qwen3-4b" in name.lower() and not os.path.isdir(name):
        return models.qwen3_4b_config()
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name)
    return models.load_model(name, device="cpu")[0].config      # GGUF / hub: the only way to read its config


def param_counts(mc):
    """(N, N cast by autocast, largest tensor) for a config, from a model built on the meta device."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(mc)
    ps = list(m.parameters())                                   # tied weights appear once
    emb = m.get_input_embeddings().weight
    cast = sum(p.numel() for p in ps if p.ndim == 2 and (p is not emb or mc.tie_word_embeddings))
    return sum(p.numel() for p in ps), cast, max(p.numel() for p in ps)


def estimate(cfg, mc, device="cuda", prompt_tokens=256) -> dict:
    """{phase: {component: bytes}} for one GRPO step of cfg's shapes (every response max_new_tokens long,
    every row trained) on `device` under memory.scheme; nothing is allocated. The docstring has each term."""
    N, N_cast, N_max = param_counts(mc)
    L, D, I, V = mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size
    Hq, Hkv = mc.num_attention_heads, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or D // Hq
    cuda, kahan = torch.device(device).type == "cuda", scheme(cfg, device) == "kahan"
    wb = 2 if kahan else 4                      # bytes of a weight and of its gradient
    rb = wb                                     # the residual stream: embedding output, + bf16 sublayers
    cb = 2 if cuda or kahan else 4              # matmul outputs (bf16 autocast on CUDA)
    P, R = prompt_tokens, cfg.max_new_tokens
    T, B = P + R, cfg.prompts_per_step * cfg.group_size
    g, b, c = min(cfg.gen_chunk, B), min(cfg.micro_batch, B), min(cfg.logprob_chunk, R)
    layers = captures(cfg)                      # the fused pass takes the attention maps
    w = dict(weights=N * wb, grads=N * wb, optimizer=N * (6 if kahan else 8),
             **{"cast cache": 2 * N_cast if cuda and not kahan else 0})
    zero = dict.fromkeys(COMPONENTS, 0)
    # generation: KV cache (grown by torch.cat: one layer's K copy on top) vs the prompt's prefill
    kv = lambda t: 2 * L * Hkv * hd * t * g * cb                          # noqa: E731
    prefill = g * P * (4 * D * rb + 3 * I * cb) + 5 * g * V * 4
    decode = Hkv * hd * T * g * cb + 5 * g * V * 4                        # cat copy, sampling on (g, V) fp32
    gen = {**zero, **w, "grads": 0, "KV cache": kv(T) if kv(T) + decode > kv(P) + prefill else kv(P),
           "workspace": decode if kv(T) + decode > kv(P) + prefill else prefill}
    # update: checkpointed layer inputs + final norm output, (b, T, D) each; the (b, T) batch tensors
    acts = (L + 2) * b * T * D * rb
    batch = B * T * (2 * 8 + 3) + b * T * T * (Hq > Hkv)                 # ids, masks; sdpa's bool mask
    layer_fwd = b * T * (3 * I * cb + 2 * D * 4 + T * cb)               # + sdpa's float mask
    blk = b * Hq * T * auto_chunk(b, Hq, T)                               # fp32 score block (flowtracer)
    cap_ws = 4 * (b * T * (Hq + Hkv) * hd + 2 * blk + 2 * b * T * auto_chunk(b, Hq, T))
    logits = 3 * b * c * V * 4                                            # log-softmax, exp, product (fp32)
    at_capture = layers * ((max(select(cfg.layers, L)) + 2) * b * T * D * rb + cap_ws)   # last captured layer
    end = acts + logits                                                     # the log-prob chunks
    fwd = {**zero, **w, "activations": acts if end >= at_capture else at_capture - cap_ws,
           "attention": b * T * T * 4 if layers else 0, "logits": logits if end >= at_capture else 0,
           "workspace": batch + max(layer_fwd, 0 if end >= at_capture else cap_ws)}
    credit = {**zero, **w, "cast cache": 0, "activations": acts,
              "attention": layers * b * T * T * (4 + 4 + (8 + 8 * cuda) * (cfg.credit == "flow")),
              "workspace": batch}
    layer_bwd = b * T * (layer_saved(mc, T, cb, rb) + 3 * I * cb + 2 * D * 4) + I * D * (wb + cb)
    logits_bwd = b * c * V * (8 + cb) + V * D * (wb + cb)
    bwd = {**zero, **w, "cast cache": 0, "activations": acts, "attention": b * T * T * 4 if layers else 0,
           "logits": logits_bwd if logits_bwd > layer_bwd else 0,
           "workspace": batch + 2 * b * T * D * 4 + (layer_bwd if layer_bwd >= logits_bwd else 0)}
    temp = 0 if kahan and cuda else N_max * wb if kahan else N * 4 if cuda else 3 * N_max * 4
    opt = {**zero, **w, "cast cache": 0, "workspace": B * T * 19 + temp}   # torch foreach: one copy of v
    return dict(zip(PHASES, (gen, fwd, credit, bwd, opt)))


def captures(cfg):
    """True when grpo.py's fused pass captures attention maps in the training forward (grpo.capturing)."""
    import credit
    import signals
    return not credit.separate_pass(cfg) and signals.NEEDS.get(cfg.credit) == "attn"


def layer_saved(mc, T, cb, rb, padded=True):
    """Bytes per token that one decoder layer (HF Qwen3 / Llama, sdpa) saves for its backward, i.e. what the
    recomputation in backward re-creates under checkpointing. Counted op by op (autograd saves an operand
    only where the other one needs a gradient): each RMSNorm its fp32 input (or fp32 copy), the normalised
    value and its output; the per-head q/k norms of Qwen3 their input and normalised value; sdpa its q,
    k and v (k, v repeated to the Hq heads when a padding mask is passed), output, logsumexp and the
    mask as a (b, 1, T, T) float; the SwiGLU MLP gate, silu, up and their product, (I,) each.
    Equal to track_peak's count on the CPU for both dtypes (tests/test_memory.py)."""
    D, I, Hq, Hkv = mc.hidden_size, mc.intermediate_size, mc.num_attention_heads, mc.num_key_value_heads
    hd = getattr(mc, "head_dim", None) or D // Hq
    q, k, qwen, gqa = Hq * hd, Hkv * hd, mc.model_type == "qwen3", padded and Hq > Hkv
    nb = lambda x: 4 if x == 4 else x                                      # noqa: E731  the normalised value
    norms = (4 * D * (rb != 4) + nb(rb) * D + cb * D) + (4 * D + nb(rb) * D + cb * D)   # input, post-attn
    qk_norms = qwen * (4 + nb(cb)) * (q + k)
    sdpa = cb * q + cb * (2 * q if gqa else 2 * k) + cb * q + 4 * Hq + padded * T * cb
    rsqrt = 4 * (2 + qwen * (Hq + Hkv))
    return norms + qk_norms + sdpa + rsqrt + 4 * I * cb


def table(est, title, unit=GB) -> str:
    """The estimate as a fixed-width table, one row per phase (unit GB = 1e9 bytes, or MB = 1e6)."""
    head = f"{'phase':15s}" + "".join(f"{k:>12s}" for k in (*COMPONENTS, "total"))
    rows = [f"{ph:15s}" + "".join(f"{v / unit:12.2f}" for v in (*comp.values(), sum(comp.values())))
            for ph, comp in est.items()]
    return "\n".join([title, head, *rows])


def fit(cfg, mc, device="cuda", prompt_tokens=256, budget=70 * GB):
    """The largest gen_chunk and micro_batch (powers of two up to cfg's) whose phases stay under `budget`,
    or None where even 1 does not fit: the KV-cache chunk and micro-batch the budget allows."""
    def largest(field, phases):
        n = getattr(cfg, field)
        while n >= 1:
            c = SimpleNamespace(**{**vars(cfg), field: n})
            if all(sum(v.values()) <= budget for k, v in estimate(c, mc, device, prompt_tokens).items()
                   if k in phases):
                return n
            n = n // 2 if n & (n - 1) == 0 else 2 ** (n.bit_length() - 1)
        return None
    return largest("gen_chunk", ("generation",)), largest("micro_batch", PHASES[1:4])


def report(cfg, prompt_tokens=256, measured=None, device="cuda") -> str:
    """The table of `python eval.py memory`, the schemes side by side, and the fit; last line the peak."""
    mc = model_config(cfg.model)
    est = estimate(cfg, mc, device, prompt_tokens)
    unit, name = (GB, "GB") if peak(est)[1] >= GB else (1e6, "MB")
    T = prompt_tokens + cfg.max_new_tokens
    out = [table(est, f"{cfg.model} on {device}, scheme {scheme(cfg, device)}: {cfg.prompts_per_step} x "
                      f"{cfg.group_size} rows of {prompt_tokens} + {cfg.max_new_tokens} = {T} tokens, "
                      f"gen_chunk {cfg.gen_chunk}, micro_batch {cfg.micro_batch}, "
                      f"logprob_chunk {cfg.logprob_chunk} ({name})", unit)]
    if measured:
        out.append(f"measured ({'torch.cuda.max_memory_allocated' if device != 'cpu' else 'track_peak'}):")
        out += [f"  {ph:15s} estimate {sum(c.values()) / unit:10.2f}  measured {measured[ph] / unit:10.2f}  "
                f"ratio {sum(c.values()) / measured[ph]:.3f}" for ph, c in est.items()]
    for other in ("adamw", "kahan"):
        p = peak(estimate(SimpleNamespace(**{**vars(cfg), "optimizer": other}), mc, device, prompt_tokens))
        out.append(f"scheme {other:6s}: peak {p[1] / unit:.2f} {name} in {p[0]}")
    g, m = fit(cfg, mc, device, prompt_tokens)
    out.append(f"under 70 GB: gen_chunk <= {g}, micro_batch <= {m}" if g and m else
               "under 70 GB: no gen_chunk / micro_batch fits")
    ph, top = peak(est)
    out.append(f"peak {top / GB:.2f} GB ({top / GiB:.2f} GiB) in {ph}")
    return "\n".join(out)


def peak(est):
    """(phase, bytes) of the largest phase total."""
    return max(((ph, sum(c.values())) for ph, c in est.items()), key=lambda x: x[1])


# ----------------------------------------------------------------------------- one real step, measured
def measure(cfg, prompt_tokens, device=None, seed=0, reserved=None) -> dict:
    """{phase: peak bytes} of one real GRPO step, the second one (the optimizer states exist), with grpo.py's
    own pieces: HF generate, token_logprobs under the attention capture, fused credit.assign, grpo_loss,
    backward, optimizer_step. Every response runs to max_new_tokens (min_new_tokens), all rows are trained.
    CPU: track_peak; CUDA: torch.cuda.max_memory_allocated, and max_memory_reserved into `reserved` (a dict)
    where one is given."""
    import credit
    import grpo
    import signals
    from flowtracer import build_batch, take
    from models import load_model
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    model, tok = load_model(cfg.model, device=device, dtype=weight_dtype(cfg, device))
    if cfg.grad_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    opt = make_optimizer(model, cfg, device)
    run = SimpleNamespace(cfg=cfg, model=model, opt=opt, device=device, bad=0, ref=None,
                          autocast=torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"))
    B, R, P = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens, prompt_tokens
    special = set(tok.all_special_ids)
    vocab = torch.tensor([i for i in range(min(len(tok), 4096)) if i not in special])
    lens = [P - (i * 7) % max(1, P // 4) for i in range(cfg.prompts_per_step)]        # left padding, width P
    prompts = [vocab[torch.randint(len(vocab), (n,))].tolist() for n in lens for _ in range(cfg.group_size)]

    def step(tr):
        tr.phase("generation")
        model.eval()
        resp = []
        with torch.no_grad(), run.autocast:
            for c in range(0, B, cfg.gen_chunk):
                rows = prompts[c:c + cfg.gen_chunk]
                W = max(map(len, rows))
                x = torch.tensor([[tok.pad_token_id] * (W - len(r)) + r for r in rows], device=device)
                m = torch.tensor([[0] * (W - len(r)) + [1] * len(r) for r in rows], device=device)
                seq = model.generate(input_ids=x, attention_mask=m, max_new_tokens=R,
                                     min_new_tokens=R, do_sample=True, top_k=cfg.top_k, top_p=cfg.top_p,
                                     temperature=cfg.temperature, pad_token_id=tok.pad_token_id)
                resp += seq[:, W:].tolist()
        tr.phase(None)
        batch = build_batch(tok, prompts, resp).to(device)
        adv = torch.tensor([1.0, -1.0] * (B // 2) + [1.0] * (B % 2), device=device)            # (B,)
        mask = batch.response_mask[:, P:]                                                       # (B, R)
        model.train()
        opt.zero_grad(set_to_none=True)
        stats = {"loss": 0.0}
        for s in range(0, B, cfg.micro_batch):
            mb = list(range(s, min(B, s + cfg.micro_batch)))
            sub = take(batch, mb)
            tr.phase("update forward")
            with run.autocast, grpo.capturing(run, sub, 0) as cap:
                logp, ent = grpo.token_logprobs(model, sub.input_ids, sub.attention_mask, P,
                                                cfg.logprob_chunk)
            tr.phase("credit")
            with torch.no_grad():
                c = credit.assign(model, tok, sub, adv[mb], cfg, signals.Captured(cap.attn, ent))
            tr.phase("backward")
            loss, _ = grpo.grpo_loss(logp, logp.detach(), adv[mb], c.gamma, mask[mb], cfg, B)
            loss.backward()
            stats["loss"] += loss.item()
            del logp, ent, c, cap, loss
        tr.phase("optimizer step")
        grpo.optimizer_step(run, stats)
        opt.zero_grad(set_to_none=True)            # the design: no gradient lives through the next rollout
        tr.phase(None)

    step(SimpleNamespace(phase=lambda name: None))
    with (cuda_peak(reserved=reserved) if device.type == "cuda" else track_peak(model, opt)) as tr:
        step(tr)
    return tr.peak
