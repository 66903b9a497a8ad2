"""Stopping the user's code: a --reward that never returns is stopped by the first Ctrl-C or SIGTERM.

    with interruptible():           # reward_code.py, around each call of a --reward function
        value = fn(completion, record)

Between steps a first Ctrl-C / SIGTERM only asks the run to stop after the step (training/run/log.py's
RunLog.on_signal: stop_requested), and a second stops at once, losing the step. Inside a --reward the step
cannot finish until the function returns, so there the first signal also raises Interrupted at once; grpo.py
then saves the last completed step as it ended (RunLog.stopped) and exits. Exceptions the user's code raises
are named by training/usercode/reward_code.py (RewardError); Interrupted is a KeyboardInterrupt, which no
guard keeps. `guarded` adds one more: os._exit inside the user's code is a SystemExit, named like any other
raise.

Run the tests: python -m pytest -q tests/usercode/test_guard.py
"""

import contextlib
import os
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM inside the user's code (`interruptible`): the step cannot finish, so grpo.py saves
    the last completed one (RunLog.stopped) and stops. A KeyboardInterrupt: no guard of user code keeps it."""


SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interruptible():
    """Around a call of the user's code (training/usercode/reward_code.py): a Ctrl-C or SIGTERM first goes to
    the handler in force (RunLog's sets stop_requested; SIGTERM's default ends the process), then raises
    Interrupted at once, so a reward that never returns is stopped by the first signal, not by a second that
    loses the step. A call stuck in one C function that keeps Python's lock (a catastrophic `re` match) runs
    no handler: only SIGKILL stops it. Outside the main thread nothing changes."""
    before = {s: signal.getsignal(s) for s in SIGNALS}
    if threading.current_thread() is not threading.main_thread() or None in before.values():
        yield
        return

    def stop(signum, frame):
        for s, h in before.items():  # the handlers in force again, for a next signal
            signal.signal(s, h)
        h = before[signum]
        if h == signal.SIG_IGN:
            return
        if h == signal.SIG_DFL:  # SIGTERM's default: the process ends, as it would
            signal.raise_signal(signum)
        elif callable(h) and h is not signal.default_int_handler:
            h(signum, frame)  # RunLog.on_signal: stop_requested, then the default
        raise Interrupted(signal.Signals(signum).name)

    for s in SIGNALS:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, h in before.items():
            if signal.getsignal(s) is stop:
                signal.signal(s, h)


@contextlib.contextmanager
def guarded():
    """Around each call of the user's code: `interruptible`, and os._exit made a SystemExit, which the caller
    names as the user's error like any raise (os._exit would end the run at once, with its status, 0 too,
    skipping every handler). The real os._exit is back after."""
    real = os._exit

    def no_exit(status=0):
        raise SystemExit(f"os._exit({status})")

    os._exit = no_exit
    try:
        with interruptible():
            yield
    finally:
        os._exit = real
