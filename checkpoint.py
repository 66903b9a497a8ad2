"""Checkpoints that resume a GRPO run exactly: weights, optimizer, scheduler, RNG states, step and config.

grpo.py saves one to <out_dir>/ckpt every --save-every steps, at the end, on Ctrl-C and before stopping on
repeated NaN steps. `python grpo.py --resume <out_dir>` continues from it: on the CPU with the same seed the
next step's metrics equal those of an uninterrupted run (tests/test_grpo.py checks it). The data order is a
function of (seed, step), so only the RNG states and the step need saving for the batches to line up.
Writes are atomic: a crash while saving leaves the previous checkpoint in place.
"""
import dataclasses
import json
import random
import shutil
import sys
from pathlib import Path

import torch


def save_checkpoint(path, model, tok, opt, sched, step, cfg, bad_steps):
    tmp = Path(str(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step, "rng": rng,
                "config": dataclasses.asdict(cfg), "bad_steps": bad_steps}, tmp / "trainer_state.pt")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)                                                      # atomic: never a half-written ckpt


def load_checkpoint(path, opt, sched):
    state = torch.load(Path(path) / "trainer_state.pt", weights_only=False)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"], state["bad_steps"]


def check_out_dir(out, resume, overwrite):
    """A new run never silently replaces an old one (placeholder; see the reliability branch)."""
    out = Path(out)
    if not resume and ((out / "metrics.jsonl").exists() or (out / "ckpt").exists()):
        if not overwrite:
            raise ValueError(f"{out} already holds a run: continue it with --resume {out}, or pass --overwrite")
        shutil.rmtree(out)


def open_metrics(out, resume_step):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.jsonl"
    if resume_step is not None and path.exists():
        keep = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= resume_step]
        path.write_text("".join(keep))
    return open(path, "a" if resume_step is not None else "w")


def write_metrics(fh, record):
    fh.write(json.dumps(record) + "\n")
    fh.flush()


def saved_config(ckpt):
    return torch.load(Path(ckpt) / "trainer_state.pt", weights_only=False)["config"]


def find_checkpoint(resume):
    """--resume accepts a run directory or its ckpt/ folder."""
    for ckpt in (Path(resume) / "ckpt", Path(resume)):
        if (ckpt / "trainer_state.pt").exists():
            return ckpt
    raise ValueError(f"--resume {resume}: no checkpoint there (expected {Path(resume) / 'ckpt'}/trainer_state.pt)")
