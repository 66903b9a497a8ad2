"""Your own task: the records of a JSONL / parquet file of any columns; the columns a task reads from a row.

  records(rows, split, path, limit, question_field, answer_field)  -> grpo.py --dataset custom's records
  with_fields(row, task, question_field, answer_field)             -> a built-in task's row, its question and
                                                                      answer read from the columns named

A custom record holds every column of its row as it is, plus:
  "question"  the question column (--question-field; default: the first of GUESS_QUESTION present), text
  "answer"    the answer column (--answer-field; default: the first of GUESS_ANSWER present), any JSON value,
              absent when the row has none: the --reward function decides what it needs
  "id"        the row's own "id" column, else "custom/<split>/<n>" (error messages name the row by it)
  "task"      "custom" (a column named "task" is replaced: prompts.py and heldout.py read it)
There is no built-in reward for it: grpo.py --dataset custom needs --reward
(training/usercode/reward_code.py), and its prompt is the question as written, through the model's chat
template (prompts.py, style "question").
A column that is missing is a ColumnError naming the row and listing the columns it has (data.py raises it as
its DataError).

Run: python -c "import data; print(data.load_task('custom', 'train', 'docs/your-task/train.jsonl')[0])"
"""

NAME = "custom"  # grpo.py --dataset custom
GUESS_QUESTION = ("question", "problem", "prompt", "Question", "Problem")
GUESS_ANSWER = ("answer", "Answer", "solution", "label")

# The columns each built-in task's normaliser reads first (data.py), which --question-field / --answer-field
# fill: its question's, its answer's; None: the task builds its question from other fields (Countdown).
READS = {
    "dapo-math-17k": ("prompt", "reward_model"),
    "olympiadbench": ("question", "final_answer"),
    "countdown": None,
    "countdown-3to4": None,
}
QUESTION_KEYS = ("problem", "question", "Problem", "Question", "prompt")  # every column a task reads
ANSWER_KEYS = (
    "answer",
    "Answer",
    "final_answer",
    "solution",
    "label",
    "answer_key",
    "answerKey",
    "correct",
    "reward_model",
)


class ColumnError(ValueError):
    """A row without the column a flag names, or a task without such a field: one sentence."""


def missing(row, field, flag):
    """The message for a column the row lacks: it names the flag and lists the row's columns."""
    return f"no column {field!r} ({flag}); the row's columns: {', '.join(map(str, row)) or 'none'}"


def with_fields(row, task, question_field="", answer_field=""):
    """The row with its question and answer moved to the columns task `task` reads (READS), the other
    candidate columns dropped so the normaliser cannot pick one of them first; the row itself when neither
    field is given. ColumnError (data.py names the row) for a missing column, or a task without the field."""
    if not question_field and not answer_field:
        return row
    if task in READS and READS[task] is None:
        raise ColumnError(
            f"task {task!r} builds its question from the columns nums and target: "
            f"--question-field / --answer-field do not apply"
        )
    q_key, a_key = READS.get(task, ("question", "answer"))
    out = dict(row)
    for field, flag, keys, key in (
        (question_field, "--question-field", QUESTION_KEYS, q_key),
        (answer_field, "--answer-field", ANSWER_KEYS, a_key),
    ):
        if not field:
            continue
        if field not in row:
            raise ColumnError(missing(row, field, flag))
        value = row[field]
        out = {k: v for k, v in out.items() if k not in keys}
        out[key] = {"ground_truth": value} if key == "reward_model" else value
    return out


def records(rows, split, path, limit=None, question_field="", answer_field=""):
    """The records of a custom file (see the module docstring): rows = data.read_rows(path). ColumnError
    naming the row for a missing column or a question that is not text."""
    out = []
    for where, row in rows:
        if limit and len(out) >= limit:
            break
        q_key = question_field or next((k for k in GUESS_QUESTION if k in row), None)
        if q_key is None or q_key not in row:
            why = (
                missing(row, question_field, "--question-field")
                if question_field
                else (
                    f"no question column (looked for {', '.join(GUESS_QUESTION)}); the row's columns: "
                    f"{', '.join(map(str, row))}; name it with --question-field"
                )
            )
            raise ColumnError(f"{where}: {why}")
        q = row[q_key]
        if not isinstance(q, str) or not q.strip():
            raise ColumnError(
                f"{where}: the question column {q_key!r} is {type(q).__name__} "
                f"{str(q)[:40]!r}, expected non-empty text"
            )
        if answer_field and answer_field not in row:
            raise ColumnError(f"{where}: {missing(row, answer_field, '--answer-field')}")
        a_key = answer_field or next((k for k in GUESS_ANSWER if k in row), None)
        rec = {"id": f"{NAME}/{split}/{len(out)}", **row, "question": q, "task": NAME}
        if a_key is not None:
            rec["answer"] = row[a_key]
        out.append(rec)
    if not out:
        raise ColumnError(f"{path}: no rows")
    return out
