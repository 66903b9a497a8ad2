"""The policy a run trains, and everything that changes its weights, behind one object (Policy):

    logp, ent = token_logprobs(model, ids, mask, P, ..., capture=cap)   # (B, R) each; cap gets eq. 1's maps
    policy.backward(loss)                    # fp16: times the GradScaler's scale
    s = policy.step(loss, max_grad_norm)     # clip, step (or skip), zero: one call per PPO epoch -> Stepped
    lr = policy.next_lr(stepped)             # the warmup schedule: once a GRPO step, not per PPO epoch
    ref = policy.ref_logprobs(batch, rows, ...)   # the k3 term's reference (LoRA: the adapters off)

training/model/trainable.py builds it (load_policy: the precision, the optimizer, LoRA). grpo.py's micro-batch
calls token_logprobs once; everything below its signature is how it is made fast and small, and a student may
stop there. The arithmetic is the plain one: the decoder's last hidden states h_{t-1}, the LM head and a
log-softmax, gathered at y_t.

Departures (numbered; grpo.py's departure 2 is the chunked log-softmax; the precision's:
training/model/trainable.py):
 1. Each prompt read once (share_prefix, grpo.py --share-prefix, on by default). The G rows of a group carry
    the same prompt columns, so the decoder reads each distinct prompt of a micro-batch once (with grad),
    keeps its keys and values (PromptKV) and reads only the responses on top, each row's layer taking its
    prompt's keys (a differentiable index). The same arithmetic on the same tokens: the log-probs equal the
    full forward's to float noise, and so does the gradient (tests/test_policy_shared_prefix.py). The time
    saved is measured by `python benchmarks/generate_speed.py --update [--grad-checkpointing]`
    (results/README.md).
    A Capture given to the forward gets the same (B, T, T) maps: the prompt pass fills its (k, P, P) maps,
    Capture.expand_prompts makes them the top left of each row's, and the response pass fills the rest.
 2. Fallback to one pass over every row's [prompt | response] when nothing is shared (no two rows of the
    micro-batch share a prompt, an empty prompt or response: the same work either way) and when the layers
    are checkpointed in a way that drops the prompt's keys (reentrant, or switched on other than by
    `checkpointing`): `sharing_problem` names that case, and grpo.py says it in one line at setup.
 3. The shared prompt's backward runs in two stages (PromptStage). Read once, the prompt is a second pass
    through every decoder weight, and autograd sums a weight's gradient from both passes before it adds it
    into .grad: in one backward the response pass's gradient of every weight would wait, made, while the
    prompt pass is differentiated (a full fine-tune's decoder gradients once more: 7.2 GB for Qwen3-4B in
    bf16, beside its backward's peak). So the response pass reads the prompt's keys and values, its last
    hidden state and the responses' embeddings detached; its backward adds each weight's part into .grad as
    it is made, and gives those tensors' gradients to the prompt pass, differentiated as a backward of its
    own (the lookup's dense (V, D) gradient in it, last). The same sums in another order: the gradients
    equal one backward's to float noise (tests/test_policy_staged_backward.py). It happens inside
    `loss.backward()`, so every caller gets it; torch.autograd.grad (or backward(inputs=...)) through it
    would miss the prompt pass, and raises instead: pass share_prefix=False there.

Run: python -m pytest -q tests/test_policy*.py tests/model/test_precision.py
"""

import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from gpu_kernels.availability import unavailable


def checkpointing(model, reentrant=False):
    """Gradient checkpointing of the decoder layers, with every rule its replay needs, in one place: grpo.py,
    the benchmarks and the memory tools all switch it on here. A checkpointed layer keeps only its inputs;
    backward replays its forward with the same arguments, so:
      * the replay reads the shared prompt's keys and values again (PromptKV) and writes nothing new: the
        layers may keep that cache (transformers' _can_checkpoint_with_cache, for caches that only read);
      * a flowtracer.Capture given to the forward sees the replayed layer again and adds nothing.
    reentrant=True (a test's reference): that checkpoint passes no gradient to the prompt keys a layer reads
    from outside its arguments, so the rows are read whole under it (departure 2)."""
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    for m in model.get_decoder().modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._can_checkpoint_with_cache = not reentrant


