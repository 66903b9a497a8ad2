"""eval.py's command line: every bad flag, number or file is one `eval.py: error:` line, exit 2, before any
model loads (numbers past int64 or out of range, a device it cannot use, a --responses row naming an unknown
task, results that cannot be written on a full disk: hardening finding 11 among them), or means what its help
says (bench --top-k 0 is off). The metrics files of `eval.py plot`: tests/evaluation/test_figures.py; a memory
snapshot is never unpickled: tests/evaluation/test_memtrace.py."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import enospc, last_line, no_model, one_error

import eval as ev
from evaluation import harness

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- eval.py from the command line
def run_eval(*argv, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *map(str, argv)],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_eval_bench_top_k_0_is_off(tmp_path, eval_main):
    p = eval_main(
        "bench",
        "--model",
        "tiny-qwen3",
        "--device",
        "cpu",
        "--benchmarks",
        "countdown",
        "--n-problems",
        "1",
        "--n",
        "2",
        "--ks",
        "1",
        "--max-new-tokens",
        "3",
        "--top-k",
        "0",
        "--out",
        tmp_path,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["args"]["top_k"] == 0 and res["benchmarks"]["countdown"]["n_problems"] == 1


@pytest.mark.parametrize(
    "argv, words",
    [
        (["learn", "--seeds", "99999999999999999999"], ["--seeds", "at most"]),
        (["learn", "--seeds", "0,99999999999999999999"], ["--seeds"]),
        (["bench", "--max-new-tokens", "99999999999999999999"], ["--max-new-tokens", "int64"]),
        (["recall", "--n-responses", "-99999999999999999999"], ["--n-responses", "int64"]),
        (["answer-forms", "--percents", "10", "99999999999999999999"], ["--percents"]),
        (["plot", "--metrics"], ["--metrics"]),
        (["plot", "--figures", "curves"], ["--metrics"]),
    ],
)
def test_eval_out_of_range_numbers_and_missing_files_are_one_error_line(tmp_path, eval_main, argv, words):
    one_error(eval_main(*argv, "--out" if argv[0] != "learn" else "--out-dir", tmp_path / "o"), *words)


def test_an_eval_error_from_the_shell_is_one_line_exit_2(tmp_path):
    """The cases above call eval.py's main in this process; this one runs the real command line."""
    p = run_eval("bench", "--max-new-tokens", "99999999999999999999", "--out", tmp_path / "o")
    one_error(p, "--max-new-tokens", "int64")
    assert not (tmp_path / "o").exists()


def test_eval_max_new_tokens_past_the_models_context_is_one_error_line(tmp_path, eval_main):
    one_error(
        eval_main(
            "bench",
            "--model",
            "tiny-qwen3",
            "--device",
            "cpu",
            "--benchmarks",
            "countdown",
            "--n-problems",
            "1",
            "--max-new-tokens",
            "100000",
            "--out",
            tmp_path,
        ),
        "--max-new-tokens 100000",
        "2048",
    )


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


# ----------------------------------------------------------------------------- 11. eval.py's flags, up front
EVAL_BAD_BEFORE_MODEL = [  # (argv, a word of the one line); each before any model loads
    (["bench", "--device", "cuda:99"], "--device"),
    (["bench", "--device", "tpu"], "--device"),
    (["plot", "--answer-pattern", "("], "--answer-pattern: '(' does not compile"),
    (["bench", "--seed", str(2**70)], "--seed"),
    (["intervene", "--seed", "-1"], "--seed"),
    (["bench", "--out", "{file}"], "is a file"),
    (["plot", "--out", "{file}/sub"], "is a file"),
    (["recall", "--out", "{file}"], "--out"),
    (["bench", "--threads", str(10**20)], "--threads"),
]


@pytest.mark.parametrize("argv, word", EVAL_BAD_BEFORE_MODEL)
def test_eval_refuses_bad_flags_before_the_model(tmp_path, monkeypatch, capsys, argv, word):
    (tmp_path / "file").write_text("x")
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        ev.main([a.replace("{file}", str(tmp_path / "file")) for a in argv])
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("eval.py: error: ") and word in line, line


def test_cuda_without_a_gpu_is_refused_by_eval():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit):
        ev.parse(["bench", "--device", "cuda"])


@pytest.mark.parametrize("task", ["poetry", ["math"], "countdown"])
def test_eval_responses_with_an_unknown_task_is_one_line(tmp_path, capsys, task):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"question": "1 + 1?", "answer": "2", "response": "\\boxed{2}", "task": task}))
    with pytest.raises(SystemExit) as e:
        ev.main(
            [
                "intervene",
                "--model",
                "tiny-llama",
                "--device",
                "cpu",
                "--responses",
                str(path),
                "--style",
                "fewshot",
                "--n-problems",
                "1",
                "--max-new-tokens",
                "2",
                "--out",
                str(tmp_path / "o"),
            ]
        )
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("eval.py: error: ") and "line 1: task" in line, line


# ----------------------------------------------------------------------------- a full disk
def test_eval_full_disk_when_writing_results_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Path, "write_text", enospc)
    with pytest.raises(harness.EvalError) as e:  # eval.main prints it as one line, exit 2
        harness.save(argparse.Namespace(out=str(tmp_path), cmd="bench"), {}, "| table |")
    msg, code = e.value.args
    assert code == 2 and "cannot write the results (No space left on device)" in msg
