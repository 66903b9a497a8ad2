"""The out-of-memory back-off: a step that the memory estimate got wrong is redone smaller, not lost.

grpo.py sizes its step to the card before the weights load (training/memory/budget.py's size, from
training/memory/phases.py's estimate). Where the estimate is wrong, the allocator raises
torch.OutOfMemoryError (cudagraph.out_of_memory: any device, and what accelerate's should_reduce_batch_size
reads as one) minutes into a step. grpo.py reaches each phase through one call here:

    gen = backoff.generate(run, "rollout", generate, model, tok, prompts, G, sampling, ...) # rollout.generate
    up = backoff.update(run, update, batch, trained, adv, clock)                            # grpo.update
    m.update(backoff.generate(run, "held-out evaluation", heldout.accuracy, ...))           # heldout.accuracy

  rollout, held-out evaluation   fn gets chunk_size = run.cfg.gen_chunk, the run's engine and `done`, the
           rows finished so far (rollout.generate appends each chunk as it ends). Out of memory: gen_chunk is
           halved, the engine resized to it (its buffers made again at the new width, its graphs captured
           again as the calls come: Engine.resize) and fn called again: it generates the rows not yet
           generated.
  update   fn(run, ...) reads run.cfg.micro_batch (a separate credit pass too: baselines.OtherCredit takes the
           same micro-batches). Out of memory before the optimizer's step has begun (every PPO epoch of the
           default --num-iterations 1): what the step held is freed (the gradients set to None with the
           failed call's tensors), micro_batch is halved and the update redone from its start on the same
           rollouts. The loss is normalised by the whole batch (grpo.Experience.denom), so in fp32 the
           gradient does not depend on micro_batch (tests/memory/test_backoff.py). After an optimizer step
           began (a later PPO epoch's, or the step itself) the weights have moved: redoing would train those
           rollouts twice, so the run stops (below).
           Where budget.plan releases the engine for the update (run.budget.plan.release), the engine is
           released here first: its cache is freed for the update and reserved again by the next generate
           call.

Each back-off is one line (the phase, the size before and after, the error) and counted in the step's
metrics (oom/backoffs: RunLog.backoffs); the size goes into run.cfg, which every checkpoint writes to
run_config.json, so --resume continues at it. A back-off only lowers a size, and nothing raises it again
(budget.size plans at or below the sizes a run records).
At gen_chunk / micro_batch 1, or after an optimizer step began: OutOfMemory, one line naming the phase, the
sizes tried and the estimate at them (training/memory/phases.py), and what stands: the
last step logged is saved when no optimizer step has begun since (RunLog.save_last: nothing is lost, and
--resume is exact), else the last checkpoint stands. grpo.main prints it and exits with status 1.

The anchors: accelerate's find_executable_batch_size retries a whole function at 0.9x the batch on such an
error; vLLM sizes its KV cache to what is free after a profiling run. No GRPO reference backs off its step.
Departures (numbered):
 1. Halved, not 0.9x: the sizes stay powers of two as budget.plan picks them, a step is tried at most
    log2(size) + 1 times, and a rollout keeps the chunks it finished.
 2. A rollout redone at a smaller chunk draws other samples than the run that never failed would have (a
    chunk's rows share the draws); --resume after a back-off is exact with respect to the run that backed off.

Run: python -m pytest -q tests/memory/test_backoff.py
"""

from accelerate.utils.memory import clear_device_cache
from tqdm import tqdm

from training.decode.cudagraph import error_line, out_of_memory
from training.decode.rollout import Generations
from training.memory import budget, phases


class OutOfMemory(Exception):
    """Out of memory at size 1, or after an optimizer step began: the one line grpo.main prints (status 1)."""


def generate(run, phase, fn, *args, **kw):
    """fn(*args, chunk_size=run.cfg.gen_chunk, engine=run.engine, done=..., **kw): rollout.generate or
    heldout.accuracy on the run's decode engine, its rows generated at a halved gen_chunk after an
    out-of-memory error (the docstring), the engine resized with the chunk; what fn returns."""
    cfg, engine, done, tried = run.cfg, run.engine, Generations([], [], [], []), [run.cfg.gen_chunk]
    while True:
        try:
            return fn(*args, chunk_size=cfg.gen_chunk, engine=engine, done=done, **kw)
        except Exception as e:  # noqa: BLE001 (only memory is caught)
            if not out_of_memory(e):
                raise
            why = error_line(e)
        free()  # the failed chunk's tensors are gone
        if chunk_rows(cfg, engine) == 1:
            raise OutOfMemory(last_line(run, phase, tried, why))
        halve_chunk(cfg, engine)
        said(
            run,
            f"the {phase} ran out of memory at gen_chunk {tried[-1]} ({why}): gen_chunk "
            f"{cfg.gen_chunk} from here on; the {len(done.texts)} rows done are kept, the others made",
        )
        tried.append(cfg.gen_chunk)


