"""Rewards from your code: grpo.py --reward FILE.py:FUNCTION[,FILE.py:FUNCTION ...] [--reward-weights W,...].

A reward function takes one of two forms, told apart by its signature:

    def reward(completion: str, record: dict) -> float                 # per row: one call per completion
    def accuracy_reward(completions, solution, **kwargs) -> list       # TRL's: one call per batch

The record holds every column of the dataset row (tasks/custom.py; a built-in task's record: data.py). The
built-in tasks' reward is a per-row function, data.reward. A function whose signature takes `completions` is
called as TRL's GRPOTrainer calls its reward_funcs, so a reward file written for TRL (or Unsloth, open-r1)
runs unchanged: once per batch with prompts=, completions=, completion_ids= and every column of the rows as
a keyword list (solution=[...]; not "prompt" and "completion", as TRL). prompts and completions are
conversational ([{"role": "user", ...}, ...] and [{"role": "assistant", "content": ...}]) exactly when a chat
template rendered the prompt (prompts.turns), else strings. It returns one float or None per completion;
None: it does not score that one. A completion no function scores gets TRL's treatment (its reward is NaN,
left out of its group's mean and std, its advantage 0) and a warning line naming the row. With several
functions the reward is their weighted sum, sum_k w_k f_k (TRL's reward_funcs with reward_weights; default
weights 1; a None term adds nothing). data.batch_reward is grpo.py's and heldout.py's one call. The forms
and the values a function may return: below (trl_form, reward_value).

A reward file is code the run executes, and part of the experiment:
  recorded      each file's path and hash, as --reward-files (reward_files.py: a resume refuses a file that
                moved or changed, and reads each where the run recorded it)
  load          imports each file (printing its resolved path; its folder is importable from it, so it may
                import its neighbours), finds the function, and calls it once on the first record and an
                empty completion: a raise or a value other than a number stops the run at setup, before
                anything is written (RewardError, one line naming the form expected and what came back)
  UserReward    the weighted sum; later, anything the user's code raises (any BaseException but a
                KeyboardInterrupt: sys.exit too) or a value that is not a number finite as a float32
                (|r| <= 3.4e38: 1e300 is refused, not turned into inf) is a RewardError naming the function
                and the row: grpo.py stops, its last completed step saved (log.RunLog.stopped). A call
                that never returns is stopped by the first Ctrl-C or SIGTERM (guard.interruptible)
  check         the task flags' rules (--reward, --reward-weights, --dataset custom, --answer-pattern,
                --chat-template-kwargs, --eval-data-path): one sentence for the first that is wrong
Only the file named is hashed, not the modules it imports.

Run: python grpo.py --dataset custom --data-path docs/your-task/train.jsonl \\
         --reward docs/your-task/reward.py:exact_number --answer-pattern '(-?\\d+)\\D*$'   (docs/your-task.md)
"""

import asyncio
import hashlib
import importlib.util
import inspect
import json
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from tasks import prompts as prompts_mod
from tasks.answers import pattern_problem
from training.usercode.guard import Interrupted, guarded


@dataclass
class TaskConfig:
    """grpo.Config's flags for your own task (docs/your-task.md): the reward, the dataset's fields, the
    answer region of eq. 2, the chat template's options."""

    # your own task (training/usercode/reward_code.py, tasks/custom.py; docs/your-task.md)
    question_field: str = ""  # the question's column ("": the task's, or guessed: tasks/custom.py)
    answer_field: str = ""  # the answer's column ("": the task's, or guessed: tasks/custom.py)
    chat_template_kwargs: str = ""  # JSON object for apply_chat_template, e.g. {"enable_thinking": false}
    reward: str = ""  # FILE.py:FUNCTION[,...]: (completion, record) -> float, or TRL's form
    reward_weights: str = ""  # W,... one weight per --reward function, summed ("": 1 each)
    reward_files: str = ""  # set by the run: each --reward file's path, SHA-256 (reward_files.py)
    answer_pattern: str = ""  # answer regex (eq. 2): last match, group 1; "": \boxed{} else <answer>
    eval_data_path: str = ""  # local JSONL/parquet of the held-out rows (needed by --dataset custom)


class RewardError(ValueError):
    """A --reward that cannot be used: a missing file or function, or one that raised or returned something
    other than a number finite as a float32. The message names the function (and the row, during the run)."""


