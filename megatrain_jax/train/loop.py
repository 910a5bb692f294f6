"""Training: `make_trainer(cfg)` gives the step, `train(cfg)` runs the loop.

    cfg = load_config("demo")
    summary = train(cfg)                 # writes RUN_DIR/config.json and metrics.jsonl

Both trainers have `init(key) -> state` and `train_step(state, batch) -> (state, metrics)`:
`stream` (the default) keeps state on the host and streams layers through the GPU;
`reference` holds the whole model on the device. The loop is a plain for-loop.

A run starts once its data, its checkpoints (a resume must continue the run that wrote them:
resume.py) and the disk are checked; only then is RUN_DIR created or its config.json
replaced, and metrics.jsonl cut back to the step resumed from. A save that fails ends the run
at the next step; `loop.max_skipped_steps` skipped steps in a row (non-finite gradients) end
it with TrainingStopped, the checkpoints from before them kept.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from megatrain_jax.config import (
    Config,
    ConfigError,
    host_update,
    save_config,
)
from megatrain_jax.io.checkpoint import (
    Checkpointer,
    CheckpointError,
    complete_steps,
    foreign_steps,
    tree_bytes,
)
from megatrain_jax.io.data import TokenSource
from megatrain_jax.stream import Timeline
from megatrain_jax.tools.machine import memory_record, peak_flops
from megatrain_jax.tools.progress import Progress
from megatrain_jax.train.export import export_final
from megatrain_jax.train.resume import check_continues, restore, run_record
from megatrain_jax.train.trainers import initial_state, make_trainer


class TrainingStopped(RuntimeError):
    """The run cannot go on as configured (its steps keep being skipped); the message says
    why and what the checkpoints hold."""


def _check_writable(run_dir: Path) -> None:
    """Refuses a loop.run_dir that could not be created or written, before anything starts."""
    existing = run_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"loop.run_dir {run_dir}: {existing} is not a folder this process "
                          "can write into; choose another loop.run_dir.")


def checkpoint_folder(cfg: Config) -> Path:
    """RUN_DIR/checkpoints, the one folder of every process of a run: the others of a run of
    several log into RUN_DIR/process-I (tools/distributed.py) and write their shards here."""
    import jax

    run_dir, process = Path(cfg.loop.run_dir), jax.process_index()
    if process and run_dir.name == f"process-{process}":
        run_dir = run_dir.parent
    return run_dir / "checkpoints"


def _checkpointer(cfg: Config, trainer) -> Checkpointer | None:
    """The run's checkpoints, to write or to resume from, checked before anything starts;
    None when there are neither."""
    directory = checkpoint_folder(cfg)
    if foreign_steps(directory):
        raise CheckpointError(
            f"{directory} holds step folders this version cannot read "
            f"({foreign_steps(directory)}: written by an earlier megatrain-jax, with orbax, or "
            "not checkpoints): move them away, or use another loop.run_dir.")
    existing = complete_steps(directory)
    if existing and not cfg.loop.resume:
        raise CheckpointError(
            f"loop.resume=false, but {directory} holds checkpoints of an earlier run "
            f"({existing}); a new run there would mix its checkpoints with them. Use another "
            "loop.run_dir, or move that folder away.")
    if not cfg.loop.checkpoint_every and not existing:
        return None
    ckpt = Checkpointer(directory, keep=cfg.loop.keep_checkpoints)
    if cfg.loop.checkpoint_every:
        ckpt.check_room(tree_bytes(trainer.abstract_state()))
    return ckpt


def _resume(cfg: Config, trainer, ckpt: Checkpointer | None):
    """(state, first step, skipped steps) from the latest checkpoint, or (None, 0, 0)."""
    if ckpt is None or not cfg.loop.resume or ckpt.latest_step() is None:
        return None, 0, 0
    step = ckpt.latest_step()
    check_continues(cfg, ckpt.read_meta(step), ckpt.directory / str(step))
    tree, meta = restore(ckpt, step, trainer, cfg)
    return (trainer.from_tree(tree, step, meta.get("state", {})), meta["data_position"],
            meta.get("skipped_steps", 0))


def _rewind(run_dir: Path, step: int) -> None:
    """Drops the records after `step` from metrics.jsonl and eval.jsonl: a run resumed from
    an older checkpoint writes those steps again."""
    for path in (run_dir / "metrics.jsonl", run_dir / "eval.jsonl"):
        if not step or not path.exists():
            path.unlink(missing_ok=True)
            continue
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                pass  # a line cut short by a killed process
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        partial.replace(path)


def _tensorboard(cfg: Config, run_dir: Path):
    """A tensorboardX writer when wanted and installed (the `tensorboard` extra), else None."""
    if cfg.loop.tensorboard == "off":
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if cfg.loop.tensorboard == "on":
            raise ImportError("loop.tensorboard=on needs tensorboardX: "
                              "pip install 'megatrain-jax[tensorboard]'") from None
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def evaluate(trainer, state, val: TokenSource, batches: int) -> float:
    """Mean loss per trained token over the first `batches` validation batches."""
    total = count = 0.0
    for i in range(batches):
        batch = val.batch_at(i)
        tokens = float(batch["mask"].sum())
        total += float(trainer.eval_loss(state, batch)) * tokens
        count += tokens
    return total / max(count, 1.0)


def write_timeline(path: Path, bars: list[dict], step: int, cfg: Config) -> None:
    """One step's bars (lane, name, start, end in seconds) for `megatrain-jax report`."""
    update = "host" if host_update(cfg) else "device"
    doc = {"step": step, "layers": cfg.model.layers, "prefetch_depth": cfg.stream.prefetch_depth,
           "update": update, "bars": bars}
    path.write_text(json.dumps(doc) + "\n")


