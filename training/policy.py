"""The policy as one device trains it: the device, the weights' dtype, the optimizer, autocast, checkpointing;
its per-token log-probs (token_logprobs: grpo.py departure 2) and the optimizer step.

grpo.setup and memtrace.measure both build the policy here, so the step memtrace.py measures is grpo.py's.

The fp32 design does not fit Qwen3-4B on one 80 GB GPU. N = 4.02 B parameters: fp32 weights + gradients +
AdamW m, v = 16 B/param = 64.4 GB; torch.autocast caches a bf16 copy of every fp32 weight it casts for the
whole autocast region (generation and each training forward: +8.0 GB, 2 B/param); torch's foreach AdamW (the
CUDA default) allocates a fp32 copy of v in the step (+16 GB). Peak 80.5 GB before any activation.

The scheme (--optimizer auto = kahan on CUDA): bf16 weights and gradients, AdamW with bf16 m and v and a
bf16 Kahan compensation buffer (torch-optimi's AdamW, kahan_sum=True): 2 + 2 + 6 = 10 B/param = 40.2 GB,
no autocast cache (the weights are bf16 already), no optimizer temporaries on CUDA (optimi's Triton kernel or
its foreach step, which uses the gradients as scratch; the CPU runs its for-loop: one temporary the size of
the largest weight). The step is chosen at setup, not left to optimi (optimi_kernel, one printed line):
Triton compiles a launcher with the host C compiler at the first step, after the first full rollout, and
runtime images often have none, so without $CC / gcc / clang (or without Triton) CUDA runs the foreach
step, the same arithmetic. The compensation c keeps what bf16 rounding drops from each update: p + c is the
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

On CUDA the caching allocator gets expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
unless the variable is set): a segment grows by mapping more pages and unmaps what is freed, so a KV cache
grown step by step leaves no trail of freed blocks too small to reuse (memory.py's margin counts the rest).

Departures (numbered):
 1. Each prompt read once in the update (response_states, grpo.py --share-prefix, on by default): the G rows
    of a group carry the same prompt columns, so the decoder reads each distinct prompt of a micro-batch once
    into a KV cache (with grad), copies it to the prompt's rows (a differentiable index) and reads only the
    responses on top. The same arithmetic on the same tokens (the log-probs equal the full forward's to
    float noise, and the gradient too: every row's gradient reaches the weights through the shared keys and
    values). At the embedded run's micro-batch (4 rows of a 380-token prompt, ~100-token responses, one
    thread) forward + backward take 0.51x the full pass's time (benchmarks/generate_speed.py --update; the
    LM head over the responses is the same in both). Fallback to one pass over every row's
    [prompt | response]: under gradient checkpointing in training (transformers' checkpointed layers drop
    the KV cache; the GPU Qwen3-4B runs keep it on), when no two rows of the micro-batch share a prompt,
    and when the prompt or the response is empty.

Run: python eval.py memory --model qwen3-4b-random        # the accounting this scheme was chosen by
"""
import math
import os
import shutil
import warnings

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import DynamicCache

import flowtracer
from flowtracer import select_layers
from training.models import load_model
from training.rollout import take


def device_of(name="auto") -> torch.device:
    """--device auto | cpu | cuda as a torch.device; on CUDA, before CUDA starts, expandable segments."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_initialized():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return device


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


def c_compiler():
    """The host C compiler Triton builds its launcher with, or None: $CC, else gcc, else clang, the order of
    triton/runtime/build.py (which raises "Failed to find C compiler" at the first kernel without one)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def optimi_kernel(device) -> str:
    """Which torch-optimi step runs (see the docstring): 'triton' on CUDA with Triton and a C compiler,
    'foreach' on CUDA without either, 'for-loop' on the CPU."""
    if torch.device(device).type != "cuda":
        return "for-loop"
    from optimi.utils import HAS_TRITON
    return "triton" if HAS_TRITON and c_compiler() else "foreach"


