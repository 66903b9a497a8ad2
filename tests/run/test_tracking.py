"""training/run/tracking.py (grpo.py --report-to): what is logged to TensorBoard is read back with
TensorBoard's
own reader and equals what was logged; wandb missing is one error naming its install command."""

import builtins
import json
import sys
import types

import pytest

from training.run import tracking

reader = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

LINES = [
    {
        "step": 1,
        "reward/mean": 0.25,
        "loss": -0.5,
        "eval/accuracy": 0.75,
        "eval/correct": 3,
        "eval/total": 4,
        "entropy": None,
        "skipped": "every prompt is longer",
        "eval/right": [1, 0, 1, 1],
        "bad": True,
    },
    {"step": 2, "reward/mean": 0.5, "loss": 1.25e-3, "entropy": 2.0},
    {"step": 3, "reward/mean": 1.0, "loss": 0.0, "entropy": 1.5, "eval/accuracy": 0.5},
]
CONFIG = {
    "model": "tiny-qwen3",
    "lr": 1e-6,
    "steps": 3,
    "data_path": "",
    "resume": None,
    "grad_checkpointing": True,
}


def read(out):
    acc = reader.EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return acc, {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_equal_what_was_logged(tmp_path):
    tr = tracking.open("tensorboard", tmp_path, CONFIG)
    for m in LINES:
        tr.log(m, step=m["step"])
    tr.close()
    acc, got = read(tmp_path)
    want = {}
    for m in LINES:  # numbers only; None, strings, lists are not scalars
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)):
                want.setdefault(k, []).append((m["step"], float(v)))
    assert set(got) == set(want) and "eval/right" not in got and "skipped" not in got and "step" not in got
    for tag, pts in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in pts]
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in pts], rel=1e-6)  # float32 on disk
    assert got["eval/accuracy"] == [(1, 0.75), (3, 0.5)] and got["bad"] == [(1, 1.0)]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n")) == CONFIG
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")


def test_a_resumed_run_purges_the_steps_after_its_checkpoint(tmp_path):
    tr = tracking.open("tensorboard", tmp_path, CONFIG)
    for m in LINES:  # steps 1..3 logged, then killed; the checkpoint is at 1
        tr.log(m, step=m["step"])
    tr.close()
    tr = tracking.open("tensorboard", tmp_path, CONFIG, resume_step=1)
    tr.log({"reward/mean": -1.0}, step=2)  # step 2 again, after the resume
    tr.close()
    assert read(tmp_path)[1]["reward/mean"] == [(1, 0.25), (2, -1.0)]


def test_none_logs_nothing(tmp_path):
    tr = tracking.open("none", tmp_path, CONFIG)
    tr.log(LINES[0], step=1)
    tr.close()
    assert list(tmp_path.iterdir()) == []


def test_wandb_missing_names_the_install_command(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_wandb(name, *args, **kwargs):  # as if wandb were not installed, whether or not it is
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("No module named 'wandb'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match="pip install wandb"):
        tracking.open("wandb", tmp_path, CONFIG)


def test_wandb_is_offline_in_the_run_directory(tmp_path, monkeypatch):
    calls = {}

    class Run:
        def log(self, scalars, step):
            calls.setdefault("log", []).append((step, scalars))

        def finish(self):
            calls["finish"] = True

    fake = types.SimpleNamespace(init=lambda **kw: calls.update(init=kw) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tr = tracking.open("wandb", tmp_path, CONFIG)
    tr.log(LINES[1], step=2)
    tr.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["dir"] == str(tmp_path)
    assert calls["init"]["config"] == CONFIG and calls["finish"]
    assert calls["log"] == [(2, {"reward/mean": 0.5, "loss": 1.25e-3, "entropy": 2.0})]
    monkeypatch.setenv("WANDB_MODE", "online")
    tracking.open("wandb", tmp_path, CONFIG)
    assert calls["init"]["mode"] == "online"


def test_an_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="none, tensorboard, wandb"):
        tracking.open("mlflow", tmp_path, CONFIG)
