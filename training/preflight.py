"""The preflight: each GPU part a run will use, run once on a tiny input at setup, before the first rollout.

The GPU parts (the fused head-mean kernel, torch-optimi's Triton step, the decode engine's graphs) otherwise
meet the GPU for the first time minutes into the run: a Triton launcher that cannot be built raises inside
step 1's update, after the whole first rollout. run.setup calls `check` once, after the checkpoint has
loaded; on CUDA it tries, in this order:

  head-mean kernel   gpu_kernels/head_mean.py's kernel on a (1, 4 heads, 32, 16) fp32 input against
                     flowtracer.add_head_mean (the reference; 1e-4), when head_mean_kernel chose it
  optimizer step     torch-optimi's AdamW step with Kahan summation on a scratch bf16 parameter, on the step
                     policy.optimi_kernel chose, when it chose Triton
  decode engine      one greedy rollout.generate of 2 new tokens on a 4-token prompt through the run's engine:
                     one capture and one replay at the smallest bucket (greedy: no random number drawn, so
                     the run's RNG, restored by --resume, is not moved; the sampler's graphs are captured by
                     the first rollout, under the guard that training/engine.py keeps for the run)

A part that fails is replaced by its fallback, with one line naming the part, the error and what runs
instead (docs/gpu.md lists them and what each costs): add_head_mean; optimi's foreach step (the same
arithmetic); rollout.decode, without the engine (the engine's own lines for a capture or replay that fails:
it then decodes eagerly). Then one line says which parts ran. The engine's trial allocates its buffers: out
of memory there, gen_chunk is halved and the engine resized (training/backoff.py's trial, one line each),
and only at 1 row does the fallback follow.

Also here, on every device: the run's decode engine is made and its buffers reserved once, for the run's
widest prompt (its training prompts after --max-prompt-tokens, and the held-out ones) plus --max-new-tokens
and gen_chunk rows, so no prompt met mid-run grows them (held-out evaluation decodes with it too, greedy as a
second set of graphs); and torch-optimi's step setting is written into the optimizer's param groups, after
the checkpoint's state has loaded (which holds the setting of the run that saved it: a fallback chosen now
must survive --resume).

Run: python grpo.py --model tiny-qwen3 --steps 1     (on a GPU: the preflight's lines before the first step)
     python -m pytest -q tests/test_preflight.py    (each fallback forced on the CPU)
"""
import time
from typing import NamedTuple

import torch

from flowtracer import add_head_mean
from training import backoff, policy
from training.cudagraph import one_line
from training.engine import Engine, supports
from training.rollout import eos_ids, generate

TOLERANCE = 1e-4    # the kernel against add_head_mean, fp32 (tests/test_head_mean_kernel.py holds 1e-5)


class Checked(NamedTuple):
    head_mean: object   # the function a Capture sums head means with (the kernel, or add_head_mean)
    engine: object      # the run's decode engine, its buffers reserved for the run, or None: rollout.decode
    optimizer: str      # torch-optimi's step in force (triton | foreach | for-loop), "" for torch's AdamW
    lines: list         # the lines printed, in order


def on_gpu(device):
    """Whether `check` tries the parts: a CUDA device (the CPU tests force it)."""
    return torch.device(device).type == "cuda"


def settle(opt, kernel):
    """torch-optimi's step `kernel` written into each param group (optimi reads the triton and foreach
    flags at every step; a loaded checkpoint wrote its own). torch's AdamW: untouched, ''."""
    groups = [g for g in opt.param_groups if "triton" in g and "kahan_sum" in g]
    for g in groups:
        g["triton"], g["foreach"] = kernel == "triton", kernel == "foreach"
    return kernel if groups else ""


