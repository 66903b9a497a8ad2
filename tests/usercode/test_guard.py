"""training/usercode/guard.py: a reward that never returns stops at the first Ctrl-C or SIGTERM with the last
step saved, and the resume equals the run that never hung; interruptible passes the signal to the handler in
force, then raises; a reward interrupted at setup is one line and writes nothing (hardening finding 13)."""

import os
import signal
import threading
import time

import pytest
from conftest import metrics, same_step, your_task

import grpo
from training.usercode import guard, reward_code


@pytest.mark.parametrize("sig, hang", [(signal.SIGINT, "busy"), (signal.SIGTERM, "sleep")])
def test_a_reward_that_never_returns_stops_at_the_first_signal_and_saves_the_last_step(
    tmp_path, monkeypatch, capsys, sig, hang
):
    """The reward hangs on step 2 (a busy loop, or a sleep). Under --stop-grace 0 the first Ctrl-C / SIGTERM
    stops it at once: step 1 is saved as it ended (its RNG states), the run says so and exits with the
    signal's status (130, 143); the resume equals the run that never hung. (A reward that is never
    interrupted would give up after 60 s and fail the test instead of hanging it.)"""
    mark = tmp_path / "hanging"
    wait = (
        "t = time.time()\n        while time.time() - t < 60:\n            pass"
        if hang == "busy"
        else "time.sleep(60)"
    )
    argv = your_task(
        tmp_path,
        f"open({str(mark)!r}, 'w').close()\n        {wait}\n        raise RuntimeError('never interrupted')",
        12,
        monkeypatch,
    )

    def interrupt():
        for _ in range(600):
            if mark.exists():
                time.sleep(0.2)
                return os.kill(os.getpid(), sig)
            time.sleep(0.1)

    threading.Thread(target=interrupt, daemon=True).start()
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        grpo.main([*argv, "--steps", "3", "--stop-grace", "0", "--out-dir", str(out)])
    assert done.value.code == 128 + sig and "stopped): checkpoint saved (step 1)" in capsys.readouterr().out
    assert (out / "ckpt" / "COMPLETE").read_text() == "1" and len(metrics(out)) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back
    monkeypatch.setenv("REWARD_AT", "0")
    grpo.main(["--resume", str(out), "--steps", "2", "--reward", f"{tmp_path / 'reward.py'}:score"])
    grpo.main([*argv, "--steps", "2", "--out-dir", str(tmp_path / "whole")])
    assert same_step(metrics(out)[1], metrics(tmp_path / "whole")[1])


def test_interruptible_passes_the_signal_to_the_handler_in_force_then_raises():
    """Inside: a first signal reaches the handler in force (RunLog's sets stop_requested) and raises
    Interrupted (a KeyboardInterrupt); the handlers are the ones in force again after."""
    seen = []
    before = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with pytest.raises(guard.Interrupted):
            with guard.interruptible():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with guard.interruptible():
            pass  # no signal: nothing happens
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_reward_interrupted_at_setup_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """A Ctrl-C while setup's check (or the import) runs the user's code: one line, not a traceback."""
    (tmp_path / "r.py").write_text(
        "from training.usercode import guard\nraise guard.Interrupted('SIGTERM')\n"
    )
    cfg = grpo.Config(reward=f"{tmp_path / 'r.py'}:f")
    with pytest.raises(reward_code.RewardError, match=r"interrupted \(SIGTERM\) while importing it"):
        reward_code.load(cfg, {"id": "x", "question": "q"})

    def stuck(completion, record):
        raise guard.Interrupted("SIGINT")  # what the handler raises inside the call

    monkeypatch.setattr(reward_code, "import_function", lambda s, modules=None: stuck)
    with pytest.raises(reward_code.RewardError, match=r"r\.py:f: interrupted \(SIGINT\) in the check at"):
        reward_code.load(cfg, {"id": "x", "question": "q"})
