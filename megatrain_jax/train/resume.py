"""Whether a checkpoint may continue under a config, and the record that lets it tell.

    meta = run_record(cfg, step, skipped_steps)   # saved with every checkpoint
    check_continues(cfg, meta, folder)            # before a resume reads any array

A resumed run must be the run that wrote the checkpoint: the same model (else the arrays do not
fit) and, over the steps that run had planned (its loop.steps), the same optimizer, the same
batches and the same learning rates, so that resuming gives what an unbroken run would have.
`schedule.decay_steps=0` decays until loop.steps: raising loop.steps under it changes the
learning rate of every step already planned. Such a change is refused, naming what changed and
how to continue on purpose (`schedule.decay_steps` fixed at the old length, or
`loop.accept_changes=true`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from megatrain_jax.config import Config, ConfigError, to_dict
from megatrain_jax.io.checkpoint import CheckpointError

# The settings that decide the batch of step n (data.micro_batches only splits it).
DATA_KEYS = ("source", "batch_size", "seq_len", "seed", "val_fraction")


def run_record(cfg: Config, step: int, skipped_steps: int) -> dict:
    """What a checkpoint records besides the state: where the run stands and its config."""
    return {"step": step, "data_position": step, "skipped_steps": skipped_steps,
            "config": to_dict(cfg)}


def _saved_config(cfg: Config, saved: dict) -> Config:
    """The checkpoint's run config, over `cfg` for what it does not record (or no longer
    exists in the schema)."""

    def merge(current, values: dict):
        known = {f.name for f in dataclasses.fields(current)}
        return dataclasses.replace(current, **{k: v for k, v in values.items()
                                               if k in known and not isinstance(v, dict)})

    sections = {name: merge(getattr(cfg, name), saved.get(name, {}))
                for name in ("optim", "schedule", "data", "loop")}
    return dataclasses.replace(cfg, **sections)


def _learning_rates(cfg: Config, steps: int) -> np.ndarray:
    from megatrain_jax.optim import learning_rate

    return np.asarray(learning_rate(cfg)(np.arange(steps)))


def _rate_change(before: np.ndarray, after: np.ndarray, step: int) -> str | None:
    """How the learning rates of a plan's steps differ, counted from the checkpoint at
    `step`: the first step to come whose rate changes, else the steps already trained whose
    rates would have differed. Rates are per update: step k + 1 uses the rate at count k."""
    differ = np.flatnonzero(before != after)
    if not differ.size:
        return None
    ahead = differ[differ >= step]
    if ahead.size:
        k = int(ahead[0])
        return f"the learning rate from step {k + 1} on ({before[k]:.6g} -> {after[k]:.6g} there"
    k, last = int(differ[0]), int(differ[-1])
    return (f"the learning rate of steps {k + 1} to {last + 1}, already trained under the "
            f"checkpoint's schedule ({before[k]:.6g} -> {after[k]:.6g} at step {k + 1}")


def planned_changes(cfg: Config, saved: dict, step: int = 0) -> tuple[list[str], list[str]]:
    """(what differs in the steps the checkpoint's run planned, ways to keep them), for a
    checkpoint at `step`."""
    old = _saved_config(cfg, saved)
    now, then = to_dict(cfg), to_dict(old)
    changes = [f"optim.{k}: {then['optim'][k]!r} -> {now['optim'][k]!r}"
               for k in now["optim"] if k != "lr" and then["optim"][k] != now["optim"][k]]
    changes += [f"data.{k}: {then['data'][k]!r} -> {now['data'][k]!r}"
                for k in DATA_KEYS if then["data"][k] != now["data"][k]]
    hints = []
    planned = old.loop.steps
    rates = _rate_change(_learning_rates(old, planned), _learning_rates(cfg, planned), step)
    if rates:
        causes = [f"schedule.{k}: {then['schedule'][k]!r} -> {now['schedule'][k]!r}"
                  for k in now["schedule"] if then["schedule"][k] != now["schedule"][k]]
        if old.optim.lr != cfg.optim.lr:
            causes.append(f"optim.lr: {old.optim.lr!r} -> {cfg.optim.lr!r}")
        if old.loop.steps != cfg.loop.steps and 0 in (old.schedule.decay_steps,
                                                      cfg.schedule.decay_steps):
            causes.append(f"loop.steps: {old.loop.steps} -> {cfg.loop.steps} with "
                          "schedule.decay_steps=0 (decay until loop.steps)")
            if old.schedule.decay_steps == 0:
                hints.append(f"keep the schedule with schedule.decay_steps={old.loop.steps}")
        changes.append(f"{rates}; {', '.join(causes) or 'the schedule'})")
    return changes, hints


def stored_state_dtype(meta: dict) -> str:
    """The optim.state_dtype of a checkpoint's moments, from its record."""
    return ((meta.get("config") or {}).get("optim") or {}).get("state_dtype", "float32")


def restore(ckpt, step: int, trainer, cfg: Config) -> tuple[dict, dict]:
    """(state tree, record) of checkpoint `step` in the form `trainer` keeps. Moments stored
    in another optim.state_dtype (which check_continues lets through only with
    loop.accept_changes) are read in their own form and converted (optim/compact.py): host
    memory holds both forms of the moments while they convert."""
    import jax

    stored = stored_state_dtype(ckpt.read_meta(step))
    if stored == cfg.optim.state_dtype:
        return ckpt.restore(step, trainer.abstract_state())
    from megatrain_jax.optim import compact
    from megatrain_jax.train.trainers import make_trainer

    as_stored = make_trainer(dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, state_dtype=stored)))
    tree, meta = ckpt.restore(step, as_stored.abstract_state())
    put = lambda value, like: jax.device_put(value, like.sharding)  # noqa: E731
    return compact.convert(tree, trainer.abstract_state(), put), meta


