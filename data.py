"""The tasks: datasets, prompts and verified rewards for everything the paper trains and evaluates on.

  load_task(name, split, path, limit, seed) -> records {"id", "source", "question", "answer", "task", ...}
  make_prompt(record, tokenizer, style)      -> the text the model continues (prompts.py)
  reward(completion, record)                 -> the built-in task's float reward, in the form of a user's
                                                --reward function (training/rewards.py); score(record,
                                                completion) is the same in the older argument order

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
`datasets.load_dataset` (offline, that raises an error saying how to pass a path). Quirks fixed on load:
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
     Qwen2.5-Math eval suite. CrossThinkQA's fields are not documented offline: `choice_row` accepts the
     common multiple-choice layouts.
  5. (answers.py) math-verify's timeout uses signal.alarm (main thread only). In other threads the check
     runs in a daemon thread that is abandoned after 4 * TIMEOUT_S. In both, a size guard first rejects
     values such as 9^{9^{9}} or (10^{10})! whose evaluation no timeout can interrupt (they score 0 even if
     equal), and an answer longer than answers.MAX_ANSWER_CHARS is never parsed: it equals only as a plain
     number or in normal form (the same spelling up to spaces and TeX spacing), as a short one does first.

Run: python data.py --task arithmetic --split test --limit 3     (records, prompts and a self-check)
Test: python -m pytest -q tests/test_data.py      Time the rewards: python benchmarks/reward_speed.py
"""
import argparse
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Callable, NamedTuple

from tasks import arithmetic, countdown, custom, prompts
from tasks.answers import boxed_span, equivalent, not_finite, option_letter
from tasks.prompts import STYLES, default_style, make_prompt  # noqa: F401 (data's interface)

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "shared" / "data"  # offline copies, see its README
logging.getLogger("math_verify").setLevel(logging.ERROR)  # departure 5: "Timeout during ..." warnings


class DataError(ValueError):
    """A dataset that cannot be read: the message names the file, the line (or row) and the field."""


# ----------------------------------------------------------------------------- reading rows

def read_rows(path):
    """Yield (where, row) for a JSONL or parquet file; `where` is "file, line N" (or "row N"). Every problem
    with the file (missing, a directory, CSV, unreadable, not UTF-8, bad JSON, corrupt parquet) is a DataError
    naming it; an empty file yields nothing (load_task then says "no rows")."""
    path = Path(path)
    if not path.exists():        # a symlink loop or a dangling symlink does not exist either
        raise DataError(f"{path}: " + (f"a symlink to {os.readlink(path)}, which cannot be read (a loop or a "
                                       "missing file)" if path.is_symlink() else "no such file"))
    if not path.is_file():   # a directory; or a FIFO, device or socket, which open() would wait on forever
        raise DataError(f"{path}: " + ("a directory, not a data file" if path.is_dir() else
                                       "not a regular file (a FIFO, socket or device?); not read"))
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        csv = "; convert the CSV to JSONL, one object per line" if path.suffix == ".csv" else ""
        raise DataError(f"{path}: unsupported format {path.suffix or '(no suffix)'} "
                        f"(use .jsonl or .parquet{csv})")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path).to_pylist()
        except Exception as e:       # not parquet, truncated, unreadable
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e)[:200]})") \
                from None
        yield from ((f"{path}, row {i}", row) for i, row in enumerate(table, 1))
        return
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    with f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                row = json.loads(line) if line.strip() else None  # blank lines are skipped
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {i}: not UTF-8 ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                array = " (a JSON array? use JSONL: one object per line)" * line.lstrip().startswith("[")
                raise DataError(f"{path}, line {i}: invalid JSON ({e.msg}){array}") from None
            if row is not None and not isinstance(row, dict):
                raise DataError(f"{path}, line {i}: expected a JSON object, got {type(row).__name__}")
            if row is not None:
                yield f"{path}, line {i}", row


