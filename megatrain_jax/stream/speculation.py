"""One step's host update, begun during the backward as a speculative update and settled
once the global gradient norm is known.

Exact clipping needs every gradient before any update. Waiting for that puts the whole host
update after the backward; a speculative update instead assumes that the step will not clip
and starts each part's update as soon as its gradient is on the host, while the backward
goes on:

    backward  head grad ─► speculate(head) ─► layer L-1 grad ─► speculate(layer L-1) ─► …
    validate  norm <= clip: the speculative updates stand; the embedding (last) is updated
              norm >  clip: each speculated part is undone (adamw_inverse.py), redone scaled
              not finite:   each speculated part is undone; the step is skipped

The worker takes the newest part first, of those whose gradients have landed (with none
landed, the oldest, which lands first): the backward hands over gradients faster than the host
memory updates them, and newest first leaves the ones it cannot finish in time spread over the
model, not all among the first layers, which the next forward needs first and would wait for
one by one. Whether a part is speculated does not depend on that order: a part is speculated
when the sum of squares of the step's gradients up to its own (every part's before it in the
backward, those kept on the GPU too) stays within the clip threshold, so a step speculates
the same parts however the worker's timing falls.

When the speculative updates stand, one still waiting on the worker at the end of the
backward is dropped, and its part is updated after the parts not speculated, in streaming
order: the next forward's first parts do not queue behind the updates of its last ones. The
dropped one would have written the same bits (the same update, scale 1), so the state does
not depend on how many ran in time. One known wrong is never dropped: every speculative
update the gradients allow runs and is undone, the same ones in every run, so a resumed run
repeats the undo's roundings bit for bit.

A part is never speculated when its own gradient is not finite (the sum is not finite then),
so no NaN or Inf reaches the state; nor once that sum passes the clip threshold (the step is
then known to clip). All of it runs on the update queue's worker, every speculative update
before any settling (submitted after the backward), so a part's settling always follows its
speculative update, and the next step's forward waits for a part only when it fetches it.
`policy` decides per step whether to speculate at all.

    update = StepUpdate(host_optimizer, clip_norm, speculate=True, tracer=tracer)
    update.gradient_ready("layer 7", p, g, s, seen_sq)    # during the backward
    update.settle("layer 7", p, g, s, skip=False, scale=0.8)  # after it, in streaming order
    update.close()
"""

from __future__ import annotations

import math
import threading
from typing import Callable

from megatrain_jax.optim.host_adamw import shard_views
from megatrain_jax.stream.trace import Tracer
from megatrain_jax.stream.updates import UpdateQueue

MODES = ("auto", "on", "off")

# Whether the speculative updates not yet started when the backward ends are dropped. False
# runs every one, so that the parts speculated depend on the gradients alone (tests that
# count them).
DROP_LATE_SPECULATION = True


def policy(mode: str, clip_norm: float, last_norm: float | None) -> bool:
    """Whether a step speculates (updates during its backward, as if it will not clip),
    from the last step's gradient norm (inf for a skipped step, None before the first).

    `auto` speculates when the last step's norm was within the threshold: a run that clips
    every step then never speculates (and pays nothing), one that rarely clips nearly always
    does. The first step, with no norm yet, does not. `on` always speculates (a step that
    clips costs an undo and a redo of the speculated parts), `off` never.
    """
    if mode == "off":
        return False
    if mode == "on" or clip_norm <= 0:
        return True
    return last_norm is not None and last_norm <= clip_norm


def next_part(untaken: list[int], landed: list[bool]) -> int:
    """Of the parts handed over and not yet taken (in the backward's order) and whether each
    one's gradients have landed: the newest that has landed, else the oldest, which lands
    first (taking the newest would leave the worker waiting while an older part could be
    updated)."""
    ready = [i for i, here in zip(untaken, landed) if here]
    return ready[-1] if ready else untaken[0]


