"""How a checkpoint is written, by one process or by several together (checkpoint.py's
saves, run on its background thread).

    sources = sources(tree, whole=True)       # what each array's files will hold
    capture = staging.capture(sources)        # staging.py: copied, training goes on
    Writer(directory, pool, peers).save(step, capture, meta)

One process: STEP.partial/ is made, every file written and read back, the manifest written,
the folder renamed to STEP. Several (`peers`): the first makes STEP.partial/; each process
writes and verifies its shards and lists them in part-I.json, then tells the first; the
first, once every process has told it, merges the parts (manifests.py), writes the manifest
and renames the folder, then tells the others. A failure anywhere removes STEP.partial, and
every process raises one error, the failing process's; a process killed mid-save never tells,
so the step never appears.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from megatrain_jax.io import array_files, manifests, shards
from megatrain_jax.io.array_files import Damaged, NonFinite
from megatrain_jax.io.manifests import MANIFEST, CheckpointError, PartsDisagree, complete_steps
from megatrain_jax.io.processes import PeerFailed, Peers
from megatrain_jax.io.staging import Capture, when_done

# Tests of a process killed mid-save set this to a step: in a run of several processes, that
# step's save stops once this process's files are written and verified, before it says so.
PAUSE_SAVE = "MEGATRAIN_JAX_TEST_PAUSE_SAVE"


def _file_name(path) -> str:
    """params.layers.3.wq: an array's path in the tree, as a file name."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path).replace("/", "_")


def sources(tree, whole: bool) -> list[dict]:
    """What a save writes of each array of `tree`: {"key", "name", "shape", "dtype",
    "shards": [(region, file, data, dtype)]}, data as array_files.host_pieces gives it, a
    device array's copy deferred to the writer (array_files.DeviceRead). `whole`:
    the array in one file (a process that holds all of it); else this process's shards of it,
    those it holds the first copy of (jax's replica_id 0), one file each."""
    import jax

    found, names = [], set()
    for path, array in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _file_name(path)
        name = f"{len(names)}.{name}" if name in names else name
        names.add(name)
        dtype = np.dtype(array.dtype)
        if whole:
            held = [(shards.whole(array.shape), f"{name}.bin",
                     array_files.host_pieces(array), dtype)]
        else:
            held = []
            for shard in array.addressable_shards:
                if shard.replica_id == 0:
                    region = shards.region_of(shard.index, array.shape)
                    starts = ".".join(str(start) for start, _ in region)
                    held.append((region, f"{name}@{starts}.bin" if region else f"{name}.bin",
                                 [array_files.readable(shard.data)], dtype))
        found.append({"key": jax.tree_util.keystr(path), "name": name,
                      "shape": list(array.shape), "dtype": dtype.name, "shards": held})
    return found


