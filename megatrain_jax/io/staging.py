"""A checkpoint's capture: the state copied into a staging area, so that training goes on while
the disk write follows in the background (checkpoint.py, saving.py).

    staging = Staging()                              # kept by the Checkpointer, save to save
    capture = staging.capture(sources, parts=None)   # whole: every copy under way at once
    capture.wait("layer 3")                          # that part's copy is complete: update it
    for group in capture.groups():                   # the writer, in the parts' order
        capture.take(group); ...write group.sources...; capture.release(group)

Arrays in device memory (the state the GPU holds) are captured by a copy to pinned host memory
(`jax.device_put`): issued at once, it runs at the link's speed, and JAX keeps its value
whatever the next updates donate. Its memory comes from XLA's pinned pool, which keeps it
from save to save once grown. Arrays in host memory (the state the host update writes in
place) are copied by threads into buffers kept from save to save: only the first save pays
for touching them.

A part is the embedding, a layer or the head, as the streaming engine updates them. With
`parts=None` every part is captured at once (a copy of the whole state, at link and memory
speed). With `parts=K` at most K parts are staged at a time: the writer captures the next part
once a staged one is written, so a part's update waits for its own capture, and the later
parts' for the disk: the run of a host without room for a copy is paced by its disk during a
save, not stopped for it. With `parts=0` nothing is staged: the writer reads each part from the
live state, one part at a time, and the part counts as captured once it is written, so its
update waits for its write (a host without room for even one part's copy).
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from megatrain_jax.io import array_files

COPY_THREADS = min(16, os.cpu_count() or 1)  # host copies at once: memory speed needs several
COPY_BYTES = 64 * 2**20  # one thread's slice of a host copy


def part_of(key: str) -> str | None:
    """The streaming part an array of the state belongs to, from its path in the tree
    ("['params']['layers'][3]['wq']" -> "layer 3"); None outside the model's parts."""
    layer = re.search(r"\['layers'\]\[(\d+)\]", key)
    if layer:
        return f"layer {layer.group(1)}"
    for part in ("embed", "head"):
        if f"['{part}']" in key:
            return part
    return None


def _order(part: str | None) -> tuple:
    if part == "embed":
        return (0, 0)
    if part is not None and part.startswith("layer "):
        return (1, int(part.split()[1]))
    return (2, 0) if part == "head" else (3, 0)


@dataclass
class Group:
    """The sources of one part (or of everything outside the parts), captured together."""

    part: str | None
    sources: list
    captured: threading.Event = field(default_factory=threading.Event)
    copies: list = field(default_factory=list)  # the host copies under way
    lent: list = field(default_factory=list)  # host buffers lent for it, part by part


class Staging:
    """The staging area of a run's saves: host buffers kept from save to save, and the threads
    that copy into them."""

    def __init__(self):
        self._buffers: dict[tuple, np.ndarray] = {}  # a whole capture's, by file
        self._free: dict[int, list] = {}  # part by part: buffers lent and given back, by size
        self._threads = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="checkpoint-copy")

    def capture(self, sources: list, parts: int | None = None) -> "Capture":
        """Begins capturing `sources` (saving.sources: their pieces are views of the live
        state or deferred device reads): every part at once, or `parts` at a time."""
        return Capture(self, sources, parts)

    def reserve(self, sources: list, parts: int | None = None) -> Future:
        """Makes the staging area of `sources` in the background, copying no state: pinned
        memory for the device arrays (XLA's pool keeps it once grown; new memory comes slowly,
        about 1.3 GB/s on the lent H200 machines) and host buffers for the rest, touched. The
        first save then costs what the later ones do."""
        groups = _groups(sources)
        device = [(a.shape, a.dtype, a.sharding) for a in _pieces(groups, parts, device=True)]
        host = [(key, piece.size) for key, piece in _pieces(groups, parts, device=False)]
        return self._threads.submit(self._reserve, device, host, parts is not None)

    def _reserve(self, device: list, host: list, lent: bool) -> None:
        import jax
        from jax.sharding import SingleDeviceSharding

        from megatrain_jax.stream.placement import HOST_KIND

        buffers = []
        for key, nbytes in host:
            buffers.append(self.lend(nbytes) if lent else self._buffer(key, nbytes))
            buffers[-1].fill(0)
        if lent:  # given back together: the parts' captures hold them at once
            self.give_back(buffers)
        held = []  # all at once: the pool must hold them together, as a save's capture does
        for shape, dtype, sharding in device:
            # Host to pinned host (no GPU memory taken), this process's shards one by one: a
            # device_put to a sharding over several processes checks its value across them,
            # a collective that this thread must not start beside the training's.
            block = sharding.shard_shape(shape)
            for target in sharding.addressable_devices:
                one = SingleDeviceSharding(target).with_memory_kind(HOST_KIND)
                held.append(jax.device_put(np.zeros(block, dtype), one))
        jax.block_until_ready(held)

    def close(self) -> None:
        self._threads.shutdown()

    def _buffer(self, key: tuple, nbytes: int) -> np.ndarray:
        """The host buffer kept for `key`, made (or made anew) `nbytes` long."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.size != nbytes:
            buffer = self._buffers[key] = array_files.mapped_empty((nbytes,), np.uint8)
        return buffer

    @property
    def held_bytes(self) -> int:
        """Bytes of host buffers the staging area holds between saves."""
        kept = sum(b.size for b in self._buffers.values())
        return kept + sum(b.size for free in self._free.values() for b in free)

    def lend(self, nbytes: int) -> np.ndarray:
        """A host buffer of `nbytes` for one part's capture, given back once it is written."""
        free = self._free.get(nbytes)
        return free.pop() if free else array_files.mapped_empty((nbytes,), np.uint8)

    def give_back(self, buffers: list) -> None:
        for buffer in buffers:
            self._free.setdefault(buffer.size, []).append(buffer)

    def _copy(self, source: np.ndarray, target: np.ndarray) -> list[Future]:
        return [self._threads.submit(np.copyto, target[i:i + COPY_BYTES],
                                     source[i:i + COPY_BYTES])
                for i in range(0, source.size, COPY_BYTES)]

    def _stage(self, key: tuple | None, piece) -> tuple[object, list[Future]]:
        """(the piece's staged stand-in, host copies still running into it), into the buffer
        kept for `key` or, with None, one lent."""
        if isinstance(piece, array_files.DeviceRead):
            array = piece.array
            if array_files.in_host_memory(array):  # another layout: NumPy reorders it now
                return piece(), []
            import jax

            from megatrain_jax.stream.placement import HOST_KIND

            pinned = array.sharding.with_memory_kind(HOST_KIND)
            return array_files.Staged(jax.device_put(array, pinned)), []
        target = self.lend(piece.size) if key is None else self._buffer(key, piece.size)
        return target, self._copy(piece, target)


