"""The preflight: each GPU part a run will use, run once on a tiny input at setup, before the first rollout.

The GPU parts (the fused head-mean kernel, torch-optimi's Triton step, the decode engine's graphs) otherwise
meet the GPU for the first time minutes into the run: a Triton launcher that cannot be built raises inside
step 1's update, after the whole first rollout. run.setup calls `check` once, after the checkpoint has
loaded; on CUDA it tries, in this order:

  head-mean kernel   gpu_kernels/head_mean.py's kernel as the run calls it, when head_mean_kernel chose it:
                     one no-grad forward of the run's model through token_logprobs, as grpo.update calls it,
                     under the run's autocast (its dtype, its head dim and heads) on two prompts, one left-
                     padded, of two responses each (the padding mask; with --share-prefix the response pass
                     over the cached prompt, S > T), its Capture against one that sums with
                     flowtracer.add_head_mean (the reference; 1e-4). Triton compiles a kernel per dtype, head
                     dim and mask kind: a toy input in another dtype would try another kernel.
  optimizer step     torch-optimi's AdamW step with Kahan summation on a scratch bf16 parameter, on the step
                     policy.optimi_kernel chose, when it chose Triton (Policy.use_kernel writes it)
  decode engine      rollout.generate of 2 new tokens on a 4-token prompt through the run's engine, greedy
                     (held-out evaluation's graph) and sampled at the run's temperature, top-k and top-p (the
                     rollouts' graph): a capture and a replay of each, the graphs the run's rollouts and
                     evaluations replay (one a warp, at the reserved rows: none is captured later).
                     Sampling draws random numbers: the CPU's and every GPU's RNG states are saved before
                     the trial and restored after it (keep_rng), so the run's RNG, restored by --resume, is
                     not moved.

A part that fails is replaced by its fallback, with one line naming the part, the error and what runs
instead (docs/gpu.md lists them and what each costs): add_head_mean; optimi's foreach step (the same
arithmetic); rollout.decode, without the engine (the engine's own lines for a capture or replay that fails:
it then decodes eagerly). Then one line says which parts ran. The engine's trial allocates its buffers: out
of memory there, gen_chunk is halved and the engine resized (training/memory/backoff.py's trial, one line
each), and only at 1 row does the fallback follow.

Also here, on CUDA: the run's decode engine is made and its buffers reserved once, for the run's
widest prompt (its training prompts after --max-prompt-tokens, and the held-out ones) plus --max-new-tokens
and gen_chunk rows, so no prompt met mid-run grows them (held-out evaluation decodes with it too, greedy as a
second set of graphs); and, on every device (on the CPU, with no GPU part to try and no engine, run.setup
writes it without calling `check`), torch-optimi's step setting is written into the optimizer's param
groups, after the checkpoint's state has loaded (which holds the setting of the run that saved it: a
fallback chosen now must survive --resume).

Run: python grpo.py --model tiny-qwen3 --steps 1     (on a GPU: the preflight's lines before the first step)
     python -m pytest -q tests/memory/test_preflight.py    (each fallback forced on the CPU)
"""

import contextlib
import time
from typing import NamedTuple

import torch

from data import build_batch
from flowtracer import Capture, add_head_mean
from training.decode.cudagraph import error_line
from training.decode.engine import Engine, supports
from training.decode.rollout import Sampling, eos_ids, generate
from training.memory import backoff
from training.policy import token_logprobs

TOLERANCE = 1e-4  # the kernel's maps against add_head_mean's (tests/gpu_kernels/test_head_mean.py holds 1e-5)


class GpuParts(NamedTuple):
    """The GPU parts a run uses after the preflight: each tried once on CUDA, or its fallback."""

    head_mean: object  # the function a Capture sums head means with (the kernel, or add_head_mean)
    engine: object  # the run's decode engine, its buffers reserved for the run, or None: rollout.decode
    optimizer: str  # torch-optimi's step in force (triton | foreach | for-loop), "" for torch's AdamW
    lines: list  # the lines printed, in order


def on_gpu(device):
    """Whether `check` tries the parts: a CUDA device (the CPU tests force it)."""
    return torch.device(device).type == "cuda"


def first_token(tok):
    return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id


def head_mean_trial(fn, run, cfg, device):
    """The kernel `fn` as the run calls it (see the docstring): the maps of one forward captured with `fn`
    against those captured with add_head_mean; raises when it fails or they differ."""
    s, pol = first_token(run.policy.tok), run.policy
    prompts = [[s, 17, 18, 19, 20, 21]] * 2 + [[s, 22, 23]] * 2  # one left-padded
    batch = build_batch(pol.tok, prompts, [[30, 31, 32], [33], [34, 35], [36]], device=device)  # (4, T)
    maps = []
    for f in (fn, add_head_mean):
        cap = Capture(run.layers, head_mean=f)
        with torch.no_grad(), pol.autocast:
            token_logprobs(
                pol.model,
                batch.input_ids,
                batch.attention_mask,
                batch.prompt_width,
                cfg.logprob_chunk,
                cfg.share_prefix,
                capture=cap,
            )
        maps.append(cap.maps(batch.attention_mask))  # (4, T, T)
    gap = (maps[0] - maps[1]).abs().max().item()  # a host read: the launch is done
    if not gap <= TOLERANCE:
        raise ValueError(f"differs from add_head_mean by {gap:.1e} (> {TOLERANCE:g})")


