"""What one real GRPO step holds in memory, measured phase by phase (memory.py estimates it from the config).

measure() runs grpo.py's own step on a real policy (trainable.load_policy, as run.setup builds it; the update
is grpo.update, passed in) twice and counts the second one, in phases.PHASES. It rolls out as grpo.py does:
on CUDA through the run's decode engine, made and reserved once before the first step (preflight.make_engine,
as setup makes it), so its cache is in every phase of the update it measures, or freed before the update
where the plan releases it (release):
  on the CPU   track_peak: a TorchDispatchMode that counts the live tensor storages (a view costs nothing,
               each storage once, from the op that made it until it is freed);
  on a GPU     cuda_peak: torch.cuda.max_memory_allocated (and max_memory_reserved), reset at each phase.
tests/memory/test_phases.py holds phases.estimate within 10% of what this counts; `eval.py memory --measure`
prints both side by side. On a GPU, `--snapshot PATH` also records what the backward's peak holds, block by
block with its stack (cuda_peak), and held_at_peak sums it by site: what memory.py's backward misses there
(PATH: the pickle for memory_viz; PATH.json: the sums, which report_held prints; no pickle is read back).
`eval.py memory` (evaluation/memory.py's command) prints the estimate, and with --measure this beside it.

Run: python eval.py memory --model tiny-qwen3 --measure --max-new-tokens 64   # estimate vs a real step
     python eval.py memory --model qwen3-4b-random --measure --snapshot runs/backward.pickle   # on a GPU
"""

import contextlib
import json
import os
import pickle
import re
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from data import build_batch
from training.decode import rollout
from training.memory import budget, preflight
from training.model import trainable
from training.run.setup import load_for_update


# ----------------------------------------------------------------------------- the live-tensor tracker
class Grads(NamedTuple):
    """The resident modules' parameter gradients live at a phase's peak (track_peak.grads)."""

    grad: int  # bytes of .grad: what the estimate's "grads" counts
    waiting: int  # bytes of gradients made and not yet in .grad: autograd sums the parts of a weight used
    # twice (a prompt pass and a response pass) before it adds them in; the estimate counts none
    params: tuple  # the names of the parameters whose gradients wait, in the order of the model


class track_peak(TorchDispatchMode):
    """Peak live tensor bytes, phase by phase, counted by storage (a view costs nothing, each storage is
    counted once, from the op that made it until it is freed). Tensors made before the block are counted
    when passed in (`*resident`: modules, optimizers, tensors) or when an op first reads them.

        with track_peak(model, opt) as tr:
            tr.phase("generation"); ...
        tr.peak   # {phase: bytes}
        tr.grads  # {phase: Grads}: the resident modules' parameter gradients live at that phase's peak

    A gradient is told apart by the autograd node that makes it (torch._C._current_autograd_node, in the
    backward): an output of that node's op, of a parameter's shape, where the node's edge leads to that
    parameter's AccumulateGrad, is the parameter's gradient until it is freed; at the peak it is either
    the parameter's .grad or a part waiting for the rest of its sum (Grads). Ops run with grad mode on
    inside a node are a checkpointed layer's forward replayed, and are not read so; nor is a parameter's
    own storage (a node unpacks the weight it saved as a new tensor on it)."""

    def __init__(self, *resident):
        super().__init__()
        self.live, self.now, self.peak, self.name = {}, 0, {}, None
        self.resident, self.grads, self.params, self.grad_of, self.weights = resident, {}, {}, {}, set()

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
        if self.name is not None and self.now > self.peak.get(self.name, -1):
            self.at_peak()

    def free(self, key):
        self.now -= self.live.pop(key, 0)
        self.grad_of.pop(key, None)

    def phase(self, name):
        self.name = name
        if name is not None and self.now > self.peak.get(name, -1):
            self.at_peak()

    def at_peak(self):
        """A new peak of the phase: its bytes, and the parameters' gradients live then (Grads)."""
        self.peak[self.name] = self.now
        grad = {p.grad.untyped_storage().data_ptr() for _, p in self.params.values() if p.grad is not None}
        waiting = {k: i for k, i in self.grad_of.items() if k not in grad}  # storage -> parameter
        self.grads[self.name] = Grads(
            sum(self.live.get(k, 0) for k in grad),
            sum(self.live[k] for k in waiting),
            tuple(n for i, (n, _) in self.params.items() if i in waiting.values()),
        )

    def __enter__(self):
        for r in self.resident:
            if isinstance(r, torch.nn.Module):
                self.params.update({id(p): (n, p) for n, p in r.named_parameters()})
                self.weights |= {p.untyped_storage().data_ptr() for p in r.parameters()}
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
        made = tree_flatten(out)[0]
        node = torch._C._current_autograd_node()  # the backward's node running this op, or None
        if node is not None and not torch.is_grad_enabled():  # (with grad: a checkpoint's replay in it)
            params = {
                p.shape: id(p)
                for fn, _ in node.next_functions
                if id(p := getattr(fn, "variable", None)) in self.params
            }
            for t in made if params else ():
                key = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr()
                if key and t.shape in params and key not in self.weights:  # (a saved weight, unpacked)
                    self.add(t)
                    self.grad_of[key] = params[t.shape]
        for t in tree_flatten((args, kwargs))[0] + made:
            self.add(t)
        return out


