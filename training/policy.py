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
    (with grad), keeps its keys and values (PromptKV) and reads only the responses on top, each row's layer
    taking its prompt's keys (a differentiable index). The same arithmetic on the same tokens (the log-probs
    equal the full forward's to float noise, and the gradient too: every row's gradient reaches the weights
    through the shared keys and values). At the embedded run's micro-batch (4 rows of a 380-token prompt,
    ~100-token responses, one thread) forward + backward take 0.51x the full pass's time
    (benchmarks/generate_speed.py --update; the LM head over the responses is the same in both). Under
    gradient checkpointing (the GPU runs) as well: the layers are told they may keep the cache (transformers'
    _can_checkpoint_with_cache), which PromptKV makes safe, since a layer replayed in backward reads the same
    prompt keys and writes nothing new; at 4 rows of a 380-token prompt and 64 new tokens the checkpointed
    update takes 0.41x the full pass's CPU time at the same peak memory (benchmarks/generate_speed.py --update
    --grad-checkpointing). Fallback to one pass over every row's [prompt | response]: under reentrant
    checkpointing (no gradient reaches keys read from outside a layer's arguments), when no two rows of the
    micro-batch share a prompt, and when the prompt or the response is empty.

Run: python eval.py memory --model qwen3-4b-random        # the accounting this scheme was chosen by
"""
import math
import os
import shutil
import warnings

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

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
    kernel = optimi_kernel(next(model.parameters()).device)     # where the weights are: CPU weights, for-loop
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
    cfg.model in the scheme's dtype, under flowtracer's attention (sdpa, plus the head-mean maps when a
    forward is given a flowtracer.Capture); a --layers it lacks an error here; the frozen reference when
    beta > 0; gradient checkpointing as --grad-checkpointing says (checkpointing, below)."""
    dtype = weight_dtype(cfg, device)
    model, tok = load_model(path or cfg.model, device=device, dtype=dtype,
                            attn_implementation=flowtracer.IMPL)          # sdpa, + the maps when asked
    select_layers(cfg.layers, model.config.num_hidden_layers)     # a --layers this model lacks fails here
    ref = load_model(cfg.model, device=device, dtype=dtype)[0].eval() if cfg.beta > 0 else None
    if cfg.grad_checkpointing:
        checkpointing(model)
    return model, tok, ref, make_optimizer(model, cfg, device)


def checkpointing(model, reentrant=False):
    """Gradient checkpointing of the decoder layers, with every rule its replay needs, in one place.
    A checkpointed layer keeps only its inputs; backward replays its forward with the same arguments, so:
      * the replay reads the shared prompt's keys and values again (PromptKV) and writes nothing new: the
        layers may keep that cache (transformers' _can_checkpoint_with_cache, for caches that only read);
      * a flowtracer.Capture given to the forward sees the replayed layer again and adds nothing
        (Capture.take: a layer already taken in this pass is skipped).
    reentrant=True (a test's reference): that checkpoint passes no gradient to the prompt keys a layer reads
    from outside its arguments, so response_states reads every row whole under it (replay_safe)."""
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    for m in model.get_decoder().modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._can_checkpoint_with_cache = not reentrant


# ----------------------------------------------------------------------------- log-probs and the step
def token_logprobs(model, input_ids, attention_mask, prompt_width, chunk=128, share_prompt=True,
                   capture=None):
    """log pi(y_t | x, y_<t) and the entropy of pi(. | x, y_<t), detached, for the response columns P..T-1:
    both (B, T-P). Hidden states come from the decoder (response_states: each distinct prompt read once when
    share_prompt); the LM head and log-softmax run on `chunk` positions at a time and are recomputed in
    backward (grpo.py departure 2), so at most (B, chunk, V) logits exist at once. `capture`: a
    flowtracer.Capture that the decoder's forward fills with the chosen layers' head-mean maps, or None."""
    hid = response_states(model, input_ids, attention_mask, prompt_width, share_prompt, capture)  # (B, R, D)
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


def response_states(model, input_ids, attention_mask, prompt_width, share_prompt=True, capture=None):
    """(B, R, D): the decoder's last hidden states at columns P-1 .. T-2, h_{t-1} for each response token y_t.

    share_prompt (departure 1): the distinct prompts (k of them) are read once, (k, P), with grad; their keys
    and values (PromptKV) are read by the rows' responses (B, R) on top. Else, and in the fallbacks, one pass
    over every row's [prompt | response]. A `capture` (flowtracer.Capture) given to it gets the same
    (B, T, T) maps either way (Capture.expand_prompts between the two passes). Under gradient checkpointing
    PromptKV gives a layer replayed in backward what it read in the forward (checkpointing, above). Both
    passes' tokens are embedded in one lookup: its one backward, a dense (V, D) gradient summed into the
    embedding's, runs at the end, when the prompt pass's kept tensors are gone (a lookup per pass: the
    response pass's sum ran beside them, a higher peak)."""
    P, (B, T), dec = prompt_width, input_ids.shape, model.get_decoder()
    pos = (attention_mask.cumsum(-1) - 1).clamp_min(0)                    # (B, T) as HF generate numbers them
    layers = [m for m in dec.modules() if isinstance(m, GradientCheckpointingLayer)]
    shared = share_prompt and 0 < P < T and replay_safe(layers)
    if shared:
        prompts, which = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], dim=1), dim=0,
                                      return_inverse=True)                # (k, 2P) ids | mask; (B,) row -> k
    if not shared or len(prompts) == B:                                   # the fallbacks: one full pass
        return dec(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False,
                   flow_capture=capture).last_hidden_state[:, P - 1:-1]  # (B, R, D)
    kv, ids, mask, k = PromptKV(model.config), prompts[:, :P], prompts[:, P:], len(prompts)       # (k, P)
    x = model.get_input_embeddings()(torch.cat([ids.flatten(), input_ids[:, P:].flatten()]))      # (kP+BR, D)
    first = dec(inputs_embeds=x[:k * P].view(k, P, -1), attention_mask=mask, past_key_values=kv,
                position_ids=(mask.cumsum(-1) - 1).clamp_min(0), use_cache=False,
                flow_capture=capture).last_hidden_state                   # (k, P, D): the prompt pass
    if capture is not None:
        capture.expand_prompts(which, T)                                  # (k, P, P) maps -> (B, T, T)
    rest = dec(inputs_embeds=x[k * P:].view(B, T - P, -1), attention_mask=attention_mask,
               position_ids=pos[:, P:], past_key_values=PromptKV(model.config, kv, which), use_cache=False,
               flow_capture=capture).last_hidden_state                    # (B, R, D): the response pass
    return torch.cat([first[which, P - 1:], rest[:, :-1]], dim=1)         # (B, R, D)


