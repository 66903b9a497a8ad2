"""training/run/directory.py and the run directory (setup.check_out_dir): its lock (a second run into a locked
out_dir names the holder: hardening finding 2), paths of the wrong kind where a run writes, a new run that
never silently replaces an old one, metrics.jsonl cut back to the checkpoint on resume (a kill during the cut
loses nothing); and a run's directory and its files end to end: a moved run resumes where it is, a run that
would do nothing says so, the last K checkpoints are kept, the curves are drawn at every save, a --config file
replays a run, TensorBoard's scalars equal the metrics with held-out evaluation, and --overwrite deletes the
kept checkpoints and the tracker files too."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Killed, last_line, no_model, subprocess_env

import grpo
from training.run import checkpoint as ckpt_io
from training.run import directory, log
from training.run import setup as run_mod

SMOKE = [
    "--model",
    "tiny-qwen3",
    "--device",
    "cpu",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "8",
    "--micro-batch",
    "2",
]


@pytest.fixture
def run(in_process):
    """`python grpo.py args` as grpo.main(args) in this process (conftest.in_process): returncode, stderr."""
    return lambda *args: in_process(grpo.main, *args)


def steps_in(d):
    return [json.loads(line)["step"] for line in open(Path(d) / "metrics.jsonl")]


# ----------------------------------------------------------------------------- the run directory
def test_a_moved_run_resumes_in_its_new_directory(tmp_path, run):
    a, b = tmp_path / "a", tmp_path / "b"
    first = run(*SMOKE, "--steps", "2", "--out-dir", str(a))
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.move(a, b)
    second = run("--resume", str(b), "--steps", "3")
    assert second.returncode == 0, second.stderr[-2000:]
    assert not a.exists()  # nothing re-created where the run began
    assert steps_in(b) == [1, 2, 3]
    assert (b / "ckpt" / ckpt_io.MARK).read_text() == "3"
    assert json.loads((b / "ckpt" / ckpt_io.RUN_CONFIG).read_text())["out_dir"] == str(b)


def test_resume_refuses_another_out_dir(tmp_path, run):
    done = run(*SMOKE, "--steps", "1", "--out-dir", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = run("--resume", str(tmp_path / "a"), "--steps", "2", "--out-dir", str(tmp_path / "c"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1].startswith(
        "grpo.py: error: --resume continues the run in its own"
    )
    assert "Traceback" not in out.stderr and not (tmp_path / "c").exists()


def test_a_resume_with_nothing_to_run_says_so(tmp_path, run):
    done = run(*SMOKE, "--steps", "2", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    for steps in ("2", "1"):
        out = run("--resume", str(tmp_path), "--steps", steps)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines()[-1] == (
            f"grpo.py: error: --resume {tmp_path}: the run is at step 2 already and --steps is {steps}: "
            f"nothing to run (give --steps more than 2)"
        )
    assert steps_in(tmp_path) == [1, 2]


def test_keep_checkpoints_keeps_the_last_k(tmp_path, run):
    out = run(
        *SMOKE, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "3", "--out-dir", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt"))
    assert kept == ["ckpt", "ckpt-00002", "ckpt-00003"]
    assert [(tmp_path / d / ckpt_io.MARK).read_text() for d in kept] == ["4", "2", "3"]
    default = run(*SMOKE, "--steps", "2", "--save-every", "1", "--out-dir", str(tmp_path / "one"))
    assert default.returncode == 0, default.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "one").iterdir() if p.name.startswith("ckpt")) == ["ckpt"]


def test_curves_are_drawn_at_every_save(tmp_path, monkeypatch):
    """curves.png is redrawn as the run goes (at every checkpoint), not only when it ends."""
    drawn = []
    real = log.plot_curves
    monkeypatch.setattr(log, "plot_curves", lambda *a: (drawn.append(len(steps_in(tmp_path))), real(*a))[1])
    grpo.train(grpo.parse_args([*SMOKE, "--steps", "3", "--save-every", "1", "--out-dir", str(tmp_path)]))
    assert drawn == [1, 2, 3] and (tmp_path / "curves.png").is_file()


def test_a_config_file_replays_a_run_and_flags_win(tmp_path, run):
    cfg = grpo.parse_args([*SMOKE, "--lr", "3e-4", "--seed", "7", "--out-dir", str(tmp_path / "a")])
    directory.write_atomic(
        tmp_path / "run_config.json", json.dumps(cfg.__dict__)
    )  # as a checkpoint writes it
    again = grpo.parse_args(["--config", str(tmp_path / "run_config.json")])
    assert {**again.__dict__, "config": ""} == cfg.__dict__
    over = grpo.parse_args(["--config", str(tmp_path / "run_config.json"), "--lr", "1e-5"])
    assert over.lr == 1e-5 and over.seed == 7
    (tmp_path / "run.yaml").write_text("model: tiny-qwen3\nlr: 2.0e-4\nmicro-batch: 3\n")
    y = grpo.parse_args(["--config", str(tmp_path / "run.yaml")])
    assert (y.model, y.lr, y.micro_batch) == ("tiny-qwen3", 2e-4, 3)
    (tmp_path / "bad.yaml").write_text("model: tiny-qwen3\nlearning_rate: 1e-5\n")
    out = run("--config", str(tmp_path / "bad.yaml"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo.py: error:") and "bad.yaml" in last and "learning_rate" in last


def test_tensorboard_scalars_of_a_run_equal_its_metrics_with_evaluation(tmp_path, run):
    """grpo.py --report-to tensorboard --eval-every 2 --steps 3: the event files, read back with TensorBoard's
    own reader, hold every numeric metric of metrics.jsonl at its step, eval/accuracy at steps 2 and 3."""
    from tensorboard.backend.event_processing import event_accumulator

    out = run(
        *SMOKE,
        "--steps",
        "3",
        "--report-to",
        "tensorboard",
        "--eval-every",
        "2",
        "--eval-size",
        "3",
        "--out-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines if "eval/accuracy" in m] == [2, 3]
    assert all(m["eval/total"] == 3 for m in lines if "eval/total" in m)
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    logged = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    want = {}
    for m in lines:
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)):  # bools too, as 0 / 1
                want.setdefault(k, {})[m["step"]] = float(v)
    assert set(logged) == set(want)
    for k in want:
        assert logged[k] == pytest.approx(want[k], rel=1e-6), k  # TensorBoard stores fp32


def test_overwrite_deletes_the_kept_checkpoints_and_the_tracker_files_too(tmp_path, run):
    """--overwrite starts afresh: the older saves of --keep-checkpoints and --report-to's event files go with
    the metrics, so the new run's TensorBoard shows no step of the old one."""
    from tensorboard.backend.event_processing import event_accumulator

    old = run(
        *SMOKE,
        "--steps",
        "3",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "3",
        "--report-to",
        "tensorboard",
        "--out-dir",
        str(tmp_path),
    )
    assert old.returncode == 0, old.stderr[-2000:]
    assert (tmp_path / "ckpt-00002").is_dir() and (tmp_path / "tensorboard").is_dir()
    new = run(*SMOKE, "--steps", "1", "--report-to", "tensorboard", "--overwrite", "--out-dir", str(tmp_path))
    assert new.returncode == 0, new.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt"]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {e.step for e in acc.Scalars("loss")} == {1} and steps_in(tmp_path) == [1]


