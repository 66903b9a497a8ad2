"""The reading path stays short: the project files and functions that one default GRPO step runs through
(grpo.train, one step of tiny-qwen3 with the fused flow credit, every group trained, the log and the
checkpoint included; setup excluded), and those setup runs through before it (grpo.parse_args and
grpo.setup, the same run), measured with a profiler, not read off the source, and held below upper bounds
(docs/method.md states what it measured)."""

import os
import sys
import zlib
from pathlib import Path

import grpo

ROOT = Path(__file__).resolve().parents[1]
STEP_BOUND = (10, 64)  # one step reads at most these many project files and functions (docs/method.md)
SETUP_BOUND = (20, 66)  # setup reads at most these many project files and functions (docs/method.md)


def profiled(calls):
    """A sys.setprofile function adding (file relative to the root, function qualname) to `calls` for each
    call of a project function (not a library's, not a lambda or comprehension)."""

    def profile(frame, event, arg):
        path, name = os.path.abspath(frame.f_code.co_filename), frame.f_code.co_qualname
        if (
            event == "call"
            and path.startswith(f"{ROOT}/")
            and "site-packages" not in path
            and path.endswith(".py")
            and "<" not in name
        ):
            calls.add((str(Path(path).relative_to(ROOT)), name))

    return profile


def argv(tmp_path):
    return [
        "--model",
        "tiny-qwen3",
        "--device",
        "cpu",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "10",
        "--steps",
        "1",
        "--out-dir",
        str(tmp_path / "run"),
    ]


def step_calls(tmp_path, monkeypatch):
    """{(file relative to the root, function qualname)} of the project code one step of grpo.train calls."""
    real = grpo.data.reward  # the real verifier runs; a toy reward on top makes every group train
    monkeypatch.setattr(
        grpo.data, "reward", lambda txt, rec: (real(txt, rec), zlib.crc32(txt.encode()) % 4 / 3)[1]
    )
    cfg = grpo.parse_args(argv(tmp_path))
    run = grpo.setup(cfg)
    calls = set()
    sys.setprofile(profiled(calls))
    try:
        out = grpo.train(cfg, run)
    finally:
        sys.setprofile(None)
    assert out.history[0]["rows/trained"] > 0  # a real step: the update and its credit ran
    return calls


def test_one_step_reads_few_files_and_functions(tmp_path, monkeypatch):
    """One default step runs through at most STEP_BOUND project files and functions (docs/method.md states
    the counts measured and lists the files; an upper bound, so a helper extracted to be read on its own
    does not fail it). The step's own files are among those it runs: grpo.py, flowtracer.py, data.py, the
    rollout and the policy."""
    calls = step_calls(tmp_path, monkeypatch)
    files = {f for f, _ in calls}
    assert len(files) <= STEP_BOUND[0] and len(calls) <= STEP_BOUND[1], sorted(calls)
    assert {
        "grpo.py",
        "flowtracer.py",
        "data.py",
        "training/decode/rollout.py",
        "training/policy.py",
    } <= files
    assert {
        ("flowtracer.py", "trace_flow"),
        ("flowtracer.py", "flow_credit"),
        ("grpo.py", "grpo_loss"),
    } <= calls


def test_setup_reads_few_files_and_functions(tmp_path):
    """Setup, before the first step (grpo.parse_args and grpo.setup of the same run on the CPU), reads as
    plainly as the step: at most SETUP_BOUND project files and functions (docs/method.md states the
    counts)."""
    calls, words = set(), argv(tmp_path)
    sys.setprofile(profiled(calls))
    try:
        run = grpo.setup(grpo.parse_args(words))
    finally:
        sys.setprofile(None)
    assert run.start == 0 and (tmp_path / "run" / "metrics.jsonl").exists()  # a run set up, not refused
    files = {f for f, _ in calls}
    assert len(files) <= SETUP_BOUND[0] and len(calls) <= SETUP_BOUND[1], sorted(calls)
