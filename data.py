"""The tasks: datasets, prompts and verified rewards for everything the paper trains and evaluates on, and the
batch a rollout becomes (where the question, the response and the answer are).

  load_task(name, split, path, limit, seed) -> records {"id", "source", "question", "answer", "task", ...}
  make_prompt(record, tokenizer, style)      -> the text the model continues (prompts.py)
  reward(completion, record)                 -> the built-in task's float reward, in the form of a user's
                                                --reward function (training/usercode/reward_code.py)
  batch_reward(reward, completions, records, completion_ids) -> each completion's reward, one call a batch
  build_batch(tokenizer, prompt_ids, response_ids) -> Batch: the token layout and its three regions (below)

Tasks (`TASKS`; paper §4, App. B Table 9, App. C.3):
  math training   dapo-math-17k (deduplicated: the hub file repeats each problem ~100x), gsm8k (train)
  math eval       gsm8k (test), math500, aime24, aime25, amc23, olympiadbench, minerva
  choice          crossthinkqa (train / validation; "test" reads validation, App. C.3)
  countdown       countdown (generated, TinyZero's protocol: countdown.py), countdown-3to4 (TinyZero's data)
  math, offline   arithmetic: generated 1-3 step word problems (arithmetic.py), the default task of the
                  embedded SmolLM2-135M-Instruct
  yours           custom: a JSONL/parquet file of any columns, rewarded by a --reward function (custom.py)
Rows come from `path=` (a JSONL or parquet file) if given; else the generator; else
$FLOWTRACER_DATA/<dir>/<split>.jsonl|.parquet (default: ../shared/data next to this repo); else the hub via
`datasets.load_dataset` (offline, that raises an error saying how to pass a path). Quirks fixed on load
(each task's normaliser in tasks/rows.py, which reads the files too):
AIME24's "025", AMC23's floats, OlympiadBench's lists, Minerva's answer inside the solution's \\boxed{},
AIME25's control characters (a JSON escaping bug: \\x0c -> \\f and TAB -> \\t, as in "\\frac", "\\triangle").
A file or row that cannot be used is a DataError (a ValueError) naming the file, the line and the field: a
missing file, a directory or FIFO, CSV, an empty file, non-UTF-8 or invalid JSON, a truncated parquet; a
missing, empty or wrongly typed field; a NaN / Infinity / "nan" answer; a non-integer Countdown target or
number; a lone surrogate ("\\ud800"). Every pattern run on a row or a reward is linear in its length.

Prompt styles (which model family uses which) and the exemplars: prompts.py.

Rewards (math_reward, countdown_reward, choice_reward) never raise on any string and never hang.

Departures (numbered; 1-3, on the prompts, are prompts.py's):
  4. Hub names: the paper links HPDL/OlympiadBench and UCLA-AGI/Minerva_Math; we use the copies of the
     Qwen2.5-Math eval suite. CrossThinkQA's fields are not documented offline: rows.choice_row takes the
     common multiple-choice layouts.
  5. (answers.py) math-verify's timeout uses signal.alarm (main thread only). In other threads the check
     runs in a daemon thread that is abandoned after 4 * TIMEOUT_S. In both, a size guard first rejects
     values such as 9^{9^{9}} or (10^{10})! whose evaluation no timeout can interrupt (they score 0 even if
     equal), and an answer longer than answers.MAX_ANSWER_CHARS is never parsed: it equals only as a plain
     number or in normal form (the same spelling up to spaces and TeX spacing), as a short one does first.

The batch that the update reads: where the question, the response and the answer are, in tokens.
    Batch / build_batch [left-padded prompt | right-padded response] with the three masks, as HF generate;
                        the answer's tokens are tasks/answers.py's answer_token_range (find_answer_span's
                        characters: the last \\boxed{...}, else <answer>...</answer>, or --answer-pattern's)
    take                some rows of a Batch

These are the sets of FlowTracer's equations (flowtracer.py): the question is the source of the flow (eq. 4),
the answer its sink (eq. 2), the response the tokens that get credit (eq. 6). Region boundaries are
flowtracer.py's departure 2: the question is the prompt minus special tokens (BOS, chat markers), the answer
the content of the last \\boxed{...} (else the last <answer>...</answer>), or the last match of
--answer-pattern (its first group, if it has one) for a task whose answer is not boxed.

Run: python data.py --task arithmetic --split test --limit 3     (records, prompts and a self-check)
Test: python -m pytest -q tests/test_data*.py    Time the rewards: python benchmarks/reward_speed.py
"""

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from tasks import arithmetic, countdown, custom, prompts
from tasks.answers import answer_text, answer_token_range, equivalent, last_boxed, not_finite, option_letter
from tasks.prompts import STYLES, default_style, make_prompt  # noqa: F401 (data's interface)
from tasks.rows import (
    DataError,
    aime25_row,
    choice_row,
    countdown_row,
    dapo_row,
    gsm8k_row,
    math_row,
    minerva_row,
    olympiad_row,
    read_rows,
    unicode_text,
)

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "shared" / "data"  # offline copies, see its README
logging.getLogger("math_verify").setLevel(logging.ERROR)  # departure 5: "Timeout during ..." warnings