# ----------------------------------------------------------------------------- 2. two runs, one out_dir
HOLD = (
    "import sys; from training.run import directory; directory.lock_out_dir(sys.argv[1]); "
    "print('locked', flush=True); sys.stdin.read()"
)


def test_a_second_run_into_a_locked_out_dir_names_the_holder(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        no_model(monkeypatch)
        with pytest.raises(SystemExit) as e:
            grpo.main(["--out-dir", str(out), "--overwrite"])
        line = last_line(capsys)
        assert e.value.code == 2 and line.startswith("grpo.py: error: ") and f"PID {holder.pid}" in line, line
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written, nothing cut
    finally:
        holder.stdin.close()
        holder.wait(60)
    run_mod.check_out_dir(out, resume=False, overwrite=False)  # free once the holder ends
    run_mod.check_out_dir(out, resume=False, overwrite=False)  # the same process: again fine
    directory.unlock_out_dir(out)


def test_an_out_dir_that_is_a_file_fails_before_the_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        grpo.main(["--out-dir", str(tmp_path / "file")])
    assert e.value.code == 2 and "file" in last_line(capsys)


# ----------------------------------------------------------------------------- what a run may write over
@pytest.mark.parametrize(
    "name, kind",
    [
        ("curves.png", "dir"),
        ("metrics.jsonl", "dir"),
        (".lock", "dir"),
        ("rollouts", "file"),
        ("ckpt", "file"),
        ("ckpt.tmp", "file"),
        ("ckpt.old", "file"),
        ("ckpt", "dangling link"),
    ],
)
@pytest.mark.parametrize(
    "resume, overwrite, claim", [(False, False, False), (False, True, True), (True, False, True)]
)
def test_a_path_of_the_wrong_kind_where_the_run_writes_is_one_error(
    tmp_path, name, kind, resume, overwrite, claim
):
    p = tmp_path / name
    if kind == "dir":
        p.mkdir()
    elif kind == "file":
        p.write_text("mine")
    else:
        p.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ckpt_io.RunError) as e:
        run_mod.check_out_dir(tmp_path, resume=resume, overwrite=overwrite, claim=claim)
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    assert p.is_symlink() or p.exists()  # --overwrite deleted nothing
    assert not (tmp_path / ".lock").is_file()  # checked before the lock is taken


