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
from pathlib import Path

from megatrain_jax.train.startup import checkpoint_folder, rewind

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


class AgreedStop:
    """Whether the run stops after a step, decided alike in every process of a run.

    One process (`peers` None) stops on its own signal. In a run of several, the first
    process decides for all, once per step: on its own signal or on one another process
    told it of (each tells its first); the others wait for its word, so every process stops
    after the same step, with the same save, and none is left waiting in a step the others
    never start. The word costs one message of the coordination service a step.
    """

    def __init__(self, stop, peers):
        self.stop, self.peers = stop, peers
        self._told = False

    def decide(self, key: str, last: bool, pending) -> tuple[int | None, int | None]:
        """(the signal the run stops on after step `key`, else None; then, `pending()`: the
        step of the save under way, as the first process sees it, else None). `last`: the
        step was the run's last, which no signal stops."""
        if self.peers is None:
            signum = self.stop.signal if requested(self.stop) and not last else None
            return signum, (pending() if signum else None)
        if not self.peers.main:
            if requested(self.stop) and not self._told:
                self.peers.tell("stop-request", str(self.stop.signal))
                self._told = True
            word = self.peers.word(f"stop/{key}", 0)
        else:
            signum = self.stop.signal if requested(self.stop) else None
            if signum is None:
                requests = self.peers.said("stop-request")
                signum = int(requests[min(requests)]) if requests else None
            stopping = signum is not None and not last
            saving = pending() if stopping else None
            word = f"{signum} {'' if saving is None else saving}" if stopping else "go"
            self.peers.tell(f"stop/{key}", word)
        if word == "go":
            return None, None
        signum, saving = word.split(" ")
        return int(signum), (int(saving) if saving else None)


def interrupted(cfg, at: int, signum: int, history: list[dict], ckpt) -> RunInterrupted:
    """The run stopped on a signal at step `at`: once its checkpoints are complete (a failed
    save raises here), the error that says where it stopped and how to resume."""
    if ckpt is not None:
        ckpt.wait()
    latest = ckpt.latest_step() if ckpt is not None else None
    folder = checkpoint_folder(cfg)
    head = f"stopped by {signal.Signals(signum).name} at step {at} of {cfg.loop.steps}"
    if latest == at:
        ended = history[-1]["step"] if history else at
        if ended > at:  # the save under way was of an earlier step: the run ends there
            rewind(Path(cfg.loop.run_dir), at)
            again = f"step {ended}" if ended == at + 1 else f"steps {at + 1} to {ended}"
            head += f" ({again} will be trained again)"
        tail = f"checkpoint {at} is complete in {folder}; run the same command to resume"
    else:
        why = "no room on the disk for it" if cfg.loop.stop_save else "loop.stop_save=false"
        tail = (f"no checkpoint of it ({why}); " + (
            f"run the same command to resume from checkpoint {latest} in {folder}"
            if latest is not None else "the same command starts the run over"))
    return RunInterrupted(f"{head}: {tail}.", signum, at)