def get(row, keys, types=(str,)):
    """The first present field among keys, type-checked, non-empty and finite; DataError naming the field."""
    for k in keys:
        if row.get(k) is not None:
            v = row[k]
            if not isinstance(v, types) or isinstance(v, bool):
                want = "/".join(t.__name__ for t in types)
                raise DataError(f"field {k!r} is {type(v).__name__}, expected {want}")
            if isinstance(v, str) and not v.strip() or isinstance(v, (list, dict)) and not v:
                raise DataError(f"field {k!r} is empty")
            if (isinstance(v, float) and not math.isfinite(v)
                    or isinstance(v, str) and not_finite(v)):
                raise DataError(f"field {k!r} is {v!r}, not a finite value")
            return v
    raise DataError(f"missing field {' or '.join(repr(k) for k in keys)}")


SURROGATE = re.compile("[\ud800-\udfff]")


def unicode_text(where, **fields):
    """A DataError naming the record when a text field holds a lone surrogate (a JSON "\\ud800" escape without
    its pair): no tokenizer can encode one."""
    for name, text in fields.items():
        m = SURROGATE.search(text) if isinstance(text, str) else None
        if m:
            raise DataError(f"{where}: field {name!r} holds a lone surrogate {m.group()!r} at character "
                            f"{m.start()}: not Unicode text")


def answer_text(a):
    """A ground truth as a string: 27.0 -> "27", ["$1$", "$2$"] -> "1, 2", " $x$ " -> "x", "\\$5" -> "5"."""
    if isinstance(a, float) and a.is_integer():
        return str(int(a))
    if isinstance(a, (list, tuple)):
        return ", ".join(answer_text(x) for x in a)
    return re.sub(r"\\?\$", "", str(a)).strip()    # math-mode $ and the dollar sign \$ (not "\18.90")


# ----------------------------------------------------------------------------- one normaliser per layout

QUESTION = ("problem", "question", "Problem", "Question")
ANSWER = ("answer", "Answer")
NUMBER = (str, int, float)


def math_row(row):
    return get(row, QUESTION), answer_text(get(row, ANSWER, NUMBER))


def gsm8k_row(row):  # the worked solution ends in "#### <number>"
    *_, final = get(row, ("answer",)).split("####")
    if len(_) == 0:
        raise DataError("field 'answer' has no '#### <number>' final answer")
    return get(row, ("question",)), final.strip().replace(",", "")


def aime25_row(row):  # the source JSON lost two backslashes: "\f"rac became a form feed, "\t"riangle a TAB
    q, a = math_row(row)
    return q.replace("\x0c", "\\f").replace("\t", "\\t"), a


def olympiad_row(row):
    return get(row, ("question",)), answer_text(get(row, ("final_answer",), (list, str)))


def minerva_row(row):  # the answer is the \boxed{} of the solution
    boxed = get(row, ANSWER, NUMBER) if row.get("answer") is not None else last_boxed(get(row, ("solution",)))
    if boxed is None:
        raise DataError("field 'solution' has no \\boxed{} answer")
    return get(row, QUESTION), answer_text(boxed)


def dapo_question(prompt):
    """DAPO's "Solve the following math problem ...\\n\\n<question>\\n\\nRemember to put your answer ..."
    -> the question: its own "Answer: $Answer" instructions go, ours ask for \\boxed{}
    (str search: linear)."""
    head, _, rest = prompt.partition("\n\n")
    body, end, _ = rest.rpartition("\n\nRemember to put your answer")
    return body if head.startswith("Solve the following math problem") and end else prompt


def dapo_row(row):
    prompt = get(row, ("prompt",), (list, str))  # the hub's chat list [{"role": "user", "content": ...}]
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1], str):
            raise DataError("field 'prompt' has no user message with text content")
        prompt = users[-1]
    reward = get(row, ("reward_model",), (dict,))
    return dapo_question(prompt).strip(), answer_text(get(reward, ("ground_truth",), NUMBER))


LETTERS = "ABCDEFGHIJKLMNOP"