# ----------------------------------------------------------------------------- a reward function's two forms
# trl_form tells them apart by the signature (`completions`, or keywords alone). A value counts as a reward
# when it is a real number (a bool, a one-element tensor or array too) finite as a float32, |r| <= F32_MAX
# (reward_value: the rewards tensor is float32, so 1e300 is refused, not turned into inf); an `async def`
# one's is awaited first (returned, as TRL does); a TRL-form one may answer None for a completion it does
# not score. A TRL-form call gets the dataset's columns as keyword lists (columns, as TRL's Arrow table
# gives them). The user's values and rows are named in one line (shown, ids_of): an object's str() may raise.
F32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38: a reward beyond it is inf in float32
ROW_FORM = "the per-row form (completion, record) -> a number"
TRL_FORM = "TRL's form (it takes `completions`) -> a list of one number or None per completion"
NOT_COLUMNS = ("prompt", "completion", "prompts", "completions", "completion_ids")  # TRL's, and the call's


def trl_form(fn):
    """Whether `fn` is called TRL's way: its signature takes `completions`, or keywords alone (**kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the per-row form
        return False
    kinds = {q.kind for q in params}
    return any(q.name == "completions" for q in params) or kinds == {inspect.Parameter.VAR_KEYWORD}


def returned(got):
    """A reward function's answer, an `async def` one's awaited (TRL awaits them too)."""
    return asyncio.run(got) if inspect.iscoroutine(got) else got


def reward_value(v):
    """A reward value as a float (a real number, a bool, a one-element tensor or array), or None when it is
    not one or not finite as a float32 (|v| <= F32_MAX: the rewards tensor's dtype)."""
    if torch.is_tensor(v) and v.numel() == 1 or type(v).__module__ == "numpy" and getattr(v, "size", 0) == 1:
        v = v.item()
    if not isinstance(v, numbers.Real):
        return None
    try:
        f = float(v)
    except (OverflowError, ValueError):  # an int past float's range
        return None
    return f if math.isfinite(f) and abs(f) <= F32_MAX else None


def columns(records, keys=None):
    """TRL's keyword lists: every column of the dataset (`keys`; None: the rows'), None where a row lacks it
    (as TRL's Arrow table fills it), but "prompt" and "completion" (TRL gives those as prompts= and
    completions=) and the call's own names."""
    keys = dict.fromkeys(k for k in (keys or (k for r in records for k in r)) if k not in NOT_COLUMNS)
    return {k: [r.get(k) for r in records] for k in keys}


def shown(e, n=200):
    """str(e) on one line, cut to n characters; an object whose str() itself raises: its type's name."""
    try:
        return " ".join(str(e).split())[:n]
    except Exception:  # the user's object: its __str__ may raise too
        return f"<a {type(e).__name__} whose str() raises>"


def ids_of(records, n=3):
    """The first n of a batch's row ids, for a message: "'a', 'b', 'c' ... (8)"."""
    ids = [repr(r.get("id")) for r in records]
    return ", ".join(ids[:n]) + (f" ... ({len(ids)})" if len(ids) > n else "")


class Source(NamedTuple):
    file: str  # FILE as given in --reward
    function: str  # FUNCTION as given


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


def import_function(s, modules=None):
    """The function s.function of the file s.file, imported under a name of its own (its path printed; once
    per file in `modules`, {path: module}), with the file's folder on the import path (at its front, as
    `python FILE.py` would put it): a reward file imports its neighbours."""
    path = Path(s.file).expanduser().resolve()
    name = "reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    module = (modules or {}).get(path)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None:
            raise RewardError(f"--reward {s.file}: not a Python file (name it FILE.py)")
        module = importlib.util.module_from_spec(spec)
        print(f"reward: importing {path}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        try:
            with guarded():
                spec.loader.exec_module(module)
        except Interrupted as e:  # a Ctrl-C / SIGTERM while it imported: one line
            raise RewardError(
                f"--reward {s.file}: interrupted ({e}) while importing it; nothing was written"
            ) from None
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the user's code: a SyntaxError, an ImportError, sys.exit, anything
            raise RewardError(
                f"--reward {s.file}: importing it raised {type(e).__name__}: {shown(e)}"
            ) from None
        if modules is not None:
            modules[path] = module
    fn = getattr(module, s.function, None)
    if not callable(fn):
        have = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == name
        )
        raise RewardError(
            f"--reward {s.file}:{s.function}: "
            + (
                "not a function"
                if fn is not None
                else f"no function {s.function!r} there (it defines: {', '.join(have) or 'none'})"
            )
        )
    return fn


# ----------------------------------------------------------------------------- the weighted sum
class Term(NamedTuple):
    name: str  # "FILE.py:FUNCTION", as given
    fn: Callable  # (completion, record) -> float, or TRL's (completions, **kwargs) -> list
    weight: float  # w_k of the weighted sum


def plain_prompt(record):
    return record.get("question", "")


class UserReward:
    """The weighted sum of the user's reward functions over a batch (`batch`), or one row (`__call__`, as
    data.reward is called). prompt: record -> what a TRL-form function gets as its prompt (trl_prompt: the
    chat turns when a chat template renders them, else the prompt text); the question without one. keys:
    the dataset's columns, each a keyword of a TRL-form call (None: the batch's rows')."""

    def __init__(self, terms, prompt=None, keys=None):
        self.terms, self.prompt = terms, prompt or plain_prompt
        self.keys = list(dict.fromkeys(keys)) if keys else None  # each column once, in order

    def table(self, completions, records, completion_ids=None, **extra):
        """[per term: [its value (float) or None (not scored: TRL's form) per completion]], each checked.
        completion_ids: the token ids of each completion (None: unknown); extra: TRL's own keywords
        (trainer_state, log_metric, ...), for a TRL-form function only."""
        ids = completion_ids if completion_ids is not None else [None] * len(completions)
        return [self.values(t, list(completions), list(records), list(ids), extra) for t in self.terms]

    def values(self, t, completions, records, ids, extra):
        if not trl_form(t.fn):
            return [self.one(t, c, r) for c, r in zip(completions, records)]
        prompts = [self.prompt(r) for r in records]
        chat = any(isinstance(p, list) for p in prompts)  # TRL's rule: a conversational prompt
        comps = [[{"role": "assistant", "content": c}] for c in completions] if chat else completions
        rows = f"the batch of {len(records)} completion(s) of rows {ids_of(records)}"
        try:
            with guarded():
                got = returned(
                    t.fn(
                        prompts=prompts,
                        completions=comps,
                        completion_ids=ids,
                        **{**columns(records, self.keys), **extra},
                    )
                )  # TRL's own keywords win
                if torch.is_tensor(got) or type(got).__module__ == "numpy":
                    got = got.tolist() if getattr(got, "ndim", 0) == 1 else got
                elif inspect.isgenerator(got) or isinstance(got, (map, filter, zip, range)):
                    got = list(got)  # TRL iterates what it gets
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the user's code: anything, sys.exit
            raise RewardError(
                f"--reward {t.name} (TRL's form) raised {type(e).__name__} ({shown(e)}) on {rows}"
            ) from None
        if not isinstance(got, (list, tuple)) or len(got) != len(completions):
            what = f"{len(got)} value(s)" if isinstance(got, (list, tuple)) else shown(repr(got), 60)
            raise RewardError(
                f"--reward {t.name} returned {what} for {len(completions)} completion(s) of "
                f"rows {ids_of(records)}: {TRL_FORM}"
            )
        out = [None if v is None else reward_value(v) for v in got]
        for v, x, r in zip(got, out, records):
            if v is not None and x is None:
                raise RewardError(
                    f"--reward {t.name} returned {shown(repr(v), 60)} for row "
                    f"{r.get('id')!r} in its list: {TRL_FORM}, each finite as a float32 "
                    f"(|r| <= 3.4e38)"
                )
        return out

    def one(self, t, completion, record):
        try:
            with guarded():
                v = returned(t.fn(completion, dict(record)))  # a copy: it cannot change the records
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the user's code: anything, sys.exit(0) too
            raise RewardError(
                f"--reward {t.name} raised {type(e).__name__} ({shown(e)}) on row "
                f"{record.get('id')!r} ({ROW_FORM})"
            ) from None
        x = reward_value(v)
        if x is None:
            hint = (
                "; a function that scores a batch takes `completions` (TRL's form)"
                if isinstance(v, (list, tuple))
                else ""
            )
            raise RewardError(
                f"--reward {t.name} returned {shown(repr(v), 60)} on row "
                f"{record.get('id')!r}: {ROW_FORM} finite as a float32 (|r| <= 3.4e38){hint}"
            )
        return x

    def batch(self, completions, records, completion_ids=None):
        """The weighted sum per completion, NaN where no function scored it (TRL's treatment; one warning
        line a batch); RewardError for a sum not finite as a float32."""
        table, out = self.table(completions, records, completion_ids), []
        for i, r in enumerate(records):
            got = [t.weight * col[i] for t, col in zip(self.terms, table) if col[i] is not None]
            total = math.fsum(got) if got else math.nan
            if got and reward_value(total) is None:
                raise RewardError(
                    f"the weighted sum of --reward {', '.join(t.name for t in self.terms)} "
                    f"is {total:g} on row {r.get('id')!r}: not finite as a float32 "
                    f"(|r| <= 3.4e38)"
                )
            out.append(total)
        unscored = [i for i, x in enumerate(out) if math.isnan(x)]
        if unscored:
            i = unscored[0]
            tqdm.write(
                f"reward: every --reward function returned None for {len(unscored)} of {len(out)} "
                f"completion(s) (first: row {records[i].get('id')!r}, completion "
                f"{shown(repr(completions[i]), 80)}): no reward, left out of the group's mean and "
                f"std, advantage 0 (TRL's rule); make one function score every completion",
                file=sys.stderr,
            )
        return out

    def __call__(self, completion, record):
        return self.batch([completion], [record])[0]


def trl_prompt(tok, style, template_kwargs=None):
    """record -> the prompt a TRL-form function gets: the chat turns (prompts.turns) when the tokenizer's chat
    template renders them, else the prompt text (data.make_prompt), as TRL holds a dataset's prompts."""

    def prompt(record):
        messages = prompts_mod.turns(record, style)
        return (
            messages
            if messages is not None and prompts_mod.has_template(tok)
            else prompts_mod.make_prompt(record, tok, style, template_kwargs)
        )

    return prompt


def load(cfg, first_record, prompt=None, keys=None):
    """The run's reward: data.reward (the built-in task's) without --reward, else a UserReward of the user's
    functions (prompt: trl_prompt's, keys: the dataset's columns, for TRL-form ones), each imported and
    called once on `first_record` and an empty completion (setup's check: a TRL-form one may answer None)."""
    import data

    if not cfg.reward:
        return data.reward
    modules = {}  # each file imported once
    terms = [
        Term(f"{s.file}:{s.function}", import_function(s, modules), w)
        for s, w in zip(sources(cfg.reward), weights(cfg))
    ]
    reward = UserReward(terms, prompt, keys)
    for t in terms:
        try:
            UserReward([t], prompt, keys).table([""], [first_record], [[]])
        except RewardError as e:
            raise RewardError(f"{e} (the check at setup: the first record and an empty completion)") from None
        except Interrupted as e:  # a Ctrl-C / SIGTERM while it ran: one line, nothing written yet
            raise RewardError(
                f"--reward {t.name}: interrupted ({e}) in the check at setup (the first record "
                f"and an empty completion), before it returned; nothing was written"
            ) from None
    return reward


# ----------------------------------------------------------------------------- the task flags
# apply_chat_template's own arguments that prompts.render sets (tokenize=False, add_generation_prompt=True)
# or that change what it returns: --chat-template-kwargs may not set them (tools, documents, chat_template
# and the template's own variables, enable_thinking, ..., it may).
TEMPLATE_OWN = (
    "conversation",
    "messages",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
)


# the flags `check` reads besides --dataset custom: with none of them given it has nothing to check
TASK_FLAGS = ("reward", "reward_weights", "answer_pattern", "chat_template_kwargs")


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
    if not all(math.isfinite(x) and abs(x) <= F32_MAX for x in w):
        return "--reward-weights must be finite numbers (|w| <= 3.4e38)"
    if cfg.dataset.lower() == "custom" and not (cfg.reward and cfg.data_path):
        return "--dataset custom needs --data-path FILE (its rows) and --reward FILE.py:FUNCTION (its reward)"
    if cfg.dataset.lower() == "custom" and cfg.eval_every and not cfg.eval_data_path:
        return (
            "--eval-every on --dataset custom needs --eval-data-path FILE (held-out rows, scored with "
            "the same --reward)"
        )
    if pattern_problem(cfg.answer_pattern):
        return pattern_problem(cfg.answer_pattern)
    try:
        kwargs = json.loads(cfg.chat_template_kwargs or "{}")
    except ValueError as e:
        return f"--chat-template-kwargs {cfg.chat_template_kwargs!r} is not JSON: {e}"
    if not isinstance(kwargs, dict):
        return f'--chat-template-kwargs must be a JSON object ({{"enable_thinking": false}}), not {kwargs}'
    own = [k for k in kwargs if k in TEMPLATE_OWN]
    if own:
        return (
            f"--chat-template-kwargs sets {', '.join(map(repr, own))}, which the prompts set themselves "
            f"(apply_chat_template(..., tokenize=False, add_generation_prompt=True): tasks/prompts.py): "
            f"leave it out"
        )
    return None


def template_kwargs(cfg):
    """--chat-template-kwargs as a dict (check has parsed it), or None."""
    return json.loads(cfg.chat_template_kwargs) if cfg.chat_template_kwargs else None