class Capture:
    """One save's capture, part by part (Staging.capture)."""

    def __init__(self, staging: Staging, sources: list, parts: int | None):
        self._staging = staging
        self._groups = _groups(sources)
        self._live = parts == 0  # nothing staged: written from the live state (the docstring)
        self._slots = None if parts is None else threading.Semaphore(max(1, parts))
        if self._slots is None:
            for group in self._groups:
                self._begin(group)

    def groups(self) -> list[Group]:
        return self._groups

    def wait(self, part: str | None = None) -> None:
        """Returns once `part`'s arrays are captured, and those outside the model's parts
        (every part's, for None): the state's buffers of that part may be written again."""
        for group in self._groups:
            if part is None or group.part == part or group.part is None:
                group.captured.wait()

    def captured(self) -> bool:
        """Whether every part is captured."""
        return all(group.captured.is_set() for group in self._groups)

    def take(self, group: Group) -> None:
        """The writer's turn at `group`: captured (after a free slot, part by part), its host
        copies complete. Raises what a copy raised."""
        if self._slots is not None:
            self._slots.acquire()
            if not self._live:
                self._begin(group)
        try:
            for copy in group.copies:
                copy.result()
        finally:
            group.copies.clear()
            if not self._live:  # live: the state's own buffers, read until released
                group.captured.set()

    def release(self, group: Group) -> None:
        """`group` is written: its staged copies go (the pool keeps their pinned memory, the
        staging area the host buffers it lent)."""
        for source in group.sources:
            source["shards"] = []
        self._staging.give_back(group.lent)
        group.lent = []
        group.captured.set()  # written: live, its state may change now
        if self._slots is not None:
            self._slots.release()

    def abandon(self) -> None:
        """The save ended early: nothing waits for a capture that will not come."""
        for group in self._groups:
            group.captured.set()

    def _begin(self, group: Group) -> None:
        """Issues `group`'s copies; where it has no host copy it is captured already."""
        for source in group.sources:
            staged_shards = []
            for region, file, pieces, dtype in source["shards"]:
                staged = []
                for i, piece in enumerate(pieces):
                    key = (file, i) if self._slots is None else None  # part by part: lent
                    stand_in, copies = self._staging._stage(key, piece)
                    if key is None and isinstance(stand_in, np.ndarray) and copies:
                        group.lent.append(stand_in)
                    staged.append(stand_in)
                    group.copies += copies
                staged_shards.append((region, file, staged, dtype))
            source["shards"] = staged_shards
        when_done(group.copies, group.captured.set)


def _groups(sources: list) -> list[Group]:
    """`sources` grouped by part, in the order the engine updates the parts."""
    by_part: dict[str | None, list] = {}
    for source in sources:
        by_part.setdefault(part_of(source["key"]), []).append(source)
    return [Group(part, by_part[part]) for part in sorted(by_part, key=_order)]


def _pieces(groups: list[Group], parts: int | None, device: bool) -> list:
    """The device arrays (`device`) or the host pieces, keyed by (file, index), of every group's
    capture, or of the `parts` groups with the most of them: the most a save stages at once."""
    def of(group):
        found = []
        for source in group.sources:
            for _, file, pieces, _ in source["shards"]:
                for i, piece in enumerate(pieces):
                    if isinstance(piece, array_files.DeviceRead) == device:
                        found.append(piece.array if device else ((file, i), piece))
        return found

    def size(found):
        return sum(x.nbytes if device else x[1].size for x in found)

    each = [of(group) for group in groups]
    if parts is not None:
        each = sorted(each, key=size, reverse=True)[:parts]
    return [x for found in each for x in found]


def when_done(futures: list, then) -> None:
    """Calls `then()` once every future of `futures` is done (at once where there is none)."""
    if not futures:
        then()
        return
    left, lock = [len(futures)], threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for future in futures:
        future.add_done_callback(one_done)
