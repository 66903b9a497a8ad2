"""A run's Ctrl-C and SIGTERM, and the user's code they stop: the step finishes within a grace, then the run
saves and exits with the signal's status.

    stop = Stop(grace=30.0).install()    # training/run/log.py's RunLog; flowtracer_trl.py's main
    with guarded():                      # reward_code.py, around each call of a --reward function
        value = fn(completion, record)
    sys.exit(stop.status)                # grpo.main: 128 + the signal, 143 (SIGTERM) or 130 (Ctrl-C)

  first signal   stop.requested: the step finishes, is saved, and the run exits with stop.status (the
                 shell's 128 + the signal: a scheduler that reads 0 as "done" sees that it was stopped)
  the grace      user code (a --reward: an LLM judge, a sandboxed test run) running at the first signal, or
                 called after it, may run until `grace` seconds after it (30 s: Slurm's and Kubernetes'
                 default grace between SIGTERM and SIGKILL); still running then, it is stopped: Interrupted
                 is raised inside it, and the last completed step stands (RunLog.stopped saves it)
  second signal  Interrupted at once, wherever the run is: the last completed step stands, the same status
The words of the run's last line say which of the three ended it (Stop.ended). A watchdog thread sends the
first signal again to the main thread when the grace ends inside the user's code (signal.pthread_kill: a
sleep or a busy loop is interrupted, as by the signal itself; not signal.alarm, which math-verify's timeouts
use). A call stuck in one C function that keeps Python's lock (a catastrophic `re` match) runs no handler:
only SIGKILL stops it.

Without a Stop installed (eval.py bench, a test's thread) `interruptible` keeps the rule it had: the first
signal goes to the handler in force, then raises Interrupted at once. Exceptions the user's code raises are
named by training/usercode/reward_code.py (RewardError); Interrupted is a KeyboardInterrupt, which no guard
keeps. `guarded` adds one more: os._exit inside the user's code is a SystemExit, named like any other raise.

Run the tests: python -m pytest -q tests/run/test_run_ends.py tests/usercode/test_guard.py
"""

import contextlib
import os
import signal
import sys
import threading
import time


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM that stops the run mid-step: a second one, or the grace's end inside the user's
    code (args[0]: what stopped it, in words). grpo.py saves the last completed step (RunLog.stopped) and
    exits with the signal's status. A KeyboardInterrupt: no guard of user code keeps it."""


SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.05  # how often the watchdog looks at the clock once a stop is requested


def status(signum) -> int:
    """The shell's exit status of a process a signal stopped: 128 + its number (130 Ctrl-C, 143 SIGTERM)."""
    return 128 + int(signum)


class Stop:
    """A run's Ctrl-C and SIGTERM (the module docstring): installed as the handler of both (`install`, the
    main thread only), it is itself the handler: `interruptible` finds it there."""

    def __init__(self, grace):
        self.grace = grace  # seconds user code may run after the first signal (--stop-grace)
        self.signum = None  # the first signal (None: none yet)
        self.since = None  # its time.monotonic()
        self.how = ""  # what stopped the run mid-step: "grace", "second"; "": the step finished
        self.call = None  # the user's call running now (a token), or None
        self.sent = False  # the watchdog sent the signal (the grace ended), its handler not yet run
        self.first = threading.Event()  # set at the first signal: the watchdog starts looking
        self.main = threading.main_thread().ident
        self.watchdog = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def status(self) -> int:
        """The run's exit status: 0 without a signal, else status(the first signal)."""
        return status(self.signum) if self.requested else 0

    def install(self):
        if threading.current_thread() is threading.main_thread():  # (a test's thread installs nothing)
            for s in SIGNALS:
                signal.signal(s, self)
        return self

    def uninstall(self):
        """The handlers Python starts with again (grpo.py's RunLog.finish sets them itself); the watchdog
        sees that it is no longer the handler in force, and ends."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                if signal.getsignal(s) is self:
                    signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)

    def __call__(self, signum, _frame):
        """The handler. No lock and no print here: the main thread may hold either when a signal comes."""
        if self.sent:  # the watchdog's: the grace ended
            self.sent = False
            if self.call is not None:  # (else the call returned first: nothing to stop)
                self.how = "grace"
                raise Interrupted(self.ended())
            return
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
            self.first.set()
            say(
                f"\n{name(signum)}: the step finishes, is saved, and the run exits with status "
                f"{status(signum)} (a --reward running gets {self.grace:g} s: --stop-grace; a second "
                f"signal stops at once)\n"
            )
            return
        self.how = "second"
        raise Interrupted(self.ended())

    def expired(self) -> bool:
        return self.requested and time.monotonic() >= self.since + self.grace

    @contextlib.contextmanager
    def user_code(self):
        """Around a call of the user's code: called after the grace ended, Interrupted at once; running when
        it ends, Interrupted inside it (the watchdog's signal)."""
        if self.expired():
            self.how = "grace"
            raise Interrupted(self.ended())
        if self.watchdog is None:
            self.watchdog = threading.Thread(target=self.watch, daemon=True, name="stop-grace")
            self.watchdog.start()
        self.call = object()
        try:
            yield
        finally:
            self.call = None

    def watch(self):
        """The watchdog's thread: after the first signal, the grace's end inside the user's code sends the
        signal again to the main thread; it ends once this Stop is no longer the handler in force."""
        while signal.getsignal(signal.SIGTERM) is self:
            if not self.first.wait(1.0):
                continue
            if self.call is not None and not self.sent and self.expired():
                self.sent = True
                signal.pthread_kill(self.main, self.signum)
            time.sleep(POLL_S)

    def ended(self) -> str:
        """What ended the run, in words: the first words of its last line."""
        if self.how == "second":
            return f"a second {name(self.signum)} stopped it at once"
        if self.how == "grace":
            return (
                f"{name(self.signum)}: the user's code (--reward) was still running when the "
                f"{self.grace:g} s grace ended (--stop-grace), and was stopped"
            )
        return f"{name(self.signum)}: the step finished"


def name(signum) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def say(text):
    """A line from a signal handler: os.write, which no lock guards (print's buffer may be mid-write)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.write(sys.stderr.fileno(), text.encode())


@contextlib.contextmanager
def interruptible():
    """Around a call of the user's code (training/usercode/reward_code.py). Under a Stop (the handler in
    force): Stop.user_code, the grace. Without one: a Ctrl-C or SIGTERM first goes to the handler in force
    (SIGTERM's default ends the process), then raises Interrupted at once, so a reward that never returns is
    stopped by the first signal. Outside the main thread nothing changes."""
    before = {s: signal.getsignal(s) for s in SIGNALS}
    if isinstance(before[signal.SIGTERM], Stop):
        with before[signal.SIGTERM].user_code():
            yield
        return
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
            h(signum, frame)
        raise Interrupted(name(signum))

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
