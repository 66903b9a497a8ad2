"""Odd inputs to eval.py get one clear error, or mean what their help says: its numbers and metrics files from
the command line, and a memory snapshot that is never unpickled."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev
from evaluation import memtrace

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


@pytest.fixture
def eval_main(in_process):
    """eval.py's main(argv) in this process, read as run_eval's result (conftest.in_process)."""
    return lambda *argv: in_process(ev.main, *argv)


def one_error(p, *words):
    """Exit 2, exactly one `eval.py: error:` line holding `words`, and no traceback."""
    lines = [x for x in p.stderr.splitlines() if x.startswith("eval.py: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def test_eval_bench_top_k_0_is_off(tmp_path, eval_main):
    p = eval_main(
        "bench",
        "--model",
        "tiny-qwen3",
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


@pytest.mark.parametrize(
    "line",
    [
        '{"step": null, "acc": 0.2}',
        '{"step": "2", "acc": 0.2}',
        '{"step": 1.5, "acc": 0.2}',
        "step 2 acc 0.2",
        "[2, 0.2]",
    ],
)
def test_eval_plot_names_the_file_and_line_of_a_malformed_metrics_line(tmp_path, eval_main, line):
    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text(f'{{"step": 1, "acc": 0.5}}\n{line}\n{{"step": 3, "acc": 0.7}}\n')
    one_error(eval_main("plot", "--metrics", m, "--keys", "acc", "--out", tmp_path / "o"), f"{m}, line 2")
    assert not (tmp_path / "o" / "curves.png").exists()


def test_eval_plot_keeps_two_runs_of_the_same_name_apart(tmp_path, eval_main):
    paths = []
    for d, acc in (("a", 0.25), ("b", 0.75)):
        m = tmp_path / d / "run" / "metrics.jsonl"
        m.parent.mkdir(parents=True)
        m.write_text(json.dumps({"step": 1, "acc": acc}) + "\n")
        paths.append(m)
    p = eval_main("plot", "--metrics", *paths, "--keys", "acc", "--out", tmp_path / "o")
    assert p.returncode == 0, p.stderr[-2000:]
    ema = json.loads((tmp_path / "o" / "plot.json").read_text())["curves"]["final_peak_ema"]
    assert sorted(ema.values()) == [0.25, 0.75]  # two curves, not one overwritten by the other


# ----------------------------------------------------------------------------- memory snapshots
class Evil:
    """A pickle that creates a file when it is loaded: what a crafted snapshot could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_snapshot_is_read_back_from_its_json_summary_never_unpickled(tmp_path):
    frames = [{"filename": "/x/policy.py", "line": 183, "name": "piece"}]
    snap = {
        "base_allocated": 10**9,
        "window_peak": 15 * 10**8,
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 4 * 10**8, "frames": frames},  # 1.4 GB
                {"action": "alloc", "addr": 2, "size": 10**8, "frames": []},  # 1.5 GB: the peak
                {"action": "free_requested", "addr": 2, "size": 10**8, "frames": []},
            ]
        ],
    }
    path = tmp_path / "snap" / "backward.pickle"
    memtrace.save_snapshot(snap, str(path))
    assert path.read_bytes() == pickle.dumps(snap)  # the pickle is memory_viz's
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps(Evil(marker)))  # swapped for a crafted one
    out = memtrace.report_held(str(path), 12 * 10**8).splitlines()
    assert not marker.exists()  # nothing was unpickled
    assert "peak 1.50 GB" in out[0] and "estimated 1.20" in out[0] and "1.00 GB of it from before" in out[0]
    assert [x.split()[:2] for x in out[2:]] == [["0.400", "1"], ["0.100", "1"]]
    assert out[2].endswith("- | - | policy.py:183 piece")
    Path(str(path) + ".json").unlink()
    with pytest.raises(ValueError, match=r"backward\.pickle\.json"):
        memtrace.report_held(str(path), 1200)
    src = (ROOT / "evaluation" / "memtrace.py").read_text() + (ROOT / "eval.py").read_text()
    assert "pickle.load" not in src