# ----------------------------------------------------------------------------- the task table


class Dataset(NamedTuple):
    task: str  # "math" | "countdown" | "choice": which reward `score` uses
    local: str  # folder under $FLOWTRACER_DATA holding <split>.jsonl|.parquet
    hub: tuple  # (hub name, config, {our split: hub split}); () for generated tasks
    normalise: Callable  # row -> (question, answer); raises DataError naming the field
    generator: Callable = (
        None  # (split, seed, limit) -> rows {question, answer, ...}, for the generated tasks
    )


TASKS = {
    "gsm8k": Dataset(
        "math", "gsm8k", ("openai/gsm8k", "main", {"train": "train", "test": "test"}), gsm8k_row
    ),
    "math500": Dataset("math", "math500", ("HuggingFaceH4/MATH-500", None, {"test": "test"}), math_row),
    "aime24": Dataset("math", "aime24", ("HuggingFaceH4/aime_2024", None, {"test": "train"}), math_row),
    "aime25": Dataset("math", "aime25", ("math-ai/aime25", None, {"test": "test"}), aime25_row),
    "amc23": Dataset("math", "amc23", ("math-ai/amc23", None, {"test": "test"}), math_row),
    "olympiadbench": Dataset(
        "math",
        "olympiadbench",
        ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", {"test": "train"}),
        olympiad_row,
    ),
    "minerva": Dataset("math", "minerva_math", ("math-ai/minervamath", None, {"test": "test"}), minerva_row),
    "dapo-math-17k": Dataset(
        "math", "dapo-math-17k", ("BytedTsinghua-SIA/DAPO-Math-17k", None, {"train": "train"}), dapo_row
    ),
    # Table 9's link; "test" is the validation split (App. C.3)
    "crossthinkqa": Dataset(
        "choice",
        "crossthinkqa",
        ("nvidia/CrossThink-QA", None, {"train": "train", "test": "validation"}),
        choice_row,
    ),
    "countdown": Dataset("countdown", "countdown", (), countdown_row, countdown.rows),
    "countdown-3to4": Dataset(
        "countdown",
        "countdown-3to4",  # TinyZero: train = rows[:N], test = the next rows
        ("Jiayi-Pan/Countdown-Tasks-3to4", None, {"train": "train", "test": "train"}),
        countdown_row,
    ),
    "arithmetic": Dataset("math", "arithmetic", (), math_row, arithmetic.rows),
}
DATASETS = (*TASKS, custom.NAME)  # grpo.py's --dataset: the tasks, and your own file (custom.py)
SPLITS = {name: list(t.hub[2]) if t.hub else ["train", "test"] for name, t in TASKS.items()}


def hub_rows(name, t, split):
    hub, config, splits = t.hub
    try:
        import datasets

        ds = datasets.load_dataset(hub, config, split=splits[split])
    except Exception as e:
        where = Path(os.environ.get("FLOWTRACER_DATA") or DEFAULT_DATA) / t.local / f"{split}.jsonl"
        why = " ".join(str(e).split())[:300]  # one line
        raise DataError(
            f"{name}: could not load {hub!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{why}). Offline: download its {split} split as JSONL or parquet and pass it with "
            f"--data-path FILE, or put it at {where} (eval.py reads it there; $FLOWTRACER_DATA "
            f"moves it)"
        ) from e
    return ((f"{hub} [{splits[split]}] row {i}", dict(r)) for i, r in enumerate(ds, 1))