def sharing_problem(model):
    """Why the update cannot read each prompt once on this model (departure 2), or None: checkpointed
    layers that would drop the prompt's keys in their replay (response_states checks the same at each
    call: every checkpointed layer must be one `checkpointing` set up, non-reentrant, keeping the cache)."""
    layers = [m for m in model.get_decoder().modules() if isinstance(m, GradientCheckpointingLayer)]
    if all(m._can_checkpoint_with_cache for m in layers if m.gradient_checkpointing):
        return None
    return "its layers are checkpointed other than by training.policy.checkpointing (reentrant, or HF's)"


class TokenLogprobs(NamedTuple):
    logp: torch.Tensor  # (B, R) log pi(y_t | x, y_<t) of each response column, with grad
    entropy: torch.Tensor  # (B, R) the entropy of pi(. | x, y_<t), detached (credit, logs)


def token_logprobs(
    model, input_ids, attention_mask, prompt_width, chunk=128, share_prefix=True, capture=None
) -> TokenLogprobs:
    """log pi(y_t | x, y_<t) and the entropy of pi(. | x, y_<t), detached, for the response columns P..T-1:
    both (B, T-P). Hidden states come from the decoder (response_states: each distinct prompt read once when
    share_prefix); the LM head and log-softmax run on `chunk` positions at a time and are recomputed in
    backward (grpo.py departure 2), so at most (B, chunk, V) logits exist at once. `capture`: a
    flowtracer.Capture that the decoder's forward fills with the chosen layers' head-mean maps, or None."""
    hid = response_states(model, input_ids, attention_mask, prompt_width, share_prefix, capture)  # (B, R, D)
    head, tgt = model.get_output_embeddings(), input_ids[:, prompt_width:]  # (B, R): h_{t-1} -> y_t

    def piece(h, y):
        logp = F.log_softmax(head(h).float(), dim=-1)  # (B, c, V) fp32
        lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (B, c)
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)  # (B, c) entropy: credit, logs
        return lp, ent

    outs = [
        checkpoint(piece, hid[:, s : s + chunk], tgt[:, s : s + chunk], use_reentrant=False)
        if torch.is_grad_enabled()
        else piece(hid[:, s : s + chunk], tgt[:, s : s + chunk])
        for s in range(0, tgt.shape[1], chunk)
    ]
    lp, ent = (torch.cat(x, dim=1) for x in zip(*outs))  # (B, R)
    return TokenLogprobs(lp, ent.detach())


def response_states(model, input_ids, attention_mask, prompt_width, share_prefix=True, capture=None):
    """(B, R, D): the decoder's last hidden states at columns P-1 .. T-2, h_{t-1} for each response token y_t.

    share_prefix (departure 1): the distinct prompts (k of them) are read once, (k, P), with grad; their keys
    and values (PromptKV) are read by the rows' responses (B, R) on top. Else, and in the fallbacks
    (departure 2), one pass over every row's [prompt | response]. Both passes' tokens are embedded in one
    lookup: its one backward, a dense (V, D) gradient summed into the embedding's, runs at the end, when the
    prompt pass's kept tensors are gone."""
    P, (B, T), dec = prompt_width, input_ids.shape, model.get_decoder()
    pos = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # (B, T) as HF generate numbers them
    layers = [m for m in dec.modules() if isinstance(m, GradientCheckpointingLayer)]
    shared = (
        share_prefix
        and 0 < P < T
        and all(
            m._can_checkpoint_with_cache
            for m in layers  # the replay
            if m.gradient_checkpointing
        )
    )  # keeps the keys
    if shared:
        prompts, which = torch.unique(
            torch.cat([input_ids[:, :P], attention_mask[:, :P]], dim=1), dim=0, return_inverse=True
        )  # (k, 2P) ids | mask; (B,) row -> k
    if not shared or len(prompts) == B:  # the fallbacks: one full pass
        return dec(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=pos,
            use_cache=False,
            flow_capture=capture,
        ).last_hidden_state[:, P - 1 : -1]  # (B, R, D)
    kv, ids, mask, k = PromptKV(model.config), prompts[:, :P], prompts[:, P:], len(prompts)  # (k, P)
    x = model.get_input_embeddings()(torch.cat([ids.flatten(), input_ids[:, P:].flatten()]))  # (kP+BR, D)
    out = dec(
        inputs_embeds=x[: k * P].view(k, P, -1),
        attention_mask=mask,
        past_key_values=kv,
        position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
        use_cache=False,
        flow_capture=capture,
    ).last_hidden_state  # (k, P, D): the prompt pass
    if capture is not None:
        capture.expand_prompts(which, T)  # (k, P, P) maps -> (B, T, T)
    read = [t for layer in kv.layers for t in (layer.keys, layer.values)]  # (k, Hkv, P, hd) each
    *read, last, xr = PromptStage.split([*read, out[:, P - 1 :], x[k * P :]])  # departure 3
    rest = dec(
        inputs_embeds=xr.view(B, T - P, -1),
        attention_mask=attention_mask,
        position_ids=pos[:, P:],
        past_key_values=PromptKV(model.config, list(zip(read[0::2], read[1::2])), which),
        use_cache=False,
        flow_capture=capture,
    ).last_hidden_state  # (B, R, D): the response pass
    PromptStage.guard(rest, read + [last, xr])
    return torch.cat([last[which], rest[:, :-1]], dim=1)  # (B, R, D)


