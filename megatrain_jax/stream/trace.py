"""Watching a step without changing it: tracers passed to `train_step`.

The schedule tells its tracer what it dispatches and where it waits; the base `Tracer` only
adds up the main thread's waits (they go into the step's metrics) and otherwise does
nothing, so an untraced step runs bare. Subclasses record more:

    Timeline()     every transfer, computation and host update as a bar, without stalling
    PhaseTimer()   waits at the end of each phase to split a step's time (benchmarks only)

    state, metrics = engine.train_step(state, batch, tracer=Timeline())
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Callable

import jax

LANES = ("h2d", "compute", "d2h", "host update", "waits")

# Owners of worker threads that may still be inside XLA when the interpreter exits: a daemon
# thread that returns from C++ after finalization began is torn down by a forced unwind,
# which aborts the process ("FATAL: exception not rethrown"). Each owner's `finish_at_exit`
# runs before that, so an exit right after a step lets its host update end first.
_WORKERS: weakref.WeakSet = weakref.WeakSet()


def finish_at_exit(owner) -> None:
    """Registers `owner` (weakly): `owner.finish_at_exit()` runs at interpreter exit."""
    _WORKERS.add(owner)


@atexit.register
def _finish_workers() -> None:
    for owner in list(_WORKERS):
        owner.finish_at_exit()


class Tracer:
    """The do-nothing tracer: sums the waits of the main thread and nothing else."""

    def __init__(self):
        self.waits: dict[str, float] = {"update": 0.0, "d2h": 0.0}

    def issued(self, lane: str, name: str, tree):
        """`tree` was just dispatched on `lane` (h2d, compute, d2h); returns it."""
        return tree

    def span(self, lane: str, name: str, start: float, end: float) -> None:
        """Work timed where it ran (perf_counter seconds), e.g. a host update."""

    def waited(self, what: str, start: float) -> None:
        """The main thread waited for `what` (update, d2h, compute, checkpoint) since `start`."""
        end = time.perf_counter()
        self.waits[what] = self.waits.get(what, 0.0) + end - start
        if end - start > 1e-4:
            self.span("waits", what, start, end)

    def visit(self, phase: str, index: int) -> None:
        """The schedule is at layer `index` of `phase` (forward, backward)."""

    def phase_end(self, phase: str, wait: Callable[[], object]) -> None:
        """`phase` (forward, backward, update) is dispatched; `wait()` waits for its work."""


class PhaseTimer(Tracer):
    """Waits at the end of each phase and records its seconds in `seconds`. This serializes
    the phases, so it is for a benchmark's time split, never for training."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def phase_end(self, phase: str, wait: Callable[[], object]) -> None:
        jax.block_until_ready(wait())
        now = time.perf_counter()
        self.seconds[phase] = now - self._start
        self._start = now


class Timeline(Tracer):
    """Bars of a step's work per lane, recorded without stalling the GPU.

    One watcher thread per lane waits for each dispatched result and notes when it
    completed; nothing on the main thread waits. A bar starts when its work was issued or
    when the previous work of its lane completed, whichever is later, and ends at
    completion. Host updates and the main thread's waits are timed where they happen.

        timeline = Timeline()
        engine.train_step(state, batch, tracer=timeline)
        bars = timeline.finish()    # [{"lane", "name", "start", "end"}], seconds from start
    """

    def __init__(self):
        super().__init__()
        self.t0 = time.perf_counter()
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self._watched: dict[str, list] = {}
        self._queues: dict[str, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        finish_at_exit(self)

    def issued(self, lane: str, name: str, tree):
        if lane not in self._queues:
            self._queues[lane] = queue.Queue()
            self._watched[lane] = []
            thread = threading.Thread(target=self._watch, args=(lane,), daemon=True)
            thread.start()
            self._threads.append(thread)
        self._queues[lane].put((name, time.perf_counter(), tree))
        return tree

    def span(self, lane: str, name: str, start: float, end: float) -> None:
        with self._lock:
            self.spans.append({"lane": lane, "name": name, "start": start - self.t0,
                               "end": end - self.t0})

    def _watch(self, lane: str) -> None:
        q = self._queues[lane]
        while (item := q.get()) is not None:
            name, issued, tree = item
            try:
                jax.block_until_ready(tree)
            except RuntimeError:  # deleted (donated) since: it was computed, so it is done
                pass
            self._watched[lane].append((name, issued, time.perf_counter()))
            del tree, item

    def finish_at_exit(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()

    def finish(self) -> list[dict]:
        """Waits for every watched result; returns all bars sorted by start."""
        self.finish_at_exit()
        bars = list(self.spans)
        for lane, done in self._watched.items():
            previous_end = 0.0
            for name, issued, end in done:
                start = max(issued - self.t0, previous_end)
                bars.append({"lane": lane, "name": name, "start": start,
                             "end": end - self.t0})
                previous_end = end - self.t0
        return sorted(bars, key=lambda b: b["start"])