def head_mean_trial(fn, device):
    """The kernel against add_head_mean on a tiny causal input; raises when it fails or differs."""
    gen = torch.Generator().manual_seed(0)                                # not the run's RNG
    q = torch.randn(1, 4, 32, 16, generator=gen).to(device)               # (B, H, T, d)
    k = torch.randn(1, 2, 32, 16, generator=gen).to(device)               # (B, Hkv, S, d)
    got, want = (torch.zeros(1, 32, 32, device=device) for _ in range(2))  # (B, T, S)
    fn(got, q, k, None, 0.25, 32)
    add_head_mean(want, q, k, None, 0.25, 32)
    gap = (got - want).abs().max().item()                                 # a host read: the launch is done
    if not gap <= TOLERANCE:
        raise ValueError(f"differs from add_head_mean by {gap:.1e} (> {TOLERANCE:g})")


def optimizer_trial(device):
    """torch-optimi's Triton step (Kahan summation, bf16) on a scratch parameter; raises when it fails."""
    import optimi
    p = torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16, device=device))
    p.grad = torch.ones_like(p)
    optimi.AdamW([p], lr=1e-2, kahan_sum=True, triton=True, foreach=False).step()
    if not (p.detach().float() < 0).all().item():                         # lr 1e-2, g 1: p = -1e-2
        raise ValueError("the step left the scratch parameter unchanged")


def engine_trial(engine, model, tok, device):
    """One greedy decode through the engine: a capture and a replay of the smallest bucket."""
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    with torch.no_grad(), policy.autocast(device):
        generate(model, tok, [[start, 17, 18, 19]], n=1, max_new_tokens=2, greedy=True, chunk_size=1,
                 engine=engine)


def make_engine(cfg, model, tok, widest, n_eval):
    """The run's engine, its buffers reserved once: rows of a chunk (training's or the evaluation's), the
    widest prompt plus max_new_tokens, and the run's sampling (greedy calls share the buffers)."""
    if not (cfg.share_prefix and supports(model)):
        return None
    rows = min(cfg.gen_chunk, max(cfg.prompts_per_step * cfg.group_size, n_eval))
    warp = (cfg.temperature, cfg.top_k, cfg.top_p)
    return Engine(model).reserve(rows, widest - 1 + cfg.max_new_tokens, cfg.max_new_tokens,
                                 eos_ids(model, tok), tok.pad_token_id, warp)


def check(cfg, u, device, widest, n_eval=0) -> Checked:
    """The parts `u` (run.for_update's record) will use, each tried once on CUDA (see the docstring), and
    the optimizer's step setting applied after a checkpoint's load. widest: the run's widest prompt in
    tokens; n_eval: its held-out questions."""
    kernel = policy.optimi_kernel(next(u.model.parameters()).device)
    step = settle(u.opt, kernel)
    if not on_gpu(device):
        return Checked(u.head_mean, None, step, [])
    clock, lines, ran = time.perf_counter(), [], []
    head_mean, engine = u.head_mean, make_engine(cfg, u.model, u.tok, widest, n_eval)

    def fails(part, trial, instead):
        try:
            trial()
            ran.append(part)
            return False
        except Exception as e:                                          # noqa: BLE001 (a fallback follows)
            lines.append(f"preflight: the {part} failed ({one_line(e)}); {instead}")
            print(lines[-1], flush=True)
            return True
    if head_mean not in (None, add_head_mean) and fails(
            "head-mean kernel", lambda: head_mean_trial(head_mean, device),
            "flow credit uses add_head_mean, the PyTorch reference"):
        head_mean = add_head_mean
    if step == "triton" and fails("optimizer's Triton step", lambda: optimizer_trial(device),
                                  "torch-optimi's foreach step runs instead (the same arithmetic)"):
        step = settle(u.opt, "foreach")

    def decode():                                                      # out of memory: a smaller gen_chunk
        return backoff.trial(cfg, engine, lambda: engine_trial(engine, u.model, u.tok, device))
    if engine is not None and fails("decode engine", decode,
                                    "rollouts decode with rollout.decode, without the engine"):
        engine = None
    if engine is not None and engine.off:                              # the engine said why, in its line
        engine = None
    lines.append(f"preflight: {', '.join(ran) or 'no GPU part'} ran on {device} in "
                 f"{time.perf_counter() - clock:.1f} s" + ("" if engine is None or engine.graphs else
                                                          " (the decode engine without graphs)"))
    print(lines[-1], flush=True)
    return Checked(head_mean, engine, step, lines)
