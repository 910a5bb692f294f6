"""What `train` checks and prepares in the run folder before its first step, and what it reads
back from it: whether the run is already finished, its checkpoints, its records.

    check_writable(run_dir)                    # before anything starts
    checkpoint_folder(cfg)                     # RUN_DIR/checkpoints, of every process
    finished_summary(cfg)                      # a finished run's summary, or None
    ckpt = checkpointer(cfg, trainer)          # its checkpoints, checked; None without any
    rewind(run_dir, step)                      # records after `step` dropped
    board = tensorboard(cfg, run_dir, step)    # events after `step` hidden from TensorBoard
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatrain_jax.config import Config, ConfigError
from megatrain_jax.config.load import write_whole
from megatrain_jax.config.schema import pinned
from megatrain_jax.io.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointError,
    complete_steps,
    foreign_steps,
    tree_bytes,
)
from megatrain_jax.planning.staging import saves
from megatrain_jax.train.resume import check_model


def check_writable(run_dir: Path) -> None:
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


def _latest_record(directory: Path) -> tuple[int, dict] | None:
    """(step, record) of the newest complete checkpoint, from its manifest alone; None when
    there is none or it cannot be read (the resume then says why)."""
    steps = complete_steps(directory)
    if not steps:
        return None
    try:
        return steps[-1], json.loads((directory / str(steps[-1]) / MANIFEST).read_text())["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished_summary(cfg: Config) -> dict | None:
    """The summary of a run whose newest checkpoint is its last step (loop.steps): running
    its command again has nothing to do. None for any other run."""
    run_dir = Path(cfg.loop.run_dir)
    directory = checkpoint_folder(cfg)
    latest = _latest_record(directory) if cfg.loop.resume else None
    if latest is None and not complete_steps(directory):
        return _finished_without_checkpoint(cfg)
    if latest is None or latest[0] != cfg.loop.steps or foreign_steps(directory):
        return None
    check_model(cfg, latest[1], directory / str(latest[0]))
    losses = [r["loss"] for r in read_records(run_dir / "metrics.jsonl")]
    return {"finished_before": True, "steps": latest[0], "checkpoint": latest[0],
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "run_dir": str(run_dir)}


def _finished_without_checkpoint(cfg: Config) -> dict | None:
    """The summary of a run that kept no checkpoint and whose records reach its last step:
    its outputs are not trained over. None for any other run."""
    run_dir = Path(cfg.loop.run_dir)
    records = read_records(run_dir / "metrics.jsonl") if cfg.loop.resume else []
    if not records or records[-1]["step"] != cfg.loop.steps:
        return None
    return {"finished_before": True, "steps": cfg.loop.steps, "checkpoint": None,
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
            "run_dir": str(run_dir)}


def _foreign_message(directory: Path, steps: list[int]) -> str:
    empty = [s for s in steps if not any((directory / str(s)).iterdir())]
    others = [s for s in steps if s not in empty]
    parts = []
    if empty:
        parts.append(f"empty step folders ({empty}: not checkpoints, whose folders appear "
                     "only complete; remove them)")
    if others:
        parts.append(f"step folders without a {MANIFEST} ({others}: written by an earlier "
                     "megatrain-jax, with orbax, or not checkpoints; move them away)")
    return (f"{directory} holds {' and '.join(parts)}, which this version cannot read. Or use "
            "another loop.run_dir.")


def checkpointer(cfg: Config, trainer) -> Checkpointer | None:
    """The run's checkpoints, to write or to resume from, checked before anything starts;
    None when there are neither."""
    directory = checkpoint_folder(cfg)
    if foreign_steps(directory):
        raise CheckpointError(_foreign_message(directory, foreign_steps(directory)))
    existing = complete_steps(directory)
    if existing and not cfg.loop.resume:
        raise CheckpointError(
            f"loop.resume=false, but {directory} holds checkpoints of an earlier run "
            f"({existing}); a new run there would mix its checkpoints with them. Use another "
            "loop.run_dir, or move that folder away.")
    if not saves(cfg) and not existing:
        return None
    ckpt = Checkpointer(directory, keep=cfg.loop.keep_checkpoints,
                        staging_parts=pinned(cfg.stream.save_staging))
    if saves(cfg):
        try:
            ckpt.check_room(tree_bytes(trainer.abstract_state()))
        except CheckpointError as e:
            if cfg.loop.checkpoint_every:
                raise
            ckpt.no_room = str(e)  # the final and stop saves are skipped, and the run says so
    return ckpt


def kept(cfg: Config, ckpt: Checkpointer | None = None) -> str:
    """What the run keeps of its training, in words: its start line and summary say it."""
    loop, folder = cfg.loop, checkpoint_folder(cfg)
    if ckpt is not None and ckpt.no_room and not loop.checkpoint_every:
        kept = f"no checkpoint: {ckpt.no_room}"
    elif loop.checkpoint_every:
        kept = (f"checkpoints every {loop.checkpoint_every} steps and of its last step in "
                f"{folder} (the newest {loop.keep_checkpoints})")
    elif loop.final_checkpoint:
        kept = f"a checkpoint of its last step in {folder}"
    elif loop.stop_save:
        kept = (f"a checkpoint in {folder} only if a signal stops it (loop.final_checkpoint="
                "false: the finished run keeps no weights)")
    else:
        kept = ("no checkpoint (loop.checkpoint_every=0, loop.final_checkpoint=false, "
                "loop.stop_save=false)")
    if loop.export_dir:
        kept += f"; the final weights exported to {loop.export_dir}"
    return kept


def write_summary(run_dir: Path, summary: dict) -> None:
    """RUN_DIR/summary.json: the finished attempt's summary (`report` reads it)."""
    write_whole(run_dir / "summary.json", json.dumps(summary, indent=1) + "\n")


def read_records(path: Path) -> list[dict]:
    """The whole records of a JSONL file (a line cut short by a killed process is left out)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def rewind(run_dir: Path, step: int) -> None:
    """Drops the records after `step` from metrics.jsonl and eval.jsonl: a run resumed from
    an older checkpoint writes those steps again."""
    for path in (run_dir / "metrics.jsonl", run_dir / "eval.jsonl"):
        if not step or not path.exists():
            path.unlink(missing_ok=True)
            continue
        write_whole(path, "".join(json.dumps(r) + "\n" for r in read_records(path)
                                  if r["step"] <= step))


def tensorboard(cfg: Config, run_dir: Path, start: int):
    """A tensorboardX writer when wanted and installed (the `tensorboard` extra), else None.
    It marks the steps after `start` as purged: TensorBoard hides the events an earlier
    attempt wrote past the checkpoint this one resumes from (or all of them, from step 1)."""
    if cfg.loop.tensorboard == "off":
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if cfg.loop.tensorboard == "on":
            raise ImportError("loop.tensorboard=on needs tensorboardX: "
                              "pip install 'megatrain-jax[tensorboard]'") from None
        return None
    # Files are named by the second they start in: an attempt of its own suffix, which sorts
    # as the attempts came, keeps a quick restart from writing over the one before.
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=start + 1,
                         filename_suffix=f".{time.time_ns()}")
