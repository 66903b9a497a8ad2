"""Checkpoints, written and read: the save (atomic: a kill at any point of it leaves one that --resume loads),
the checkpoint --resume continues from, the config it was run with, and the check that a run directory can
take a new run (check_out_dir; the directory itself, its lock and its files: training/run/directory.py).

The save (save_checkpoint; RunLog.save calls it when a save is due), and why a kill at any point of it leaves
a checkpoint that --resume loads: 1. all is written to ckpt.tmp/, the marker COMPLETE last; 2. ckpt/ ->
ckpt.old/; 3. ckpt.tmp/ -> ckpt/; 4. ckpt.old/ is deleted (or kept as ckpt-<step>/, the K - 1 newest of
--keep-checkpoints K). A directory is deleted marker first (`discard`), and a save first finishes one killed
between 2 and 3. A full disk is one line with the space needed, and the last complete checkpoint stands.

`python grpo.py --resume <out_dir>` continues from <out_dir>/ckpt in <out_dir> itself (the out_dir saved in
run_config.json is a record of where the run began, not a destination: a moved run continues where it is).
On the CPU with the same seed the next step's metrics equal those of an uninterrupted run
(tests/test_grpo_runs.py). The data order is a function of (seed, step), so only the RNG states and the step
need saving for the batches to line up. A checkpoint saved with --no-save-optimizer resumes with the optimizer
restarted (zero moments; lr, schedule, RNG, step kept), and the resume says so in one line. find_checkpoint
takes the first complete one of ckpt/, ckpt.tmp/ (killed between renames), ckpt.old/. On --resume
metrics.jsonl is first cut back to the checkpoint's step, one line per step (atomically: a temp file, then
os.replace), so a step redone after a kill appears once and no step before it is lost. A new run refuses an
out_dir that already holds a run unless --overwrite is given (check_out_dir), and an out_dir another run is
writing to (its lock names the PID).

Untrusted files. trainer_state.pt is read with torch.load(weights_only=True): tensors and plain types only, so
a crafted file cannot run code (a pickle of anything else is refused, naming the file); its fields are type-
checked. It is read onto the CPU (map_location, mmap), whatever device saved it: the optimizer's tensors
reach the GPU only through load_state_dict. The run's flags are also kept in run_config.json, so parse_args
reads them before CUDA starts without touching the tensors, and checks each value as a flag given on the
command line (flags.read_config). A --resume that changes a flag that changes the run's meaning is refused
(check_resume_config). check_disk finds at setup a disk too small for the run's checkpoints.

What grpo.py calls, in order:
  check_resume_config(saved_config(find_checkpoint(resume)), flags)   # parse_args: a --resume's new flags
  ckpt = find_checkpoint(cfg.resume) if cfg.resume else None     # RunError: no complete checkpoint there
  check_out_dir(out, resume=ckpt is not None, overwrite=cfg.overwrite, claim=False)   # creates nothing
  ... the model loads, then the same with claim=True: out_dir created and locked (directory.lock_out_dir)
  step, bad = load_checkpoint(ckpt, opt, sched) if ckpt else (0, 0)
  metrics = directory.open_metrics(out, step if ckpt else None)     # then log.RunLog writes each step
Every error about the user's files is a RunError (a ValueError) whose message names the file or directory.
"""

import contextlib
import dataclasses
import errno
import json
import pickle
import random
import shutil
from pathlib import Path

import torch

from training.model.pretrained import quiet_bars
from training.model.trainable import STATE_BYTES, WEIGHT_BYTES
from training.run.directory import RunError, link_problem

MARK = "COMPLETE"  # written last into a checkpoint directory: without it the directory is partial
RUN_CONFIG = "run_config.json"  # the run's flags, beside the tensors (config.json is the model's)