class PromptKV(DynamicCache):
    """The shared prompts' keys and values, read the same by a layer that gradient checkpointing replays in
    backward (update() never grows the cache). Prompt pass (no `which`): each layer's (k, Hkv, P, hd) keys
    and values are kept (a replay keeps its own again). Response pass (`prompts`, `which`: row -> prompt):
    layer l reads [keys of row b's prompt | its own] and keeps nothing; the row selection runs inside the
    layer, so only the k prompts' keys and values wait for backward, not B copies."""
    def __init__(self, config, prompts=None, which=None):
        super().__init__(config=config)
        self.which = which
        for layer, old in zip(self.layers, prompts.layers if prompts is not None else []):
            layer.lazy_initialization(old.keys, old.values)
            layer.keys, layer.values = old.keys, old.values

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if self.which is None:
            layer.lazy_initialization(key_states, value_states)
            layer.keys, layer.values = key_states, value_states
            return key_states, value_states
        return (torch.cat([layer.keys[self.which], key_states], dim=-2),
                torch.cat([layer.values[self.which], value_states], dim=-2))


def replay_safe(layers):
    """True when a shared prompt's keys survive gradient checkpointing: no layer is checkpointed, or every
    checkpointed one was set up by `checkpointing` (non-reentrant, allowed to keep the read-only cache).
    Else the rows are read whole: transformers drops the cache of a checkpointed layer by default."""
    return all(m._can_checkpoint_with_cache for m in layers if m.gradient_checkpointing)


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


def optimizer_step(model, opt, max_grad_norm, loss):
    """Clip, then step; a non-finite loss or gradient skips the update (grpo.py counts the streak).
    Returns (stepped, grad_norm)."""
    for p in model.parameters():                         # AdamW still steps on a zero gradient, as GRPO would
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    stepped = math.isfinite(loss) and math.isfinite(grad_norm)
    if stepped:
        opt.step()
    opt.zero_grad(set_to_none=True)                      # the gradients are not kept through the next rollout
    return stepped, grad_norm
