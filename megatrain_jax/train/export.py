"""A run's weights as a Hugging Face folder: from a checkpoint (`export_run`, the `export`
command) or when the run ends (`export_final`, loop.export_dir).

    export_run("runs/latest", "out/")                  # the latest checkpoint
    export_run("runs/latest", "out/", step=500, dtype="bfloat16")
    export_final(params, cfg, checkpoints)             # loop.export_dir, when the run ends

The parameters are read from a checkpoint whole, into host memory, whatever the device and
process count of the run that wrote it, and only they are read and verified: a damaged
optimizer moment does not stop an export. `export_run` takes no lock: it reads only complete
checkpoints (a step folder appears once verified), so it may run beside the `train` writing
them; where RUN_DIR's config.json cannot be read, it takes the config the checkpoint recorded.
"""

from __future__ import annotations

from pathlib import Path

from megatrain_jax import model
from megatrain_jax.config import Config
from megatrain_jax.io import hf
from megatrain_jax.io.checkpoint import Checkpointer, CheckpointError
from megatrain_jax.io.processes import PeerFailed, Peers
from megatrain_jax.io.progress import Progress
from megatrain_jax.io.run_folder import run_config


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
            raise CheckpointError(_no_checkpoint(run_dir, cfg))
        params = read_params(ckpt, step, cfg)
    finally:
        ckpt.close()
    return export_params(params, cfg, out_dir, dtype, progress)


def _no_checkpoint(run_dir: Path, cfg: Config) -> str:
    """Why a run has nothing to export, naming what it has and what would have kept it."""
    folder = run_dir / "checkpoints"
    where = (f"{folder} holds no complete checkpoint" if folder.is_dir() else
             f"{run_dir} holds no checkpoints folder: the run kept no checkpoint")
    exported = (f"; its final weights were to be exported to loop.export_dir="
                f"{cfg.loop.export_dir}" if cfg.loop.export_dir else "")
    return (f"{where}{exported}. A run keeps a checkpoint of its last step unless "
            "loop.final_checkpoint=false; train with it (or loop.checkpoint_every=N, or "
            "loop.export_dir=FOLDER to export as it ends).")


def read_params(ckpt: Checkpointer, step: int, cfg: Config) -> dict:
    """The parameters of checkpoint `step`, whole, as host NumPy arrays, from a checkpoint of
    any device and process count (the optimizer state is not read)."""
    tree, _ = ckpt.restore(step, {"params": model.abstract(cfg.model)})
    return tree["params"]


def export_final(params: dict | None, cfg: Config, checkpoints: Path,
                 step: int | None = None) -> None:
    """Writes loop.export_dir when the run ends: `params`, or where they are None or in a run
    of several processes (none of which holds them whole) those of checkpoint `step` (default
    loop.steps, always written) in `checkpoints`, read by the first process while the others
    wait for it."""
    peers = Peers.of_this_run()
    if peers is None:
        if params is None:
            params = _checkpoint_params(checkpoints, step or cfg.loop.steps, cfg)
        export_params(params, cfg, cfg.loop.export_dir, None, cfg.loop.progress)
        return
    if not peers.main:
        try:
            peers.hear("export", 0)
        except PeerFailed as e:
            raise CheckpointError(f"loop.export_dir was not written: {e}") from None
        return
    try:
        params = _checkpoint_params(checkpoints, step or cfg.loop.steps, cfg)
        export_params(params, cfg, cfg.loop.export_dir, None, cfg.loop.progress)
    except BaseException as e:
        peers.tell("export", f"process 0: {e}")
        raise
    peers.tell("export", "ok")


def _checkpoint_params(checkpoints: Path, step: int, cfg: Config) -> dict:
    ckpt = Checkpointer(checkpoints)
    try:
        return read_params(ckpt, step, cfg)
    finally:
        ckpt.close()


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