# ----------------------------------------------------------------------------- a checkpoint, written
def rng_state():
    """The RNGs a checkpoint restores: Python's, torch's, and CUDA's where it is available."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),  # tuples of ints, tensors
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def save_checkpoint(path, model, tok, opt, sched, step, cfg, bad_steps, keep=1, rng=None):
    """Weights, tokenizer, optimizer (its moments only if cfg.save_optimizer), scheduler, RNG (rng_state(),
    or `rng`), step, config into `path` (ckpt/), atomically (above). keep > 1: the previous checkpoint stays
    as ckpt-<its step>/, and the keep - 1 newest of those are kept."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if complete(tmp) and not complete(path):  # 0. a save killed between 2 and 3:
        discard(path)  #    finish it, so that ckpt.tmp (the
        tmp.rename(path)  #    newest, maybe resumed) is kept
    discard(tmp)
    try:
        with quiet_bars():
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        rng = rng or rng_state()
        optim = opt.state_dict() if cfg.save_optimizer else {**opt.state_dict(), "state": {}}  # lr, betas
        torch.save(
            {
                "optimizer": optim,
                "scheduler": sched.state_dict(),
                "step": step,
                "rng": rng,
                "config": dataclasses.asdict(cfg),
                "bad_steps": bad_steps,
            },
            tmp / "trainer_state.pt",
        )
        (tmp / RUN_CONFIG).write_text(json.dumps(dataclasses.asdict(cfg), indent=1))  # parse_args reads it
        (tmp / MARK).write_text(str(step))  # 1. complete
    except Exception as e:
        if not no_space(e):
            raise
        discard(tmp)  # the partial copy goes; ckpt/ stays
        raise RunError(
            f"{path}: no space left on the device to save the checkpoint of step {step} (it needs "
            f"about {gb(state_bytes(model, opt, cfg.save_optimizer))}, "
            f"{gb(shutil.disk_usage(path.parent).free)} are "
            f"free); the last complete checkpoint is kept"
        ) from None
    if complete(path):
        discard(old)
        path.rename(old)  # 2. keep the previous one ...
    discard(path)  # (a partial ckpt/ is garbage)
    tmp.rename(path)  # 3. ... until the new one is in
    if keep > 1 and complete(old):  # 4. the old one kept, or deleted
        old.rename(path.with_name(f"{path.name}-{int((old / MARK).read_text()):05d}"))
        for d in sorted(path.parent.glob(f"{path.name}-*"))[: -(keep - 1)]:
            discard(d)
    discard(old)


def state_bytes(model, opt, with_optimizer=True):
    """About the bytes of a checkpoint: the weights and the optimizer's tensors (the tokenizer is small)."""
    moments = [v for st in opt.state.values() for v in st.values()] if with_optimizer else []
    ts = [*model.state_dict().values(), *moments]
    return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))


def complete(d):
    return (Path(d) / MARK).is_file() and (Path(d) / "trainer_state.pt").is_file()


def discard(d):
    """Delete a checkpoint directory, its marker first: a kill half-way leaves a partial one, never a
    "complete" one with files missing."""
    Path(d, MARK).unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)


# torch.save's zip writer reports a failed write as a RuntimeError without errno: into /dev/full, torch 2.13
# raises "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" ("basic_ios::clear:
# iostream error" for a small file); older versions "PytorchStreamWriter failed writing file".
ZIP_WRITER = ("inline_container.cc", "unexpected pos", "basic_ios::clear", "PytorchStreamWriter failed")


def no_space(e):
    """A full disk or quota: OSError ENOSPC / EDQUOT, safetensors' own error (os error 28), or torch.save's
    zip writer failing to write (ZIP_WRITER)."""
    return (
        isinstance(e, OSError)
        and e.errno in (errno.ENOSPC, errno.EDQUOT)
        or "No space left on device" in str(e)
        or "os error 28" in str(e)
        or isinstance(e, RuntimeError)
        and any(m in str(e) for m in ZIP_WRITER)
    )


