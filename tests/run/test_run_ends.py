"""A run ends the way schedulers and people expect: grpo.py stopped by SIGTERM exits 143 and by Ctrl-C 130
(128 + the signal), its step saved and the --resume line printed, and the resume finishes with 0; a slow
--reward finishes its step within --stop-grace; one that never returns is stopped when the grace ends or at a
second signal, and the last completed step stands. Each in a subprocess that gets real signals
(training/usercode/guard.py's Stop)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_RUN, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"q": "What is 3 + 4?", "a": 7}, {"q": "What is 10 - 2?", "a": 8}, {"q": "What is 6 * 2?", "a": 12}]
# A reward that varies in each group; on the call numbered AT (1: setup's check, 2-9: step 1's rows, 10-17:
# step 2's) it marks the file `mark` and sleeps SLEEP s (600: never returns, in a test's time); every call
# sleeps EACH s.
REWARD = """import os, time, zlib
CALLS = []


def score(completion, record):
    CALLS.append(1)
    if len(CALLS) == int(os.environ["AT"]):
        open(os.environ["MARK"], "w").close()
        time.sleep(float(os.environ["SLEEP"]))
    time.sleep(float(os.environ["EACH"]))
    return zlib.crc32((completion + record["id"]).encode()) % 4 / 3
"""


def start(tmp_path, *flags, at=0, sleep=0.0, each=0.0):
    """grpo.py on the tiny model, the CPU and the toy task with REWARD, in its own process."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "reward.py").write_text(REWARD)
    env = {**subprocess_env(), "AT": str(at), "SLEEP": str(sleep), "EACH": str(each)}
    env["MARK"] = str(tmp_path / "mark")
    argv = [
        *TINY_RUN,
        "--dataset",
        "custom",
        "--data-path",
        str(tmp_path / "train.jsonl"),
        "--question-field",
        "q",
        "--answer-field",
        "a",
        "--reward",
        f"{tmp_path / 'reward.py'}:score",
        "--out-dir",
        str(tmp_path / "run"),
        *flags,
    ]
    return subprocess.Popen(
        [sys.executable, str(ROOT / "grpo.py"), *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(ready, proc, limit=240.0):
    t = time.time() + limit
    while not ready():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < t, "the run never got there"
        time.sleep(0.1)


def steps(run):
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def saved(run):
    return (run / "ckpt" / "COMPLETE").read_text()


@pytest.mark.parametrize(
    "sig, code, said", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")]
)
def test_a_signal_after_the_first_step_saves_it_and_exits_128_plus_the_signal(tmp_path, sig, code, said):
    """SIGTERM or Ctrl-C once step 1 is logged: the step running finishes, is saved, the --resume line, and
    status 143 or 130 (it was 0, as for a finished run); the resume runs the next step and exits 0."""
    proc, run = start(tmp_path, "--steps", "40", "--save-every", "100"), tmp_path / "run"
    wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text(), proc)
    proc.send_signal(sig)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == code, out[-3000:]
    done = steps(run)
    assert done == list(range(1, len(done) + 1)) and saved(run) == str(done[-1]) and len(done) < 40
    assert (
        f"interrupted ({said}: the step finished): checkpoint saved (step {done[-1]}); continue with "
        f"--resume {run}" in out
    )
    more = subprocess.run(
        [sys.executable, str(ROOT / "grpo.py"), "--resume", str(run), "--steps", str(done[-1] + 1)],
        cwd=tmp_path,
        env={**subprocess_env(), "AT": "0", "SLEEP": "0", "EACH": "0", "MARK": "x"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert more.returncode == 0, more.stdout[-2000:] + more.stderr[-2000:]
    assert steps(run) == [*done, done[-1] + 1]


def test_a_slow_reward_finishes_its_step_within_the_grace(tmp_path):
    """A reward of 1 s a call, SIGTERM at step 1's first call: the step's 8 calls (8 s) finish within the
    30 s grace, step 1 is saved and the run exits 143 (the first signal had stopped the reward at once: step
    1 lost, nothing saved, status 0)."""
    proc, run = start(tmp_path, "--steps", "3", at=2, each=1.0), tmp_path / "run"
    wait_for((tmp_path / "mark").exists, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 143, out[-3000:]
    assert steps(run) == [1] and saved(run) == "1"
    assert "interrupted (SIGTERM: the step finished): checkpoint saved (step 1)" in out


def test_a_reward_that_never_returns_is_stopped_when_the_grace_ends(tmp_path):
    """Step 2's first call never returns; SIGTERM: the run waits out a 2 s grace, then stops the reward,
    saves step 1 as it ended and exits 143, its last line saying that the grace ended."""
    proc, run = start(tmp_path, "--steps", "3", "--stop-grace", "2", at=10, sleep=600), tmp_path / "run"
    wait_for((tmp_path / "mark").exists, proc)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 143, out[-3000:]
    assert time.monotonic() - t >= 2.0  # the grace waited out
    assert steps(run) == [1] and saved(run) == "1"
    assert (
        "was still running when the 2 s grace ended (--stop-grace), and was stopped): checkpoint "
        "saved (step 1)" in out
    )


def test_a_second_signal_stops_a_reward_that_never_returns_at_once(tmp_path):
    """The same reward, the default 30 s grace: after the first SIGTERM the run is still waiting 3 s later;
    a second stops it at once (well within the grace), step 1 saved, status 143."""
    proc, run = start(tmp_path, "--steps", "3", at=10, sleep=600), tmp_path / "run"
    wait_for((tmp_path / "mark").exists, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(3)
    assert proc.poll() is None  # the grace: the reward may still finish
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 143, out[-3000:]
    assert time.monotonic() - t < 25  # not the grace's end: the save and the exit
    assert steps(run) == [1] and saved(run) == "1"
    assert "interrupted (a second SIGTERM stopped it at once): checkpoint saved (step 1)" in out


# ----------------------------------------------------------------------------- eval.py learn, the TRL plug-in
def test_the_trl_plug_in_saves_the_step_and_exits_143(tmp_path):
    """flowtracer_trl.py, SIGTERM during step 2's rewards (the reward waits 3 s there, so the signal lands in
    that step on a busy machine): TRL's step finishes, checkpoint-2 is saved, the resume line, status 143 (a
    traceback or a killed process before)."""
    pytest.importorskip("trl", reason="TRL's plug-in needs trl: pip install -r requirements.txt")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "reward.py").write_text(REWARD)
    env = {**subprocess_env(), "AT": "4", "SLEEP": "3", "EACH": "0", "MARK": str(tmp_path / "mark")}
    flags = "--model tiny-qwen3 --use-cpu --bf16 false --max-steps 40 --num-generations 2 "
    flags += "--per-device-train-batch-size 2 "
    flags += "--max-completion-length 8 --warmup-steps 0 --save-strategy no --dataset custom "
    flags += "--question-field q --answer-field a"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "flowtracer_trl.py"), *flags.split(), "--data-path"]
        + [str(tmp_path / "train.jsonl"), "--reward", f"{tmp_path / 'reward.py'}:score"]
        + ["--output-dir", str(tmp_path / "trl")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for((tmp_path / "mark").exists, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 143, out[-3000:]
    at = tmp_path / "trl" / "checkpoint-2"
    assert at.is_dir() and f"continue with the same flags and\n  --resume-from-checkpoint {at}" in out, out[
        -3000:
    ]


def test_eval_learn_exits_with_the_signals_status(tmp_path, monkeypatch, capsys):
    """eval.py learn: a SIGTERM to learn is 143, and an arm-seed's grpo.py that exits 143 (its step saved)
    stops learn with 143 too, not a "grpo.py exited with status 143" error; the line says to run it again."""
    import os
    from types import SimpleNamespace

    import grpo
    from evaluation import learn

    def signalled(argv, prog):  # learn's first step, stopped by a real SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    monkeypatch.setattr(learn, "parse", signalled)
    with pytest.raises(SystemExit) as e:
        learn.main([], grpo)
    assert (
        e.value.code == 143 and "interrupted (SIGTERM); the same command continues" in capsys.readouterr().err
    )
    script = tmp_path / "grpo.py"
    script.write_text("import sys\nsys.exit(143)\n")
    g = SimpleNamespace(
        out=tmp_path / "grid",
        rc=SimpleNamespace(steps=2),
        grpo=SimpleNamespace(__file__=str(script)),
        recipe=[],
        every=1,
        cfg=SimpleNamespace(eval_size=1),
        eval_dataset="arithmetic",
    )
    with pytest.raises(learn.LearnStopped) as stopped:
        learn.train(g, "flow-s0", SimpleNamespace(update=lambda n: None))
    assert stopped.value.args[0] == signal.SIGTERM
