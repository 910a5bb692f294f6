"""The run's time, accounted: where its wall time went, and its goodput.

    clock = RunClock()                        # at the start of `train`
    clock.first_step()                        # startup ends
    clock.saved(seconds, waited)              # time spent starting a save, after a step
    clock.step(seconds, saving)               # each step; `saving`: a save's capture was
                                              #   under way (or began just before it)
    clock.evaluated(seconds)
    clock.summary(tokens_per_step)            # {"time": {...}, "goodput": ...}

The steps' own time leaves out what saves and compiling add: a step a capture slowed counts
as the median step (of those no save slowed, after the first), the first step too. Goodput
is the run's tokens/s over the steps' own: the share of the wall time the steps' own time
is. The rest is split into startup (reading data, building and placing the state,
restoring), compile (the first step beyond the median), save stalls (starting saves, what a
capture added to a step, waiting for the last save at the end), evaluation, and other
(export, closing). The parts add up to the wall time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

SAVE_SHARE = 0.05  # saves costing more of the run's time than this are reported once
SLOW_STARTUP_S = 30.0  # a state built and placed slower than this is explained once
# New pinned host memory's rate (the kernel locking fresh pages): 1.3-1.9 GB/s measured on the
# lent H200 machines (benchmarks/bench_capture.py).
NEW_PINNED_GBPS = 1.5


@dataclass
class RunClock:
    began: float = field(default_factory=time.perf_counter)
    startup_s: float | None = None
    step_s: list = field(default_factory=list)  # (seconds, whether a save was under way)
    save_s: float = 0.0
    eval_s: float = 0.0
    stalls: list = field(default_factory=list)  # the run's time each save cost, as measured
    waits: list = field(default_factory=list)  # of which each waited for the save before
    _open_stall: float | None = None  # the save being measured
    _opened_at: int = -1  # the count of steps when it began

    placing: tuple = (0.0, 0)  # the new state's build and placement: seconds, pinned bytes

    def placed(self, seconds: float, pinned_bytes: int) -> None:
        self.placing = (seconds, pinned_bytes)

    def first_step(self) -> None:
        self.startup_s = time.perf_counter() - self.began

    def step(self, seconds: float, saving: bool) -> None:
        own_turn = self._opened_at == len(self.step_s)  # the save began after this step
        self.step_s.append((seconds, saving))
        if self._open_stall is None or own_turn:
            return
        if saving:
            self._open_stall += max(0.0, seconds - self.median())
        else:  # the save's capture is over: its cost is known
            self.stalls.append(self._open_stall)
            self._open_stall = None

    def saved(self, seconds: float, waited: float = 0.0) -> None:
        """A save began, taking `seconds` of the loop, `waited` of them for the last save to
        be written."""
        self.save_s += seconds
        self.waits.append(waited)
        if self._open_stall is not None:
            self.stalls.append(self._open_stall)
        self._open_stall, self._opened_at = seconds, len(self.step_s)

    def evaluated(self, seconds: float) -> None:
        self.eval_s += seconds

    def aside(self) -> float:
        """Seconds spent so far starting saves and evaluating: not the steps' own time."""
        return self.save_s + self.eval_s

    def median(self) -> float:
        """The steps' own time: the median of those no save slowed (the first left out)."""
        clean = [s for s, saving in self.step_s[1:] if not saving]
        timed = clean or [s for s, _ in self.step_s[1:]] or [s for s, _ in self.step_s]
        return statistics.median(timed) if timed else 0.0

    def last_stall(self) -> float | None:
        """The last save's cost to the run so far (the one being measured, else the last)."""
        if self._open_stall is not None:
            return self._open_stall
        return self.stalls[-1] if self.stalls else None

    def save_share(self, every: int) -> float | None:
        """The share of the run's time one save in `every` steps costs, from the last save;
        None before one is."""
        stall = self.last_stall()
        if stall is None or not every or not self.median():
            return None
        return stall / (stall + every * self.median())

    def summary(self, tokens_per_step: int, end_wait_s: float = 0.0) -> dict:
        """The time split and goodput of the run so far; `end_wait_s`: spent after the loop
        waiting for the last save."""
        wall = time.perf_counter() - self.began
        m, steps = self.median(), self.step_s
        first = steps[0][0] if steps else 0.0
        compile_s = max(0.0, first - m)
        steps_s = min(first, m)
        saves_s = self.save_s + end_wait_s
        for seconds, saving in steps[1:]:
            slowed = max(0.0, seconds - m) if saving else 0.0
            steps_s += seconds - slowed
            saves_s += slowed
        split = {"startup_s": self.startup_s or 0.0, "compile_s": compile_s,
                 "steps_s": steps_s, "save_stall_s": saves_s, "eval_s": self.eval_s}
        split["other_s"] = wall - sum(split.values())
        split["wall_s"] = wall
        stalls = self.stalls + ([self._open_stall] if self._open_stall is not None else [])
        return {"time": {k: round(v, 3) for k, v in split.items()},
                "save_stalls_s": [round(x, 3) for x in stalls],
                "goodput": steps_s / wall if wall and steps else None,
                "step_tokens_per_s": len(steps) * tokens_per_step / steps_s if steps_s else None}