@contextlib.contextmanager
def full_disk(path, what):
    """A full disk inside the block is a RunError naming the file and what was being written (grpo.py prints
    it as one line); every other error passes."""
    try:
        yield
    except Exception as e:
        if not no_space(e):
            raise
        raise RunError(f"{path}: no space left on the device to write {what}") from None


def gb(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- its size, and reading it back
def checkpoint_bytes(n_params, scheme, with_optimizer=True):
    """About the bytes of one checkpoint of n_params trained parameters under `scheme` (memory.py counts
    the same optimizer state resident): Qwen3-4B under kahan, 4.02e9 x (2 + 6) = 32 GB; under lora the
    adapters' alone (rank 16: 33M x 12 = 0.4 GB); without the optimizer's state (--no-save-optimizer) the
    weights alone."""
    return n_params * (WEIGHT_BYTES[scheme] + (STATE_BYTES[scheme] if with_optimizer else 0))


def find_checkpoint(resume):
    """--resume takes a run directory or its ckpt/ folder: the first complete of ckpt, ckpt.tmp, ckpt.old."""
    base = Path(resume)
    problem = link_problem(base) or (f"{resume}: a file, not a run directory" if base.is_file() else None)
    if problem:
        raise RunError(f"--resume {problem}")
    roots = [base / "ckpt", base] if base.name != "ckpt" else [base]
    for root in roots:
        for d in (root, root.with_name(root.name + ".tmp"), root.with_name(root.name + ".old")):
            if complete(d):
                if problem := safetensors_problem(d):  # a cut or corrupted weights file
                    older = sorted(d.parent.glob("ckpt-*"))
                    raise RunError(
                        f"--resume {resume}: {problem}: the checkpoint is damaged"
                        + (f"; an older one: --resume {older[-1]}" if older and complete(older[-1]) else "")
                    )
                return d
    raise RunError(f"--resume {resume}: no complete checkpoint there (expected {base / 'ckpt'}/{MARK})")


def safetensors_problem(d):
    """Why a *.safetensors file of directory `d` (weights, LoRA adapters) cannot be loaded, as one sentence
    naming it, or None: its size is not what its header promises (cut short by a kill or a full disk, or
    grown), or the header is not JSON. Read from the header alone, before any model loads."""
    for f in sorted(Path(d).glob("*.safetensors")):
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 8 + n <= size else None
            end = (
                8
                + n
                + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            )
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return f"{f}: cut short or corrupted (its header does not read)"
        if end != size:
            return f"{f}: cut short or corrupted ({size:,} bytes; its header promises {end:,})"
    return None


STATE = {
    "optimizer": dict,
    "scheduler": dict,
    "step": int,
    "rng": dict,
    "config": dict,  # key -> its type
    "bad_steps": int,
}


def read_state(ckpt):
    """trainer_state.pt, safely: weights_only=True unpickles tensors and plain types only, never code."""
    f = Path(ckpt) / "trainer_state.pt"
    try:
        state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)  # never onto a GPU
    except pickle.UnpicklingError:  # a pickle of other objects (a crafted file, another program's state)
        raise RunError(
            f"{f}: not a grpo.py trainer state (it holds objects other than tensors and plain "
            f"types; not loaded)"
        ) from None
    except Exception as e:  # missing, truncated, corrupted, not a torch file
        raise RunError(f"{f}: cannot be read ({type(e).__name__}: {str(e)[:200]})") from None
    missing = [k for k in STATE if not isinstance(state, dict) or k not in state]
    if missing:
        raise RunError(f"{f}: not a grpo.py trainer state (missing {', '.join(missing)})")
    wrong = [k for k, t in STATE.items() if not isinstance(state[k], t) or isinstance(state[k], bool)]
    if not wrong:  # the values: counters >= 0, the three RNG states
        wrong = [k for k in ("step", "bad_steps") if state[k] < 0]
        wrong += [] if {"python", "torch", "cuda"} <= state["rng"].keys() else ["rng"]
    if wrong:
        raise RunError(f"{f}: not a grpo.py trainer state (a wrong {', '.join(wrong)})")
    return state


