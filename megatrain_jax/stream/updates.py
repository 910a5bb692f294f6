"""The host update queue: one step's in-place updates, part by part, off the main thread.

The schedule submits each part's update as soon as it may run; the next step's forward
waits for a part only when it fetches that part. Work runs in submission order; each part
has one completion event, keyed by its name.

    queue = UpdateQueue(tracer)
    queue.submit("layer 3", lambda: host_optimizer.update(p, g, s, scale))
    queue.wait("layer 3")       # that part written (a part never submitted: at once)
    queue.wait()                # everything submitted so far written

Submitting a part again (a redo after validation) clears its event until the new work is
done. Work that returns a string names what it wrote, in the spans and the timeline, instead
of the name it was submitted under. An error in the work stops the queue's later work and is
raised by `wait` in the caller's thread.

Every queue's work runs on one long-lived worker thread per process, in submission order
across queues too (a step's update never overtakes the last one's). Every `TRIM_EVERY`
closed queues (steps) the worker also hands the heap's free pages back to the system (glibc
keeps what was freed): the start-up's, and the records XLA frees when the engine renews the
host weights (`stream/engine.py`, RENEW_EVERY): 0.04–0.1 GiB at a time in a 1b run.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from typing import Callable

from megatrain_jax.stream.trace import Tracer, finish_at_exit

TRIM_EVERY = 100


def release_free_heap() -> bool:
    """Returns the heap's free pages to the system (glibc's malloc_trim); False where the C
    library has none."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


class _Worker:
    """The thread that runs every queue's work, one item at a time."""

    def __init__(self):
        self._work: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="megatrain-host-update")
        self._thread.start()
        self._closed_queues = 0
        finish_at_exit(self)

    def put(self, run: Callable[[], None]) -> None:
        self._work.put(run)

    def queue_closed(self) -> None:
        """A step's queue is complete: every TRIM_EVERY of them, after their work, trim."""
        self._closed_queues += 1
        if self._closed_queues % TRIM_EVERY == 0:
            self._work.put(release_free_heap)

    def _run(self) -> None:
        while (run := self._work.get()) is not None:
            run()

    def finish_at_exit(self) -> None:
        """Lets the submitted work end (a process never exits halfway through writing the
        master weights), then the thread."""
        self._work.put(None)
        self._thread.join()


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _shared_worker() -> _Worker:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = _Worker()
        return _worker


def _forget_worker() -> None:  # a forked child has no thread: it starts its own
    global _worker
    _worker = None


os.register_at_fork(after_in_child=_forget_worker)


class UpdateQueue:
    """One step's host updates: work submitted per part, run in order on the shared worker,
    with an event per part that the next step's fetches wait on (the module says how)."""

    def __init__(self, tracer: Tracer | None = None):
        self.tracer = tracer or Tracer()
        self.error: BaseException | None = None
        self.started: float | None = None
        self.finished: float | None = None
        self.spans: list[tuple[str, float, float]] = []  # (part, start, end) as they ran
        self._events: dict[str, threading.Event] = {}
        self._pending: dict[str, int] = {}  # submitted and not yet run, per part
        self._all_done = threading.Event()
        self._all_done.set()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._closed = False
        self._worker = _shared_worker()

    def submit(self, part: str, work: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("this step's update queue is closed: submit to the next one")
        with self._lock:
            self._events.setdefault(part, threading.Event()).clear()
            self._pending[part] = self._pending.get(part, 0) + 1
            self._outstanding += 1
            self._all_done.clear()
        self._worker.put(lambda: self._run(part, work))

    def done(self, part: str) -> bool:
        """Whether `part` has no update pending, without waiting."""
        event = self._events.get(part)
        return event is None or event.is_set()

    def wait(self, part: str | None = None) -> None:
        """Waits for `part`'s update (None: every update submitted so far)."""
        event = self._all_done if part is None else self._events.get(part)
        if event is not None:
            event.wait()
        if self.error is not None:
            raise RuntimeError("the host optimizer update failed") from self.error

    def close(self) -> None:
        """No more work for this step's queue (what was submitted still runs)."""
        if not self._closed:
            self._closed = True
            self._worker.queue_closed()

    @property
    def seconds(self) -> float:
        """From the first work's start to the last's end (0 before any ran)."""
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    def _run(self, part: str, work: Callable[[], None]) -> None:
        start = time.perf_counter()
        if self.started is None:
            self.started = start
        label = part
        try:
            if self.error is None:
                wrote = work()
                label = wrote if isinstance(wrote, str) else part
        except BaseException as e:  # surfaced in the caller's thread by wait()
            self.error = e
        finally:
            self.finished = time.perf_counter()
            self.spans.append((label, start, self.finished))
            self.tracer.span("host update", label, start, self.finished)
            with self._lock:
                self._pending[part] -= 1
                if self._pending[part] == 0:
                    self._events[part].set()
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._all_done.set()


def wait_for_checkpoint(before_write: Callable | None, tracer: Tracer,
                        parts: list[str] | None = None) -> None:
    """Waits, timed in the trace, until a checkpoint under way has captured the state of
    `parts` (every part's for None) (before_write): the update about to run writes or donates
    their buffers."""
    if before_write is not None:
        waiting = time.perf_counter()
        for part in [None] if parts is None else parts:
            before_write(part)
        tracer.waited("checkpoint", waiting)