class StepUpdate:
    """The host update of one step: the update queue plus the speculative updates on it."""

    def __init__(self, host_optimizer, clip_norm: float, speculate: bool,
                 tracer: Tracer | None = None, before_write: Callable | None = None):
        self.host, self.clip_norm, self.speculate = host_optimizer, clip_norm, speculate
        self.queue = UpdateQueue(tracer)
        self.tracer = self.queue.tracer
        # Worker-side record of the speculative updates (read once the queue is done).
        self.speculated: set[str] = set()
        self.undone = 0
        # Per part handed over, in the backward's order: its update's arguments until taken
        # (the gradients must not outlive the step's update: the next step's need the pinned
        # pool), and the step's sum of squares up to it, in host memory.
        self._handed: list[tuple | None] = []
        self._seen_sqs: list = []
        self._untaken: list[int] = []
        self._wrong_from = math.inf  # the first part known to clip or skip, by index
        self._lock = threading.Lock()
        self._stopped = False  # by settle: the speculative updates not yet taken are too late
        # A checkpoint capturing the state: each part's update waits for that part's capture.
        self.before_write = before_write

    # ----- during the backward -------------------------------------------------------------

    def gradient_ready(self, part: str, params, grads, opt_state, seen_sq) -> None:
        """`grads` of `part` are on their way to the host and `seen_sq`, the sum of squares
        of the step's gradients so far, this part's included, is on its way after them (a
        scalar in host memory): speculate the part's update, unless the step is already known
        to clip or skip."""
        if self.speculate:
            with self._lock:
                self._handed.append((part, params, grads, opt_state))
                self._seen_sqs.append(seen_sq)
                self._untaken.append(len(self._handed) - 1)
            self.queue.submit("speculate", self._speculate_next)

    def _speculate_next(self) -> str:
        """Takes a part (`next_part`) and updates it speculatively if it may; returns the
        part's name, for the timeline."""
        with self._lock:
            i = next_part(self._untaken, [self._seen_sqs[i].is_ready() for i in self._untaken])
            self._untaken.remove(i)
            part, params, grads, opt_state = self._handed[i]
            self._handed[i] = None
        self._captured(part)  # a save capturing the part comes first
        if self._stopped or not self._may_speculate(i):
            return f"{part}: not speculated"
        self.host.update(params, grads, opt_state, 1.0)
        self.speculated.add(part)
        return part

    def _may_speculate(self, i: int) -> bool:
        """Whether the sum of squares of the step's gradients up to part i (in the
        backward's order) is finite and within the clip threshold. The sum is read where it
        landed, beside the part's gradients: reading it waits for that part's copies only."""
        if i >= self._wrong_from:
            return False
        seen = float(shard_views(self._seen_sqs[i])[0][0])
        clips = self.clip_norm > 0 and seen > self.clip_norm ** 2
        if not math.isfinite(seen) or clips:
            self._wrong_from = i  # the step skips or clips: every later part would be undone
            return False
        return True

    # ----- after the backward --------------------------------------------------------------

    def settle(self, part: str, params, grads, opt_state, skip: bool, scale: float) -> None:
        """The part's final update, now that `skip` and the clip `scale` are known: a good
        speculative update stands, a wrong one is undone and redone, a part not speculated
        (or whose speculative update was dropped) is updated."""
        speculation_stands = not skip and scale == 1.0
        if speculation_stands and DROP_LATE_SPECULATION:
            self._stopped = True  # the speculative updates not started yet are dropped

        def work():
            self._captured(part)
            if part in self.speculated:
                if speculation_stands:
                    return
                self.host.undo(params, grads, opt_state, 1.0)
                self.undone += 1
            if not skip:
                self.host.update(params, grads, opt_state, scale)

        if not (skip and not self.speculate):  # nothing to write for a skipped plain step
            self.queue.submit(part, work)

    def close(self) -> None:
        self.queue.close()

    def _captured(self, part: str) -> None:
        """Waits until a checkpoint under way has captured `part`: its update writes it."""
        if self.before_write is not None:
            self.before_write(part)

    # ----- what the next step and the state read (the queue's interface) -------------------

    def done(self, part: str) -> bool:
        return self.queue.done(part)

    def wait(self, part: str | None = None) -> None:
        self.queue.wait(part)

    @property
    def seconds(self) -> float:
        return self.queue.seconds

    @property
    def spans(self) -> list:
        return self.queue.spans
