"""Checkpoints of the training state: written from the host buffers, checksummed, verified.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    ckpt.save(step, tree, meta)       # returns once the capture is under way
    ckpt.wait_captured("layer 3")     # that part is copied: its buffers may be written again
    ckpt.wait()                       # on disk, read back, verified, the oldest ones deleted
    tree, meta = ckpt.restore(step, target)   # target: ShapeDtypeStructs with shardings

CHECKPOINTS/STEP/ holds one raw file per array, or per shard of it (array_files.py,
shards.py), and manifest.json (manifests.py): the caller's record (`meta`) and, per array, its
path in the tree, shape, dtype and shards, each with its file, size and checksum (checksum.py).
What the folder promises:

- It appears (renamed from STEP.partial) only when every file is written, synced to the disk,
  read back and matched against the checksums taken from the state as it was written; only
  then are checkpoints beyond `keep` deleted. A killed process, a full disk or a folder that
  is not writable leaves the earlier checkpoints as they were, and the error says so once.
- It never holds a non-finite value: the write stops at the first one and names the array.
- Restoring checks every file's size and checksum and refuses a damaged checkpoint, naming
  the step and the file; nothing is deleted. Any device count, in any count of processes,
  restores any checkpoint: each process reads the blocks its devices hold.

Several processes (jax.distributed), one folder on a disk they all see: each process writes
the shards of the state it holds (one copy of each), reads them back and lists them in
STEP.partial/part-I.json; the first process, told by every other that its part is verified
(processes.py), checks that the parts tile every array and renames the folder. Until then the
step is not visible, whichever process dies.

Host memory: a save first captures the state into a staging area (staging.py): arrays the
GPU holds are copied to pinned host memory at the link's speed, arrays in host memory copied
by threads into buffers kept from save to save. Training goes on at once; a part's update
waits only until that part is captured (`wait_captured`). The files are then written from the
staging area in the background. Where the host has no room for a copy of the state
(`parts`), K parts are staged at a time and the later parts wait for the disk. (orbax-checkpoint,
used before, copies the state to host arrays to write it and checks no data on restore: its
zarr3 format checksums shard indexes only.)
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from megatrain_jax.io import manifests, saving, shards
from megatrain_jax.io.array_files import Damaged
from megatrain_jax.io.checksum import Checksum
from megatrain_jax.io.manifests import MANIFEST, CheckpointError, complete_steps
from megatrain_jax.io.processes import Peers
from megatrain_jax.io.saving import Writer
from megatrain_jax.io.staging import Capture, Staging
from megatrain_jax.stream.placement import assemble

__all__ = ["Checkpointer", "CheckpointError", "complete_steps", "foreign_steps", "free_bytes",
           "room_needed", "size", "tree_bytes"]
THREADS = min(4, os.cpu_count() or 1)  # arrays written, verified or restored at once
BACKGROUND_NICE = 10  # the writer's threads' priority: below the training thread's


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


def give_way() -> None:
    """Lowers the calling thread's CPU priority (nice 10; Linux schedules threads on their
    own): a save's background write, checksums and read-back give way to the training
    thread, whose step waits on its own dispatch. Where it cannot (another system), as is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, staging_parts: int | None = None):
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.staging_parts = staging_parts  # parts staged at a time; None: the whole state
        self.no_room: str | None = None  # why the disk cannot take a checkpoint, if it cannot
        self.write_seconds: list[float] = []  # each save's background work, capture to publish
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="checkpoint",
                                          initializer=give_way)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="checkpoint-io",
                                        initializer=give_way)
        self._job: Future | None = None
        self._job_step: int | None = None
        self._peers: Peers | None = None  # the run's other processes, met at the first save
        self._staging = Staging()
        self._capture: Capture | None = None
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

    def save(self, step: int, tree, meta: dict) -> float:
        """Captures `tree` (staging.py) and starts writing it and `meta` as checkpoint `step`,
        once the previous save has ended (its error, if any, is raised here); returns the
        seconds it waited for that save. In a run of several processes every process calls
        it, for the same step, with its own arrays of the same tree."""
        import jax

        waiting = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - waiting
        if self._peers is None and jax.process_count() > 1:
            self._peers = Peers.of_this_run()
        sources = saving.sources(tree, whole=self._peers is None)
        self._capture = self._staging.capture(sources, self.staging_parts)
        self._job = self._runner.submit(self._save, step, self._capture, meta)
        self._job_step = step
        return waited

    def prepare(self, tree) -> None:
        """Makes the staging area of saves of `tree` in the background, copying nothing
        (Staging.reserve), so that the first save costs the run what the later ones do."""
        import jax

        self._job = self._staging.reserve(saving.sources(tree, whole=jax.process_count() == 1),
                                          self.staging_parts)
        self._job_step = None

    def saving(self) -> int | None:
        """The step of the save still under way (not yet verified and visible), else None."""
        job = self._job
        return self._job_step if job is not None and not job.done() else None

    @property
    def staging(self) -> Staging:
        """The staging area its saves capture into (kept from save to save)."""
        return self._staging

    def capturing(self) -> bool:
        """Whether the last save is still capturing the state."""
        capture = self._capture
        return capture is not None and not capture.captured()

    def wait_captured(self, part: str | None = None) -> None:
        """Returns once the last save has captured `part` (a part's name as the streaming
        engine gives it; None: every part): its buffers may be written or donated."""
        capture = self._capture
        if capture is not None:
            capture.wait(part)

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
            try:
                job.result()
            finally:
                self._capture = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._runner.shutdown()
            self._pool.shutdown()
            self._staging.close()

    def _save(self, step: int, capture: Capture, meta: dict) -> None:
        began = time.perf_counter()
        Writer(self.directory, self._pool, self._peers).save(step, capture, meta)
        self.write_seconds.append(time.perf_counter() - began)
        if self._peers is None or self._peers.main:
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.directory / str(old), ignore_errors=True)

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
            if manifest.get("format") not in manifests.READABLE:
                raise ValueError(f"format {manifest.get('format')!r}, not "
                                 f"{' or '.join(manifests.READABLE)}")
            return manifest
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {step} is damaged: {file} cannot be read "
                                  f"({e}).{self._older_hint(step)}") from None

    def restore(self, step: int, target) -> tuple[object, dict]:
        """Reads checkpoint `step` into arrays shaped and placed like `target` (a tree of
        ShapeDtypeStructs with shardings; each process gets its devices' blocks), checking
        every file's size and checksum. A leaf without a sharding comes back whole as a NumPy
        array."""
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
            stored = manifests.shards_of(entries[key])
            blocks = {}  # devices holding the same block share one read

            def block(index):
                region = shards.region_of(index, leaf.shape)
                if region not in blocks:
                    blocks[region] = shards.read_region(folder, stored, region, leaf.dtype)
                return blocks[region]

            try:
                if getattr(leaf, "sharding", None) is None:
                    return block(())
                return assemble(leaf.shape, leaf.sharding, block)
            except Damaged as e:
                raise CheckpointError(f"checkpoint {step} is damaged: {e}."
                                      f"{self._older_hint(step)}") from None

        arrays = list(self._pool.map(load, wanted))
        return treedef.unflatten(arrays), manifest["meta"]

    def _older_hint(self, step: int) -> str:
        older = [s for s in self.steps() if s < step]
        if not older:
            return " No earlier checkpoint is left."
        return (f" Earlier checkpoints are untouched ({older}): move {self.directory / str(step)}"
                f" away to resume from step {older[-1]}.")