def trial(cfg, engine, fn):
    """fn() (training/memory/preflight.py's engine trial: the engine's first decode allocates its buffers at
    setup) tried again at a halved gen_chunk, the engine resized, after an out-of-memory error, one line each:
    an estimate wrong by the engine's cache costs a size, not the engine. At 1 row the error is raised (the
    preflight's fallback follows)."""
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (only memory is caught)
            if not out_of_memory(e) or chunk_rows(cfg, engine) == 1:
                raise
            why, old = error_line(e), cfg.gen_chunk
        free()
        halve_chunk(cfg, engine)
        tqdm.write(
            f"backoff: the preflight's decode ran out of memory at gen_chunk {old} ({why}): gen_chunk "
            f"{cfg.gen_chunk} from here on"
        )


def chunk_rows(cfg, engine):
    """The rows a generate call holds at most: gen_chunk, or the engine's rows where fewer (the engine is
    reserved for the run's widest call: preflight.make_engine)."""
    return min(cfg.gen_chunk, engine.rows) if engine is not None and not engine.off else cfg.gen_chunk


def halve_chunk(cfg, engine):
    """gen_chunk halved (from the rows a call holds) and the engine resized to it, its old buffers freed."""
    cfg.gen_chunk = chunk_rows(cfg, engine) // 2
    if engine is not None and not engine.off and cfg.gen_chunk < engine.rows:
        engine.resize(cfg.gen_chunk)
    free()


def update(run, fn, *args):
    """fn(run, *args) (grpo.update), redone from its start at a halved micro_batch after an out-of-memory
    error before any optimizer step (the docstring); what fn returns. The engine is released first where
    the plan says so."""
    cfg, tried, release = run.cfg, [run.cfg.micro_batch], run.budget is not None and run.budget.plan.release
    if release and run.engine is not None:
        run.engine.release()  # reserved again by the next rollout
    while True:
        try:
            return fn(run, *args)
        except Exception as e:  # noqa: BLE001 (only memory is caught)
            if not out_of_memory(e):
                raise
            why = error_line(e)
        run.policy.opt.zero_grad(set_to_none=True)  # no partial sum carries over
        free()
        if run.policy.moved:  # an optimizer step began
            raise OutOfMemory(
                last_line(
                    run,
                    "update",
                    tried,
                    why,
                    "after an optimizer step began (the "
                    "weights moved: redone, it would train on these rollouts twice)",
                )
            )
        if cfg.micro_batch == 1:
            raise OutOfMemory(last_line(run, "update", tried, why))
        cfg.micro_batch = cfg.micro_batch // 2
        said(
            run,
            f"the update ran out of memory at micro_batch {tried[-1]} ({why}): micro_batch "
            f"{cfg.micro_batch} from here on; the update is redone from its start on the same rollouts",
        )
        tried.append(cfg.micro_batch)


def free():
    """What the failed call held back to the allocator: its tensors (the exception and its frames are gone
    by now; gc for their cycles), and on a GPU the cached blocks (accelerate's clear_device_cache)."""
    clear_device_cache(garbage_collection=True)


def said(run, line):
    """One back-off: its line (through tqdm: the step's bar stays whole), and the step's count."""
    tqdm.write(f"backoff: {line}")
    run.log.backoffs += 1


def last_line(run, phase, tried, why, when=""):
    """OutOfMemory's line: the phase, the sizes tried, the error, the estimate at the sizes reached, and
    what stands (RunLog.save_last: the last step logged saved where nothing has moved since)."""
    field = "micro_batch" if phase == "update" else "gen_chunk"
    other = "gen_chunk" if phase == "update" else "micro_batch"
    at = f"at {field} {tried[-1]}" if not when else when
    return (
        f"out of memory in the {phase} {at} ({field} tried: {', '.join(map(str, tried))}; {other} "
        f"{getattr(run.cfg, other)}; {why}); {estimate_line(run)}; {run.log.save_last()}"
    )


def estimate_line(run):
    """The step's estimate (training/memory/phases.py) at the run's sizes now, as words: the peak and its
    phase,
    the margin included on CUDA, beside the card setup sized the step to (Run.budget)."""
    cfg, dev = run.cfg, run.policy.device.type
    try:
        mc, n = phases.model_config(cfg.model), len(run.task.eval_records)
        release = run.budget is not None and run.budget.plan.release
        est = phases.estimate(cfg, mc, dev, run.task.widest_prompt, n_eval=n, release=release)
        phase, top = phases.peak(est)
        top += sum(budget.margin(cfg, mc, run.task.widest_prompt, n).values()) if dev == "cuda" else 0
    except Exception as e:  # noqa: BLE001 (words for a last line)
        return f"no estimate ({error_line(e)})"
    card = (
        f" for {run.budget.total / budget.GB:.1f} GB ({run.budget.source})"
        if run.budget
        else f" on the {dev}"
    )
    return (
        f"the estimate at these sizes: {top / budget.GB:.2f} GB at its peak ({phase}"
        f"{', margin included' if dev == 'cuda' else ''}){card}"
    )
