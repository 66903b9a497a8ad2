"""docs/your-task.md runs as written: its reward block is docs/your-task/reward.py, its rows are in
docs/your-task/train.jsonl, and its commands (grpo.py on the embedded model, the rollout's flow figure, the
TRL plug-in) succeed, shortened: one step and fewer tokens, the TRL run on tiny-qwen3, the outputs under
tmp_path. The grpo.py run is the smoke test of a user's task: a reward file that records its calls, rows
trained, and no flow fallback on a trained row whose response matches --answer-pattern.

Run: python -m pytest -q tests/test_your_task_doc.py
"""
import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "your-task.md"
# The user's function of the smoke run: the doc's data, a reward that varies within a group (how far the
# last number is from the solution), recording each call.
RECORDED = '''import re


def exact_number(completion, record):
    open({log!r}, "a").write(record["id"] + "\\n")
    numbers = re.findall(r"-?\\d+", completion)
    return -min(abs(int(numbers[-1]) - record["solution"]), 100) if numbers else -100.0
'''


def blocks(kind):
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_shows_the_files_it_uses():
    assert blocks("python") == [(ROOT / "docs" / "your-task" / "reward.py").read_text()]
    rows = (ROOT / "docs" / "your-task" / "train.jsonl").read_text().splitlines()
    assert all(line in rows for line in blocks("json")[0].splitlines())
    assert len(blocks("bash")) == 3


@pytest.mark.slow
@pytest.mark.smollm2
def test_the_doc_s_commands_run(tmp_path):
    log = tmp_path / "calls.txt"
    (tmp_path / "recorded.py").write_text(RECORDED.format(log=str(log)))
    short = {"python grpo.py": f" --steps 1 --max-new-tokens 24 --rollouts-every 1 "
                               f"--reward {tmp_path / 'recorded.py'}:exact_number",
             "python flowtracer_trl.py": " --model tiny-qwen3 --max-steps 1 --max-completion-length 16",
             "python -": ""}
    for block in blocks("bash"):
        cmd = block.replace("runs/", f"{tmp_path}/runs/").rstrip("\n")
        first = next(k for k in short if cmd.startswith(k))
        cmd += short[first]
        out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=900,
                             env=subprocess_env())
        assert out.returncode == 0, cmd + "\n" + out.stdout[-3000:] + out.stderr[-3000:]
        if first == "python grpo.py":
            run = tmp_path / "runs" / "your-task"
            m = json.loads((run / "metrics.jsonl").read_text())
            assert "reward: importing" in out.stdout and "have no answer region" not in out.stdout
            assert len(log.read_text().split()) == 1 + 8 + 4                  # setup, 2 x 4 rows, 4 held out
            rollouts = [json.loads(line) for line in open(run / "rollouts" / "step_00001.jsonl")]
            trained = [r for r in rollouts if r["adv"] != 0]
            assert m["rows/trained"] == len(trained) > 0
            assert any(any(r["answer"]) for r in trained)                    # the pattern met, so flow ran
            assert m["credit/fallback"] == sum(not any(r["answer"]) for r in trained)   # only where not met
    assert (tmp_path / "runs" / "your-task" / "figures" / "heatmap.png").is_file()
    assert (tmp_path / "runs" / "your-task-trl" / "metrics.jsonl").is_file()
