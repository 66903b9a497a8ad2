"""Rewards from your code: grpo.py --reward FILE.py:FUNCTION[,FILE.py:FUNCTION ...] [--reward-weights W,...].

A reward is a plain function of one completion and its dataset record:

    def reward(completion: str, record: dict) -> float

The record holds every column of the dataset row (tasks/custom.py; a built-in task's record: data.py). The
built-in tasks' reward is the same kind of function, data.reward, so a step has one reward path: grpo.py calls
`run.reward(completion, record)` for every rollout, and the held-out evaluation scores with it too. With
several functions the reward is their weighted sum, sum_k w_k f_k(completion, record) (TRL's reward_funcs
with reward_weights; default weights 1).

A reward file is code the run executes, and part of the experiment:
  fingerprint   each file's resolved path and the SHA-256 of its contents, recorded as the run's
                --reward-files (run_config.json, so `--config run_config.json` still reads): flags.parse
  changed       --resume refuses a reward file that moved or changed since it was recorded, in one line,
                unless --reward is given again on the command line (then the new hash is recorded)
  load          imports each file (printing its resolved path), finds the function, and calls it once on
                the first record and an empty completion: a raise or a value that is not a finite number
                stops the run at setup, before anything is written (RewardError, one line)
  Rewards       the weighted sum; later, a raise or a value that is not a finite number (NaN) is a
                RewardError naming the function and the row: grpo.py stops, and the last checkpoint stands
  check         the task flags' rules (--reward, --reward-weights, --dataset custom, --answer-pattern,
                --chat-template-kwargs, --eval-data-path): one sentence for the first that is wrong
Only the file named is hashed, not the modules it imports.

Run: python grpo.py --dataset custom --data-path docs/your-task/train.jsonl \\
         --reward docs/your-task/reward.py:exact_number --answer-pattern '(-?\\d+)\\D*$'   (docs/your-task.md)
"""
import hashlib
import importlib.util
import json
import math
import numbers
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple


@dataclass
class TaskConfig:
    """grpo.Config's flags for your own task (docs/your-task.md): the reward, the dataset's fields, the
    answer region of eq. 2, the chat template's options."""
    # your own task (training/rewards.py, tasks/custom.py; docs/your-task.md)
    question_field: str = ""           # the question's column ("": the task's, or guessed: tasks/custom.py)
    answer_field: str = ""             # the answer's column ("": the task's, or guessed: tasks/custom.py)
    chat_template_kwargs: str = ""     # JSON object for apply_chat_template, e.g. {"enable_thinking": false}
    reward: str = ""                   # FILE.py:FUNCTION[,...], (completion, record) -> float; "": the task's
    reward_weights: str = ""           # W,... one weight per --reward function, summed ("": 1 each)
    reward_files: str = ""             # set by the run: each --reward file's path and SHA-256 (rewards.py)
    answer_pattern: str = ""           # answer regex (eq. 2): last match, group 1; "": \boxed{} else <answer>
    eval_data_path: str = ""           # local JSONL/parquet of the held-out rows (needed by --dataset custom)


class RewardError(ValueError):
    """A --reward that cannot be used: a missing file or function, or one that raised or returned something
    other than a finite number. The message names the function (and the row, during the run)."""


class Source(NamedTuple):
    file: str                   # FILE as given in --reward
    function: str               # FUNCTION as given


