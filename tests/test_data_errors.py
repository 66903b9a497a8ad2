"""data.py's user errors, one clear line each. Table-driven: bad dataset values and data files are a DataError
naming the field or the file; slow or malformed input (hardening findings 8-10): 60,000 spaces read at once, a
FIFO as the data file refused at once, a lone surrogate naming the record, each one line from grpo.py before
any model loads. eval.py's bad arguments: tests/test_eval_cli.py."""

import json
import os
import threading

import pytest
from conftest import last_line, no_model, timed

import data
import grpo
from evaluation import probes

# ----------------------------------------------------------------------------- bad data
BAD_ROWS = [  # (jsonl line, task, words the DataError must name)
    ('{"question": "", "answer": "2"}', "arithmetic", ["line 1", "question", "empty"]),
    ('{"question": "1+1?", "answer": NaN}', "arithmetic", ["line 1", "answer", "finite"]),
    ('{"question": "1+1?", "answer": Infinity}', "arithmetic", ["line 1", "answer", "finite"]),
    ('{"question": "1+1?", "answer": "nan"}', "arithmetic", ["line 1", "answer"]),
    ('{"question": "1+1?", "answer": "-Infinity"}', "arithmetic", ["line 1", "answer", "finite"]),
    ('{"question": "  ", "answer": "2"}', "arithmetic", ["line 1", "question", "empty"]),
    ('{"question": "1+1?"}', "arithmetic", ["line 1", "missing", "answer"]),
    ('{"question": "1+1?", "answer": true}', "arithmetic", ["line 1", "answer", "bool"]),
    ('{"question": "q", "final_answer": []}', "olympiadbench", ["line 1", "final_answer", "empty"]),
    ('{"question": "q", "final_answer": [NaN]}', "olympiadbench", ["line 1", "answer", "finite"]),
    ('{"question": "q", "answer": "so #### nan"}', "gsm8k", ["line 1", "answer", "finite"]),
    ('{"question": "q", "answer": "so ####  "}', "gsm8k", ["line 1", "answer", "empty"]),
    ('{"nums": [3, 4], "target": 17.9}', "countdown", ["line 1", "target"]),
    ('{"nums": [3, 4], "target": 17.0}', "countdown", ["line 1", "target", "int"]),
    ('{"nums": [3.7, 4], "target": 17}', "countdown", ["line 1", "nums"]),
    ('{"nums": [], "target": 17}', "countdown", ["line 1", "nums"]),
]


@pytest.mark.parametrize("line, task, words", BAD_ROWS)
def test_bad_dataset_values_are_rejected_naming_the_field(tmp_path, line, task, words):
    p = tmp_path / "rows.jsonl"
    p.write_text(line + "\n")
    split = "test" if task in ("olympiadbench", "gsm8k") else "train"
    with pytest.raises(data.DataError) as e:
        data.load_task(task, split=split, path=p)
    assert str(p) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def parquet(path, content):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"], "answer": ["1"]}), path)
    path.write_bytes(path.read_bytes()[:content])  # truncated


BAD_FILES = [  # (file name, how to make it, words the DataError must name); every --data-path mistake
    ("nosuch.jsonl", None, ["nosuch.jsonl", "no such file"]),
    ("rows.csv", lambda p: p.write_text("question,answer\n1+1?,2\n"), ["rows.csv", "CSV", "JSONL"]),
    ("rows", lambda p: p.write_text("{}\n"), ["rows", "unsupported format"]),
    ("adir.jsonl", lambda p: p.mkdir(), ["adir.jsonl", "directory"]),
    ("empty.jsonl", lambda p: p.write_text(""), ["empty.jsonl", "no rows"]),
    ("blank.jsonl", lambda p: p.write_text("\n  \n"), ["blank.jsonl", "no rows"]),
    (
        "bad.jsonl",
        lambda p: p.write_text('{"question": "a", "answer": "1"}\n{"question": \n'),
        ["bad.jsonl, line 2", "invalid JSON"],
    ),
    (
        "array.json",
        lambda p: p.write_text('[\n{"question": "a", "answer": "1"}\n]\n'),
        ["array.json, line 1", "JSON array"],
    ),
    ("list.jsonl", lambda p: p.write_text('["a", "1"]\n'), ["list.jsonl, line 1", "JSON object"]),
    (
        "latin1.jsonl",
        lambda p: p.write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n'),
        ["latin1.jsonl, line 1", "not UTF-8"],
    ),
    ("cut.parquet", lambda p: parquet(p, 40), ["cut.parquet", "parquet"]),
]


@pytest.mark.parametrize("name, make, words", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_data_files_are_a_data_error_naming_them(tmp_path, name, make, words):
    p = tmp_path / name
    if make:
        make(p)
    with pytest.raises(data.DataError) as e:
        data.load_task("arithmetic", split="train", path=p)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_non_utf8_names_file_and_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(data.DataError, match=r"x\.jsonl, line 2: not UTF-8"):
        data.load_task("arithmetic", split="train", path=p)


# ----------------------------------------------------------------------------- 8-10. slow or malformed input
def test_the_loader_reads_60000_spaces_at_once(tmp_path):
    path = tmp_path / "spaces.jsonl"
    row = {"question": " " * 60_000 + "What is 1 + 1?", "answer": " " * 60_000 + "2"}
    path.write_text(json.dumps(row) + "\n")
    assert timed(data.load_task, "arithmetic", "train", str(path)) < 2.0


def in_thread(fn, *a):
    """(finished, error) of fn(*a) given 20 s: a hang fails the test instead of hanging it."""
    box = []

    def work():
        try:
            fn(*a)
            box.append(None)
        except Exception as e:
            box.append(e)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(20)
    return bool(box), box[0] if box else None


def test_a_fifo_as_the_data_file_is_refused_at_once(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    done, err = in_thread(data.load_task, "arithmetic", "train", str(fifo))
    assert done and isinstance(err, data.DataError) and "not a regular file" in str(err)
    done, err = in_thread(probes.load_responses, str(fifo), None, "plain")  # eval's --responses
    assert done and isinstance(err, data.DataError)
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        grpo.main(["--data-path", str(fifo), "--out-dir", str(tmp_path / "run")])
    assert e.value.code == 2 and "data.jsonl: not a regular file" in last_line(capsys)


SURROGATES = [  # (row, the field the error names)
    ({"question": "What is \ud800 1 + 1?", "answer": "2"}, "question"),
    ({"question": "What is 1 + 1?", "answer": "2\udfff"}, "answer"),
]


@pytest.mark.parametrize("row, field", SURROGATES)
def test_a_lone_surrogate_names_the_record(tmp_path, monkeypatch, capsys, row, field):
    path = tmp_path / "s.jsonl"
    path.write_text('{"question": "fine", "answer": "1"}\n' + json.dumps(row) + "\n")  # \ud800 escapes
    with pytest.raises(data.DataError, match=rf"s\.jsonl, line 2: field '{field}' holds a lone surrogate"):
        data.load_task("arithmetic", "train", str(path))
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        grpo.main(["--data-path", str(path), "--out-dir", str(tmp_path / "run")])
    assert e.value.code == 2 and "line 2" in last_line(capsys)
    path.write_text(json.dumps({**row, "response": "\\boxed{2}"}) + "\n")
    with pytest.raises(data.DataError, match="line 1: field .* lone surrogate"):
        probes.load_responses(str(path), None, "plain")
