"""docs/method.md's counts of the reading path are true: the project files and functions that one default
GRPO step runs through (grpo.train, one step of tiny-qwen3 with the fused flow credit, every group trained,
the log and the checkpoint included; setup excluded), and those setup runs through before it (grpo.parse_args
and grpo.setup, the same run), measured with a profiler, not read off the source."""

import os
import re
import sys
import zlib
from pathlib import Path

import grpo

ROOT = Path(__file__).resolve().parents[1]
SETUP_BOUND = (19, 60)  # setup reads fewer project files and functions than these (docs/method.md)


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


def test_the_documented_reading_path_is_what_one_step_runs(tmp_path, monkeypatch):
    calls = step_calls(tmp_path, monkeypatch)
    files = sorted({f for f, _ in calls})
    doc = (ROOT / "docs" / "method.md").read_text()
    m = re.search(
        r"passes\s+through\s+(\d+)\s+project\s+files\s+and\s+(\d+)\s+of\s+their\s+functions:\s*(.*?)\.\n",
        doc,
        re.S,
    )
    assert m, "docs/method.md must state the reading path's count"
    listed = sorted(re.findall(r"`([\w/]+\.py)`", m.group(3)))
    assert (int(m.group(1)), int(m.group(2)), listed) == (len(files), len(calls), files), sorted(calls)


def test_the_documented_setup_path_is_what_setup_runs(tmp_path):
    """Setup, before the first step (grpo.parse_args and grpo.setup of the same run on the CPU), reads as
    plainly as the step: its count is docs/method.md's, and below SETUP_BOUND, the bound stated there."""
    calls, words = set(), argv(tmp_path)
    sys.setprofile(profiled(calls))
    try:
        run = grpo.setup(grpo.parse_args(words))
    finally:
        sys.setprofile(None)
    assert run.start == 0 and (tmp_path / "run" / "metrics.jsonl").exists()  # a run set up, not refused
    files = sorted({f for f, _ in calls})
    doc = (ROOT / "docs" / "method.md").read_text()
    m = re.search(
        r"reads\s+(\d+)\s+project\s+files\s+and\s+(\d+)\s+of\s+their\s+functions\s+before\s+the\s+"
        r"first\s+step:\s*(.*?)\.\n",
        doc,
        re.S,
    )
    assert m, "docs/method.md must state setup's count"
    listed = sorted(re.findall(r"`([\w/]+\.py)`", m.group(3)))
    assert (int(m.group(1)), int(m.group(2)), listed) == (len(files), len(calls), files), sorted(calls)
    assert len(files) < SETUP_BOUND[0] and len(calls) < SETUP_BOUND[1], sorted(calls)