def sources(spec):
    """The (file, function) pairs of a --reward value "a.py:f,b.py:g"; RewardError for an item without one."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        file, _, function = item.rpartition(":")
        if not file or not function.isidentifier():
            raise RewardError(f"--reward {item!r}: expected FILE.py:FUNCTION (e.g. reward.py:score)")
        out.append(Source(file, function))
    return out


def weights(cfg):
    """--reward-weights as floats, one per --reward function (all 1.0 when not given)."""
    n = len(sources(cfg.reward)) if cfg.reward else 0
    return [float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights else [1.0] * n


def fingerprint(spec):
    """JSON of [{"path": the file's resolved path, "sha256": its contents' hash}] for each file of a --reward
    value (each once), what --reward-files records; RewardError naming a file that cannot be read."""
    out = {}
    for s in sources(spec):
        path = Path(s.file).expanduser().resolve()
        if not path.is_file():
            raise RewardError(f"--reward {s.file}: " + ("a directory, not a Python file" if path.is_dir()
                                                        else "no such file"))
        try:
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as e:
            raise RewardError(f"--reward {s.file}: cannot be read ({e.strerror})") from None
    return json.dumps([{"path": p, "sha256": h} for p, h in out.items()])


def changed(spec, recorded):
    """One sentence for the first reward file of `spec` that moved or changed since `recorded` (a
    --reward-files value), naming it; None when each is where it was, with the same contents."""
    before = {e["path"]: e["sha256"] for e in json.loads(recorded or "[]")}
    for s in sources(spec):
        path = Path(s.file).expanduser().resolve()
        if str(path) not in before:
            return (f"the reward file {s.file} resolves to {path}, not to the file the run recorded "
                    f"({', '.join(before) or 'none'}): it moved")
        if not path.is_file():
            return f"the reward file {path} is gone (moved or deleted)"
        if hashlib.sha256(path.read_bytes()).hexdigest() != before[str(path)]:
            return f"the reward file {path} changed since the run recorded it (its SHA-256 differs)"
    return None


def import_function(s):
    """The function s.function of the file s.file, imported under a name of its own (its path printed)."""
    path = Path(s.file).expanduser().resolve()
    name = "reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise RewardError(f"--reward {s.file}: not a Python file (name it FILE.py)")
    module = importlib.util.module_from_spec(spec)
    print(f"reward: importing {path}")
    try:
        spec.loader.exec_module(module)
    except Exception as e:               # the user's code: a SyntaxError, an ImportError, anything it raises
        raise RewardError(f"--reward {s.file}: importing it raised {type(e).__name__}: "
                          f"{one_line(e)}") from None
    fn = getattr(module, s.function, None)
    if not callable(fn):
        have = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                      and getattr(v, "__module__", None) == name)
        raise RewardError(f"--reward {s.file}:{s.function}: " + ("not a function" if fn is not None else
                          f"no function {s.function!r} there (it defines: {', '.join(have) or 'none'})"))
    return fn


def one_line(e, n=200):
    return " ".join(str(e).split())[:n]


class Term(NamedTuple):
    name: str                   # "FILE.py:FUNCTION", as given
    fn: Callable                # (completion, record) -> float
    weight: float               # w_k of the weighted sum


class Rewards:
    """The weighted sum of the user's reward functions, called as data.reward is: (completion, record)."""

    def __init__(self, terms):
        self.terms = terms

    def __call__(self, completion, record):
        total = 0.0
        for t in self.terms:
            try:
                v = t.fn(completion, dict(record))          # a copy: the function cannot change the records
            except Exception as e:                          # the user's code
                raise RewardError(f"--reward {t.name} raised {type(e).__name__} ({one_line(e)}) on row "
                                  f"{record.get('id')!r}") from None
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise RewardError(f"--reward {t.name} returned {one_line(repr(v), 60)} on row "
                                  f"{record.get('id')!r}: a reward must be a finite number")
            total += t.weight * float(v)
        return total


def load(cfg, first_record):
    """The run's reward: data.reward (the built-in task's) without --reward, else a Rewards of the user's
    functions, each imported and called once on `first_record` and an empty completion (setup's check)."""
    import data
    if not cfg.reward:
        return data.reward
    terms = [Term(f"{s.file}:{s.function}", import_function(s), w)
             for s, w in zip(sources(cfg.reward), weights(cfg))]
    reward = Rewards(terms)
    for t in terms:
        try:
            Rewards([t])("", first_record)
        except RewardError as e:
            raise RewardError(f"{e} (the check at setup: the first record and an empty completion)") from None
    return reward


def check(cfg):
    """The first wrong task flag of a grpo.Config as one sentence naming it, or None (flags.check)."""
    if cfg.reward:
        try:
            sources(cfg.reward)
        except RewardError as e:
            return str(e)
    try:
        w = weights(cfg)
    except ValueError:
        return f"--reward-weights {cfg.reward_weights!r}: expected numbers separated by commas (1.0,0.5)"
    if cfg.reward_weights and not cfg.reward:
        return "--reward-weights needs --reward (the built-in reward has no terms to weigh)"
    if cfg.reward and len(w) != len(sources(cfg.reward)):
        return f"--reward-weights gives {len(w)} weight(s), --reward {len(sources(cfg.reward))} function(s)"
    if not all(math.isfinite(x) for x in w):
        return "--reward-weights must be finite numbers"
    if cfg.dataset.lower() == "custom" and not (cfg.reward and cfg.data_path):
        return "--dataset custom needs --data-path FILE (its rows) and --reward FILE.py:FUNCTION (its reward)"
    if cfg.dataset.lower() == "custom" and cfg.eval_every and not cfg.eval_data_path:
        return ("--eval-every on --dataset custom needs --eval-data-path FILE (held-out rows, scored with "
                "the same --reward)")
    try:
        re.compile(cfg.answer_pattern)
    except re.error as e:
        return f"--answer-pattern {cfg.answer_pattern!r} does not compile: {e}"
    try:
        kwargs = json.loads(cfg.chat_template_kwargs or "{}")
    except ValueError as e:
        return f"--chat-template-kwargs {cfg.chat_template_kwargs!r} is not JSON: {e}"
    if not isinstance(kwargs, dict):
        return f"--chat-template-kwargs must be a JSON object ({{\"enable_thinking\": false}}), not {kwargs}"
    return None


def template_kwargs(cfg):
    """--chat-template-kwargs as a dict (check has parsed it), or None."""
    return json.loads(cfg.chat_template_kwargs) if cfg.chat_template_kwargs else None