def load_task(name, split="test", path=None, limit=None, seed=0, question_field="", answer_field=""):
    """The records of one task split. `seed` only matters for the generated tasks (countdown, arithmetic).
    question_field / answer_field: the columns holding the question and the answer, for a file whose columns
    are not the ones the task reads (custom.with_fields); "custom" reads `path` (custom.py)."""
    key = str(name).lower()
    if key == custom.NAME:
        if path is None:
            raise DataError("--dataset custom reads a file: give --data-path FILE (JSONL or parquet)")
        try:
            records = custom.records(read_rows(path), split, path, limit, question_field, answer_field)
        except custom.ColumnError as e:
            raise DataError(str(e)) from None
        for r in records:
            unicode_text(f"{path}, row {r['id']!r}", question=r["question"], answer=r.get("answer"))
        return records
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    t = TASKS[key]
    if split not in SPLITS[key]:
        raise ValueError(f"task {key!r} has splits {SPLITS[key]}, not {split!r}")
    if path is None and t.generator is not None:  # the generator's rows, each a question and its answer as
        return [
            {
                "id": f"{key}/{split}/{i}",
                "source": key,
                "question": r["question"],  # made: no file's
                "answer": r["answer"],
                "task": t.task,  # columns to pick
                **{k: r[k] for k in ("steps", "nums", "target") if k in r},
            }  # or to check
            for i, r in enumerate(t.generator(split, seed, limit))
        ]
    local = [
        Path(os.environ.get("FLOWTRACER_DATA") or DEFAULT_DATA) / t.local / f"{split}{ext}"
        for ext in (".jsonl", ".parquet")
    ]
    if path is not None:
        rows, source = read_rows(path), str(path)
    elif any(p.is_file() for p in local):
        source = str(next(p for p in local if p.is_file()))
        rows = read_rows(source)
    else:
        rows, source = hub_rows(key, t, split), t.hub[0]
    n, m = countdown.SIZES["train"], countdown.SIZES["test"]  # countdown-3to4 (TinyZero): train = the first n
    stop = (n if split == "train" else n + m) if key == "countdown-3to4" else limit  # rows, test = the next m
    records, seen = [], set()
    for where, row in rows:
        if stop and len(records) >= stop:
            break
        try:
            q, a = t.normalise(custom.with_fields(row, key, question_field, answer_field))
            if t.task == "math" and (not a.strip() or not_finite(a)):  # e.g. [NaN], "#### nan"
                raise DataError(f"the answer {a!r} is empty or not a finite value")
        except (DataError, custom.ColumnError) as e:
            raise DataError(f"{where}: {e}") from None
        unicode_text(where, question=q, answer=a)
        if key == "dapo-math-17k" and q in seen:  # the hub file repeats every problem ~100 times
            continue
        seen.add(q)
        extra = {k: row[k] for k in ("steps", "nums", "target") if k in row}
        records.append(
            {
                "id": f"{key}/{split}/{len(records)}",
                "source": key,
                "question": q,
                "answer": a,
                "task": t.task,
                **extra,
            }
        )
    if key == "countdown-3to4" and split == "test":
        records = records[n:]
    if not records:
        raise DataError(f"task {key!r} split {split!r} from {source}: no rows")
    return records[:limit] if limit else records


def style_fits(style, task):
    """prompts.style_fits for a task kind ("countdown", "math", "choice") or a data.TASKS name."""
    return prompts.style_fits(style, TASKS[task].task if task in TASKS else task)


# ----------------------------------------------------------------------------- rewards


def math_reward(completion, answer):
    """1.0 when the last \\boxed{} of the completion equals the ground truth, else 0.0. Never raises."""
    try:
        pred = last_boxed(completion) if isinstance(completion, str) else None
        if pred is None or not pred.strip():
            return 0.0
        return float(equivalent(answer_text(answer), pred.strip()))
    except Exception:  # Decimal overflow, a math-verify or sympy error, RecursionError ...
        return 0.0


def choice_reward(completion, answer):
    """1.0 when the last \\boxed{} names the answer's option, and only it (answers.option_letter),
    else 0.0."""
    try:
        pred = last_boxed(completion) if isinstance(completion, str) else None
        letter = None if pred is None else option_letter(pred)
        return float(letter is not None and letter == str(answer).strip().strip("()").upper())
    except Exception:
        return 0.0


countdown_reward = countdown.reward  # TinyZero's 1.0 / 0.1 / 0.0 rule, see countdown.py
REWARDS = {"math": math_reward, "countdown": countdown_reward, "choice": choice_reward}