def optimizer_trial(device):
    """torch-optimi's Triton step (Kahan summation, bf16) on a scratch parameter; raises when it fails."""
    import optimi

    p = torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16, device=device))
    p.grad = torch.ones_like(p)
    optimi.AdamW([p], lr=1e-2, kahan_sum=True, triton=True, foreach=False).step()
    if not (p.detach().float() < 0).all().item():  # lr 1e-2, g 1: p = -1e-2
        raise ValueError("the step left the scratch parameter unchanged")


@contextlib.contextmanager
def keep_rng():
    """The CPU's and every visible GPU's RNG states as they were before the block (torch.random.fork_rng's
    saving, written out): the sampler's trial draws, the run's draws stay those --resume restores."""
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state_all()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        torch.cuda.set_rng_state_all(cuda)


def engine_trial(engine, model, tok, device, cfg, autocast):
    """One decode through the engine, greedy and then sampled at the run's settings: a capture and a replay
    of each one's graph (the run's own, at the reserved rows), the RNG kept (keep_rng)."""
    with keep_rng(), torch.no_grad(), autocast:
        for sampling in (Sampling(2, greedy=True), Sampling.of(cfg)._replace(max_new_tokens=2)):
            generate(model, tok, [[first_token(tok), 17, 18, 19]], 1, sampling, chunk_size=1, engine=engine)


def make_engine(cfg, model, tok, widest, n_eval):
    """The run's engine, its buffers reserved once: rows of a chunk (training's or the evaluation's), the
    widest prompt plus max_new_tokens, and the run's sampling (greedy calls share the buffers)."""
    if not (cfg.share_prefix and supports(model)):
        return None
    rows = min(cfg.gen_chunk, max(cfg.prompts_per_step * cfg.group_size, n_eval))
    new, warp = cfg.max_new_tokens, Sampling.of(cfg).warp
    return Engine(model).reserve(rows, widest - 1 + new, new, eos_ids(model, tok), tok.pad_token_id, warp)


def try_parts(cfg, run, device, widest, n_eval=0) -> GpuParts:
    """The parts `run` (run.load_for_update's) will use, each tried once on CUDA (see the docstring), and
    the optimizer's step setting applied after a checkpoint's load (Policy.use_kernel). widest: the run's
    widest prompt in tokens; n_eval: its held-out questions."""
    pol = run.policy
    step = pol.use_kernel()  # optimi_kernel's choice, where the weights are
    if not on_gpu(device):
        return GpuParts(run.head_mean, None, step, [])
    clock, lines, ran = time.perf_counter(), [], []
    head_mean, engine = run.head_mean, make_engine(cfg, pol.model, pol.tok, widest, n_eval)

    def fails(part, trial, instead):
        try:
            trial()
            ran.append(part)
            return False
        except Exception as e:  # noqa: BLE001 (a fallback follows)
            lines.append(f"preflight: the {part} failed ({error_line(e)}); {instead}")
            print(lines[-1], flush=True)
            return True

    if head_mean not in (None, add_head_mean) and fails(
        "head-mean kernel",
        lambda: head_mean_trial(head_mean, run, cfg, device),
        "flow credit uses add_head_mean, the PyTorch reference",
    ):
        head_mean = add_head_mean
    if step == "triton" and fails(
        "optimizer's Triton step",
        lambda: optimizer_trial(device),
        "torch-optimi's foreach step runs instead (the same arithmetic)",
    ):
        step = pol.use_kernel("foreach")

    def decode():  # out of memory: a smaller gen_chunk
        return backoff.trial(
            cfg, engine, lambda: engine_trial(engine, pol.model, pol.tok, device, cfg, pol.autocast)
        )

    if engine is not None and fails(
        "decode engine", decode, "rollouts decode with rollout.decode, without the engine"
    ):
        engine = None
    if engine is not None and engine.off:  # the engine said why, in its line
        engine = None
    lines.append(
        f"preflight: {', '.join(ran) or 'no GPU part'} ran on {device} in "
        f"{time.perf_counter() - clock:.1f} s"
        + ("" if engine is None or engine.graphs else " (the decode engine without graphs)")
    )
    print(lines[-1], flush=True)
    return GpuParts(head_mean, engine, step, lines)
