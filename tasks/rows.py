"""Reading a task's rows: a JSONL or parquet file row by row (read_rows), one normaliser per dataset layout
(row -> (question, answer), the quirks of each source fixed here), and the checks every field passes (get,
unicode_text). data.py's TASKS names a normaliser for each task and load_task runs it on every row.
A file or row that cannot be used is a DataError (a ValueError) naming the file, the line and the field.

Run: python data.py --task gsm8k --split test --limit 3     (the rows of a task, read by these functions)
"""

import json
import math
import os
import re
from pathlib import Path

from tasks import countdown
from tasks.answers import answer_text, last_boxed, not_finite


class DataError(ValueError):
    """A dataset that cannot be read: the message names the file, the line (or row) and the field."""


def read_rows(path):
    """Yield (where, row) for a JSONL or parquet file; `where` is "file, line N" (or "row N"). Every problem
    with the file (missing, a directory, CSV, unreadable, not UTF-8, bad JSON, corrupt parquet) is a DataError
    naming it; an empty file yields nothing (load_task then says "no rows")."""
    path = Path(path)
    if not path.exists():  # a symlink loop or a dangling symlink does not exist either
        raise DataError(
            f"{path}: "
            + (
                f"a symlink to {os.readlink(path)}, which cannot be read (a loop or a missing file)"
                if path.is_symlink()
                else "no such file"
            )
        )
    if not path.is_file():  # a directory; or a FIFO, device or socket, which open() would wait on forever
        raise DataError(
            f"{path}: "
            + (
                "a directory, not a data file"
                if path.is_dir()
                else "not a regular file (a FIFO, socket or device?); not read"
            )
        )
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        csv = "; convert the CSV to JSONL, one object per line" if path.suffix == ".csv" else ""
        raise DataError(
            f"{path}: unsupported format {path.suffix or '(no suffix)'} (use .jsonl or .parquet{csv})"
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path).to_pylist()
        except Exception as e:  # not parquet, truncated, unreadable
            raise DataError(
                f"{path}: not a readable parquet file ({type(e).__name__}: {str(e)[:200]})"
            ) from None
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
            if isinstance(v, float) and not math.isfinite(v) or isinstance(v, str) and not_finite(v):
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
            raise DataError(
                f"{where}: field {name!r} holds a lone surrogate {m.group()!r} at character "
                f"{m.start()}: not Unicode text"
            )


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
    opts = dict(
        zip(opts.get("label", LETTERS), opts["text"])
        if isinstance(opts, dict) and "text" in opts
        else zip(LETTERS, opts)
        if isinstance(opts, list)
        else opts or {}
    )
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