class PromptStage(torch.autograd.Function):
    """Departure 3: where the update's backward splits in two. Forward: the prompt pass's tensors that the
    response pass reads (`held`: each layer's keys and values, the last prompt position's hidden state, the
    responses' embeddings), detached, so the response pass's graph starts here. Backward, which autograd runs
    once the response pass is differentiated (each weight's part of it already in .grad: nothing else waits
    on those weights in this backward): their gradients, given to the prompt pass as a backward of its own.

        *read, = PromptStage.split(held)   # the response pass reads these
        PromptStage.guard(out, read)       # its output: torch.autograd.grad through it is an error
    """

    @staticmethod
    def forward(ctx, anchor, held):  # anchor: an empty leaf with grad, so that the outputs have grad
        ctx.edges = [get_gradient_edge(t) for t in held]  # where each one's gradient goes, not the tensor
        return tuple(t.detach() for t in held)

    @staticmethod
    def backward(ctx, *grads):
        edges, ctx.edges = ctx.edges, None  # the prompt pass's graph is freed as its backward runs
        torch.autograd.backward(edges, grads)  # the prompt pass, its own backward: into .grad
        return None, None

    @staticmethod
    def split(held):
        """`held` with those that have grad detached behind one PromptStage (without grad: as they are)."""
        grad = [i for i, t in enumerate(held) if t.requires_grad]
        if not torch.is_grad_enabled() or not grad:
            return held
        anchor = torch.empty(0, device=held[grad[0]].device, requires_grad=True)
        out = list(held)
        for i, t in zip(grad, PromptStage.apply(anchor, [held[i] for i in grad])):
            out[i] = t
        return out

    @staticmethod
    def guard(out, read):
        """A hook on the response pass's output `out`: a backward that reaches it but will not run the
        PromptStage behind `read` (torch.autograd.grad, backward(inputs=...): they never reach the prompt
        pass's weights) raises, rather than return the response pass's part of a gradient as the whole."""
        stage = next((t.grad_fn for t in read if isinstance(t.grad_fn, PromptStage._backward_cls)), None)
        if stage is None or not out.requires_grad:
            return

        def check(grad):
            if not torch._C._will_engine_execute_node(stage):
                raise RuntimeError(
                    "token_logprobs(share_prefix=True): its gradient reaches the prompt pass only by "
                    ".backward() over the whole graph (policy.py departure 3); for torch.autograd.grad or "
                    "backward(inputs=...) pass share_prefix=False"
                )
            return grad

        out.register_hook(check)


