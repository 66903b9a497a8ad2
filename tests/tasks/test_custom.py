"""tasks/custom.py, your own rows (docs/your-task.md): --dataset custom keeps every column of a record,
--question-field and --answer-field read a file's columns (a built-in task's too) and leave a generated task's
rows as they are (one notice each), with_fields refuses countdown and names the columns; a custom run trains
with --answer-pattern and warns once without."""

import json

import pytest
from conftest import TINY_RUN, VARIED, task_files

import data
import grpo
from tasks import custom


# ----------------------------------------------------------------------------- custom rows and fields
def test_a_custom_record_holds_every_column(tmp_path):
    task_files(tmp_path)
    recs = data.load_task("custom", "train", tmp_path / "train.jsonl", question_field="q", answer_field="a")
    assert recs[1] == {
        "id": "custom/train/1",
        "q": "What is 10 - 2?",
        "a": 8,
        "level": 2,
        "question": "What is 10 - 2?",
        "answer": 8,
        "task": "custom",
    }
    assert data.make_prompt(recs[0], None, data.default_style("tiny-qwen3", "custom")) == "What is 3 + 4?"


def test_fields_name_a_files_columns_not_a_generated_tasks(tmp_path, capsys):
    """A generated task's rows have no columns to pick: the fields leave them as they are (the fields of an
    --eval-data-path file no longer stop a run that trains on arithmetic), and given with nothing but
    generated rows to read, one notice each says they have no effect (the run goes on)."""
    plain = data.load_task("arithmetic", "test", limit=5, seed=1)
    assert (
        data.load_task("arithmetic", "test", limit=5, seed=1, question_field="q", answer_field="a") == plain
    )
    from training.config import flags

    given = {"question_field": "q", "answer_field": "a"}
    lines = flags.unused(grpo.Config(**given), given, "grpo.py")
    assert [line.split(" has no effect: ")[0] for line in lines] == ["--question-field", "--answer-field"]
    assert (
        "arithmetic's rows are generated" in lines[0]
        and "notice: --question-field" in capsys.readouterr().err
    )
    task_files(tmp_path)
    for more in (
        {"data_path": str(tmp_path / "train.jsonl")},
        {"dataset": "gsm8k"},
        {"eval_every": 2, "eval_dataset": "gsm8k"},
    ):
        assert flags.unused(grpo.Config(**given, **more), given, "grpo.py") == [], more


def test_fields_read_a_builtin_task_from_other_columns(tmp_path, shared_data, monkeypatch):
    monkeypatch.setenv("FLOWTRACER_DATA", str(shared_data))
    want = data.load_task("gsm8k", "test", limit=5)
    src = [json.loads(line) for line in open(shared_data / "gsm8k" / "test.jsonl")][:5]
    f = tmp_path / "renamed.jsonl"
    f.write_text("".join(json.dumps({"Q": r["question"], "worked": r["answer"]}) + "\n" for r in src))
    got = data.load_task("gsm8k", "test", f, question_field="Q", answer_field="worked")
    assert [(r["question"], r["answer"]) for r in got] == [(r["question"], r["answer"]) for r in want]


def test_with_fields_refuses_countdown_and_names_the_columns():
    with pytest.raises(custom.ColumnError, match="nums and target"):
        custom.with_fields({"nums": [1], "target": 1}, "countdown", "q")
    with pytest.raises(custom.ColumnError, match=r"no column 'x' \(--answer-field\); the row's columns: p"):
        custom.with_fields({"p": 1, "s": 2}, "math500", "", "x")


# ----------------------------------------------------------------------------- a run
def test_a_custom_run_trains_with_the_pattern_and_warns_once_without(tmp_path, capsys):
    """tiny-qwen3 never writes \\boxed{}: without --answer-pattern every response lacks the answer region
    and the run says so once in two steps, with the default rule and the step's first reply, cut short; with
    a pattern that every response meets, no warning and no flow fallback, and the user's function computed
    every reward (it records its calls)."""
    log = tmp_path / "calls.txt"
    argv = task_files(
        tmp_path,
        VARIED.replace(
            "def score(completion, record):\n",
            (f"def score(completion, record):\n    open({str(log)!r}, 'a').write(record['id'] + '\\n')\n"),
        ),
    )
    grpo.main(
        [*TINY_RUN, *argv, "--steps", "2", "--rollouts-every", "1", "--out-dir", str(tmp_path / "plain")]
    )
    out = capsys.readouterr().out
    assert out.count("have no answer region") == 1 and "--answer-pattern" in out
    first = json.loads(open(tmp_path / "plain" / "rollouts" / "step_00001.jsonl").readline())["response"]
    assert "step 1: 8 of 8 responses have no answer region" in out and "<answer>...</answer>" in out
    shown = repr(first) if len(first) <= 165 else f"{first[:60]!r} [...] {first[-100:]!r}"
    assert f"one reply ({len(first)} characters): {shown}" in out  # the model's own words
    assert len(log.read_text().split()) == 1 + 2 * 8  # the setup check, then each row
    grpo.main(
        [
            *TINY_RUN,
            *argv,
            "--steps",
            "1",
            "--answer-pattern",
            r"(\S+)\s*$",
            "--out-dir",
            str(tmp_path / "mine"),
        ]
    )
    assert "have no answer region" not in capsys.readouterr().out
    m = json.loads((tmp_path / "mine" / "metrics.jsonl").read_text())
    assert m["rows/trained"] > 0 and m["credit/fallback"] == 0 and m["answers/missing"] == 0
    cfg = json.loads((tmp_path / "mine" / "ckpt" / "run_config.json").read_text())
    assert cfg["reward"] == f"{tmp_path / 'reward.py'}:score" and cfg["answer_pattern"] == r"(\S+)\s*$"
    assert json.loads(cfg["reward_files"])[0]["path"] == str((tmp_path / "reward.py").resolve())
