"""A clean stop on SIGTERM and SIGINT, as schedulers (SLURM, Kubernetes, spot pre-emption)
and Ctrl-C ask for it.

    with StopSignals() as stop:            # catches the two signals (in the main thread)
        train(cfg, stop=stop)              # raises RunInterrupted once it has stopped

The first signal only sets `stop.signal` and says so on stderr; the loop sees it when the step
in flight ends (train/loop.py decides what is saved). A second signal stops at once: the
handler gives the signal back its default action and sends it again, so the process ends as
that signal ends a process (a shell sees 128 + its number, as after a clean stop), leaving
only complete checkpoints (a save cut short is a STEP.partial folder, never read).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(RuntimeError):
    """The run stopped on a signal before its last step; the message says where it stopped
    and how to resume. `status` is the exit status for it: 128 + the signal's number (143 for
    SIGTERM, 130 for SIGINT)."""

    def __init__(self, message: str, signum: int, step: int | None):
        super().__init__(message)
        self.signal, self.step = signum, step

    @property
    def status(self) -> int:
        return 128 + self.signal


class StopSignals:
    """Catches SIGTERM and SIGINT for the `with` block: `signal` is the first one's number
    (None until one comes). Outside the main thread, where Python cannot catch signals, it
    catches nothing and `signal` stays None."""

    def __init__(self, saves: bool = True, stream=None):
        self.signal: int | None = None
        self.saves = saves  # what the notice says: the stop writes a checkpoint
        self.stream = stream or sys.stderr
        self._previous: dict = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._received)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _received(self, signum: int, frame) -> None:
        if self.signal is not None:  # the second: stop now, as the signal would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal = signum
        then = " and its checkpoint" if self.saves else ""
        fresh_line = "\n" if getattr(self.stream, "isatty", lambda: False)() else ""  # a bar
        self.stream.write(f"{fresh_line}megatrain-jax: {self.name}: stopping after the step in "
                          f"flight{then}; send it again to stop at once\n")
        self.stream.flush()


def requested(stop) -> bool:
    """Whether `stop` (a StopSignals, or None) has received a signal."""
    return stop is not None and stop.signal is not None