def reward(completion, record):
    """The built-in reward of one completion of one record, by record["task"] (REWARDS), as a --reward
    function is called (training/usercode/reward_code.py): grpo.py's default reward. Never raises on any
    completion; an
    unknown record["task"] is a programming error and raises ValueError."""
    verify = REWARDS.get(record.get("task"))
    if verify is None:
        raise ValueError(
            f"record {record.get('id')!r} has task {record.get('task')!r}; known: {list(REWARDS)}"
        )
    return verify(completion, record["answer"])


def batch_reward(reward, completions, records, completion_ids=None):
    """The reward of each completion of its record, as a list of floats: `reward` is data.reward (called on
    each row), or a --reward's (training/usercode/reward_code.py's UserReward: its batch, each TRL-form
    function called once, NaN where no function scored a completion). grpo.py's and heldout.py's one call
    for a batch."""
    batch = getattr(reward, "batch", None)
    if batch is not None:
        return batch(completions, records, completion_ids)
    return [float(reward(c, r)) for c, r in zip(completions, records)]


# ----------------------------------------------------------------------------- the batch a rollout becomes
class Batch(NamedTuple):
    input_ids: torch.Tensor  # (B, T) long: [left-padded prompt | right-padded response]
    attention_mask: torch.Tensor  # (B, T) long: 1 on real tokens
    question_mask: torch.Tensor  # (B, T) bool: prompt tokens (special tokens excluded unless asked)
    response_mask: torch.Tensor  # (B, T) bool: generated tokens, EOS included
    answer_mask: torch.Tensor  # (B, T) bool: tokens of the final answer span inside the response
    prompt_width: int  # P: response token j of row b sits at column P + j

    def to(self, device):
        return Batch(*(x.to(device) for x in self[:-1]), self.prompt_width)


def build_batch(
    tokenizer,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    question_special: bool = False,
    device=None,
    answer_pattern: str | None = None,
) -> Batch:
    """Lay out prompts + responses as HF generate does and mark the three regions (on `device`, else the CPU).
    answer_pattern: the answer region's regular expression (find_answer_span; None: \\boxed{} / <answer>).

    question_special=False drops special tokens (BOS, <|im_start|>, ...) from the question region: the BOS
    attention sink would otherwise take most of the injected flow. The remaining chat-template words stay.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    special = set(tokenizer.all_special_ids)
    B, P, R = len(prompt_ids), max(map(len, prompt_ids)), max([len(r) for r in response_ids] + [0])
    ids = torch.full((B, P + R), pad, dtype=torch.long)
    attn_mask = torch.zeros(B, P + R, dtype=torch.long)
    q, resp, ans = (torch.zeros(B, P + R, dtype=torch.bool) for _ in range(3))
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[b, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        ids[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        attn_mask[b, P - len(p) : P + len(r)] = 1
        q[b, P - len(p) : P] = torch.tensor(
            [question_special or t not in special for t in p], dtype=torch.bool
        )
        resp[b, P : P + len(r)] = True
        rng = answer_token_range(tokenizer, list(r), answer_pattern) if r else None
        if rng is not None:
            ans[b, P + rng[0] : P + rng[1]] = True
    return Batch(*(x.to(device) for x in (ids, attn_mask, q, resp, ans)), P)


def take(batch: Batch, rows) -> Batch:
    """The rows `rows` (a list or index tensor) of a batch, same width and prompt_width."""
    idx = torch.as_tensor(rows, dtype=torch.long, device=batch.input_ids.device)
    return Batch(*(x[idx] for x in batch[:-1]), batch.prompt_width)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        prog="data.py",
        allow_abbrev=False,
        description="Print a few records of a task, their prompts, a self-check.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--task", default="arithmetic", choices=list(TASKS), help="which task")
    ap.add_argument("--split", default="test", choices=["train", "test"], help="which split")
    ap.add_argument("--path", default=None, help="a local JSONL/parquet file of the task instead")
    ap.add_argument("--limit", type=int, default=3, help="how many records")
    ap.add_argument("--style", default="plain", choices=STYLES, help="prompt style (no tokenizer here)")
    args = ap.parse_args()
    if args.limit < 1:
        ap.error("--limit must be >= 1")
    try:  # a bad --path, a split the task lacks, a style that does not fit: one line
        for r in load_task(args.task, args.split, args.path, args.limit):
            good = (
                f"<answer>{countdown.solve(r['nums'], r['target'])}</answer>"
                if r["task"] == "countdown"
                else f"\\boxed{{{r['answer']}}}"
            )
            print(
                json.dumps(r), "\n", make_prompt(r, None, args.style), "\n self-check:", reward(good, r), "\n"
            )
    except ValueError as e:
        ap.error(str(e))
