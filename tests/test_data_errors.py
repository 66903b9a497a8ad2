"""Reliability: one clear line for every user error. Table-driven: bad dataset values and data files are a
DataError naming the field or the file, and eval.py's bad arguments and metrics files are one line, exit 2."""

import json

import pytest

import data
from evaluation import figures

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


# ----------------------------------------------------------------------------- eval.py: one line, exit 2
EVAL_BAD = [
    (["bench", "--n-problems", "0"], "--n-problems"),
    (["bench", "--ks", "8", "--n", "4"], "--ks"),
    (["intervene", "--frac", "0"], "--frac"),
    (["bench", "--n", "0"], "--n"),
    (["bench", "--ks", "0"], "--ks"),
    (["bench", "--temperature", "0"], "--temperature"),
    (["bench", "--top-p", "1.5"], "--top-p"),
    (["bench", "--top-k", "-1"], "--top-k"),
    (["bench", "--temperature", "nan"], "--temperature"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--benchmarks", "gsm9k"], "gsm9k"),
    (["intervene", "--task", "nosuch"], "nosuch"),
    (["intervene", "--layers", "mid"], "--layers"),
    (["recall", "--signals", "flow", "nosuch"], "nosuch"),
    (["recall", "--n-responses", "0"], "--n-responses"),
    (["plot", "--alpha", "0"], "--alpha"),
    (["plot", "--index", "-1"], "--index"),
    (["plot", "--token", "-2"], "--token"),
    (["intervene", "--max-new-tokens", "0"], "--max-new-tokens"),
]


@pytest.mark.parametrize("argv, word", EVAL_BAD)
def test_eval_bad_args(argv, word, capsys, monkeypatch):
    import eval as ev
    from evaluation import harness

    monkeypatch.setattr(
        harness, "load_model", lambda *a, **k: pytest.fail("a model loaded before the flag check")
    )
    with pytest.raises(SystemExit) as e:
        ev.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("eval.py: error:") and word in err, err


def test_eval_plot_reads_a_killed_runs_metrics_and_names_a_bad_line(tmp_path, capsys):
    import eval as ev

    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text('{"step": 1, "acc": 0.5}\n{"step": 2, "acc": 0.7}\n{"step": 3, "ac')  # a kill cut line 3
    ev.main(["plot", "--metrics", str(m), "--keys", "acc", "--out", str(tmp_path / "o")])
    res = json.loads((tmp_path / "o" / "plot.json").read_text())
    assert res["curves"]["final_peak_ema"]["run/acc"] == pytest.approx(figures.peak_ema([0.5, 0.7])[-1])
    m.write_text('{"step": 1, "acc": 0.5}\nnot json\n{"step": 3, "acc": 0.7}\n')
    with pytest.raises(SystemExit) as e:
        ev.main(["plot", "--metrics", str(m), "--keys", "acc", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "metrics.jsonl, line 2" in err and err.startswith("eval.py: error:")


def test_eval_plot_unknown_key_is_an_error(tmp_path, capsys):
    import eval as ev

    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text(json.dumps({"step": 1, "acc": 0.5}) + "\n")
    with pytest.raises(SystemExit) as e:
        ev.main(["plot", "--metrics", str(m), "--keys", "nosuch", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("eval.py: error: --keys nosuch")
