"""A run's weights as a Hugging Face folder: from a checkpoint (`export_run`, the `export`
command) or from the state at the end of a run (`export_params`, loop.export_dir).

    export_run("runs/latest", "out/")                  # the latest checkpoint
    export_run("runs/latest", "out/", step=500, dtype="bfloat16")

`export_run` takes no lock: it reads only complete checkpoints (a step folder appears once
verified), so it may run beside the `train` writing them. It reads and verifies the
parameters alone, so a damaged optimizer moment does not stop it; and where RUN_DIR's
config.json cannot be read, it takes the config the checkpoint recorded.
"""

from __future__ import annotations

from pathlib import Path

from megatrain_jax.config import Config
from megatrain_jax.io import hf
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError
from megatrain_jax.io.run_folder import run_config
from megatrain_jax.tools.progress import Progress
from megatrain_jax.train.trainers import make_trainer


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               dtype: str | None = None, progress: str = "auto", note=None) -> Path:
    """Writes checkpoint `step` (default: the latest) of a run as a Hugging Face folder.

    `dtype` defaults to that of the checkpoint the run started from (model.hf_path), else
    float32. Tokenizer files beside that checkpoint are copied along. `note(text)` hears
    when the config comes from the checkpoint's record rather than config.json.
    """
    run_dir = Path(run_dir)
    cfg, fallback = run_config(run_dir, step)
    if fallback and note is not None:
        note(fallback)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.loop.keep_checkpoints)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{run_dir / 'checkpoints'} holds no complete checkpoint; "
                                  "train with loop.checkpoint_every=N to write some.")
        params = make_trainer(cfg).abstract_state()["params"]
        tree, _ = ckpt.restore(step, {"params": params})  # the optimizer state is not read
    finally:
        ckpt.close()
    return export_params(tree["params"], cfg, out_dir, dtype, progress)


def export_params(params: dict, cfg: Config, out_dir, dtype: str | None,
                  progress: str) -> Path:
    """Writes `params` as a Hugging Face folder, in the source checkpoint's dtype by default."""
    source = cfg.model.hf_path if cfg.model.hf_path and Path(cfg.model.hf_path).is_dir() else None
    if dtype is None:
        source_config = hf.read_hf_config(source) if source else {}
        dtype = source_config.get("dtype") or source_config.get("torch_dtype") or "float32"
    bar = Progress(len(hf.shard_plan(cfg.model, dtype)), progress, label="export")
    out = hf.save_params(params, cfg.model, out_dir, dtype=dtype, source=source, progress=bar)
    bar.close()
    return out
