"""training/run/checkpoint.py on the one-GPU path, checked on the CPU with tiny models (a checkpoint written
on each device present) and fakes where the CPU cannot show it; each test failed before its fix: a checkpoint
is read onto the CPU, the run's flags from a small JSON file; a full disk is found at setup (checkpoint_bytes:
what a checkpoint holds), and torch.save's own full-disk error is one line like the others. `eval.py memory`
names the disk a checkpoint needs: tests/evaluation/test_memory_command.py."""

import json
import shutil

import pytest
import torch
from conftest import DEVICES, last_line

import grpo
from training.model import trainable
from training.model.load import load_model
from training.run import checkpoint as ckpt_io


@pytest.fixture(scope="module", params=DEVICES)
def tiny_state(request):
    """A model and an optimizer with state on each device: its checkpoint is read onto the CPU."""
    model, tok = load_model("tiny-llama", device=request.param)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]], device=model.device)).logits.sum().backward()
    opt.step()  # the optimizer has its state
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, tok, opt, sched, grpo.Config(model="tiny-llama", credit="entropy")


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
    device = next(model.parameters()).device
    drawn = torch.rand(4, device=device)  # the RNG state saved was before it
    assert ckpt_io.load_checkpoint(tmp_path / "ckpt", opt, sched) == (2, 0)
    assert [c.get("map_location") for c in calls] == ["cpu"] and calls[0]["weights_only"]
    assert torch.equal(torch.rand(4, device=device), drawn)  # this device's RNG restored


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial ckpt.tmp
    assert ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), opt, sched)[0] == 1
    assert grpo.parse_args(["--resume", str(tmp_path)]).model == "tiny-llama"  # --resume works


def test_the_real_zip_writer_error_is_a_full_disk():
    """The message torch.save gives into /dev/full (a device that is always full) is recognised."""
    with pytest.raises(RuntimeError) as e:
        torch.save({"a": torch.zeros(10**5)}, "/dev/full")
    assert ckpt_io.no_space(e.value), str(e.value)
    assert not ckpt_io.no_space(RuntimeError("a bug"))


def disk_with(monkeypatch, free):
    """shutil.disk_usage as a disk with `free` bytes free, wherever checkpoint.py asks."""
    monkeypatch.setattr(ckpt_io.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**15, 0, free))


def tiny_run(tmp_path, *flags):
    return [
        "--model",
        "tiny-qwen3",
        "--device",
        "cpu",
        "--prompts-per-step",
        "1",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--out-dir",
        str(tmp_path / "run"),
        *flags,
    ]


@pytest.mark.parametrize("steps, copies", [(4, 2), (1, 1)])
@pytest.mark.parametrize("optimizer, per_param", [("adamw", 4 + 8), ("kahan", 2 + 6)])
def test_a_disk_too_small_for_the_checkpoints_stops_before_the_first_step(
    tmp_path, monkeypatch, capsys, device, optimizer, per_param, steps, copies
):
    """One byte short of the checkpoints the run will write, under each scheme (adamw: fp32 weights, m, v;
    kahan, the CUDA default: bf16 weights, m, v and compensation), on each device: one line before the first
    step. (On the H100 this test asked for the adamw size while the run, --optimizer auto on CUDA, was
    kahan's: 12 B/param of disk minus a byte was more than kahan's 8, so the run rightly began.)"""
    model = load_model("tiny-qwen3", device="cpu")[0]
    n = sum(p.numel() for p in model.parameters())
    one = ckpt_io.checkpoint_bytes(n, optimizer)
    assert one == n * per_param
    disk_with(monkeypatch, copies * one - 1)
    monkeypatch.setattr(grpo, "generate", lambda *a, **k: pytest.fail("a step began"))
    with pytest.raises(SystemExit) as e:
        grpo.main(
            tiny_run(
                tmp_path,
                "--steps",
                str(steps),
                "--save-every",
                "2",
                "--optimizer",
                optimizer,
                "--device",
                device.type,
            )
        )
    line = last_line(capsys)
    assert e.value.code == 2 and line.startswith("grpo.py: error: ") and "Traceback" not in line, line
    assert f"need about {ckpt_io.gb(copies * one)}" in line, line
    assert all(w in line for w in ("--out-dir", "--save-every")), line
    assert ("--optimizer kahan" in line) == (optimizer == "adamw"), line  # the smaller state, if not used
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # a rerun needs no --overwrite


@pytest.mark.parametrize("optimizer", ["adamw", "kahan"])
def test_checkpoint_bytes_is_what_a_checkpoint_holds(tmp_path, optimizer):
    """checkpoint_bytes (the disk check's estimate) against a checkpoint written under each scheme: its
    weights and optimizer tensors (state_bytes), and the files on disk, which add only the tokenizer, the
    config and the pickle's framing (under 2 MB at this size)."""
    cfg = grpo.Config(model="tiny-qwen3", optimizer=optimizer, lr=1e-3)
    model, tok = load_model("tiny-qwen3", device="cpu", dtype=trainable.weight_dtype(cfg, "cpu"))
    opt = trainable.make_optimizer(model, cfg, "cpu")
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-2)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    one = ckpt_io.checkpoint_bytes(sum(p.numel() for p in model.parameters()), optimizer)
    scalars = 8 * len(opt.state)  # a step count per parameter
    assert one <= ckpt_io.state_bytes(model, opt) <= one + scalars
    held = sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir() if f.is_file())
    assert one <= held < one + 2 * 2**20, (held, one)


def test_a_disk_just_large_enough_runs(tmp_path, monkeypatch):
    """Enough for one checkpoint beside the one a resumed run already has."""
    model = load_model("tiny-qwen3", device="cpu")[0]
    one = ckpt_io.checkpoint_bytes(sum(p.numel() for p in model.parameters()), "adamw")
    grpo.main(tiny_run(tmp_path, "--steps", "1"))
    held = sum(f.stat().st_size for f in (tmp_path / "run" / "ckpt").iterdir())
    disk_with(monkeypatch, 2 * one - held)
    grpo.main(tiny_run(tmp_path, "--steps", "2", "--resume", str(tmp_path / "run")))
    assert [json.loads(x)["step"] for x in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