def saved_config(ckpt):
    """The saved run's flags from run_config.json, without reading the tensors (grpo.parse_args runs before
    CUDA is set up); a checkpoint written before that file existed: from trainer_state.pt, on the CPU."""
    f = Path(ckpt) / RUN_CONFIG
    if not f.is_file():
        return read_state(ckpt)["config"]
    try:
        config = json.loads(f.read_text())
    except (OSError, ValueError) as e:  # unreadable, cut short, not JSON
        raise RunError(f"{f}: cannot be read ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(config, dict):
        raise RunError(f"{f}: not a grpo.py run config (a JSON object of flags)")
    return config


def load_checkpoint(path, opt, sched):
    """Restore optimizer, scheduler and RNG states from a checkpoint directory; returns (step, bad_steps).
    A checkpoint saved without the optimizer's moments (--no-save-optimizer) restores its hyperparameters
    and says in one line that the optimizer restarts: the continued run is not the uninterrupted one."""
    state = read_state(path)
    if not state["config"].get("save_optimizer", True):
        print(
            f"resume: {path} was saved without the optimizer's state (--no-save-optimizer): AdamW restarts "
            f"from zero moments; weights, schedule, RNG and step continue"
        )
    try:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:  # another model's state
        raise RunError(
            f"{Path(path) / 'trainer_state.pt'}: does not fit this run's model / optimizer "
            f"({type(e).__name__}: {str(e)[:200]})"
        ) from None
    return state["step"], state["bad_steps"]


# Flags a --resume may change: how long the run goes, where and how often it writes, and how the same
# computation is split or placed (micro-batches, chunks, recomputation, prefix cache, device), never what is
# computed. Every other flag (model, dataset, data_path, prompt_style, credit, shaping, top_frac, gamma,
# layers, seed, group_size, prompts_per_step, lr, clips, beta, filters, optimizer, ...) changes what the run
# samples or optimises, so the continued run would be another experiment under the old one's name: refused
# unless --allow-config-change. A flag added later is a meaning flag until it is listed here.
BOOKKEEPING = {
    "steps",
    "out_dir",
    "overwrite",
    "resume",
    "save_every",
    "rollouts_every",
    "max_bad_steps",
    "device",
    "micro_batch",
    "gen_chunk",
    "logprob_chunk",
    "grad_checkpointing",
    "oar_chunk",
    "oar_prefix_cache",
    "allow_config_change",
    "save_optimizer",
    "keep_checkpoints",
    "report_to",
    "eval_every",
    "eval_dataset",
    "eval_size",
    "eval_data_path",
    "config",
    "gpu_gb",
    "stop_grace",
    "precision_resolved",
}


def check_resume_config(saved, given):
    """RunError listing the flags given with --resume whose values differ from the saved run's and change its
    meaning (not in BOOKKEEPING), unless --allow-config-change is among them."""
    changed = [
        f"--{k.replace('_', '-')} {saved.get(k)!r} -> {v!r}"
        for k, v in given.items()
        if k not in BOOKKEEPING and saved.get(k) != v
    ]
    if changed and not given.get("allow_config_change"):
        raise RunError(
            f"--resume {given['resume']}: these flags change the run's meaning: "
            f"{'; '.join(changed)}. Leave them out to continue the run, or pass "
            f"--allow-config-change"
        )


# ----------------------------------------------------------------------------- the run directory


def run_dir(ckpt):
    """The run directory of a checkpoint find_checkpoint found: the one that holds ckpt/ (ckpt.tmp/ and
    ckpt.old/ beside it), where --resume continues the run (the out_dir in run_config.json is where it
    began: a moved run continues where it is now)."""
    return Path(ckpt).parent
