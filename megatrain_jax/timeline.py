"""A one-step timeline of the engine's work, recorded without stalling the GPU.

The engine tells the timeline about each transfer and computation as it dispatches it; one
watcher thread per lane waits for the result and notes when it completed. Nothing on the
main thread waits, so the step runs as it would unobserved. A bar starts when its work was
issued or when the previous work of its lane completed, whichever is later (a lane is one
stream: host→device copies, device→host copies, GPU compute) and ends at completion. Host
optimizer updates and the main thread's waits are timed where they happen.

    timeline = Timeline()
    engine.timeline = timeline
    engine.train_step(state, batch)
    engine.timeline = None
    events = timeline.finish()    # [{"lane", "name", "start", "end"}], seconds from start
"""

from __future__ import annotations

import queue
import threading
import time

import jax

LANES = ("h2d", "compute", "d2h", "host update", "waits")


class Timeline:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self._watched: dict[str, list] = {}
        self._queues: dict[str, queue.Queue] = {}
        self._threads: list[threading.Thread] = []

    def track(self, lane: str, name: str, tree) -> None:
        """Notes that `tree` was just dispatched on `lane`; its completion is watched."""
        if lane not in self._queues:
            self._queues[lane] = queue.Queue()
            self._watched[lane] = []
            thread = threading.Thread(target=self._watch, args=(lane,), daemon=True)
            thread.start()
            self._threads.append(thread)
        self._queues[lane].put((name, time.perf_counter(), tree))

    def span(self, lane: str, name: str, start: float, end: float) -> None:
        """Records work timed where it ran (perf_counter seconds)."""
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

    def finish(self) -> list[dict]:
        """Waits for every watched result; returns all bars sorted by start."""
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        bars = list(self.spans)
        for lane, done in self._watched.items():
            previous_end = 0.0
            for name, issued, end in done:
                start = max(issued - self.t0, previous_end)
                bars.append({"lane": lane, "name": name, "start": start,
                             "end": end - self.t0})
                previous_end = end - self.t0
        return sorted(bars, key=lambda b: b["start"])