def advice(clock: RunClock, every: int, write_s: float | None) -> str | None:
    """What to tell a run whose saves cost more than SAVE_SHARE of its time: the share and
    the loop.checkpoint_every that would bring it under (one whose capture costs under the
    share, and whose write, `write_s` in the background, fits between two saves); None
    otherwise."""
    share = clock.save_share(every)
    if share is None or share <= SAVE_SHARE or write_s is None:  # said once the write is known
        return None
    stall, m = clock.last_stall(), clock.median()
    capture = max(0.0, stall - clock.waits[-1])
    wanted = max(int(capture * (1 - SAVE_SHARE) / (SAVE_SHARE * m)),
                 int(write_s / m)) + 1
    written = f", {write_s:.1f} s to write in the background"
    if clock.waits[-1] > 0.1:
        written += f", {clock.waits[-1]:.1f} s of the stall waiting for the last one's write"
    return (f"saves cost {share:.0%} of this run's time ({stall:.2f} s a save{written}, one "
            f"every {every} steps of {m:.2f} s); loop.checkpoint_every={wanted} or more would "
            f"keep them under {SAVE_SHARE:.0%}.")


def startup_note(seconds: float, pinned_bytes: int) -> str | None:
    """Why building and placing a new state took more than SLOW_STARTUP_S, where filling its
    pinned host memory at NEW_PINNED_GBPS accounts for half of it or more; None otherwise."""
    pinning = pinned_bytes / (NEW_PINNED_GBPS * 1e9)
    if seconds <= SLOW_STARTUP_S or pinning < seconds / 2:
        return None
    return (f"building and placing the state took {seconds:.0f} s, {pinned_bytes / 1e9:.0f} GB "
            f"of it in pinned host memory, which comes at about {NEW_PINNED_GBPS:g} GB/s when "
            f"new (about {min(pinning, seconds):.0f} s of it), once a run; a larger "
            "stream.gpu_budget_gb keeps more of the state on the GPU and starts sooner "
            "(`megatrain-jax plan CONFIG --budgets ...` shows what each costs).")


def time_line(summary: dict) -> str:
    """The progress output's last line: where the run's time went."""
    t = summary["time"]
    parts = ", ".join(f"{name} {t[key]:.1f} s" for name, key in (
        ("startup", "startup_s"), ("compile", "compile_s"), ("steps", "steps_s"),
        ("save stalls", "save_stall_s"), ("eval", "eval_s"), ("other", "other_s")))
    goodput = summary["goodput"]
    return (f"run time {t['wall_s']:.1f} s: {parts}; goodput "
            + (f"{goodput:.1%}" if goodput is not None else "n/a"))
