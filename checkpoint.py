"""Run data that is never lost: checkpoints that resume a GRPO run exactly, and a metrics log that never
duplicates or drops a step.

A checkpoint holds weights, tokenizer, optimizer, scheduler, RNG states, step and config. grpo.py saves one to
<out_dir>/ckpt every --save-every steps, at the end, on Ctrl-C / SIGTERM and before stopping on repeated NaN
steps. `python grpo.py --resume <out_dir>` continues from it: on the CPU with the same seed the next step's
metrics equal those of an uninterrupted run (tests/test_grpo.py). The data order is a function of (seed,
step), so only the RNG states and the step need saving for the batches to line up.

The save, and why a kill at any point of it leaves a checkpoint that --resume loads:
  1. write everything to ckpt.tmp/, then the marker file COMPLETE last (a directory without it is partial);
  2. rename ckpt/ -> ckpt.old/;   3. rename ckpt.tmp/ -> ckpt/;   4. delete ckpt.old/.
find_checkpoint takes the first complete one of ckpt/, ckpt.tmp/ (killed between 2 and 3), ckpt.old/. A
directory is deleted marker first (`discard`), so a half-deleted one is never taken for complete, and a save
first finishes one that was killed between 2 and 3 (step 0), so the newest checkpoint is never the one lost.
tests/test_reliability.py kills the save at each point and loads what is left.

metrics.jsonl gets one line per step, flushed and fsynced (write_metrics). On --resume it is first cut back
to the checkpoint's step, one line per step (atomically: a temp file, then os.replace), so a step redone
after a kill appears once and no step before it is lost. A new run refuses an out_dir that already holds a
run unless --overwrite is given (check_out_dir).

What grpo.py calls, in order:
  ckpt = find_checkpoint(cfg.resume) if cfg.resume else None     # RunError: no complete checkpoint there
  check_out_dir(out, resume=ckpt is not None, overwrite=cfg.overwrite)
  step, bad = load_checkpoint(ckpt, opt, sched) if ckpt else (0, 0)
  metrics = open_metrics(out, step if ckpt else None); write_metrics(metrics, m) each step
  save_checkpoint(out / "ckpt", model, tok, opt, sched, step, cfg, bad)
Every error about the user's files is a RunError (a ValueError) whose message names the file or directory.
"""
import dataclasses
import json
import os
import random
import shutil
from pathlib import Path

import torch

MARK = "COMPLETE"   # written last into a checkpoint directory: without it the directory is partial


class RunError(ValueError):
    """A run directory or checkpoint the user pointed at that cannot be used; the message names it."""


def discard(d):
    """Delete a checkpoint directory, its marker first: a kill half-way leaves a partial one, never a
    "complete" one with files missing."""
    Path(d, MARK).unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)


def save_checkpoint(path, model, tok, opt, sched, step, cfg, bad_steps):
    """Weights, tokenizer, optimizer, scheduler, RNG, step, config into `path` (ckpt/), atomically (above)."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if complete(tmp) and not complete(path):                             # 0. a save killed between 2 and 3:
        discard(path)                                                    #    finish it, so that ckpt.tmp (the
        tmp.rename(path)                                                 #    newest, maybe resumed) is kept
    discard(tmp)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step, "rng": rng,
                "config": dataclasses.asdict(cfg), "bad_steps": bad_steps}, tmp / "trainer_state.pt")
    (tmp / MARK).write_text(str(step))                                  # 1. complete
    if complete(path):
        discard(old)
        path.rename(old)                                                 # 2. keep the previous one ...
    discard(path)                                                        # (a partial ckpt/ is garbage)
    tmp.rename(path)                                                     # 3. ... until the new one is in
    discard(old)                                                         # 4.


def complete(d):
    return (Path(d) / MARK).is_file() and (Path(d) / "trainer_state.pt").is_file()


def find_checkpoint(resume):
    """--resume takes a run directory or its ckpt/ folder: the first complete of ckpt, ckpt.tmp, ckpt.old."""
    base = Path(resume)
    roots = [base / "ckpt", base] if base.name != "ckpt" else [base]
    for root in roots:
        for d in (root, root.with_name(root.name + ".tmp"), root.with_name(root.name + ".old")):
            if complete(d):
                return d
    raise RunError(f"--resume {resume}: no complete checkpoint there (expected {base / 'ckpt'}/{MARK})")


STATE_KEYS = ("optimizer", "scheduler", "step", "rng", "config", "bad_steps")


def read_state(ckpt):
    f = Path(ckpt) / "trainer_state.pt"
    try:
        state = torch.load(f, weights_only=False)
    except Exception as e:       # missing, truncated, corrupted, not a torch file
        raise RunError(f"{f}: cannot be read ({type(e).__name__}: {str(e)[:200]})") from None
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise RunError(f"{f}: not a grpo.py trainer state (missing {', '.join(missing)})")
    return state


def saved_config(ckpt):
    return read_state(ckpt)["config"]


def load_checkpoint(path, opt, sched):
    """Restore optimizer, scheduler and RNG states from a checkpoint directory; returns (step, bad_steps)."""
    state = read_state(path)
    try:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:   # another model's or optimizer's state
        raise RunError(f"{Path(path) / 'trainer_state.pt'}: does not fit this run's model / optimizer "
                       f"({type(e).__name__}: {str(e)[:200]})") from None
    return state["step"], state["bad_steps"]


# ----------------------------------------------------------------------------- the run directory and metrics
def check_out_dir(out, resume, overwrite):
    """A new run never silently replaces an old one: an out_dir holding metrics or a checkpoint needs
    --resume (continue it) or --overwrite (delete it first). RunError naming both flags otherwise."""
    out = Path(out)
    held = [p for p in ("metrics.jsonl", "ckpt", "ckpt.tmp", "ckpt.old") if (out / p).exists()]
    if resume or not held:
        return
    if not overwrite:
        raise RunError(f"{out} already holds a run ({', '.join(held)}): continue it with --resume {out}, "
                       f"or start afresh with --overwrite")
    for p in held + ["rollouts", "curves.png"]:
        discard(out / p) if (out / p).is_dir() else (out / p).unlink(missing_ok=True)


def open_metrics(out, resume_step):
    """metrics.jsonl opened for appending. Resuming at step k: first cut it back to the lines of steps <= k,
    the last line of each step (a duplicate from an older run is dropped), written to a temp file, fsynced,
    then os.replace'd over the old one, so a kill during the cut loses nothing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.jsonl"
    if resume_step is not None and path.exists():
        keep = {}
        for line in path.read_text(errors="replace").splitlines():
            try:
                step = json.loads(line)["step"]
                if step <= resume_step:
                    keep[step] = line + "\n"               # the last line of each step
            except (ValueError, KeyError, TypeError):    # a line cut by the kill: dropped
                pass
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.write("".join(keep[s] for s in sorted(keep)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return open(path, "a")                               # check_out_dir made sure a new run starts empty


def write_atomic(path, text):
    """A small file written whole or not at all (a temp file, fsync, os.replace): learn.py's results."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_metrics(fh, record):
    """One JSON line, on disk before the next step starts."""
    fh.write(json.dumps(record) + "\n")
    fh.flush()
    os.fsync(fh.fileno())
