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
find_checkpoint takes the first complete one of ckpt/, ckpt.tmp/ (killed after 2), ckpt.old/ (killed during
3). tests/test_reliability.py kills the save at each point.

metrics.jsonl gets one line per step, flushed and fsynced. On --resume it is first cut back to the
checkpoint's step (atomically: a temp file, then os.replace), so a step redone after a kill appears once.
A new run refuses an out_dir that already holds a run unless --overwrite is given.
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


def save_checkpoint(path, model, tok, opt, sched, step, cfg, bad_steps):
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step, "rng": rng,
                "config": dataclasses.asdict(cfg), "bad_steps": bad_steps}, tmp / "trainer_state.pt")
    (tmp / MARK).write_text(str(step))                                  # 1. complete
    if complete(path):
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)                                                 # 2. keep the previous one ...
    shutil.rmtree(path, ignore_errors=True)                              # (a partial ckpt/ is garbage)
    tmp.rename(path)                                                     # 3. ... until the new one is in place
    shutil.rmtree(old, ignore_errors=True)                               # 4.


def complete(d):
    return (Path(d) / MARK).is_file() and (Path(d) / "trainer_state.pt").is_file()


def find_checkpoint(resume):
    """--resume accepts a run directory or its ckpt/ folder; the first complete of ckpt, ckpt.tmp, ckpt.old."""
    base = Path(resume)
    roots = [base / "ckpt", base] if base.name != "ckpt" else [base]
    for root in roots:
        for d in (root, root.with_name(root.name + ".tmp"), root.with_name(root.name + ".old")):
            if complete(d):
                return d
    raise RunError(f"--resume {resume}: no complete checkpoint there (expected {base / 'ckpt'}/{MARK})")


def read_state(ckpt):
    f = Path(ckpt) / "trainer_state.pt"
    try:
        return torch.load(f, weights_only=False)
    except Exception as e:       # truncated, corrupted, not a torch file
        raise RunError(f"{f}: cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def saved_config(ckpt):
    return read_state(ckpt)["config"]


def load_checkpoint(path, opt, sched):
    state = read_state(path)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"], state["bad_steps"]


# ----------------------------------------------------------------------------- the run directory and metrics
def check_out_dir(out, resume, overwrite):
    """A new run never silently replaces an old one: an out_dir holding metrics or a checkpoint needs
    --resume (continue it) or --overwrite (delete it first)."""
    out = Path(out)
    held = [p for p in ("metrics.jsonl", "ckpt", "ckpt.tmp", "ckpt.old") if (out / p).exists()]
    if resume or not held:
        return
    if not overwrite:
        raise RunError(f"{out} already holds a run ({', '.join(held)}): continue it with --resume {out}, "
                       f"or start afresh with --overwrite")
    for p in held + ["rollouts", "curves.png"]:
        shutil.rmtree(out / p, ignore_errors=True) if (out / p).is_dir() else (out / p).unlink(missing_ok=True)


def open_metrics(out, resume_step):
    """metrics.jsonl opened for appending. Resuming at step k: first cut it back to the lines of steps <= k."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.jsonl"
    if resume_step is not None and path.exists():
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= resume_step:
                    keep.append(line + "\n")
            except (ValueError, KeyError, TypeError):    # a line cut by the kill: dropped
                pass
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return open(path, "a" if resume_step is not None else "w")


def write_metrics(fh, record):
    """One JSON line, on disk before the next step starts."""
    fh.write(json.dumps(record) + "\n")
    fh.flush()
    os.fsync(fh.fileno())
