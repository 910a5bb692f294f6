"""A run folder as processes share it: the lock `train` holds, and the config readers use.

    with RunLock(run_dir) as lock:     # held at once where the folder exists
        ...                            # checks, init (a new folder does not exist yet)
        run_dir.mkdir(); lock.hold()   # and from the moment `train` creates it
    cfg, note = run_config(run_dir)    # config.json, else a checkpoint's record of it

RUN_DIR/run.lock is locked with flock(2) by the one `train` writing the folder, and holds its
host, pid and start time. The system releases the lock when the process ends, however it ends
(`kill -9` included), so a lock never outlives its holder; the file stays, a record of the
last one. A second `train` on a held folder is refused (RunFolderInUse, a ConfigError: exit 2)
before it reads or writes anything there. `export` and `report` take no lock: they read only
complete checkpoints (a step folder appears, renamed from STEP.partial, once verified) and
whole metrics lines. On a shared file system the lock holds across nodes where the file
system implements flock (NFSv4, Lustre mounted with `flock`, GPFS).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from megatrain_jax.config import Config, ConfigError, from_dict, load_run_config, validate
from megatrain_jax.io.checkpoint import MANIFEST, complete_steps

LOCK_FILE = "run.lock"


class RunFolderInUse(ConfigError):
    """Another process holds the run folder's lock; the message names it."""


class RunLock:
    """The exclusive lock of a run folder, held from `hold()` until `release()` (or the end
    of the `with` block, or of the process)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def hold(self) -> None:
        """Takes the lock if the folder exists and it is not held yet; raises RunFolderInUse,
        naming the holder, when another process has it."""
        if self.held or not self.run_dir.is_dir():
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            raise RunFolderInUse(
                f"loop.run_dir {self.run_dir} is in use by another train "
                f"({holder or 'a process that is just starting'}); wait for it to end, or "
                "choose another loop.run_dir.") from None
        except OSError as e:  # a file system without flock (ENOLCK, EOPNOTSUPP)
            os.close(fd)
            raise ConfigError(f"loop.run_dir {self.run_dir}: cannot lock {self.path} "
                              f"({e.strerror or e}); its file system does not support flock: "
                              "choose a loop.run_dir on one that does.") from None
        self._fd = fd
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        record = f"pid {os.getpid()} on host {socket.gethostname()}, since {started}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        self.hold()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def saved_config(folder: Path) -> Config:
    """The config recorded in a checkpoint folder's manifest (reads that file only)."""
    meta = json.loads((folder / MANIFEST).read_text())["meta"]
    return validate(from_dict(Config, meta["config"]))


def run_config(run_dir: str | Path, step: int | None = None) -> tuple[Config, str | None]:
    """(the run's config, a note when it is not config.json's): RUN_DIR/config.json, or where
    that cannot be read, the config checkpoint `step` (default: the latest) recorded."""
    run_dir = Path(run_dir)
    try:
        return load_run_config(run_dir), None
    except ConfigError as error:
        steps = complete_steps(run_dir / "checkpoints")
        chosen = step if step in steps else (steps[-1] if steps else None)
        if chosen is None:
            raise
        try:
            cfg = saved_config(run_dir / "checkpoints" / str(chosen))
        except (OSError, ValueError, KeyError, TypeError):
            raise error from None
        return cfg, (f"{error} Using the config recorded in checkpoint {chosen} instead.")
