"""Training: `make_trainer(cfg)` gives the step, `train(cfg)` runs the loop.

    cfg = load_config("demo")
    summary = train(cfg)                 # writes RUN_DIR/config.json and metrics.jsonl
    with StopSignals() as stop:          # SIGTERM / SIGINT stop it cleanly (stop.py)
        summary = train(cfg, stop=stop)

Both trainers have `init(key) -> state` and `train_step(state, batch) -> (state, metrics)`:
`stream` (the default) keeps state on the host and streams layers through the GPU;
`reference` holds the whole model on the device. The loop is a plain for-loop.

`train` holds RUN_DIR's lock (io/run_folder.py) for its lifetime: a second `train` there is
refused at once. A run whose newest checkpoint is its last step is finished: its command run
again returns at once. Otherwise a run starts once its data, its checkpoints (a resume must
continue the run that wrote them: resume.py) and the disk are checked (startup.py); only then
is RUN_DIR created or its config.json replaced, and metrics.jsonl cut back to the step resumed
from. A save that fails ends the run at the next step; `loop.max_skipped_steps` skipped steps
in a row (non-finite gradients) end it with TrainingStopped, the checkpoints from before them
kept. A signal ends it after the step in flight with RunInterrupted: the save under way
completes and the run stops at its step, or else the step just ended is saved
(`loop.stop_save`); its metrics line is written in either case. In a run of several
processes the first decides the stop after each step for all (stop.py's AgreedStop).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatrain_jax.config import Config, ConfigError, save_config
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError
from megatrain_jax.io.data import TokenSource
from megatrain_jax.io.processes import Peers
from megatrain_jax.io.run_folder import RunLock
from megatrain_jax.stream import Timeline
from megatrain_jax.stream.placement import pinned_bytes
from megatrain_jax.train import deterministic
from megatrain_jax.train.accounting import RunClock, advice, startup_note
from megatrain_jax.train.export import export_final
from megatrain_jax.train.machine import memory_record, peak_flops
from megatrain_jax.train.outputs import Outputs, evaluate, write_timeline
from megatrain_jax.train.resume import check_continues, restore, run_record
from megatrain_jax.train.startup import (
    check_writable,
    checkpoint_folder,
    checkpointer,
    finished_summary,
    kept,
    read_records,
    rewind,
    write_summary,
)
from megatrain_jax.train.stop import AgreedStop, RunInterrupted, interrupted
from megatrain_jax.train.trainers import initial_state, make_trainer


class TrainingStopped(RuntimeError):
    """The run cannot go on as configured (its steps keep being skipped); the message says
    why and what the checkpoints hold."""


@dataclass
class _Tally:
    """What the loop carries from step to step."""

    start: int  # the step this attempt began at
    skipped: int  # steps skipped in all, earlier attempts' included
    peak: float | None  # the devices' peak FLOP/s, for MFU
    streak: int = 0  # skipped steps in a row
    history: list = field(default_factory=list)  # this attempt's metric records
    timer: float = field(default_factory=time.perf_counter)  # since the last record
    # The steps after this attempt's first (which compiles), and their wall time: the run's
    # speed in the summary.
    timed_steps: int = 0
    timed_s: float = 0.0
    clock: RunClock = field(default_factory=RunClock)  # where the run's time goes
    noted: set = field(default_factory=set)  # the notes given once already


def train(cfg: Config, log=None, on_start=None, stop=None) -> dict:
    """Runs `cfg.loop.steps` steps; returns a summary (first and last loss, tokens/s, ...).
    Its `tokens_per_s` is the run's: the tokens of its `timed_steps` (every step of this
    attempt after its first, which compiles) over their wall time `timed_s` (evaluations
    left out); with one step only, that step's.

    Data, checkpoints and disk are checked, and the state restored or built, before RUN_DIR
    is created or its config.json replaced; `on_start(first_step)` is called then. `stop`
    (a StopSignals) ends the run cleanly with RunInterrupted once it has received a signal.
    A finished run (its newest checkpoint at loop.steps) returns its summary at once, with
    `finished_before: True`.
    """
    clock = RunClock()
    if cfg.loop.deterministic:
        deterministic.check()
    run_dir = Path(cfg.loop.run_dir)
    check_writable(run_dir)
    with RunLock(run_dir) as lock:
        finished = finished_summary(cfg)
        if finished is None:
            return _train(cfg, lock, log, on_start, stop, clock)
        if cfg.loop.export_dir and not Path(cfg.loop.export_dir).exists():
            export_final(None, cfg, checkpoint_folder(cfg), finished["steps"])
        return finished


def _train(cfg: Config, lock: RunLock, log, on_start, stop, clock: RunClock) -> dict:
    run_dir = Path(cfg.loop.run_dir)
    if cfg.loop.export_dir and Path(cfg.loop.export_dir).exists():
        raise ConfigError(f"loop.export_dir {cfg.loop.export_dir} already exists; name a new "
                          "folder for the exported model.")
    data = TokenSource(cfg)
    val = TokenSource(cfg, "val") if cfg.loop.eval_every else None
    trainer = make_trainer(cfg)
    ckpt = checkpointer(cfg, trainer)
    try:
        state, start, skipped = _resume(cfg, trainer, ckpt)
        if state is None:
            placing = time.perf_counter()
            state = initial_state(cfg, trainer)
            clock.placed(time.perf_counter() - placing, pinned_bytes(trainer.state_tree(state)))
        agreed = AgreedStop(stop, Peers.of_this_run())  # every process stops alike
        signum, _ = agreed.decide("begin", False, _none)
        if signum is not None:  # before the first step: nothing to save, nothing written yet
            raise RunInterrupted(f"stopped by {_name(signum)} before its first step (step "
                                 f"{start + 1}): nothing was trained or written; run the same "
                                 "command to start again.", signum, None)
        _begin(cfg, lock, start)
        if on_start is not None:
            on_start(start)
        tally = _Tally(start, skipped, peak_flops(trainer.devices), clock=clock)
        state, stopped = _loop(cfg, trainer, state, tally, data, val, ckpt, log, agreed)
        if stopped is not None:
            raise interrupted(cfg, *stopped, tally.history, ckpt)
    except BaseException:
        if ckpt is not None:
            try:  # a save under way holds a good state: let it finish
                ckpt.close()
            except CheckpointError:
                pass
        raise
    end_wait = time.perf_counter()
    if ckpt is not None:
        ckpt.close()  # raises if the last save failed
    end_wait = time.perf_counter() - end_wait
    state.wait()
    if cfg.loop.export_dir:
        export_final(state.params, cfg, checkpoint_folder(cfg))
    history = tally.history
    if not tally.timed_steps:  # one step: its own time, compilation included
        tally.timed_steps, tally.timed_s = 1, history[0]["step_seconds"]
    summary = {
        "first_loss": _first_loss(run_dir, history), "last_loss": history[-1]["loss"],
        "tokens_per_s": tally.timed_steps * cfg.data.tokens_per_step / tally.timed_s,
        "timed_steps": tally.timed_steps, "timed_s": tally.timed_s,
        "skipped_steps": tally.skipped, "run_dir": str(run_dir),
        **clock.summary(cfg.data.tokens_per_step, end_wait), "kept": kept(cfg, ckpt),
        "save_writes_s": [round(x, 3) for x in ckpt.write_seconds] if ckpt else [],
    }
    write_summary(run_dir, summary)
    return {**summary, "state": state}


def _resume(cfg: Config, trainer, ckpt: Checkpointer | None):
    """(state, first step, skipped steps) from the latest checkpoint, or (None, 0, 0)."""
    if ckpt is None or not cfg.loop.resume or ckpt.latest_step() is None:
        return None, 0, 0
    step = ckpt.latest_step()
    check_continues(cfg, ckpt.read_meta(step), ckpt.directory / str(step))
    tree, meta = restore(ckpt, step, trainer, cfg)
    return (trainer.from_tree(tree, step, meta.get("state", {})), meta["data_position"],
            meta.get("skipped_steps", 0))


def _begin(cfg: Config, lock: RunLock, start: int) -> None:
    """The run has started: RUN_DIR created (and locked, if this run creates it), its config
    written, its records cut back to `start`."""
    run_dir = Path(cfg.loop.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.hold()
        save_config(cfg, run_dir / "config.json")
        rewind(run_dir, start)
    except OSError as e:
        raise ConfigError(f"loop.run_dir {run_dir}: cannot write there "
                          f"({e.strerror or e}); choose another loop.run_dir.") from None


def _first_loss(run_dir: Path, history: list[dict]) -> float:
    """The loss of the run's first recorded step: metrics.jsonl's first record, whichever
    attempt of the run wrote it."""
    records = read_records(run_dir / "metrics.jsonl")
    return records[0]["loss"] if records else history[0]["loss"]


# ----- the loop, phase by phase ------------------------------------------------------------

def _loop(cfg: Config, trainer, state, tally: _Tally, data: TokenSource,
          val: TokenSource | None, ckpt: Checkpointer | None, log, agreed: AgreedStop):
    """The steps from `tally.start`: (final state, (the step a signal stopped the run at,
    the signal), or None when it ran to loop.steps)."""
    loop = cfg.loop
    out = Outputs(cfg, tally.start, log)
    tally.clock.first_step()
    _note_once(out, tally, "startup", startup_note(*tally.clock.placing))
    if ckpt is not None and ckpt.no_room and not loop.checkpoint_every:
        _note_once(out, tally, "room", f"this run will keep no checkpoint: {ckpt.no_room}")
    saved = False
    if loop.checkpoint_every and ckpt is not None:
        # The staging area, made while the first step compiles: new pinned memory comes
        # slowly, and holds the GPU's other calls back while it does.
        ckpt.prepare(trainer.state_tree(state))
    try:
        for step in range(tally.start, loop.steps):
            began, aside = time.perf_counter(), tally.clock.aside()
            slowed = saved or (ckpt is not None and ckpt.capturing())  # by a save's capture
            state, metrics, was_skipped = _step(cfg, trainer, state, data, step, ckpt, tally)
            done, last = step + 1, step + 1 == loop.steps
            halted = tally.streak >= loop.max_skipped_steps
            # A save under way when a stop comes ends the run at its step; else one is taken.
            signum, pending = agreed.decide(str(done), last, _none if ckpt is None else ckpt.saving)
            stopping = signum is not None
            saved = _save(cfg, trainer, state, ckpt, done, tally, was_skipped, halted,
                          stopping and pending is None and loop.stop_save, out)
            if val is not None and not halted and (done % loop.eval_every == 0 or last):
                evaluating = time.perf_counter()
                out.eval_record(done, evaluate(trainer, state, val, loop.eval_batches))
                tally.timer += time.perf_counter() - evaluating  # not training time
                tally.clock.evaluated(time.perf_counter() - evaluating)
            _note_once(out, tally, "share", advice(
                tally.clock, loop.checkpoint_every, ckpt.write_seconds[-1] if ckpt and
                ckpt.write_seconds else None))
            if saved or stopping or halted or last or step == tally.start or \
                    done % loop.log_every == 0:
                _record(cfg, out, metrics, done, tally)
            # The step's own time: all of this turn (its records waited for its results) but
            # its save and evaluation.
            tally.clock.step(time.perf_counter() - began - (tally.clock.aside() - aside), slowed)
            if halted:
                raise TrainingStopped(_halt_message(cfg, done, tally.streak, ckpt))
            if stopping:
                waited = pending is not None and loop.stop_save and not saved
                return state, (pending if waited else done, signum)
    finally:
        out.close()
    return state, None


def _step(cfg: Config, trainer, state, data: TokenSource, step: int,
          ckpt: Checkpointer | None, tally: _Tally):
    """Trains step `step` (0-based): (state, metrics, whether the step was skipped)."""
    if ckpt is not None and ckpt.failed() is not None:
        raise ckpt.failed()  # a save that failed ends the run
    timeline = Timeline() if step + 1 == cfg.loop.timeline_step else None  # counted from 1
    before_write = ckpt.wait_captured if ckpt is not None else None  # a save may capture
    state, metrics = trainer.train_step(state, data.batch_at(step), tracer=timeline,
                                        before_write=before_write)
    # The streaming engine has read it already; the reference trainer waits here.
    was_skipped = bool(np.asarray(metrics.pop("skipped")))
    tally.skipped += was_skipped
    tally.streak = tally.streak + 1 if was_skipped else 0
    if timeline is not None:
        state.wait()
        write_timeline(Path(cfg.loop.run_dir) / "timeline.json", timeline.finish(), step + 1,
                       cfg)
    return state, metrics, was_skipped


def _save(cfg: Config, trainer, state, ckpt: Checkpointer | None, done: int, tally: _Tally,
          was_skipped: bool, halted: bool, stopping: bool, out: Outputs) -> bool:
    """Starts a checkpoint of step `done` where one is due (or a stop asks for one); whether
    it did. A checkpoint waits for a step that updated the state: a run of skipped steps that
    ends in a halt leaves the checkpoints from before it."""
    every, last = cfg.loop.checkpoint_every, done == cfg.loop.steps
    if ckpt is None or halted:
        return False
    due = (every and done % every == 0 and not was_skipped) or \
        (last and (every or cfg.loop.final_checkpoint))
    if not (due or stopping) or (ckpt.no_room and not every):
        return False  # the final or stop save has no room: said at the start and the end
    began, previous = time.perf_counter(), ckpt.saving()
    waited = ckpt.save(done, trainer.state_tree(state),
                       {**run_record(cfg, done, tally.skipped),
                        "state": trainer.state_record(state)})
    tally.clock.saved(time.perf_counter() - began, waited)
    if waited > 0.1 and every and previous is not None:
        _note_once(out, tally, "waited", (
            f"checkpoint {previous} was still being written when checkpoint {done} was "
            f"due: the run waited {waited:.1f} s for it (a save's write takes longer than "
            f"{every} steps here; raise loop.checkpoint_every to leave it room)."))
    return True


def _note_once(out: Outputs, tally: _Tally, kind: str, text: str | None) -> None:
    if text is not None and kind not in tally.noted:
        tally.noted.add(kind)
        out.bar.note(f"megatrain-jax: {text}")


def _record(cfg: Config, out: Outputs, metrics: dict, done: int, tally: _Tally) -> None:
    """Step `done`'s metric record, with the speed since the last record, written out."""
    record = {k: float(np.asarray(v)) for k, v in metrics.items()}
    seconds = time.perf_counter() - tally.timer  # the read above waited for the step
    steps_done = done - (tally.history[-1]["step"] if tally.history else tally.start)
    tokens_per_s = steps_done * cfg.data.tokens_per_step / seconds
    if tally.history:  # not the attempt's first step, which compiles
        tally.timed_steps += steps_done
        tally.timed_s += seconds
    record.update(step=done, skipped_steps=tally.skipped, step_seconds=seconds / steps_done,
                  tokens_per_s=tokens_per_s, **memory_record())
    peak = tally.peak
    record["mfu"] = 6 * cfg.model.num_params * tokens_per_s / peak if peak else None
    tally.history.append(record)
    out.record(record)
    tally.timer = time.perf_counter()


def _none() -> None:
    return None


def _name(signum: int) -> str:
    return signal.Signals(signum).name


def _halt_message(cfg: Config, step: int, streak: int, ckpt: Checkpointer | None) -> str:
    text = (f"training stopped at step {step}: steps {step - streak + 1} to {step} were all "
            f"skipped, their gradients not finite (loop.max_skipped_steps="
            f"{cfg.loop.max_skipped_steps}). ")
    if ckpt is None:
        return text + "No checkpoint was written (loop.checkpoint_every=0)."
    try:
        ckpt.wait()
    except CheckpointError:
        pass
    steps = ckpt.steps()
    if not steps:
        return text + "No checkpoint was written before them."
    return (text + f"The latest checkpoint, step {steps[-1]}, holds the state from before them: "
            "lower optim.lr or check the data, then resume from it (with "
            "loop.accept_changes=true if the optimizer or data change).")