class cuda_peak:
    """track_peak's interface on a GPU: torch.cuda.max_memory_allocated, reset at each phase; the allocator's
    max_memory_reserved of each phase goes to `reserved` (a dict given, or a new one). `snapshot` (a path):
    the allocator's history of the second "backward" phase (the first micro-batch whose gradients exist) is
    recorded, every allocation with its Python and C++ stack, and saved there with the bytes allocated when
    it began (https://pytorch.org/memory_viz draws it), its held_at_peak beside it (save_snapshot)."""

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
            torch.cuda.memory._record_memory_history(max_entries=10**6, clear_history=True)

    def close(self):
        if self.name is not None:
            torch.cuda.synchronize()
            self.peak[self.name] = max(self.peak.get(self.name, 0), torch.cuda.max_memory_allocated())
            self.reserved[self.name] = max(self.reserved.get(self.name, 0), torch.cuda.max_memory_reserved())
        if self.base is not None:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            snap.update(base_allocated=self.base, window_peak=torch.cuda.max_memory_allocated())
            save_snapshot(snap, self.snapshot)
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
    trace = [
        e for device in snap["device_traces"] for e in device if e["action"] in ("alloc", "free_requested")
    ]
    now = best = snap["base_allocated"]
    at = -1  # index of the event that reached the peak
    for i, e in enumerate(trace):
        now += e["size"] if e["action"] == "alloc" else -e["size"]
        if now > best:
            best, at = now, i
    live = {}
    for e in trace[: at + 1]:  # the window's blocks live at the peak
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


def save_snapshot(snap, path):
    """The allocator's snapshot to `path` (a pickle, as https://pytorch.org/memory_viz reads it) and its
    held_at_peak, every site, to path + ".json": the summary report_held reads back. Only JSON is read back:
    unpickling a file can run code, and a path the user names may hold anything by the time it is read."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    peak, before, rows = held_at_peak(snap, top=None)
    summary = {
        "peak": peak,
        "before": before,
        "rows": rows,
        "window_peak": snap["window_peak"],
        "base_allocated": snap["base_allocated"],
    }
    Path(str(path) + ".json").write_text(json.dumps(summary))


def report_held(path, estimated, top=12):
    """The lines under `eval.py memory`'s table: the `top` sites of the summary save_snapshot wrote beside
    the snapshot at `path` (path + ".json"; the pickle itself is never loaded). ValueError naming the file
    when it is not such a summary."""
    f = Path(str(path) + ".json")
    try:
        s = json.loads(f.read_text())
        peak, before, window, rows = s["peak"], s["before"], s["window_peak"], [tuple(r) for r in s["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{f}: not a snapshot summary of eval.py memory --snapshot ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    out = [
        f"the 2nd micro-batch's backward ({path}): peak {peak / 1e9:.2f} GB allocated (replayed; the "
        f"allocator's {window / 1e9:.2f}), estimated {estimated / 1e9:.2f}; "
        f"{before / 1e9:.2f} GB of it from before the phase; the phase's own blocks live at the peak:",
        f"  {'GB':>7s} {'blocks':>6s}  autograd node | ATen function | Python line",
    ]
    out += [f"  {n / 1e9:7.3f} {b:6d}  {site}" for n, b, site in rows[:top]]
    return "\n".join(out)


def site(frames):
    """'autograd node | ATen function | file.py:line function' of an allocation's stack (innermost first)."""
    names = [f["name"] for f in frames]
    node = next((m.group(1) for n in names for m in [re.search(r"(\w+Backward\w*)::apply", n)] if m), "-")
    aten = next((n.split("(")[0] for n in names if n.startswith("at::native::")), "-")
    py = next(
        (
            f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
            for f in frames
            if f["filename"].endswith(".py")
        ),
        "-",
    )
    return f"{node} | {aten} | {py}"


