"""Where the training loop's records go: metrics.jsonl, eval.jsonl, TensorBoard, the
progress output, the step's timeline, and the caller's `log`.

    out = Outputs(cfg, start_step, log)     # opened for a run beginning at start_step
    out.record(record); out.eval_record(step, loss); out.close()
"""

from __future__ import annotations

import json
from pathlib import Path

from megatrain_jax.config import Config, host_update
from megatrain_jax.io.data import TokenSource
from megatrain_jax.io.progress import Progress
from megatrain_jax.train.startup import tensorboard


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


class Outputs:
    """Where the loop's records go: metrics.jsonl, eval.jsonl, TensorBoard, the progress
    output and the caller's `log`."""

    def __init__(self, cfg: Config, start: int, log):
        self.cfg, self.run_dir, self.log = cfg, Path(cfg.loop.run_dir), log
        self.bar = Progress(cfg.loop.steps, cfg.loop.progress, plain_every=cfg.loop.log_every)
        self.board = tensorboard(cfg, self.run_dir, start)
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")

    def record(self, record: dict) -> None:
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        step = record["step"]
        if self.board is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.board.add_scalar(key, value, step)
            self.board.flush()
        shown = {"loss": record["loss"], "tok/s": record["tokens_per_s"]}
        if record["mfu"] is not None:
            shown["mfu"] = record["mfu"]
        if self.cfg.stream.speculate != "off" and "speculated_parts" in record:
            # the speculative update that finished beside this step: the parts it updated
            # during their backward ("early"), and those undone because the step clipped
            shown["early update"] = (f"{record['speculated_parts']:.0f} parts, "
                                     f"{record['undone_parts']:.0f} undone")
        self.bar.update(step, shown)
        if self.log:
            self.log(record)

    def eval_record(self, step: int, loss: float) -> None:
        with open(self.run_dir / "eval.jsonl", "a") as eval_file:
            eval_file.write(json.dumps({"step": step, "loss": loss}) + "\n")
        if self.board is not None:
            self.board.add_scalar("eval_loss", loss, step)
        self.bar.note(f"step {step}: eval loss {loss:.4f}")

    def close(self) -> None:
        self.metrics_file.close()
        self.bar.close()
        if self.board is not None:
            self.board.close()