def train(cfg: Config, log=None, on_start=None) -> dict:
    """Runs `cfg.loop.steps` steps; returns a summary (first and last loss, tokens/s, ...).

    Data, checkpoints and disk are checked, and the state restored or built, before RUN_DIR
    is created or its config.json replaced; `on_start(first_step)` is called then.
    """
    run_dir = Path(cfg.loop.run_dir)
    _check_writable(run_dir)
    if cfg.loop.export_dir and Path(cfg.loop.export_dir).exists():
        raise ConfigError(f"loop.export_dir {cfg.loop.export_dir} already exists; name a new "
                          "folder for the exported model.")
    data = TokenSource(cfg)
    val = TokenSource(cfg, "val") if cfg.loop.eval_every else None
    trainer = make_trainer(cfg)
    ckpt = _checkpointer(cfg, trainer)
    try:
        state, start, skipped = _resume(cfg, trainer, ckpt)
        if state is None:
            state = initial_state(cfg, trainer)
        try:  # the run has started: record it
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.json")
            _rewind(run_dir, start)
        except OSError as e:
            raise ConfigError(f"loop.run_dir {run_dir}: cannot write there "
                              f"({e.strerror or e}); choose another loop.run_dir.") from None
        if on_start is not None:
            on_start(start)
        history, state, skipped = _loop(cfg, trainer, state, start, skipped, data, val, ckpt,
                                        log)
    except BaseException:
        if ckpt is not None:
            try:  # a save under way holds a good state: let it finish
                ckpt.close()
            except CheckpointError:
                pass
        raise
    if ckpt is not None:
        ckpt.close()  # raises if the last save failed
    state.wait()
    if cfg.loop.export_dir:
        export_final(state.params, cfg, checkpoint_folder(cfg))
    steady = history[1:] or history  # the first record includes compilation
    return {
        "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "skipped_steps": skipped, "run_dir": str(run_dir), "state": state,
    }


