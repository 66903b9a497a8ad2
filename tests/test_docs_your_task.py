"""docs/your-task.md runs as written: its reward block is docs/your-task/reward.py, its rows are in
docs/your-task/train.jsonl, and its commands (grpo.py on the embedded model, the credit page and the flow
figures of a saved step, the TRL plug-in) succeed, shortened: one step and fewer tokens, the TRL run on
tiny-qwen3, the outputs under tmp_path. The grpo.py run is the smoke test of a user's task: a reward file
that records its calls, rows trained, and no flow fallback on a trained row whose response matches
--answer-pattern. The TRL drop-in example (the same block in docs/scale-out.md) runs in this process on
tiny-qwen3, one step on the CPU, with TRL's two reward functions as the docs write them.

Run: python -m pytest -q tests/test_docs_your_task.py
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
RECORDED = """import re


def exact_number(completion, record):
    open({log!r}, "a").write(record["id"] + "\\n")
    numbers = re.findall(r"-?\\d+", completion)
    return -min(abs(int(numbers[-1]) - record["solution"]), 100) if numbers else -100.0
"""


def blocks(kind):
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_shows_the_files_it_uses():
    assert blocks("python")[0] == (ROOT / "docs" / "your-task" / "reward.py").read_text()
    rows = (ROOT / "docs" / "your-task" / "train.jsonl").read_text().splitlines()
    assert all(line in rows for line in blocks("json")[0].splitlines())
    assert len(blocks("bash")) == 4


@pytest.mark.slow
@pytest.mark.smollm2
def test_the_doc_s_commands_run(tmp_path):
    log = tmp_path / "calls.txt"
    (tmp_path / "recorded.py").write_text(RECORDED.format(log=str(log)))
    short = {
        "python grpo.py": f" --steps 1 --max-new-tokens 24 --rollouts-every 1 "
        f"--reward {tmp_path / 'recorded.py'}:exact_number",
        "python flowtracer_trl.py": " --model tiny-qwen3 --max-steps 1 --max-completion-length 16",
        "python eval.py credit": "",
        "python eval.py plot": " --threads 1",
    }
    for block in blocks("bash"):
        cmd = block.replace("runs/", f"{tmp_path}/runs/").rstrip("\n")
        first = next(k for k in short if cmd.startswith(k))
        cmd += short[first]
        out = subprocess.run(
            ["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=900, env=subprocess_env()
        )
        assert out.returncode == 0, cmd + "\n" + out.stdout[-3000:] + out.stderr[-3000:]
        if first == "python grpo.py":
            run = tmp_path / "runs" / "your-task"
            m = json.loads((run / "metrics.jsonl").read_text())
            assert "reward: importing" in out.stdout and "have no answer region" not in out.stdout
            assert len(log.read_text().split()) == 1 + 8 + 4  # setup, 2 x 4 rows, 4 held out
            rollouts = [json.loads(line) for line in open(run / "rollouts" / "step_00001.jsonl")]
            trained = [r for r in rollouts if r["adv"] != 0]
            assert m["rows/trained"] == len(trained) > 0
            assert any(any(r["answer"]) for r in trained)  # the pattern met, so flow ran
            assert m["credit/fallback"] == sum(not any(r["answer"]) for r in trained)  # only where not met
    page = (tmp_path / "runs" / "your-task" / "credit" / "step_00001" / "credit.html").read_text()
    assert 'class="ans"' in page and "boost" in page  # the answer and the boosted tokens
    for f in ("heatmap.png", "heatmap.html", "inout.png"):
        assert (tmp_path / "runs" / "your-task" / "figures" / f).is_file()
    plot = json.loads((tmp_path / "runs" / "your-task" / "figures" / "plot.json").read_text())
    assert plot["args"]["model"] == str(tmp_path / "runs" / "your-task")  # the run's checkpoint, by default
    assert (tmp_path / "runs" / "your-task-trl" / "metrics.jsonl").is_file()


# ----------------------------------------------------------------------------- the TRL drop-in
def varied(completions, **kwargs):
    """A third reward for the test: 0, 1, 0, 1 within each group, so that every row has A != 0 and trains."""
    return [float(i % 2) for i in range(len(completions))]


def test_the_trl_drop_in_runs_as_the_docs_show_it(tmp_path, monkeypatch):
    """The drop-in block is the same in docs/your-task.md and docs/scale-out.md; run on tiny-qwen3 (saved as
    a directory: the block names a model), one step on the CPU, TRL calls both reward functions and the
    plug-in credits the rows (a third reward, `varied`, makes every row train)."""
    pytest.importorskip("trl")
    import datasets

    from training.model.load import load_model

    code = next(b for b in blocks("python") if "FlowTracerGRPOTrainer" in b)
    scale_out = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "scale-out.md").read_text(), re.S)
    assert code in scale_out
    model, tok = load_model("tiny-qwen3", device="cpu")
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    changes = {
        '"HuggingFaceTB/SmolLM2-135M-Instruct"': repr(str(tmp_path / "tiny")),
        '"runs/trl-drop-in"': repr(str(tmp_path / "out")),
        "max_steps=3": "max_steps=1",
        "max_completion_length=64": "max_completion_length=16",
        "learning_rate=1e-5)": "learning_rate=1e-5, use_cpu=True, bf16=False, report_to='none')",
        "[accuracy_reward, format_reward]": "[accuracy_reward, format_reward, varied]",
    }
    for old, new in changes.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    monkeypatch.chdir(ROOT)  # the block's data path
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    scope = {"__name__": "__main__", "varied": varied}
    exec(compile(code, str(DOC), "exec"), scope)
    log = scope["trainer"].state.log_history[0]
    assert {"rewards/accuracy_reward/mean", "rewards/format_reward/mean"} <= set(log)
    assert type(scope["trainer"]).__name__ == "FlowTracerGRPOTrainer" and log["frac_reward_zero_std"] == 0
    assert 0 <= log["credit/fallback_frac"] <= 1 and log["credit/boosted_frac"] >= 0  # the rows credited
