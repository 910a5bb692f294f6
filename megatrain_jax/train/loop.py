"""Training: `make_trainer(cfg)` gives the step, `train(cfg)` runs the loop.

    cfg = load_config("demo")
    summary = train(cfg)                 # writes RUN_DIR/config.json and metrics.jsonl

Both trainers have `init(key) -> state` and `train_step(state, batch) -> (state, metrics)`:
`stream` (the default) keeps state on the host and streams layers through the GPU;
`reference` holds the whole model on the device. The loop is a plain for-loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from megatrain_jax.config import (
    HOST_OPTIMIZERS,
    Config,
    ConfigError,
    load_run_config,
    save_config,
    to_dict,
)
from megatrain_jax.io import hf
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError
from megatrain_jax.io.data import TokenSource
from megatrain_jax.stream import Timeline
from megatrain_jax.tools.machine import host_rss_bytes, peak_device_bytes, peak_flops
from megatrain_jax.tools.progress import Progress
from megatrain_jax.train.trainers import make_trainer


def _resume(cfg: Config, trainer, ckpt: Checkpointer | None):
    """(state, first step, skipped steps) from the latest checkpoint, or (None, 0, 0)."""
    if ckpt is None or not cfg.loop.resume or ckpt.latest_step() is None:
        return None, 0, 0
    step = ckpt.latest_step()
    meta = ckpt.read_meta(step)
    saved, now = meta.get("model", {}), to_dict(cfg)["model"]
    differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if differ:
        detail = ", ".join(f"model.{k}: checkpoint {saved.get(k)!r} vs config {now.get(k)!r}"
                           for k in differ[:5])
        raise CheckpointError(
            f"checkpoint {ckpt.directory / str(step)} is of another model ({detail}). Use "
            "another loop.run_dir, or loop.resume=false to start over in this one."
        )
    if step >= cfg.loop.steps:
        raise CheckpointError(
            f"{ckpt.directory} already holds step {step}, and loop.steps is {cfg.loop.steps}: "
            "raise loop.steps to train on, or use another loop.run_dir."
        )
    tree, meta = ckpt.restore(step, trainer.abstract_state())
    return (trainer.from_tree(tree, step, meta.get("state", {})), meta["data_position"],
            meta.get("skipped_steps", 0))


def initial_state(cfg: Config, trainer):
    """Random parameters, or those of model.hf_path read part by part into their place."""
    if not cfg.model.hf_path:
        return trainer.init(jax.random.key(cfg.loop.seed))
    parts = len(hf.tensor_names(cfg.model))
    bar = Progress(parts, cfg.loop.progress, label="import")
    params = hf.load_params(cfg.model.hf_path, cfg.model, put=trainer.put_params, progress=bar)
    bar.close()
    return trainer.init(None, params)


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
    update = "host" if cfg.optim.name in HOST_OPTIMIZERS and cfg.stream.update != "device" \
        else "device"
    doc = {"step": step, "layers": cfg.model.layers, "prefetch_depth": cfg.stream.prefetch_depth,
           "update": update, "bars": bars}
    path.write_text(json.dumps(doc) + "\n")


def train(cfg: Config, log=None) -> dict:
    """Runs `cfg.loop.steps` steps; returns a summary (first and last loss, tokens/s, ...)."""
    run_dir = Path(cfg.loop.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.json")
    if cfg.loop.export_dir and Path(cfg.loop.export_dir).exists():
        raise ConfigError(f"loop.export_dir {cfg.loop.export_dir} already exists; name a new "
                          "folder for the exported model.")
    data = TokenSource(cfg)
    val = TokenSource(cfg, "val") if cfg.loop.eval_every else None
    trainer = make_trainer(cfg)
    ckpt = (Checkpointer(run_dir / "checkpoints", keep=cfg.loop.keep_checkpoints)
            if cfg.loop.checkpoint_every else None)
    state, start, skipped_before = _resume(cfg, trainer, ckpt)
    if state is None:
        state = initial_state(cfg, trainer)
    flops_per_token = 6 * cfg.model.num_params
    peak = peak_flops()
    bar = Progress(cfg.loop.steps, cfg.loop.progress, plain_every=cfg.loop.log_every)
    history = []
    # Skipped steps are counted on the device, every step, without waiting for any of them.
    skipped = jax.numpy.asarray(skipped_before, jax.numpy.int32)
    before_write = ckpt.wait if ckpt is not None else None  # a checkpoint may still read
    board = _tensorboard(cfg, run_dir)
    timer = time.perf_counter()
    if not start:
        (run_dir / "eval.jsonl").unlink(missing_ok=True)
    with open(run_dir / "metrics.jsonl", "a" if start else "w") as metrics_file:
        for step in range(start, cfg.loop.steps):
            timeline = Timeline() if step == cfg.loop.timeline_step else None
            state, metrics = trainer.train_step(state, data.batch_at(step), tracer=timeline,
                                                before_write=before_write)
            skipped = skipped + metrics.pop("skipped")
            if timeline is not None:
                state.wait()
                write_timeline(run_dir / "timeline.json", timeline.finish(), step + 1, cfg)
            last = step + 1 == cfg.loop.steps
            if ckpt is not None and ((step + 1) % cfg.loop.checkpoint_every == 0 or last):
                meta = {"step": step + 1, "data_position": step + 1, "data_seed": cfg.data.seed,
                        "loop_seed": cfg.loop.seed, "model": to_dict(cfg)["model"],
                        "skipped_steps": int(skipped), "state": trainer.state_record(state)}
                ckpt.save(step + 1, trainer.state_tree(state), meta)
            if val is not None and ((step + 1) % cfg.loop.eval_every == 0 or last):
                began = time.perf_counter()
                eval_loss = evaluate(trainer, state, val, cfg.loop.eval_batches)
                with open(run_dir / "eval.jsonl", "a") as eval_file:
                    eval_file.write(json.dumps({"step": step + 1, "loss": eval_loss}) + "\n")
                if board is not None:
                    board.add_scalar("eval_loss", eval_loss, step + 1)
                bar.note(f"step {step + 1}: eval loss {eval_loss:.4f}")
                timer += time.perf_counter() - began  # not training time
            if (step + 1) % cfg.loop.log_every and not last and step != start:
                continue
            record = {k: float(np.asarray(v)) for k, v in metrics.items()}
            seconds = time.perf_counter() - timer  # the read above waited for the step
            steps_done = step + 1 - (history[-1]["step"] if history else start)
            tokens_per_s = steps_done * cfg.data.tokens_per_step / seconds
            record.update(step=step + 1, skipped_steps=int(skipped),
                          step_seconds=seconds / steps_done,
                          tokens_per_s=tokens_per_s, peak_device_bytes=peak_device_bytes(),
                          host_rss_bytes=host_rss_bytes())
            record["mfu"] = flops_per_token * tokens_per_s / peak if peak else None
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
            bar.update(step + 1, shown)
            if log:
                log(record)
            timer = time.perf_counter()
    bar.close()
    if board is not None:
        board.close()
    if ckpt is not None:
        ckpt.close()
    state.wait()
    if not history:
        raise RuntimeError("no step ran")
    if cfg.loop.export_dir:
        _export(state.params, cfg, cfg.loop.export_dir, None, cfg.loop.progress)
    return {
        "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
        "tokens_per_s": history[-1]["tokens_per_s"], "skipped_steps": int(skipped),
        "run_dir": str(run_dir), "state": state,
    }


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               dtype: str | None = None, progress: str = "auto") -> Path:
    """Writes checkpoint `step` (default: the latest) of a run as a Hugging Face folder.

    `dtype` defaults to that of the checkpoint the run started from (model.hf_path), else
    float32. Tokenizer files beside that checkpoint are copied along.
    """
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.loop.keep_checkpoints)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"{run_dir / 'checkpoints'} holds no complete checkpoint; train "
                              "with loop.checkpoint_every=N to write some.")
    trainer = make_trainer(cfg)
    tree, _ = ckpt.restore(step, trainer.abstract_state())
    ckpt.close()
    return _export(tree["params"], cfg, out_dir, dtype, progress)


def _export(params: dict, cfg: Config, out_dir, dtype: str | None, progress: str) -> Path:
    """Writes `params` as a Hugging Face folder, in the source checkpoint's dtype by default."""
    source = cfg.model.hf_path if cfg.model.hf_path and Path(cfg.model.hf_path).is_dir() else None
    if dtype is None:
        source_config = hf.read_hf_config(source) if source else {}
        dtype = source_config.get("dtype") or source_config.get("torch_dtype") or "float32"
    bar = Progress(len(hf.shard_plan(cfg.model, dtype)), progress, label="export")
    out = hf.save_params(params, cfg.model, out_dir, dtype=dtype, source=source, progress=bar)
    bar.close()
    return out
