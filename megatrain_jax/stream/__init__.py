"""The streaming engine, split by role, in the order a step uses them:

    placement.py   where each part lives (the one owner of memory kinds) and the moves
    programs.py    the compiled pure functions of a step (templates, optimizer, clip norm)
    schedule.py    the forward and backward loops over parts, with prefetch and offload
    updates.py     the per-part host update queue that overlaps the next step
    trace.py       tracers: waits, phase timings, a timeline, passed into a step
    engine.py      StreamEngine and StreamState: state at home, `train_step`

See docs/design.md for the data flow of one step and where each byte lives.
"""

from megatrain_jax.stream.engine import StreamEngine, StreamState
from megatrain_jax.stream.placement import Placement, memory_kinds, part_names
from megatrain_jax.stream.programs import Programs, Templates, build_programs
from megatrain_jax.stream.trace import PhaseTimer, Timeline, Tracer
from megatrain_jax.stream.updates import UpdateQueue

__all__ = ["PhaseTimer", "Placement", "Programs", "StreamEngine", "StreamState", "Templates",
           "Timeline", "Tracer", "UpdateQueue", "build_programs", "memory_kinds", "part_names"]
