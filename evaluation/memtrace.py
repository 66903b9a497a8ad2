"""What one real GRPO step holds in memory, measured phase by phase (memory.py estimates it from the config).

measure() runs grpo.py's own step on a real policy (policy.load_policy, as grpo.setup builds it; the update is
grpo.update, passed in) twice and counts the second one, in memory.PHASES:
  on the CPU   track_peak: a TorchDispatchMode that counts the live tensor storages (a view costs nothing,
               each storage once, from the op that made it until it is freed);
  on a GPU     cuda_peak: torch.cuda.max_memory_allocated (and max_memory_reserved), reset at each phase.
tests/test_memory.py holds memory.estimate within 10% of what this counts; `eval.py memory --measure` prints
both side by side.

Run: python eval.py memory --model tiny-qwen3 --measure --max-new-tokens 64   # estimate vs a real step
"""
import weakref
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from training import credit, policy, rollout
from training.rollout import build_batch


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


# ----------------------------------------------------------------------------- one real step, measured
def measure(cfg, prompt_tokens, update, device=None, seed=0, reserved=None) -> dict:
    """{phase: peak bytes} of one real GRPO step, the second one (the optimizer states exist), on the policy
    policy.load_policy builds for grpo.setup: rollout.generate, the separate credit pass if the signal needs
    one, then `update` (grpo.update: grpo.py's own micro-batch loop, fused credit inside), which marks the
    phases. Every response runs to max_new_tokens (the model's generation_config.min_new_tokens, which keeps
    prefix sharing on), every row is trained (A = +-1). CPU: track_peak; CUDA: max_memory_allocated,
    and max_memory_reserved into `reserved` (a dict) where one is given."""
    device = policy.device_of(device or "auto")
    torch.manual_seed(seed)
    model, tok, ref, opt = policy.load_policy(cfg, device)
    run = SimpleNamespace(cfg=cfg, model=model, tok=tok, ref=ref, opt=opt, device=device,
                          autocast=policy.autocast(device), clock=None)
    B, R = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens
    prompts = random_prompts(tok, cfg.prompts_per_step, prompt_tokens)
    model.generation_config.min_new_tokens = R                   # no EOS before max_new_tokens

    def step(tr):
        run.clock = tr                                           # grpo.update marks its phases on it
        tr.phase("generation")
        model.eval()
        with torch.no_grad(), run.autocast:
            gen = rollout.generate(model, tok, prompts, n=cfg.group_size, max_new_tokens=R, top_k=cfg.top_k,
                                   temperature=cfg.temperature, top_p=cfg.top_p, chunk_size=cfg.gen_chunk,
                                   share_prefix=cfg.share_prefix)
        tr.phase(None)
        batch = build_batch(tok, gen.prompt_ids, gen.response_ids).to(device)
        adv = torch.tensor([1.0, -1.0] * (B // 2) + [1.0] * (B % 2), device=device)            # (B,)
        every, given = list(range(B)), None
        if credit.separate_pass(cfg):
            tr.phase("credit")
            with torch.no_grad(), run.autocast:
                given = credit.assign(model, tok, batch, adv, cfg)
        update(run, batch, every, adv, given)

    step(SimpleNamespace(phase=lambda name: None))
    with (cuda_peak(reserved=reserved) if device.type == "cuda" else track_peak(model, ref, opt)) as tr:
        step(tr)
    return tr.peak


def random_prompts(tok, n, width, seed=0):
    """n texts of width - (7 i mod width/4) tokens (the first one `width`): random words that tokenize back
    to themselves (space-led ASCII words, or single characters for a byte tokenizer); no shared prefix."""
    singles = [i for i in range(min(len(tok), 4096)) if i not in set(tok.all_special_ids)
               and tok(tok.decode([i]), add_special_tokens=False).input_ids == [i]]
    words = [i for i in singles if tok.decode([i])[:1] == " " and tok.decode([i])[1:].isalpha()
             and tok.decode([i]).isascii()]
    pool, g = words if len(words) >= 100 else singles, torch.Generator().manual_seed(seed)
    return [tok.decode([pool[j] for j in torch.randint(len(pool), (width - (i * 7) % max(1, width // 4),),
                                                       generator=g)]) for i in range(n)]
