"""training/run/checkpoint.py's save, atomic: no lost run data. Nothing here loads a real model (the random
tiny one stands in). The save is killed at every file-system operation in turn (kill_at) and a complete
checkpoint stands; a half-deleted, corrupted or foreign trainer state is named (grpo.py --resume, eval.py
bench); the embedded demo saves once, without the optimizer state, and a checkpoint without it resumes saying
the optimizer restarts; a save prints no progress bar. The metrics cut back on resume and a new run that never
silently replaces an old one: tests/run/test_directory.py."""

import shutil
from pathlib import Path

import pytest
import torch
from conftest import Killed

import grpo
from training.model.load import load_model
from training.run import checkpoint as ckpt_io


# ----------------------------------------------------------------------------- a kill, a broken state
@pytest.fixture(scope="module")
def tiny_state():
    model, tok = load_model("tiny-llama", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, tok, opt, sched, grpo.Config(device="cpu")


def kill_at(monkeypatch, k, model, tok):
    """Make the k-th file-system operation of the next save raise Killed (k = -1: none); returns the log of
    operations. A killed rmtree has deleted the weights first: a half-deleted directory."""
    ops = []

    def wrap(owner, name, half=None):
        real = getattr(owner, name)

        def op(*a, **kw):
            where = a[0] if name in ("rmtree", "rename", "unlink", "write_text") else a[-1]
            ops.append(f"{name}({Path(where).name})")
            if len(ops) - 1 == k:
                if half:
                    half(*a)
                raise Killed(ops[-1])
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, op)

    wrap(type(model), "save_pretrained")
    wrap(type(tok), "save_pretrained")
    wrap(ckpt_io.torch, "save")
    wrap(Path, "write_text")
    wrap(Path, "rename")
    wrap(Path, "unlink")
    wrap(ckpt_io.shutil, "rmtree", half=lambda d, *_, **__: (d / "model.safetensors").unlink(missing_ok=True))
    return ops


@pytest.fixture(scope="module")
def prior_states(tiny_state, tmp_path_factory):
    """Run directories as a save finds them: a finished checkpoint at step 1; a save of step 2 killed between
    renaming ckpt/ away and ckpt.tmp/ in (ckpt.tmp at 2 and ckpt.old at 1, no ckpt/)."""
    model, tok, opt, sched, cfg = tiny_state
    root = tmp_path_factory.mktemp("prior")
    ckpt_io.save_checkpoint(root / "done" / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    shutil.copytree(root / "done", root / "half")
    with pytest.MonkeyPatch.context() as mp:
        ops = kill_at(mp, -1, model, tok)
        real = Path.rename

        def rename(self, target):
            if self.name == "ckpt.tmp":
                raise Killed("rename(ckpt.tmp)")
            return real(self, target)

        mp.setattr(Path, "rename", rename)
        with pytest.raises(Killed):
            ckpt_io.save_checkpoint(root / "half" / "ckpt", model, tok, opt, sched, 2, cfg, 0)
    assert sorted(p.name for p in (root / "half").iterdir()) == ["ckpt.old", "ckpt.tmp"] and ops
    return {"done": (root / "done", 1), "half": (root / "half", 2)}


@pytest.mark.parametrize("prior", ["done", "half"])
def test_a_kill_at_any_point_of_the_save_leaves_a_checkpoint(
    tmp_path, monkeypatch, tiny_state, prior_states, prior
):
    """Every file-system operation of the save in turn raises (a kill there): the run directory still holds a
    complete checkpoint, of the latest step before the save or of the new one, that loads (trainer state and
    weights); and the next save repairs the directory."""
    model, tok, opt, sched, cfg = tiny_state
    src, before = prior_states[prior]
    with monkeypatch.context() as mp:  # a clean save: how many operations there are
        shutil.copytree(src, tmp_path / "count")
        ops = kill_at(mp, -1, model, tok)
        ckpt_io.save_checkpoint(tmp_path / "count" / "ckpt", model, tok, opt, sched, 3, cfg, 0)
    assert len(ops) >= 10 and any(o.startswith("rename") for o in ops), ops
    for k in range(len(ops)):
        run = tmp_path / f"kill{k}"
        shutil.copytree(src, run)
        with monkeypatch.context() as mp:
            kill_at(mp, k, model, tok)
            with pytest.raises(Killed):
                ckpt_io.save_checkpoint(run / "ckpt", model, tok, opt, sched, 3, cfg, 0)
        found = ckpt_io.find_checkpoint(run)
        step, _ = ckpt_io.load_checkpoint(found, opt, sched)
        assert step in (before, 3), (ops[k], step)
        assert (found / "model.safetensors").is_file() and (found / "tokenizer.json").is_file(), ops[k]
        ckpt_io.save_checkpoint(run / "ckpt", model, tok, opt, sched, 4, cfg, 0)  # the next save
        assert [p.name for p in run.iterdir()] == ["ckpt"], ops[k]
        assert ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(run), opt, sched)[0] == 4
    load_model(str(found), device="cpu")  # the weights load too