def choice_row(row):
    """A multiple-choice row in any common layout (assumed for CrossThinkQA, whose fields are not known here):
    options as "options"/"choices" (a list, a {"A": ...} dict or ARC's {"label": [...], "text": [...]}),
    as fields "A", "B", ..., or already inside the question text; the answer as a letter ("B", "(B)"),
    a 0-based index, or the text of an option."""
    opts = next((row[k] for k in ("options", "choices") if row.get(k) is not None), None)
    if opts is None and "A" in row and "B" in row:
        opts = {L: row[L] for L in LETTERS if row.get(L) is not None}
    opts = dict(zip(opts.get("label", LETTERS), opts["text"]) if isinstance(opts, dict) and "text" in opts
                else zip(LETTERS, opts) if isinstance(opts, list) else opts or {})
    if not isinstance(opts, dict):
        raise DataError(f"field 'options' is {type(opts).__name__}, expected list or dict")
    a = get(row, ("answer", "label", "answer_key", "answerKey", "correct"), (str, int))
    if isinstance(a, int):
        if not 0 <= a < len(opts):
            raise DataError(f"field 'answer' is index {a} but the row has {len(opts)} options")
        a = list(opts)[a]
    letter = {str(v).strip(): k for k, v in opts.items()}.get(a.strip()) or re.sub(r"[\s().:]", "", a).upper()
    if len(letter) != 1 or letter not in LETTERS or (opts and letter not in opts):
        raise DataError(f"field 'answer' is {a!r}, not one of the option letters")
    q = "\n".join([get(row, QUESTION).rstrip()] + [f"{k}. {v}" for k, v in opts.items()])
    return q + "\nAnswer with the letter of the correct option.", letter


def countdown_row(row):
    nums, target = get(row, ("nums",), (list,)), get(row, ("target",), (int,))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in nums) or not nums:
        raise DataError("field 'nums' must be a non-empty list of integers")
    return countdown.question(nums, target), {"nums": list(nums), "target": target}


# ----------------------------------------------------------------------------- the task table

class Task(NamedTuple):
    task: str                  # "math" | "countdown" | "choice": which reward `score` uses
    local: str                 # folder under $FLOWTRACER_DATA holding <split>.jsonl|.parquet
    hub: tuple                 # (hub name, config, {our split: hub split}); () for generated tasks
    normalise: Callable        # row -> (question, answer); raises DataError naming the field
    generate: Callable = None  # (split, seed, limit) -> rows, for the generated tasks