# ----------------------------------------------------------------------------- one real step, measured
def measure(
    cfg, prompt_tokens, update, device=None, seed=0, reserved=None, snapshot=None, release=False, grads=None
) -> dict:
    """{phase: peak bytes} of one real GRPO step, the second one (the optimizer states exist), on the policy
    trainable.load_policy builds for run.setup: rollout.generate (on CUDA through the run's engine, reserved
    before the first step as setup reserves it; release: freed before each update, budget.plan's layout
    "released"), then `update` (grpo.update: grpo.py's own micro-batch loop, the credit inside, a credit's
    own pass too), which marks the phases on the clock it is given. Every response runs to max_new_tokens
    (the model's generation_config.min_new_tokens, which keeps prefix sharing on), every row is trained
    (A = +-1). CPU: track_peak, and its Grads at each phase's peak into `grads` (a dict) where one is given;
    CUDA: max_memory_allocated, and max_memory_reserved into `reserved` (a dict) where one is given;
    `snapshot`: cuda_peak's."""
    device, cfg = trainable.device_of(device or "auto"), budget.largest(cfg)  # a size at 0: the CPU's
    torch.manual_seed(seed)
    run = load_for_update(cfg, device)  # run.setup's policy and credit
    pol = run.policy
    model, tok, ref, opt = pol.model, pol.tok, pol.ref, pol.opt
    B, R = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens
    prompts = random_prompts(tok, cfg.prompts_per_step, prompt_tokens)
    model.generation_config.min_new_tokens = R  # no EOS before max_new_tokens
    run.engine = run_engine(cfg, model, tok, prompts, device)

    def step(clock):
        with clock.phase("generation"), torch.no_grad(), pol.autocast:
            model.eval()
            gen = rollout.generate(
                model,
                tok,
                prompts,
                cfg.group_size,
                rollout.Sampling.of(cfg),  # R = cfg.max_new_tokens new tokens
                chunk_size=cfg.gen_chunk,
                share_prefix=cfg.share_prefix,
                engine=run.engine,
            )
        if release and run.engine is not None:
            run.engine.release()  # as backoff.update does for the plan
        batch = build_batch(tok, gen.prompt_ids, gen.response_ids).to(device)
        adv = torch.tensor([1.0, -1.0] * (B // 2) + [1.0] * (B % 2), device=device)  # (B,)
        update(run, batch, list(range(B)), adv, clock)

    step(Phases(SimpleNamespace(phase=lambda name: None)))
    cuda = device.type == "cuda"
    with cuda_peak(reserved=reserved, snapshot=snapshot) if cuda else track_peak(model, ref, opt) as tr:
        step(Phases(tr))
    if grads is not None and not cuda:
        grads.update(tr.grads)
    return tr.peak


def run_engine(cfg, model, tok, prompts, device):
    """The decode engine grpo.py's setup makes for a run on CUDA (preflight.make_engine: reserved for the
    widest prompt, a chunk of rows, held-out evaluation's included), here for `prompts`; None on the CPU,
    where grpo.py decodes without one."""
    if torch.device(device).type != "cuda":
        return None
    widest = max(map(len, rollout.prompt_ids(tok, prompts)))
    return preflight.make_engine(cfg, model, tok, widest, cfg.eval_size if cfg.eval_every else 0)


class Phases:
    """grpo.update's clock (`with clock.phase(name): ...`) over a tracker's marks (tr.phase(name) starts a
    phase, tr.phase(None) ends it)."""

    def __init__(self, tracker):
        self.tracker = tracker

    @contextlib.contextmanager
    def phase(self, name):
        self.tracker.phase(name)
        try:
            yield
        finally:
            self.tracker.phase(None)


def random_prompts(tok, n, width, seed=0):
    """n texts of width - (7 i mod width/4) tokens (the first one `width`): random words that tokenize back
    to themselves (space-led ASCII words, or single characters for a byte tokenizer); no shared prefix."""
    singles = [
        i
        for i in range(min(len(tok), 4096))
        if i not in set(tok.all_special_ids)
        and tok(tok.decode([i]), add_special_tokens=False).input_ids == [i]
    ]
    words = [
        i
        for i in singles
        if tok.decode([i])[:1] == " " and tok.decode([i])[1:].isalpha() and tok.decode([i]).isascii()
    ]
    pool, g = words if len(words) >= 100 else singles, torch.Generator().manual_seed(seed)
    return [
        tok.decode(
            [pool[j] for j in torch.randint(len(pool), (width - (i * 7) % max(1, width // 4),), generator=g)]
        )
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- the command
