"""Checkpoints of training state through orbax-checkpoint: async, keep-N, atomic.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    ckpt.save(step, tree, meta)            # returns once the write is under way
    tree, meta = ckpt.restore(step, target)  # target: ShapeDtypeStructs with shardings

A checkpoint is a step folder that orbax writes under a temporary name and renames when
complete, so a process killed mid-save leaves the previous checkpoints as they were and the
partial one invisible. `target` carries the shardings to restore into: the streaming
trainer names `pinned_host`, so state goes straight back to host memory.

What a checkpoint holds: the state pytree (parameters, optimizer state) and a JSON record
with the step, the data position, the seeds and the model config, against which a resume
is checked before anything is read.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


def _orbax():
    """orbax-checkpoint, imported on first use: naming CheckpointError must not start JAX."""
    import orbax.checkpoint

    return orbax.checkpoint


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        ocp = _orbax()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, tree, meta: dict) -> None:
        """Starts writing `tree` and `meta` as checkpoint `step`; waits for the previous one.

        The arrays of `tree` must not change until `wait()` returns: the engine's in-place
        host update waits for it (StreamEngine.before_update).
        """
        ocp = _orbax()
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        """Blocks until the last save is on disk (and the old ones beyond `keep` removed)."""
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        path = self.directory / str(step)
        ocp = _orbax()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the folder
            raise CheckpointError(f"cannot read the record of checkpoint {path}: {e}") from e
        return dict(restored["meta"])

    def restore(self, step: int, target) -> tuple[object, dict]:
        """Reads checkpoint `step` into arrays shaped and placed like `target`."""
        path = self.directory / str(step)
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no complete checkpoint {path}; complete steps: "
                                  f"{self.steps() or 'none'}")
        meta = self.read_meta(step)
        ocp = _orbax()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"checkpoint {path} is corrupt or truncated ({_broken_file(path, e)}): "
                f"{type(e).__name__}: {str(e)[:400]}. Delete it to resume from an earlier "
                f"step ({[s for s in self.steps() if s != step] or 'none left'})."
            ) from e
        return restored["state"], meta

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _broken_file(path: Path, error: Exception) -> str:
    """The file of the checkpoint that the error names, else the folder."""
    text = str(error)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if file.name in text or str(file.relative_to(path)) in text:
            return f"file {file}"
    return f"under {path}"

