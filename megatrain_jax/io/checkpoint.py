"""Checkpoints of the training state: written from the host buffers, checksummed, verified.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    ckpt.save(step, tree, meta)       # returns once the write is under way
    ckpt.wait_written()               # the state's buffers are no longer read: update them
    ckpt.wait()                       # on disk, read back, verified, the oldest ones deleted
    tree, meta = ckpt.restore(step, target)   # target: ShapeDtypeStructs with shardings

CHECKPOINTS/STEP/ holds one raw file per array (array_files.py) and manifest.json: the
caller's record (`meta`) and, per array, its path in the tree, file, shape, dtype, size and
checksum (checksum.py). What the folder promises:

- It appears (renamed from STEP.partial) only when every file is written, synced to the disk,
  read back and matched against the checksums taken from the state as it was written; only
  then are checkpoints beyond `keep` deleted. A killed process, a full disk or a folder that
  is not writable leaves the earlier checkpoints as they were, and the error says so once.
- It never holds a non-finite value: the write stops at the first one and names the array.
- Restoring checks every array's size and checksum and refuses a damaged checkpoint, naming
  the step and the file; nothing is deleted.

Host memory: arrays in host memory (the streaming engine's pinned state) are read straight
from their buffers, in chunks, with no copy, while training goes on; the caller must not write
them until `wait_written()` returns. Arrays in device memory are copied to the host first,
synchronously, since the next step may donate them. (orbax-checkpoint, used before, checks
no data on restore: its zarr3 format checksums shard indexes only.)
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from megatrain_jax.io import array_files
from megatrain_jax.io.array_files import Damaged, NonFinite
from megatrain_jax.io.checksum import Checksum

FORMAT = "megatrain-checkpoint/1"
MANIFEST = "manifest.json"
THREADS = min(4, os.cpu_count() or 1)  # arrays written, verified or restored at once


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, cannot be written or does not match the model."""


def complete_steps(directory: str | Path) -> list[int]:
    """Steps of the complete checkpoints in `directory` (folders STEP holding a manifest)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and (p / MANIFEST).is_file())


def foreign_steps(directory: str | Path) -> list[int]:
    """Step folders without a manifest: written by an earlier version (orbax), or not ours."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and p.is_dir() and not (p / MANIFEST).is_file())


def free_bytes(directory: str | Path) -> int:
    """Free bytes on the disk that holds (or will hold) `directory`."""
    path = Path(directory).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def room_needed(directory: str | Path, keep: int, checkpoint_bytes: int) -> int:
    """Free bytes a run's checkpoints need: a new one is complete before the oldest goes, so
    up to keep + 1 exist at once, less those already there."""
    return checkpoint_bytes * max(1, keep + 1 - len(complete_steps(directory)))