def check_model(cfg: Config, meta: dict, folder: Path) -> None:
    """Refuses a checkpoint (in `folder`, its record `meta`) of another model than cfg's."""
    saved = meta.get("config") or {}
    then, now = saved.get("model", meta.get("model", {})), to_dict(cfg)["model"]
    differ = sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k))
    if differ:
        detail = ", ".join(f"model.{k}: checkpoint {then.get(k)!r} vs config {now.get(k)!r}"
                           for k in differ[:5])
        raise CheckpointError(f"checkpoint {folder} is of another model ({detail}). Use "
                              "another loop.run_dir, or move its checkpoints away.")


def check_continues(cfg: Config, meta: dict, folder: Path) -> None:
    """Refuses to resume from the checkpoint in `folder` (whose record is `meta`) a run that
    would not continue it: another model, fewer steps than it holds, or changed planned
    steps. (A checkpoint at loop.steps is a finished run: `startup.finished_summary`.)"""
    check_model(cfg, meta, folder)
    saved = meta.get("config") or {}
    stored = stored_state_dtype(meta)
    if saved and stored != cfg.optim.state_dtype and not cfg.loop.accept_changes:
        raise CheckpointError(
            f"checkpoint {folder} holds {stored} optimizer moments and this run asks for "
            f"optim.state_dtype={cfg.optim.state_dtype}. Resume with optim.state_dtype="
            f"{stored}, or convert the moments on purpose with loop.accept_changes=true "
            "(compact moments are rounded: the run no longer equals an unbroken one).")
    step = meta["step"]
    old = _saved_config(cfg, saved)
    if step >= cfg.loop.steps:
        keep = (f" with schedule.decay_steps={old.loop.steps} to keep the learning rates "
                "already used" if saved and old.schedule.decay_steps == 0 else "")
        raise ConfigError(f"{folder.parent} already holds step {step}, past loop.steps="
                          f"{cfg.loop.steps}: set loop.steps to {step} or more to go on from "
                          f"it{keep}, or use another loop.run_dir.")
    if not saved or cfg.loop.accept_changes:
        return
    changes, hints = planned_changes(cfg, saved, step)
    if changes:
        ways = " or ".join(hints + ["accept the change with loop.accept_changes=true"])
        raise ConfigError(
            f"resuming from {folder} would change the steps its run had planned (up to step "
            f"{old.loop.steps}): {'; '.join(changes)}. To continue on purpose, {ways}.")