class Writer:
    """Writes checkpoints into `directory` with the threads of `pool`; `peers`: the run's
    other processes (None: this process writes alone)."""

    def __init__(self, directory: Path, pool: ThreadPoolExecutor, peers: Peers | None):
        self.directory, self._pool, self._peers = directory, pool, peers

    def save(self, step: int, capture: Capture, meta: dict) -> None:
        """Writes checkpoint `step` from `capture` (staging.py), part by part as each is
        captured. Raises the one error the run reports (CheckpointError for what it can
        name)."""
        partial = self.directory / f"{step}.partial"
        try:
            if self._peers is None:
                self._save_alone(step, partial, capture, meta)
            else:
                self._save_together(step, partial, capture, meta)
        except BaseException as e:
            raise self._failure(step, e) from None
        finally:
            capture.abandon()  # also where the writes never started

    def _save_alone(self, step: int, partial: Path, capture: Capture, meta: dict) -> None:
        try:
            self._start_partial(partial)
            arrays = self._write_part(step, partial, capture)
            array_files.write_file(partial / MANIFEST, manifests.manifest_bytes(step, meta,
                                                                                arrays))
            self._publish(step, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def _save_together(self, step: int, partial: Path, capture: Capture, meta: dict) -> None:
        """The save of one process of several: the first makes STEP.partial, each writes and
        verifies its part and says so, and the first publishes the step when every part is
        there (or removes the folder and passes on the first failure)."""
        peers = self._peers
        key = f"{next(peers.rounds)}-{step}"
        if peers.main:
            self._tell_outcome(f"{key}/started", lambda: self._start_partial(partial), step)
        else:
            peers.hear(f"{key}/started", 0)

        def write_part():
            arrays = self._write_part(step, partial, capture)
            if os.environ.get(PAUSE_SAVE) == str(step):
                (partial / f"paused-{peers.process}").touch()
                threading.Event().wait()  # until the test kills this process
            array_files.write_file(partial / manifests.part_file(peers.process),
                                   json.dumps(arrays).encode())

        if not peers.main:
            self._tell_outcome(f"{key}/written", write_part, step)
            peers.hear(f"{key}/published", 0)
            return
        try:
            failure = None
            try:
                write_part()
            except BaseException as e:
                failure = e
            try:
                peers.hear_all(f"{key}/written")  # none still writes into STEP.partial
            except PeerFailed as e:
                failure = failure or e
            if failure is not None:
                raise failure
            arrays = manifests.merge_parts(partial, peers.count)
            array_files.write_file(partial / MANIFEST, manifests.manifest_bytes(step, meta,
                                                                                arrays))
            self._publish(step, partial)
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)
            peers.tell(f"{key}/published", str(self._failure(step, e)))
            raise
        peers.tell(f"{key}/published", "ok")

    def _tell_outcome(self, what: str, work, step: int) -> None:
        """Runs `work` and tells the other processes how it ended (this process's error)."""
        try:
            work()
        except BaseException as e:
            self._peers.tell(what, f"process {self._peers.process}: {self._failure(step, e)}")
            raise
        self._peers.tell(what, "ok")

    def _start_partial(self, partial: Path) -> None:
        for stale in self.directory.glob("*.partial"):  # left by a killed process
            shutil.rmtree(stale)
        partial.mkdir(parents=True)

    def _write_part(self, step: int, partial: Path, capture: Capture) -> list[dict]:
        """Writes this process's arrays (or shards of them) into `partial` as their parts are
        captured, reads them back and checks them; returns their manifest entries."""

        def write(item) -> dict:
            name, shard = item
            region, file, data, dtype = shard
            data = array_files.in_hand(data)  # a staged copy, read where it landed
            try:
                checksum = array_files.write_array(partial / file, data, dtype)
            except NonFinite:
                raise NonFinite(name) from None
            return {"region": [list(r) for r in region], "file": file,
                    "bytes": sum(int(piece.size) for piece in data), "checksum": checksum}

        jobs = []
        try:
            for group in capture.groups():
                if any(job.done() and job.exception() for _, shard_jobs in jobs
                       for job in shard_jobs):
                    break  # a write failed: capture no more
                capture.take(group)
                group_jobs = [(source, [self._pool.submit(write, (source["name"], shard))
                                        for shard in source["shards"]])
                              for source in group.sources]
                when_done([job for _, shard_jobs in group_jobs for job in shard_jobs],
                           lambda group=group: capture.release(group))
                jobs += group_jobs
            wait([job for _, shard_jobs in jobs for job in shard_jobs])
            arrays = [{"key": source["key"], "shape": source["shape"], "dtype": source["dtype"],
                       "shards": [job.result() for job in shard_jobs]}
                      for source, shard_jobs in jobs]
        finally:
            capture.abandon()

        def verify(item) -> None:
            dtype, shard = item
            try:
                array_files.read_array(partial / shard["file"], shard["bytes"], dtype,
                                       shard["checksum"])
            except Damaged as e:
                raise CheckpointError(f"checkpoint {step} did not read back as written: "
                                      f"{partial / shard['file']} {e}.") from None

        list(self._pool.map(verify, [(a["dtype"], shard) for a in arrays
                                     for shard in a["shards"]]))
        return arrays

    def _publish(self, step: int, partial: Path) -> None:
        final = self.directory / str(step)
        if final.exists():  # the same step saved again: the new one replaces it
            shutil.rmtree(final)
        partial.rename(final)
        array_files.sync_folder(self.directory)

    def _failure(self, step: int, error: BaseException) -> BaseException:
        """`error` of the save of `step` as the one error the run reports."""
        kept = complete_steps(self.directory) or "none"
        untouched = f"Earlier checkpoints are untouched ({kept})"
        if isinstance(error, OSError):
            return CheckpointError(self._write_error(step, error))
        if isinstance(error, NonFinite):
            return CheckpointError(
                f"checkpoint {step} not written: the state holds non-finite values ({error}), "
                f"and no checkpoint is ever written from such a state. {untouched}.")
        if isinstance(error, PeerFailed) and error.said:  # the other process's own message
            return CheckpointError(str(error))
        if isinstance(error, (PeerFailed, PartsDisagree)):
            return CheckpointError(f"checkpoint {step} not written: {error}. {untouched}.")
        return error

    def _write_error(self, step: int, error: OSError) -> str:
        hint = {errno.ENOSPC: "free disk space or lower loop.keep_checkpoints (`megatrain-jax "
                              "plan` shows what a checkpoint needs)",
                errno.EDQUOT: "free space within the disk quota or lower loop.keep_checkpoints",
                errno.EACCES: "make the folder writable or choose another loop.run_dir",
                errno.EROFS: "choose a loop.run_dir on a writable disk",
                errno.ENOENT: "the folder is gone; in a run of several processes, loop.run_dir "
                              "must be on a disk that every process sees"}.get(
            error.errno, "check the disk and the folder")
        return (f"cannot write checkpoint {step} ({error.filename or self.directory}): "
                f"{error.strerror or error}. Earlier checkpoints are untouched "
                f"({complete_steps(self.directory) or 'none'}); {hint}.")