def test_a_half_deleted_checkpoint_is_never_complete(tmp_path, monkeypatch, tiny_state):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt.old")

    def killed(d, *a, **k):  # rmtree killed after deleting the weights
        Path(d, "model.safetensors").unlink()
        raise Killed("rmtree")

    monkeypatch.setattr(ckpt_io.shutil, "rmtree", killed)
    with pytest.raises(Killed):
        ckpt_io.discard(tmp_path / "ckpt")
    assert not ckpt_io.complete(tmp_path / "ckpt") and ckpt_io.find_checkpoint(tmp_path).name == "ckpt.old"


def test_corrupted_trainer_state_names_the_file(tmp_path, tiny_state, in_process, monkeypatch):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    (tmp_path / "ckpt" / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="trainer_state.pt"):
        ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), opt, sched)
    monkeypatch.chdir(tmp_path)  # its out_dir, runs/grpo, unlocked
    p = in_process(grpo.main, "--resume", str(tmp_path))  # `python grpo.py --resume ...`
    assert p.returncode == 2 and "trainer_state.pt" in p.stderr and "Traceback" not in p.stderr


def test_eval_names_a_corrupted_checkpoint_in_one_line(tmp_path, tiny_state, capsys):
    import eval as ev

    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "run" / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    (tmp_path / "run" / "ckpt" / "trainer_state.pt").write_bytes(b"\x80garbage")
    with pytest.raises(SystemExit) as e:
        ev.main(
            [
                "bench",
                "--model",
                str(tmp_path / "run"),
                "--device",
                "cpu",
                "--benchmarks",
                "gsm8k",
                "--n-problems",
                "1",
                "--n",
                "1",
                "--max-new-tokens",
                "2",
                "--out",
                str(tmp_path / "o"),
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("eval.py: error:") and "trainer_state.pt" in err


def test_a_trainer_state_of_another_kind_names_the_file(tmp_path, tiny_state):
    model, tok, opt, sched, cfg = tiny_state
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    torch.save({"step": 1}, tmp_path / "ckpt" / "trainer_state.pt")
    with pytest.raises(ValueError, match=r"trainer_state\.pt: not a grpo\.py trainer state \(missing opt"):
        ckpt_io.load_checkpoint(tmp_path / "ckpt", opt, sched)
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)  # another model's optimizer
    other_sched = torch.optim.lr_scheduler.LambdaLR(other, lambda _: 1)
    with pytest.raises(ValueError, match=r"trainer_state\.pt: does not fit"):
        ckpt_io.load_checkpoint(tmp_path / "ckpt", other, other_sched)


# ----------------------------------------------------------------------------- the demo's footprint
def test_the_embedded_demo_saves_once_without_the_optimizer_state():
    """The demo (SmolLM2-135M, fp32) saved AdamW's moments (2x the weights: 1.08 GB) twice; now once, at the
    end, its weights alone. The paper's models keep the state (an exact --resume)."""
    cfg = grpo.parse_args([])
    assert [s for s in range(1, cfg.steps + 1) if s % cfg.save_every == 0 or s == cfg.steps] == [cfg.steps]
    assert cfg.save_optimizer is False
    assert grpo.parse_args(["--model", "Qwen/Qwen3-4B-Base"]).save_optimizer is True
    assert grpo.parse_args(["--save-optimizer"]).save_optimizer is True  # asked for: kept


def test_a_checkpoint_without_the_optimizer_state_resumes_and_says_the_optimizer_restarts(tmp_path, capsys):
    model, tok = load_model("tiny-llama", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()  # AdamW holds its moments now
    sched.step()  # lr = 1e-3 * 0.5
    for keep in (True, False):
        cfg = grpo.Config(model="tiny-llama", save_optimizer=keep)
        ckpt_io.save_checkpoint(tmp_path / str(keep) / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    size = {k: (tmp_path / str(k) / "ckpt" / "trainer_state.pt").stat().st_size for k in (True, False)}
    n = sum(p.numel() for p in model.parameters())
    assert size[True] - size[False] >= 2 * n * 4  # exp_avg and exp_avg_sq, fp32
    capsys.readouterr()
    for keep in (True, False):
        fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
        fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 0.5**s)
        assert ckpt_io.load_checkpoint(tmp_path / str(keep) / "ckpt", fresh, fresh_sched) == (1, 0)
        said = capsys.readouterr().out.strip().splitlines()
        assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-4  # the schedule goes on
        if keep:  # exact: the moments are back
            assert said == [] and all(
                torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
                for p in model.parameters()
            )
        else:  # one line: the optimizer restarts
            assert len(fresh.state) == 0 and len(said) == 1 and "AdamW restarts" in said[0], said


def test_a_save_prints_no_library_progress_bar(tmp_path, tiny_state, capfd):
    from transformers.utils import logging as hf_logging

    model, tok, opt, sched, cfg = tiny_state
    assert hf_logging.is_progress_bar_enabled()
    ckpt_io.save_checkpoint(tmp_path / "ckpt", model, tok, opt, sched, 1, cfg, 0)
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err and "it/s" not in err
    assert hf_logging.is_progress_bar_enabled()  # muted for the save alone