class PromptKV(DynamicCache):
    """The shared prompts' keys and values, read the same by a layer that gradient checkpointing replays in
    backward (update() never grows the cache). Prompt pass (no `which`): each layer's (k, Hkv, P, hd) keys
    and values are kept (a replay keeps its own again). Response pass (`prompts`: each layer's (keys,
    values), as PromptStage gives them; `which`: row -> prompt):
    layer l reads [keys of row b's prompt | its own] and keeps nothing; the row selection runs inside the
    layer, so only the k prompts' keys and values wait for backward, not B copies. Every layer is a plain
    DynamicLayer, a sliding-window layer's too (Gemma-2, GPT-OSS): it keeps the prompt whole and the mask
    applies the window, as in one pass over the rows (transformers' sliding layer would size the mask to a
    cache it fills itself, not to the keys given here)."""

    def __init__(self, config, prompts=(), which=None):
        super().__init__(config=config)
        self.layers, self.which = [DynamicLayer() for _ in self.layers], which
        for layer, (keys, values) in zip(self.layers, prompts):  # [(keys, values)] a layer
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if self.which is None:
            layer.lazy_initialization(key_states, value_states)
            layer.keys, layer.values = key_states, value_states
            return key_states, value_states
        return (
            torch.cat([layer.keys[self.which], key_states], dim=-2),
            torch.cat([layer.values[self.which], value_states], dim=-2),
        )


@torch.no_grad()
def fixed_logprobs(model, batch, rows, micro_batch, chunk=128, share_prefix=True):
    """(B, R) fp32 log-probs of `model` on the `rows` of `batch`, no grad, 0 on the other rows: the pre-update
    policy's for --num-iterations > 1 (PPO's old log pi), or the frozen reference's for the k3 KL term."""
    P = batch.prompt_width
    out = torch.zeros(batch.response_mask[:, P:].shape, device=batch.input_ids.device)  # (B, R)
    for s in range(0, len(rows), micro_batch):
        mb = rows[s : s + micro_batch]
        out[mb] = token_logprobs(
            model, batch.input_ids[mb], batch.attention_mask[mb], P, chunk, share_prefix
        ).logp.float()  # (b, R)
    return out


# ----------------------------------------------------------------------------- what changes the weights
class Stepped(NamedTuple):
    """What Policy.step did (grpo.update's record of it)."""

    grad_norm: float  # the gradient's global norm before clipping (unscaled under fp16)
    stepped: bool  # the optimizer stepped
    skipped: bool  # fp16: the scaled gradient overflowed and the GradScaler skipped the step,
    # its scale halved (the loss was finite): the scaler's working, not a bad step
    scale: float | None  # the GradScaler's scale after the step; None: no scaler