def size(n: float) -> str:
    """Bytes as 1.5 KiB, 38.4 GiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def tree_bytes(tree) -> int:
    """Bytes of the arrays (or ShapeDtypeStructs) of a tree: what a checkpoint of it holds."""
    import jax

    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.keep = keep
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="checkpoint-io")
        self._job: Future | None = None
        self._job_step: int | None = None
        self._written = threading.Event()
        self._written.set()
        Checksum(np.float32).update(np.zeros(8, np.uint8))  # the kernel, loaded (or compiled)
        # now rather than at the first save, whose host memory would then grow by its code

    def steps(self) -> list[int]:
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def check_room(self, checkpoint_bytes: int) -> None:
        """Refuses, with the numbers, a run whose checkpoints the disk cannot hold."""
        need, free = room_needed(self.directory, self.keep, checkpoint_bytes), \
            free_bytes(self.directory)
        if need > free:
            raise CheckpointError(
                f"{self.directory} needs {size(need)} free for checkpoints of "
                f"{size(checkpoint_bytes)} each (loop.keep_checkpoints={self.keep}, and a new "
                f"one is complete before the oldest goes) but its disk has {size(free)} free. "
                "Free space, lower loop.keep_checkpoints or choose a loop.run_dir on a larger "
                "disk.")

    # ----- saving ----------------------------------------------------------------------------

    def save(self, step: int, tree, meta: dict) -> None:
        """Starts writing `tree` and `meta` as checkpoint `step`, once the previous save has
        ended (its error, if any, is raised here)."""
        import jax

        self.wait()
        sources, names = [], set()
        for path, array in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                            for k in path).replace("/", "_") + ".bin"  # params.layers.3.wq.bin
            name = f"{len(names)}.{name}" if name in names else name
            names.add(name)
            sources.append((jax.tree_util.keystr(path), name, array,
                            array_files.host_pieces(array)))
        self._written = threading.Event()
        self._job = self._runner.submit(self._save, step, sources, meta, self._written)
        self._job_step = step

    def saving(self) -> int | None:
        """The step of the save still under way (not yet verified and visible), else None."""
        job = self._job
        return self._job_step if job is not None and not job.done() else None

    def wait_written(self) -> None:
        """Returns once the last save has read all it writes from the state's buffers."""
        self._written.wait()

    def failed(self) -> Exception | None:
        """The error of the last save, if it has already ended with one (does not wait)."""
        if self._job is not None and self._job.done():
            return self._job.exception()
        return None

    def wait(self) -> None:
        """Waits until the last save is complete and verified, and the checkpoints beyond
        `keep` deleted; raises its error."""
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._runner.shutdown()
            self._pool.shutdown()

    def _save(self, step: int, sources: list, meta: dict, written: threading.Event) -> None:
        final, partial = self.directory / str(step), self.directory / f"{step}.partial"

        def write(source) -> dict:
            key, name, array, data = source
            try:
                checksum = array_files.write_array(partial / name, data, array.dtype)
            except NonFinite:
                raise NonFinite(name[:-len(".bin")]) from None
            return {"key": key, "file": name, "shape": list(array.shape),
                    "dtype": np.dtype(array.dtype).name,
                    "bytes": sum(int(piece.size) for piece in data),
                    "checksum": checksum}

        def verify(entry: dict) -> None:
            try:
                array_files.read_array(partial / entry["file"], entry["bytes"], entry["dtype"],
                                       entry["checksum"])
            except Damaged as e:
                raise CheckpointError(f"checkpoint {step} did not read back as written: "
                                      f"{partial / entry['file']} {e}.") from None

        try:
            try:
                for stale in self.directory.glob("*.partial"):  # left by a killed process
                    shutil.rmtree(stale)
                partial.mkdir(parents=True)
                writes = [self._pool.submit(write, source) for source in sources]
                wait(writes)  # all of them: none may still read the state after `written`
                entries = [w.result() for w in writes]
            finally:
                written.set()
                sources.clear()  # host copies of device arrays go now
            manifest = {"format": FORMAT, "step": step, "meta": meta, "arrays": entries}
            array_files.write_file(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
            list(self._pool.map(verify, entries))
            if final.exists():  # the same step saved again: the new one replaces it
                shutil.rmtree(final)
            partial.rename(final)
            array_files.sync_folder(self.directory)
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(e, OSError):
                raise CheckpointError(self._write_error(step, e)) from None
            if isinstance(e, NonFinite):
                raise CheckpointError(
                    f"checkpoint {step} not written: the state holds non-finite values ({e}), "
                    f"and no checkpoint is ever written from such a state. Earlier checkpoints "
                    f"are untouched ({self.steps() or 'none'}).") from None
            raise
        for old in self.steps()[:-self.keep]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)

    def _write_error(self, step: int, error: OSError) -> str:
        hint = {errno.ENOSPC: "free disk space or lower loop.keep_checkpoints (`megatrain-jax "
                              "plan` shows what a checkpoint needs)",
                errno.EDQUOT: "free space within the disk quota or lower loop.keep_checkpoints",
                errno.EACCES: "make the folder writable or choose another loop.run_dir",
                errno.EROFS: "choose a loop.run_dir on a writable disk"}.get(
            error.errno, "check the disk and the folder")
        return (f"cannot write checkpoint {step} ({error.filename or self.directory}): "
                f"{error.strerror or error}. Earlier checkpoints are untouched "
                f"({self.steps() or 'none'}); {hint}.")

    # ----- reading ---------------------------------------------------------------------------

    def read_meta(self, step: int) -> dict:
        """The record saved with checkpoint `step` (reads the manifest only)."""
        return self._manifest(step)["meta"]

    def _manifest(self, step: int) -> dict:
        file = self.directory / str(step) / MANIFEST
        if not file.is_file():
            raise CheckpointError(f"no complete checkpoint {file.parent}; complete steps: "
                                  f"{self.steps() or 'none'}")
        try:
            manifest = json.loads(file.read_text())
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}, not {FORMAT}")
            return manifest
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {step} is damaged: {file} cannot be read "
                                  f"({e}).{self._older_hint(step)}") from None

    def restore(self, step: int, target) -> tuple[object, dict]:
        """Reads checkpoint `step` into arrays shaped and placed like `target` (a tree of
        ShapeDtypeStructs with shardings), checking every array's size and checksum."""
        import jax

        manifest = self._manifest(step)
        entries = {e["key"]: e for e in manifest["arrays"]}
        leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
        wanted = [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]
        for key, leaf in wanted:
            entry = entries.get(key)
            shape, dtype = list(leaf.shape), np.dtype(leaf.dtype).name
            if entry is None or entry["shape"] != shape or entry["dtype"] != dtype:
                found = "absent" if entry is None else f"{entry['dtype']}{entry['shape']}"
                raise CheckpointError(
                    f"checkpoint {self.directory / str(step)} does not match this model's "
                    f"state: {key} is {dtype}{shape} here, {found} there.")
        folder = self.directory / str(step)

        def load(item):
            key, leaf = item
            entry, host = entries[key], array_files.mapped_empty(leaf.shape, leaf.dtype)
            try:
                array_files.read_array(folder / entry["file"], entry["bytes"], entry["dtype"],
                                       entry["checksum"], into=array_files.byte_view(host))
            except Damaged as e:
                raise CheckpointError(f"checkpoint {step} is damaged: {folder / entry['file']} "
                                      f"{e}.{self._older_hint(step)}") from None
            return jax.device_put(host, leaf.sharding)

        arrays = list(self._pool.map(load, wanted))
        return treedef.unflatten(arrays), manifest["meta"]

    def _older_hint(self, step: int) -> str:
        older = [s for s in self.steps() if s < step]
        if not older:
            return " No earlier checkpoint is left."
        return (f" Earlier checkpoints are untouched ({older}): move {self.directory / str(step)}"
                f" away to resume from step {older[-1]}.")
