"""The run directory: its lock (one run writes into an out_dir at a time), the paths a run writes there and
the error a bad one gives, and its metrics file opened (cut back to the checkpoint's step on --resume).

    lock_out_dir(out)      an exclusive fcntl.flock on <out>/.lock for this process
    (training/run/checkpoint.py's
                           check_out_dir takes it at setup); RunError naming the PID of a run that holds it
    check_unlocked(out)    RunError when another run holds it; creates nothing
    held(out)              this process's open lock file: closing it (RunLog.finish) lets the directory go
    dir_problem, kind_problem, link_problem, file_problem    why a path cannot be used, as one sentence
    open_metrics(out, resume_step)     metrics.jsonl, cut back to the checkpoint's step on --resume
    write_atomic(path, text)           a small file written whole or not at all (learn.py's results)

The lock lasts while its file is open, so a killed run leaves no stale lock. A file system without flock (some
network mounts) gets one warning line and runs unlocked.

Run the tests: python -m pytest -q tests/run/test_directory.py -k lock
"""

import errno
import fcntl
import json
import os
from pathlib import Path

LOCK = ".lock"  # in out_dir; holds the PID of the run that has it locked
_held = {}  # resolved out_dir -> this process's lock file (the flock lasts while it is open)


class RunError(ValueError):
    """A run directory or checkpoint the user pointed at that cannot be used; the message names it."""


def held(out):
    """This process's open lock file of out_dir, or None."""
    f = _held.get(Path(out).resolve())
    return f if f is not None and not f.closed else None


def lock_out_dir(out):
    """An exclusive lock on out_dir for the life of this process's run, so two runs never write into one
    directory; RunError naming the PID that holds it. Taking it again in the same process is a no-op."""
    out = Path(out)
    if held(out) is not None:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / LOCK, "a+")
    except OSError as e:
        raise RunError(f"{out}: cannot be the run directory ({e.strerror})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise in_use(out, f) from None
    except OSError as e:  # a file system without flock (some network mounts): warn, run unlocked
        print(f"warning: {out / LOCK}: cannot lock ({e.strerror}); a second run into {out} is not stopped")
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    _held[out.resolve()] = f


def in_use(out, f):
    """The RunError of an out_dir whose lock another run holds (f: its lock file, open; closed here)."""
    f.seek(0)
    pid = f.read().strip() or "unknown"
    f.close()
    return RunError(
        f"{out} is in use by another run (PID {pid} holds {out / LOCK}): wait for it to end or "
        f"choose another --out-dir"
    )


def check_unlocked(out):
    """RunError when another run holds out_dir's lock (taken here and let go at once); creates nothing."""
    lock = Path(out) / LOCK
    if held(out) is not None or not lock.is_file():
        return
    with open(lock) as f:  # closing it lets the lock go
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use(out, f) from None
        except OSError:  # a file system without flock: lock_out_dir warns
            pass


def unlock_out_dir(out):
    f = _held.pop(Path(out).resolve(), None)
    if f is not None:
        f.close()  # closing the file releases the lock


# ----------------------------------------------------------------------------- the paths a run writes


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


def link_problem(path):
    """A symlink loop or a dangling symlink on the way to `path` (it or a parent): one sentence, or None."""
    for p in (Path(path), *Path(path).parents):
        if p.is_symlink() and not p.exists():
            try:
                os.stat(p)
                continue  # created meanwhile: fine
            except OSError as e:
                why = (
                    "a symlink loop"
                    if e.errno == errno.ELOOP
                    else f"a symlink to {os.readlink(p)}, which does not exist"
                )
            return f"{path}: {why}" if p == Path(path) else f"{path}: {p} is {why}"
    return None


def file_problem(path):
    """Why `path` is not a file to read, as one sentence naming it, or None."""
    p = Path(path)
    return (
        None
        if p.is_file()
        else link_problem(p) or f"{path}: " + ("a directory, not a file" if p.is_dir() else "no such file")
    )


# What a run writes in its out_dir, and of which kind: a path of the other kind there (a directory named
# curves.png, a file named ckpt) would stop the run when it first writes, after the model loaded, or mid-run.
WRITES = {
    "metrics.jsonl": "file",
    "curves.png": "file",
    ".lock": "file",
    "rollouts": "directory",
    "ckpt": "directory",
    "ckpt.tmp": "directory",
    "ckpt.old": "directory",
}


def dir_problem(out, writes=None):
    """Why `out` cannot become a directory to write into, as one sentence, or None (checked up front): a
    broken symlink on the way, a file, no write permission; with `writes` ({name: "file" | "directory"}, a
    run's WRITES), also the first of those paths in `out` that holds the other kind of thing or is a broken
    symlink. --overwrite deletes only what a run wrote, so it is no way out of that: the user moves it."""
    if link_problem(out):
        return link_problem(out)
    path = Path(out).absolute()
    there = next(p for p in (path, *path.parents) if p.exists())  # the part that exists already
    if not there.is_dir():
        return (f"{out} is a file" if there == path else f"{out}: {there} is a file") + ", not a directory"
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{out}: {there} is not writable"
    for name, kind in (writes or {}).items():
        p = Path(out) / name
        what = link_problem(p) or (
            p.exists()
            and p.is_dir() != (kind == "directory")
            and f"{p}: a {'directory' if p.is_dir() else 'file'}"
        )
        if what:
            return f"{what}, where the run writes a {kind}: move it away or choose another --out-dir"
    return None


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
                    keep[step] = line + "\n"  # the last line of each step
            except (ValueError, KeyError, TypeError):  # a line cut by the kill: dropped
                pass
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.write("".join(keep[s] for s in sorted(keep)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return open(path, "a")  # check_out_dir made sure a new run starts empty