@dataclass
class Policy:
    """The policy and what changes its weights (training/model/trainable.py's load_policy builds it):
    grpo.update calls backward and step, grpo_step next_lr, the preflight use_kernel; a checkpoint saves and
    restores the optimizer's state (its GradScaler's with it) and the schedule's."""

    model: torch.nn.Module
    tok: object  # the tokenizer (left padding)
    ref: torch.nn.Module | None  # the k3 term's reference (--beta > 0): a frozen copy, or under LoRA the
    # model itself, read with its adapters off (ref_logprobs); None: beta = 0
    opt: torch.optim.Optimizer  # AdamW of the scheme (trainable.make_optimizer); fp16: ScaledAdamW
    sched: torch.optim.lr_scheduler.LambdaLR  # linear warmup over --warmup-steps, then constant
    autocast: torch.autocast  # the precision's: bf16 or fp16, off under fp32 (trainable.autocast)
    device: torch.device
    kernel: str = ""  # torch-optimi's step in force (triton | foreach | for-loop); "": torch AdamW
    moved: bool = False  # an optimizer step began since RunLog logged a step (backoff.py, RunLog.save_last)

    def backward(self, loss):
        """loss.backward(), the loss times the GradScaler's scale under fp16 (ScaledAdamW)."""
        (self.opt.scaler.scale(loss) if isinstance(self.opt, ScaledAdamW) else loss).backward()

    def step(self, loss, max_grad_norm) -> Stepped:
        """Clip the trainable parameters' gradients to max_grad_norm (LoRA: the adapters alone), then one
        optimizer step; a non-finite loss or gradient: no step. A parameter without a gradient gets zeros
        (AdamW still steps on a zero gradient, as GRPO would). Under fp16 (ScaledAdamW) the gradients are
        unscaled first and the GradScaler steps, or skips a step whose scaled gradients overflowed
        (trainable.py
        departure 5). The gradients are freed either way: none is kept through the next rollout."""
        opt, params = self.opt, [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        scaler = opt.scaler if isinstance(opt, ScaledAdamW) else None
        if scaler is not None:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        finite = math.isfinite(loss)
        if scaler is None:
            stepped, skipped = finite and math.isfinite(norm), False
            if stepped:
                self.moved = True  # before the step: one that fails half-way has moved the weights
                opt.step()
        else:
            before = scaler.get_scale()
            if finite:
                self.moved = True
                scaler.step(opt)  # skipped by the scaler when the gradient overflowed
            scaler.update()  # the scale halves at an overflow
            skipped = finite and scaler.get_scale() < before
            stepped = finite and not skipped
        opt.zero_grad(set_to_none=True)
        return Stepped(norm, stepped, skipped, None if scaler is None else scaler.get_scale())

    def next_lr(self, stepped=True) -> float:
        """The learning rate of the next step: the warmup schedule moves once a GRPO step whose optimizer
        stepped (not once per PPO epoch of --num-iterations), else stays."""
        if stepped:
            self.sched.step()
        return self.sched.get_last_lr()[0]

    def ref_logprobs(self, batch, rows, micro_batch, chunk=128, share_prefix=True):
        """(B, R) the reference's log-probs on the `rows` of `batch` (fixed_logprobs), for the k3 KL term;
        under LoRA the policy's own weights with peft's adapters off (disable_adapter): no second model."""
        off = self.model.disable_adapter() if self.ref is self.model else contextlib.nullcontext()
        with off:
            return fixed_logprobs(self.ref, batch, rows, micro_batch, chunk, share_prefix)

    def use_kernel(self, kernel=None) -> str:
        """torch-optimi's step `kernel` (None: optimi_kernel's choice for where the weights are) written into
        each param group, as the preflight settles it after a checkpoint's load (optimi reads the triton
        and foreach flags at every step; a loaded checkpoint wrote its own) or falls back to foreach.
        Returns the step in force; torch's AdamW: untouched, ''."""
        kernel = kernel or optimi_kernel(next(self.model.parameters()).device)
        groups = [g for g in self.opt.param_groups if "triton" in g and "kahan_sum" in g]
        for g in groups:
            g["triton"], g["foreach"] = kernel == "triton", kernel == "foreach"
        self.kernel = kernel if groups else ""
        return self.kernel


class ScaledAdamW(torch.optim.AdamW):
    """torch's AdamW with the torch.amp.GradScaler of an fp16 run (trainable.py departure 4), whose state
    travels in state_dict: a checkpoint holds it and --resume continues it. Policy.backward and Policy.step
    use it."""

    def __init__(self, params, device, **kw):
        super().__init__(params, **kw)
        self.scaler = torch.amp.GradScaler(torch.device(device).type)  # torch's defaults
        self.scaler.scale(torch.zeros((), device=device))  # its scale made now: a step with no backward

    def state_dict(self):
        return {**super().state_dict(), "grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        scaler = state_dict.pop("grad_scaler", None)
        super().load_state_dict(state_dict)
        if scaler is None:
            print(
                "resume: the checkpoint holds no GradScaler state (saved under another --precision): the "
                "fp16 loss scale starts afresh at 2^16"
            )
        else:
            self.scaler.load_state_dict(scaler)


def optimi_kernel(device) -> str:
    """Which torch-optimi step runs (trainable.py departure 2): 'triton' on CUDA with Triton and a C compiler,
    'foreach' on CUDA without either, 'for-loop' on the CPU."""
    if torch.device(device).type != "cuda":
        return "for-loop"
    from optimi.utils import HAS_TRITON

    return "triton" if HAS_TRITON and unavailable(device) is None else "foreach"


def master_weights(model, opt) -> dict:
    """{name: fp32 tensor}: the weights the optimizer holds, p + its Kahan compensation where it has one."""
    out = {}
    for n, p in model.named_parameters():
        comp = opt.state.get(p, {}).get("kahan_comp")
        out[n] = p.detach().float().clone() + (comp.float() if comp is not None else 0)
    return out
