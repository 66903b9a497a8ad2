"""What one real GRPO step holds in memory, measured phase by phase (memory.py estimates it from the config).

measure() runs grpo.py's own step on a real policy (policy.load_policy, as grpo.setup builds it; the update is
grpo.update, passed in) twice and counts the second one, in memory.PHASES:
  on the CPU   track_peak: a TorchDispatchMode that counts the live tensor storages (a view costs nothing,
               each storage once, from the op that made it until it is freed);
  on a GPU     cuda_peak: torch.cuda.max_memory_allocated (and max_memory_reserved), reset at each phase.
tests/test_memory.py holds memory.estimate within 10% of what this counts; `eval.py memory --measure` prints
both side by side. On a GPU, `--snapshot PATH` also records what the backward's peak holds, block by
block with its stack (cuda_peak), and held_at_peak prints it by site: what memory.py's backward misses there.

Run: python eval.py memory --model tiny-qwen3 --measure --max-new-tokens 64   # estimate vs a real step
     python eval.py memory --model qwen3-4b-random --measure --snapshot runs/backward.pickle   # on a GPU
"""
import os
import pickle
import re
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
    max_memory_reserved of each phase goes to `reserved` (a dict given, or a new one). `snapshot` (a path):
    the allocator's history of the second "backward" phase (the first micro-batch whose gradients exist) is
    recorded, every allocation with its Python and C++ stack, and saved there with the bytes allocated when
    it began (held_at_peak reads it; https://pytorch.org/memory_viz draws it)."""
    def __init__(self, *resident, reserved=None, snapshot=None):
        self.peak, self.name, self.reserved = {}, None, {} if reserved is None else reserved
        self.snapshot, self.entered, self.base = snapshot, {}, None

    def phase(self, name):
        self.close()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.name = name
        self.entered[name] = self.entered.get(name, 0) + 1
        if self.snapshot and name == "backward" and self.entered[name] == 2:
            self.base = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=10 ** 6, clear_history=True)

    def close(self):
        if self.name is not None:
            torch.cuda.synchronize()
            self.peak[self.name] = max(self.peak.get(self.name, 0), torch.cuda.max_memory_allocated())
            self.reserved[self.name] = max(self.reserved.get(self.name, 0), torch.cuda.max_memory_reserved())
        if self.base is not None:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            snap.update(base_allocated=self.base, window_peak=torch.cuda.max_memory_allocated())
            os.makedirs(os.path.dirname(self.snapshot) or ".", exist_ok=True)
            with open(self.snapshot, "wb") as f:
                pickle.dump(snap, f)
            self.base = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def held_at_peak(snap, top=12):
    """What a recorded window (cuda_peak's snapshot) held at its peak: (peak bytes, bytes still held from
    before the window, [(bytes, blocks, site)] of the window's own allocations live at the peak, largest
    first). The allocator's count is replayed: allocated = the bytes at the window's start + each "alloc"
    - each "free_requested" (when the allocator's statistics drop a block), in order; the peak is its
    largest value. A site is where the block was made: the autograd node, the ATen function and the
    innermost Python line of its stack (a backward node's allocations have no Python line, a replayed
    checkpointed layer's have its forward's)."""
    trace = [e for device in snap["device_traces"] for e in device
             if e["action"] in ("alloc", "free_requested")]
    now = best = snap["base_allocated"]
    at = -1                                                     # index of the event that reached the peak
    for i, e in enumerate(trace):
        now += e["size"] if e["action"] == "alloc" else -e["size"]
        if now > best:
            best, at = now, i
    live = {}
    for e in trace[:at + 1]:                                     # the window's blocks live at the peak
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    sites = {}
    for e in live.values():
        s = site(e["frames"])
        n, b = sites.get(s, (0, 0))
        sites[s] = (n + e["size"], b + 1)
    rows = sorted(((n, b, s) for s, (n, b) in sites.items()), reverse=True)
    return best, best - sum(n for n, _, _ in rows), rows[:top]


def report_held(path, estimated):
    """held_at_peak of the snapshot cuda_peak saved at `path`, as the lines under `eval.py memory`'s table."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    peak, before, rows = held_at_peak(snap)
    out = [f"the 2nd micro-batch's backward ({path}): peak {peak / 1e9:.2f} GB allocated (replayed; the "
           f"allocator's {snap['window_peak'] / 1e9:.2f}), estimated {estimated / 1e9:.2f}; "
           f"{before / 1e9:.2f} GB of it from before the phase; the phase's own blocks live at the peak:",
           f"  {'GB':>7s} {'blocks':>6s}  autograd node | ATen function | Python line"]
    out += [f"  {n / 1e9:7.3f} {b:6d}  {s}" for n, b, s in rows]
    return "\n".join(out)


def site(frames):
    """'autograd node | ATen function | file.py:line function' of an allocation's stack (innermost first)."""
    names = [f["name"] for f in frames]
    node = next((m.group(1) for n in names for m in [re.search(r"(\w+Backward\w*)::apply", n)] if m), "-")
    aten = next((n.split("(")[0] for n in names if n.startswith("at::native::")), "-")
    py = next((f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames
               if f["filename"].endswith(".py")), "-")
    return f"{node} | {aten} | {py}"


# ----------------------------------------------------------------------------- one real step, measured
def measure(cfg, prompt_tokens, update, device=None, seed=0, reserved=None, snapshot=None) -> dict:
    """{phase: peak bytes} of one real GRPO step, the second one (the optimizer states exist), on the policy
    policy.load_policy builds for grpo.setup: rollout.generate, the separate credit pass if the signal needs
    one, then `update` (grpo.update: grpo.py's own micro-batch loop, fused credit inside), which marks the
    phases. Every response runs to max_new_tokens (the model's generation_config.min_new_tokens, which keeps
    prefix sharing on), every row is trained (A = +-1). CPU: track_peak; CUDA: max_memory_allocated,
    and max_memory_reserved into `reserved` (a dict) where one is given; `snapshot`: cuda_peak's."""
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
    cuda = device.type == "cuda"
    with (cuda_peak(reserved=reserved, snapshot=snapshot) if cuda else track_peak(model, ref, opt)) as tr:
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