OUT_DIRS = [  # (what the out_dir holds, resume, overwrite, error?)
    ([], False, False, False),
    (["metrics.jsonl"], False, False, True),
    (["ckpt/"], False, False, True),
    (["ckpt.tmp/"], False, False, True),
    (["metrics.jsonl", "ckpt/"], True, False, False),
    (["metrics.jsonl", "ckpt/", "rollouts/", "curves.png"], False, True, False),
    (["notes.txt"], False, False, False),
]


@pytest.mark.parametrize("held, resume, overwrite, error", OUT_DIRS)
def test_a_new_run_never_silently_replaces_an_old_one(tmp_path, held, resume, overwrite, error):
    for h in held:
        (tmp_path / h).mkdir() if h.endswith("/") else (tmp_path / h).write_text("x")
    if error:
        with pytest.raises(ValueError, match=r"--resume .*--overwrite"):
            run_mod.check_out_dir(tmp_path, resume, overwrite)
        assert all((tmp_path / h).exists() for h in held)
        return
    run_mod.check_out_dir(tmp_path, resume, overwrite)
    gone = overwrite and not resume
    assert all((tmp_path / h).exists() != (gone and h != "notes.txt") for h in held)


def test_metrics_resume_cuts_back_to_the_checkpoint(tmp_path):
    f = directory.open_metrics(tmp_path, None)
    for s in (1, 2, 3):
        log.write_metrics(f, {"step": s})
    f.close()
    with open(tmp_path / "metrics.jsonl", "a") as g:
        g.write('{"step": 4, "cut by a ki')  # a line cut by a kill
    f = directory.open_metrics(tmp_path, 2)
    log.write_metrics(f, {"step": 3})
    f.close()
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_metrics_cut_keeps_one_line_per_step_and_survives_a_kill(tmp_path, monkeypatch):
    m = tmp_path / "metrics.jsonl"  # as an older version left it: steps 1, 2, 3, 3, 4
    rows = ((1, 0), (2, 0), (3, 0), (3, 1), (4, 0))
    m.write_text("".join(json.dumps({"step": s, "v": v}) + "\n" for s, v in rows))
    before = m.read_text()

    def killed(*a):
        raise Killed("os.replace")

    monkeypatch.setattr(directory.os, "replace", killed)
    with pytest.raises(Killed):  # a kill during the cut: nothing lost
        directory.open_metrics(tmp_path, 3)
    assert m.read_text() == before
    monkeypatch.undo()
    directory.open_metrics(tmp_path, 3).close()
    kept = [(r["step"], r["v"]) for r in map(json.loads, m.read_text().splitlines())]
    assert kept == [(1, 0), (2, 0), (3, 1)]  # the last line of step 3: the redone one
    f = directory.open_metrics(tmp_path, None)  # a plain open appends, it never truncates
    log.write_metrics(f, {"step": 4, "v": 2})
    f.close()
    assert len(m.read_text().splitlines()) == 4