def make_optimizer(model, cfg, device) -> torch.optim.Optimizer:
    """AdamW (torch defaults: betas 0.9/0.999, eps 1e-8) for the scheme; see the docstring for the choice."""
    if scheme(cfg, device) == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    import optimi  # torch-optimi: pure PyTorch (for-loop / foreach / Triton), imported only when chosen
    bad = {p.dtype for p in model.parameters()} - {torch.bfloat16}
    if bad:
        raise ValueError(f"--optimizer kahan needs a bf16 model (policy.weight_dtype), got {bad}")
    kernel = optimi_kernel(device)
    why = " (no Triton, or no C compiler for its launcher: $CC, gcc, clang)" if kernel == "foreach" else ""
    print(f"optimizer: torch-optimi AdamW with Kahan summation, its {kernel} step{why}")
    with warnings.catch_warnings():     # optimi calls foreach deprecated in favour of Triton: chosen here
        warnings.simplefilter("ignore", DeprecationWarning)
        return optimi.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=cfg.weight_decay, kahan_sum=True, triton=kernel == "triton",
                            foreach=kernel == "foreach")


def master_weights(model, opt) -> dict:
    """{name: fp32 tensor}: the weights the optimizer holds, p + its Kahan compensation where it has one."""
    out = {}
    for n, p in model.named_parameters():
        comp = opt.state.get(p, {}).get("kahan_comp")
        out[n] = p.detach().float().clone() + (comp.float() if comp is not None else 0)
    return out


def autocast(device):
    """The run's autocast: bf16 on CUDA (a no-op for bf16 weights), off on the CPU."""
    return torch.autocast("cuda", torch.bfloat16, enabled=torch.device(device).type == "cuda")


def load_policy(cfg, device, path=None):
    """(model, tokenizer, reference model or None, optimizer): the policy from `path` (a checkpoint) or
    cfg.model in the scheme's dtype, a --layers it lacks an error here; the frozen reference when beta > 0;
    gradient checkpointing as --grad-checkpointing says."""
    dtype = weight_dtype(cfg, device)
    model, tok = load_model(path or cfg.model, device=device, dtype=dtype)
    select_layers(cfg.layers, model.config.num_hidden_layers)     # a --layers this model lacks fails here
    ref = load_model(cfg.model, device=device, dtype=dtype)[0].eval() if cfg.beta > 0 else None
    if cfg.grad_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model, tok, ref, make_optimizer(model, cfg, device)


# ----------------------------------------------------------------------------- log-probs and the step
def token_logprobs(model, input_ids, attention_mask, prompt_width, chunk=128, share_prompt=True):
    """log pi(y_t | x, y_<t) and the entropy of pi(. | x, y_<t), detached, for the response columns P..T-1:
    both (B, T-P). Hidden states come from the decoder (response_states: each distinct prompt read once when
    share_prompt); the LM head and log-softmax run on `chunk` positions at a time and are recomputed in
    backward (grpo.py departure 2), so at most (B, chunk, V) logits exist at once."""
    hid = response_states(model, input_ids, attention_mask, prompt_width, share_prompt)  # (B, R, D)
    head, tgt = model.get_output_embeddings(), input_ids[:, prompt_width:]  # (B, R): h_{t-1} -> y_t

    def piece(h, y):
        logp = F.log_softmax(head(h).float(), dim=-1)                     # (B, c, V) fp32
        lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)                 # (B, c)
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)                            # (B, c) entropy: credit, logs
        return lp, ent

    outs = [checkpoint(piece, hid[:, s:s + chunk], tgt[:, s:s + chunk], use_reentrant=False)
            if torch.is_grad_enabled() else piece(hid[:, s:s + chunk], tgt[:, s:s + chunk])
            for s in range(0, tgt.shape[1], chunk)]
    lp, ent = (torch.cat(x, dim=1) for x in zip(*outs))                   # (B, R)
    return lp, ent.detach()