TASKS = {
    "gsm8k": Task("math", "gsm8k", ("openai/gsm8k", "main", {"train": "train", "test": "test"}), gsm8k_row),
    "math500": Task("math", "math500", ("HuggingFaceH4/MATH-500", None, {"test": "test"}), math_row),
    "aime24": Task("math", "aime24", ("HuggingFaceH4/aime_2024", None, {"test": "train"}), math_row),
    "aime25": Task("math", "aime25", ("math-ai/aime25", None, {"test": "test"}), aime25_row),
    "amc23": Task("math", "amc23", ("math-ai/amc23", None, {"test": "test"}), math_row),
    "olympiadbench": Task("math", "olympiadbench",
                          ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", {"test": "train"}), olympiad_row),
    "minerva": Task("math", "minerva_math", ("math-ai/minervamath", None, {"test": "test"}), minerva_row),
    "dapo-math-17k": Task("math", "dapo-math-17k",
                          ("BytedTsinghua-SIA/DAPO-Math-17k", None, {"train": "train"}), dapo_row),
    # Table 9's link; "test" is the validation split (App. C.3)
    "crossthinkqa": Task("choice", "crossthinkqa",
                         ("nvidia/CrossThink-QA", None, {"train": "train", "test": "validation"}),
                         choice_row),
    "countdown": Task("countdown", "countdown", (), countdown_row,
                      lambda split, seed, limit: countdown.generate(limit or countdown.SIZES[split], split,
                                                                    seed)),
    "countdown-3to4": Task("countdown", "countdown-3to4",  # TinyZero: train = rows[:N], test = the next rows
                           ("Jiayi-Pan/Countdown-Tasks-3to4", None, {"train": "train", "test": "train"}),
                           countdown_row),
    "arithmetic": Task("math", "arithmetic", (), math_row, arithmetic.generate),
}
DATASETS = (*TASKS, custom.NAME)     # grpo.py's --dataset: the tasks, and your own file (custom.py)
SPLITS = {name: list(t.hub[2]) if t.hub else ["train", "test"] for name, t in TASKS.items()}


def hub_rows(name, t, split):
    hub, config, splits = t.hub
    try:
        import datasets
        ds = datasets.load_dataset(hub, config, split=splits[split])
    except Exception as e:
        where = Path(os.environ.get("FLOWTRACER_DATA") or DEFAULT_DATA) / t.local / f"{split}.jsonl"
        why = " ".join(str(e).split())[:300]                           # one line
        raise DataError(f"{name}: could not load {hub!r} from the Hugging Face hub ({type(e).__name__}: "
                        f"{why}). Offline: download its {split} split as JSONL or parquet and pass it with "
                        f"--data-path FILE, or put it at {where} (eval.py reads it there; $FLOWTRACER_DATA "
                        f"moves it)") from e
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
    local = [Path(os.environ.get("FLOWTRACER_DATA") or DEFAULT_DATA) / t.local / f"{split}{ext}"
             for ext in (".jsonl", ".parquet")]
    if path is not None:
        rows, source = read_rows(path), str(path)
    elif t.generate is not None:
        rows = ((f"generated row {i}", r) for i, r in enumerate(t.generate(split, seed, limit), 1))
        source = key
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
        records.append({"id": f"{key}/{split}/{len(records)}", "source": key, "question": q, "answer": a,
                        "task": t.task, **extra})
    if key == "countdown-3to4" and split == "test":
        records = records[n:]
    if not records:
        raise DataError(f"task {key!r} split {split!r} from {source}: no rows")
    return records[:limit] if limit else records


def style_fits(style, task):
    """prompts.style_fits for a task kind ("countdown", "math", "choice") or a data.TASKS name."""
    return prompts.style_fits(style, TASKS[task].task if task in TASKS else task)


# ----------------------------------------------------------------------------- rewards

def last_boxed(text):
    """The content of the last closed, non-empty \\boxed{...} (answers.boxed_span), or None."""
    span = boxed_span(text)
    return None if span is None else text[span[0]:span[1]]


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
    function is called (training/rewards.py): grpo.py's default reward. Never raises on any completion; an
    unknown record["task"] is a programming error and raises ValueError."""
    verify = REWARDS.get(record.get("task"))
    if verify is None:
        raise ValueError(f"record {record.get('id')!r} has task {record.get('task')!r}; "
                         f"known: {list(REWARDS)}")
    return verify(completion, record["answer"])


def score(record, completion):
    """reward(completion, record), in the argument order evaluation/ calls it with."""
    return reward(completion, record)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="data.py", allow_abbrev=False,
                                 description="Print a few records of a task, their prompts, a self-check.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--task", default="arithmetic", choices=list(TASKS), help="which task")
    ap.add_argument("--split", default="test", choices=["train", "test"], help="which split")
    ap.add_argument("--path", default=None, help="a local JSONL/parquet file of the task instead")
    ap.add_argument("--limit", type=int, default=3, help="how many records")
    ap.add_argument("--style", default="plain", choices=STYLES, help="prompt style (no tokenizer here)")
    args = ap.parse_args()
    if args.limit < 1:
        ap.error("--limit must be >= 1")
    try:                     # a bad --path, a split the task lacks, a style that does not fit: one line
        for r in load_task(args.task, args.split, args.path, args.limit):
            good = (f"<answer>{countdown.solve(r['nums'], r['target'])}</answer>" if r["task"] == "countdown"
                    else f"\\boxed{{{r['answer']}}}")
            print(json.dumps(r), "\n", make_prompt(r, None, args.style), "\n self-check:", score(r, good),
                  "\n")
    except ValueError as e:
        ap.error(str(e))
