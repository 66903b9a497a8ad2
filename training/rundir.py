"""The run directory's lock: one run writes into an out_dir at a time, and the error a bad one gives.

    lock_out_dir(out)      an exclusive fcntl.flock on <out>/.lock for this process (training/checkpoint.py's
                           check_out_dir takes it at setup); RunError naming the PID of a run that holds it
    check_unlocked(out)    RunError when another run holds it; creates nothing
    held(out)              this process's open lock file: closing it (RunLog.finish) lets the directory go

The lock lasts while its file is open, so a killed run leaves no stale lock. A file system without flock (some
network mounts) gets one warning line and runs unlocked.

Run the tests: python -m pytest -q tests/test_hardening.py -k lock
"""
import fcntl
import os
from pathlib import Path

LOCK = ".lock"   # in out_dir; holds the PID of the run that has it locked
_held = {}       # resolved out_dir -> this process's lock file (the flock lasts while it is open)


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
    except OSError as e:         # a file system without flock (some network mounts): warn, run unlocked
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
    return RunError(f"{out} is in use by another run (PID {pid} holds {out / LOCK}): wait for it to end or "
                    f"choose another --out-dir")


def check_unlocked(out):
    """RunError when another run holds out_dir's lock (taken here and let go at once); creates nothing."""
    lock = Path(out) / LOCK
    if held(out) is not None or not lock.is_file():
        return
    with open(lock) as f:                                                  # closing it lets the lock go
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use(out, f) from None
        except OSError:          # a file system without flock: lock_out_dir warns
            pass


def unlock_out_dir(out):
    f = _held.pop(Path(out).resolve(), None)
    if f is not None:
        f.close()                # closing the file releases the lock
