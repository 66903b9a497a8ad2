"""The one-GPU path, checked on the CPU: what a CUDA run does differently, shown with tiny models, the meta
device or a fake where the CPU cannot show it. One section per finding; each test failed before its fix.

  checkpoints   read onto the CPU, the run's flags from a small JSON file; a full disk found at setup, and
                torch.save's own full-disk error is one line like the others
"""
import json
import shutil

import pytest
import torch

import grpo
from training import checkpoint as ckpt_io
from training.models import load_model


@pytest.fixture(scope="module")
def tiny_state():
    model, tok = load_model("tiny-llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()                                                             # the optimizer has its state
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, tok, opt, sched, grpo.Config(model="tiny-llama", credit="entropy")


def last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- checkpoints: resume
def watch_loads(monkeypatch):
    """Every torch.load call's keyword arguments, in a list."""
    calls, real = [], torch.load

    def load(*a, **k):
        calls.append(k)
        return real(*a, **k)
    monkeypatch.setattr(ckpt_io.torch, "load", load)
    return calls


def test_resume_reads_the_flags_without_the_tensors(tmp_path, tiny_state, monkeypatch):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    calls = watch_loads(monkeypatch)
    got = grpo.parse_args(["--resume", str(tmp_path), "--steps", "9"])
    assert (got.model, got.credit, got.steps) == ("tiny-llama", "entropy", 9)
    assert calls == [], "parse_args read trainer_state.pt"
    assert json.loads((tmp_path / "ckpt" / ckpt_io.RUN_CONFIG).read_text())["credit"] == "entropy"
    assert ckpt_io.load_checkpoint(tmp_path / "ckpt", opt, sched) == (2, 0)
    assert [c.get("map_location") for c in calls] == ["cpu"] and calls[0]["weights_only"]


def test_a_checkpoint_without_the_json_still_resumes_on_the_cpu(tmp_path, tiny_state, monkeypatch):
    """A checkpoint written before run_config.json existed: the flags come from trainer_state.pt, read onto
    the CPU."""
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    (tmp_path / "ckpt" / ckpt_io.RUN_CONFIG).unlink()
    calls = watch_loads(monkeypatch)
    got = grpo.parse_args(["--resume", str(tmp_path)])
    assert (got.model, got.credit) == ("tiny-llama", "entropy")
    assert [c.get("map_location") for c in calls] == ["cpu"]


def test_a_broken_run_config_names_the_file(tmp_path, tiny_state, capsys):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    (tmp_path / "ckpt" / ckpt_io.RUN_CONFIG).write_text('{"model": "tiny-')
    with pytest.raises(SystemExit) as e:
        grpo.parse_args(["--resume", str(tmp_path)])
    assert e.value.code == 2 and ckpt_io.RUN_CONFIG in last_line(capsys)


# ----------------------------------------------------------------------------- checkpoints: a full disk
def zip_writer_full(*a, **k):
    """What torch.save raises when the disk fills under its zip writer (measured into /dev/full)."""
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def test_torch_saves_full_disk_error_is_one_line_and_loses_nothing(tmp_path, tiny_state, monkeypatch):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    with monkeypatch.context() as mp:
        mp.setattr(ckpt_io.torch, "save", zip_writer_full)
        with pytest.raises(ckpt_io.RunError, match=r"ckpt: no space left .* needs about [0-9.]+ [MG]iB"):
            ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]                 # no partial ckpt.tmp
    assert ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), opt, sched)[0] == 1
    assert grpo.parse_args(["--resume", str(tmp_path)]).model == "tiny-llama"     # --resume works


def test_the_real_zip_writer_error_is_a_full_disk():
    """The message torch.save gives into /dev/full (a device that is always full) is recognised."""
    with pytest.raises(RuntimeError) as e:
        torch.save({"a": torch.zeros(10 ** 5)}, "/dev/full")
    assert ckpt_io.no_space(e.value), str(e.value)
    assert not ckpt_io.no_space(RuntimeError("a bug"))
