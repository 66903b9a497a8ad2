"""A reward function's two forms and the values it may return (training/reward_code.py calls them):

    def reward(completion: str, record: dict) -> float                 # per row (ROW_FORM)
    def accuracy_reward(completions, solution, **kwargs) -> list       # TRL's (TRL_FORM): one call per batch

trl_form tells them apart by the signature (`completions`, or keywords alone). A value counts as a reward
when it is a real number (a bool, a one-element tensor or array too) finite as a float32, |r| <= F32_MAX
(number: the rewards tensor is float32, so 1e300 is refused, not turned into inf); an `async def` one's is
awaited first (returned, as TRL does); a TRL-form one may answer None for a completion it does not score.
A TRL-form call gets the dataset's columns as keyword lists (columns, as TRL's Arrow table gives them).
The user's values and rows are named in one line (one_line, ids_of): an object's str() may raise too.

Run: python -m pytest -q tests/test_your_task_trl_rewards.py
     python -m pytest -q tests/test_your_task.py tests/test_hardening_user_code.py -k reward
"""

import asyncio
import inspect
import math
import numbers

import torch

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


def number(v):
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


def one_line(e, n=200):
    """str(e) on one line, cut to n characters; an object whose str() itself raises: its type's name."""
    try:
        return " ".join(str(e).split())[:n]
    except Exception:  # the user's object: its __str__ may raise too
        return f"<a {type(e).__name__} whose str() raises>"


def ids_of(records, n=3):
    """The first n of a batch's row ids, for a message: "'a', 'b', 'c' ... (8)"."""
    ids = [repr(r.get("id")) for r in records]
    return ", ".join(ids[:n]) + (f" ... ({len(ids)})" if len(ids) > n else "")