def response_states(model, input_ids, attention_mask, prompt_width, share_prompt=True):
    """(B, R, D): the decoder's last hidden states at columns P-1 .. T-2, h_{t-1} for each response token y_t.

    share_prompt (departure 1): the distinct prompts (k of them) are read once, (k, P), into a KV cache with
    grad; the cache is copied to their rows and the responses (B, R) are read on top of it. Else, and in the
    fallbacks, one pass over every row's [prompt | response]. A flowtracer.capture around it gets the same
    (B, T, T) maps either way (expand_capture)."""
    P, (B, T), dec = prompt_width, input_ids.shape, model.get_decoder()
    pos = (attention_mask.cumsum(-1) - 1).clamp_min(0)                    # (B, T) as HF generate numbers them
    checkpointed = model.training and getattr(model, "is_activation_checkpointing", False)  # drops caches
    shared = share_prompt and not checkpointed and 0 < P < T
    if shared:
        prompts, which = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], dim=1), dim=0,
                                      return_inverse=True)                # (k, 2P) ids | mask; (B,) row -> k
    if not shared or len(prompts) == B:                                   # the fallbacks: one full pass
        return dec(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                   use_cache=False).last_hidden_state[:, P - 1:-1]       # (B, R, D)
    cache, ids, mask = DynamicCache(config=model.config), prompts[:, :P], prompts[:, P:]   # (k, P) each
    first = dec(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                past_key_values=cache, use_cache=True).last_hidden_state  # (k, P, D): the prompt pass
    expand_capture(which, T)
    cache.batch_select_indices(which)                                # (B, Hkv, P, hd) a layer, differentiable
    rest = dec(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=pos[:, P:],
               past_key_values=cache, use_cache=True).last_hidden_state   # (B, R, D)
    return torch.cat([first[which, P - 1:], rest[:, :-1]], dim=1)         # (B, R, D)


def expand_capture(which, width):
    """Between response_states' two passes, an active flowtracer.capture's (k, P, P) maps of the prompts
    become the top-left corner of the rows' (B, T, T) buffer, which the response pass fills below it (its
    R queries are the last rows, over all T keys); each chosen layer is then taken once more."""
    cap = flowtracer._capture
    if cap is None or cap.buf is None:
        return
    P, buf = cap.buf.shape[-1], cap.buf.new_zeros(len(which), width, width)   # (B, T, T)
    buf[:, :P, :P] = cap.buf[which]                                       # (B, P, P)
    cap.buf, cap.seen, cap.passes = buf, set(), cap.passes + 1


def old_logprobs(run, batch, trained):
    """(B, R) log-probs of the pre-update policy for num_iterations > 1; None on-policy (they would equal
    the detached current log-probs, so the training forward provides them)."""
    if run.cfg.num_iterations == 1 or not trained:
        return None
    out = torch.zeros(batch.response_mask[:, batch.prompt_width:].shape, device=run.device)
    run.model.eval()
    with torch.no_grad(), run.autocast:
        for s in range(0, len(trained), run.cfg.micro_batch):
            mb, sub = trained[s:s + run.cfg.micro_batch], take(batch, trained[s:s + run.cfg.micro_batch])
            out[mb] = token_logprobs(run.model, sub.input_ids, sub.attention_mask, sub.prompt_width,
                                     run.cfg.logprob_chunk, run.cfg.share_prefix)[0].float()
    return out


def ref_logprobs(run, sub):
    """(b, R) reference-model log-probs for the k3 KL term (its own no-grad pass), or None when beta = 0."""
    if run.ref is None:
        return None
    with torch.no_grad(), run.autocast:
        return token_logprobs(run.ref, sub.input_ids, sub.attention_mask, sub.prompt_width,
                              run.cfg.logprob_chunk, run.cfg.share_prefix)[0]


def optimizer_step(run, stats):
    """Clip, then step; a non-finite loss or gradient skips the update. Returns True when it stepped."""
    for p in run.model.parameters():                     # AdamW still steps on a zero gradient, as GRPO would
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.max_grad_norm).item()
    if not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
        run.bad += 1
        run.opt.zero_grad(set_to_none=True)
        tqdm.write(f"non-finite loss {stats['loss']} / grad norm {stats['grad_norm']}: update skipped "
                   f"({run.bad} in a row)")
        return False
    run.bad = 0
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)                  # the gradients are not kept through the next rollout
    return True
