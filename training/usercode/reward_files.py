"""A --reward file is part of the experiment: where it is and what it holds, recorded, checked on --resume.

  fingerprint   each file as given, its resolved path and the SHA-256 of its contents, recorded as the run's
                --reward-files (run_config.json, so `--config run_config.json` still reads): flags.parse
  changed       --resume refuses a reward file that moved or changed since it was recorded, in one line,
                unless --reward is given again on the command line (then the new hash is recorded)
  recorded_paths, as_recorded   a file the run recorded is read where it recorded it: a resume from another
                working directory (or with --reward given again by its absolute path) is the same reward
Only the file named is hashed, not the modules it imports (training/usercode/reward_code.py imports and calls
it).

Run the tests: python -m pytest -q tests/config/test_resume.py
"""

import hashlib
import json
from pathlib import Path

from training.usercode.reward_code import RewardError, sources


def fingerprint(spec):
    """JSON of [{"file": as given, "path": resolved, "sha256": its contents' hash}] for each file of a
    --reward value (each spelling once), what --reward-files records; RewardError naming a file that cannot
    be read."""
    out = {}
    for s in sources(spec):
        path = Path(s.file).expanduser().resolve()
        if not path.is_file():
            raise RewardError(
                f"--reward {s.file}: "
                + ("a directory, not a Python file" if path.is_dir() else "no such file")
            )
        try:
            out[s.file] = (str(path), hashlib.sha256(path.read_bytes()).hexdigest())
        except OSError as e:
            raise RewardError(f"--reward {s.file}: cannot be read ({e.strerror})") from None
    return json.dumps([{"file": f, "path": p, "sha256": h} for f, (p, h) in out.items()])


def recorded_paths(spec, recorded):
    """[(resolved path, function)] of a --reward value: a file the run recorded (--reward-files) where it
    recorded it, whatever the working directory now; another resolved from here. Two values with the same
    list name the same functions of the same files."""
    where = {e["file"]: e["path"] for e in json.loads(recorded or "[]") if "file" in e}
    return [
        (where.get(s.file) or str(Path(s.file).expanduser().resolve()), s.function) for s in sources(spec)
    ]


def changed(spec, recorded):
    """One sentence for the first reward file of `spec` that moved or changed since `recorded` (a
    --reward-files value), naming it; None when each is where it was, with the same contents."""
    before = {e["path"]: e["sha256"] for e in json.loads(recorded or "[]")}
    for s, (path, _) in zip(sources(spec), recorded_paths(spec, recorded)):
        if path not in before:
            return (
                f"the reward file {s.file} resolves to {path}, not to the file the run recorded "
                f"({', '.join(before) or 'none'}): it moved"
            )
        if not Path(path).is_file():
            return f"the reward file {path} is gone (moved or deleted)"
        if hashlib.sha256(Path(path).read_bytes()).hexdigest() != before[path]:
            return f"the reward file {path} changed since the run recorded it (its SHA-256 differs)"
    return None


def as_recorded(spec, recorded):
    """The --reward value with each file the run recorded written as its recorded absolute path: what a
    --resume loads, from any working directory."""
    return ",".join(f"{p}:{f}" for p, f in recorded_paths(spec, recorded))