def _loop(cfg: Config, trainer, state, start: int, skipped: int, data: TokenSource,
          val: TokenSource | None, ckpt: Checkpointer | None, log):
    """The steps from `start`: (metric records, final state, skipped steps in all)."""
    run_dir, loop = Path(cfg.loop.run_dir), cfg.loop
    bar = Progress(loop.steps, loop.progress, plain_every=loop.log_every)
    board = _tensorboard(cfg, run_dir)
    history, streak, peak = [], 0, peak_flops(trainer.devices)
    before_write = ckpt.wait_written if ckpt is not None else None  # a save may still read
    metrics_file = open(run_dir / "metrics.jsonl", "a")
    timer = time.perf_counter()
    try:
        for step in range(start, loop.steps):
            if ckpt is not None and ckpt.failed() is not None:
                raise ckpt.failed()  # a save that failed ends the run
            timeline = Timeline() if step == loop.timeline_step else None
            state, metrics = trainer.train_step(state, data.batch_at(step), tracer=timeline,
                                                before_write=before_write)
            # The streaming engine has read it already; the reference trainer waits here.
            was_skipped = bool(np.asarray(metrics.pop("skipped")))
            skipped += was_skipped
            streak = streak + 1 if was_skipped else 0
            stop = streak >= loop.max_skipped_steps
            if timeline is not None:
                state.wait()
                write_timeline(run_dir / "timeline.json", timeline.finish(), step + 1, cfg)
            last = step + 1 == loop.steps
            # A checkpoint waits for a step that updated the state: a run of skipped steps
            # that ends in a stop leaves the checkpoints from before it.
            if ckpt is not None and loop.checkpoint_every and not stop and \
                    ((step + 1) % loop.checkpoint_every == 0 and not was_skipped or last):
                ckpt.save(step + 1, trainer.state_tree(state),
                          {**run_record(cfg, step + 1, skipped),
                           "state": trainer.state_record(state)})
            if val is not None and not stop and ((step + 1) % loop.eval_every == 0 or last):
                began = time.perf_counter()
                eval_loss = evaluate(trainer, state, val, loop.eval_batches)
                with open(run_dir / "eval.jsonl", "a") as eval_file:
                    eval_file.write(json.dumps({"step": step + 1, "loss": eval_loss}) + "\n")
                if board is not None:
                    board.add_scalar("eval_loss", eval_loss, step + 1)
                bar.note(f"step {step + 1}: eval loss {eval_loss:.4f}")
                timer += time.perf_counter() - began  # not training time
            if (step + 1) % loop.log_every and not last and step != start and not stop:
                continue
            record = {k: float(np.asarray(v)) for k, v in metrics.items()}
            seconds = time.perf_counter() - timer  # the read above waited for the step
            steps_done = step + 1 - (history[-1]["step"] if history else start)
            tokens_per_s = steps_done * cfg.data.tokens_per_step / seconds
            record.update(step=step + 1, skipped_steps=skipped,
                          step_seconds=seconds / steps_done,
                          tokens_per_s=tokens_per_s, **memory_record())
            record["mfu"] = 6 * cfg.model.num_params * tokens_per_s / peak if peak else None
            history.append(record)
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if board is not None:
                for key, value in record.items():
                    if key != "step" and value is not None:
                        board.add_scalar(key, value, step + 1)
                board.flush()
            shown = {"loss": record["loss"], "tok/s": tokens_per_s}
            if record["mfu"] is not None:
                shown["mfu"] = record["mfu"]
            if cfg.stream.speculate != "off" and "speculated_parts" in record:
                # of the host update that overlapped this step: parts guessed, and undone
                shown["guessed"] = f"{record['speculated_parts']:.0f}"
                shown["undone"] = f"{record['rolled_back_parts']:.0f}"
            bar.update(step + 1, shown)
            if log:
                log(record)
            if stop:
                raise TrainingStopped(_stop_message(cfg, step + 1, streak, ckpt))
            timer = time.perf_counter()
    finally:
        metrics_file.close()
        bar.close()
        if board is not None:
            board.close()
    return history, state, skipped


def _stop_message(cfg: Config, step: int, streak: int, ckpt: Checkpointer | None) -> str:
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
