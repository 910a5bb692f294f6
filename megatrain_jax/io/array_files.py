"""One array in one file: written from its buffer in chunks, checksummed, read back checked.

    data = host_bytes(array)                    # a view of a host buffer, else a host copy
    data = in_hand(host_pieces(array))          # the same, a device array copied only here
    checksum = write_array(path, data, dtype)   # raises NonFinite before writing inf or NaN
    read_array(path, nbytes, dtype, checksum, into=None)   # raises Damaged with the reason

The file holds the array's bytes in row-major order and nothing else; its shape, dtype and
checksum live in the checkpoint's manifest. Writes and reads go in chunks of CHUNK bytes
through one buffer at most, and the pages written or read are dropped from the page cache, so
that reading back what was written reads the disk, and neither fills host memory.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path

import numpy as np

from megatrain_jax.io.checksum import Checksum

CHUNK = 16 * 2**20  # bytes per write, read and checksum call


class NonFinite(Exception):
    """The array holds inf or NaN."""


class Damaged(Exception):
    """The file is missing, of the wrong size, or does not match its checksum (the reason)."""


def mapped_empty(shape, dtype) -> np.ndarray:
    """An uninitialized array in its own anonymous memory map, unmapped (returned to the
    system) when the last reference to it goes. Buffers of this size from malloc would stay
    in the allocator's arenas, and the process's RSS with them."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype, int(np.prod(shape))).reshape(shape)


def byte_view(array: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous NumPy array, as a flat uint8 array (no copy)."""
    return array.reshape(-1).view(np.uint8)


def host_bytes(array) -> np.ndarray:
    """The bytes of a JAX array as a flat uint8 NumPy array: a view of the buffer itself when
    it sits in host memory in row-major order (the caller keeps `array` alive and unwritten
    while it reads), else a host copy (`DeviceRead`)."""
    return in_hand([readable(array)])[0]


def in_host_memory(array) -> bool:
    return array.sharding.memory_kind != next(iter(array.devices())).default_memory().kind


def _host_view(array) -> np.ndarray | None:
    """A read-only view of a host-memory, row-major array's buffer; None for any other."""
    layout = getattr(getattr(array, "format", None), "layout", None)
    major_to_minor = getattr(layout, "major_to_minor", None)
    row_major = major_to_minor is None or tuple(major_to_minor) == tuple(range(array.ndim))
    nbytes = int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize
    array.block_until_ready()
    if not (in_host_memory(array) and row_major and nbytes):
        return None
    raw = (ctypes.c_uint8 * nbytes).from_address(array.unsafe_buffer_pointer())
    view = np.ctypeslib.as_array(raw)
    view.flags.writeable = False
    return view


class DeviceRead:
    """The bytes of an array in device memory, copied to the host when called: a save calls
    it in its writer's thread, one array at a time, so that a checkpoint of the state the GPU
    holds never has all of it in host memory at once (the caller keeps the array alive and
    unwritten until the save has read it). The copy goes through device slices of at most
    READ_BYTES, each a new array: JAX keeps the host copy of an array it has read on the
    array itself, which for the state would last until the next update donates it."""

    def __init__(self, array):
        self.array = array

    def __call__(self) -> np.ndarray:
        array, self.array = self.array, None
        host = mapped_empty(array.shape, array.dtype)
        if array.size == 0:
            return byte_view(host)
        if in_host_memory(array):  # a host buffer in another layout: NumPy reorders it
            host[...] = np.asarray(array)
            return byte_view(host)
        if array.ndim == 0:
            host.reshape(1)[...] = np.asarray(_slicer(1)(array.reshape(1), 0))
            return byte_view(host)
        rows = array.shape[0]
        step = max(1, READ_BYTES * rows // max(host.nbytes, 1))
        for start in range(0, rows, step):
            size = min(step, rows - start)
            host[start:start + size] = np.asarray(_slicer(size)(array, start))
        return byte_view(host)


READ_BYTES = 64 * 2**20  # the device slice a DeviceRead copies at a time


@functools.lru_cache(maxsize=None)
def _slicer(size: int):
    """A compiled program giving rows [start, start + size) of an array as a new array (a
    slice, never the input forwarded), whose host copy JAX then keeps on it alone."""
    import jax

    return jax.jit(lambda a, start: jax.lax.dynamic_slice_in_dim(a, start, size))


class Staged:
    """A device array's copy in pinned host memory, on its way (checkpoint staging): read
    where it lands, with no further copy, once the transfer is complete."""

    def __init__(self, array):
        self.array = array

    def __call__(self) -> np.ndarray:
        view = _host_view(self.array)  # waits for the transfer
        return view if view is not None else DeviceRead(self.array)()


def readable(array) -> np.ndarray | DeviceRead:
    """`host_bytes` of an array, but for one in device memory, the copy deferred to the
    reader (`DeviceRead`)."""
    view = _host_view(array)
    return view if view is not None else DeviceRead(array)


def host_pieces(array) -> list:
    """The bytes of a JAX array, whole and in row-major order, as flat uint8 pieces: one, or
    one per shard of an array split over devices along its first dimension (each as
    `readable` gives it: `in_hand` reads the deferred ones). A copy of a device being the same
    as another's, it is read once."""
    if not array.is_fully_addressable:
        raise ValueError("an array with shards in other processes cannot be written by one")
    shards = {}
    for shard in array.addressable_shards:
        shards.setdefault(tuple((s.start or 0) for s in shard.index), shard.data)
    if len(shards) == 1:
        return [readable(next(iter(shards.values())))]
    if all(data.shape[1:] == array.shape[1:] and data.nbytes % 8 == 0  # checksum words
           for data in shards.values()):
        return [readable(shards[start]) for start in sorted(shards)]
    return [byte_view(np.ascontiguousarray(np.asarray(array)))]


def in_hand(pieces: list) -> list[np.ndarray]:
    """`pieces` with every deferred one read (`DeviceRead`, `Staged`)."""
    return [piece() if isinstance(piece, (DeviceRead, Staged)) else piece for piece in pieces]


def drop_cache(fd: int) -> None:
    """Drops a file's pages from the page cache (where the system can: Linux)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def write_file(path: Path, data: bytes) -> None:
    """Writes a new file and syncs it to the disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """Makes the renames and new files in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_array(path: Path, data: np.ndarray | list[np.ndarray], dtype) -> str:
    """Writes `data` (uint8, or pieces of it in order) to a new file, synced; returns its
    checksum. Stops with NonFinite at the first chunk that holds inf or NaN."""
    checksum = Checksum(dtype)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for piece in data if isinstance(data, list) else [data]:
            for start in range(0, piece.size, CHUNK):
                chunk = piece[start:start + CHUNK]
                checksum.update(chunk)
                if checksum.nonfinite:
                    raise NonFinite()
                write_all(fd, memoryview(chunk))
        os.fsync(fd)
        drop_cache(fd)
    except OSError as e:
        e.filename = e.filename or str(path)  # writes to a descriptor name no file
        raise
    finally:
        os.close(fd)
    return checksum.hexdigest()


def read_array(path: Path, nbytes: int, dtype, checksum: str,
               into: np.ndarray | None = None) -> None:
    """Reads a file written by `write_array` (into the uint8 array `into`, or through one
    chunk buffer) and checks its size and checksum; raises Damaged with the reason."""
    buffer = mapped_empty(min(CHUNK, nbytes), np.uint8) if into is None else None
    found = Checksum(dtype)
    try:
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            if size != nbytes:
                raise Damaged(f"holds {size} bytes, {nbytes} expected")
            for start in range(0, size, CHUNK):
                n = min(CHUNK, size - start)
                chunk = into[start:start + n] if into is not None else buffer[:n]
                if file.readinto(memoryview(chunk)) != n:
                    raise Damaged("ended early")
                found.update(chunk)
            drop_cache(file.fileno())
    except FileNotFoundError:
        raise Damaged("is missing") from None
    if found.hexdigest() != checksum:
        raise Damaged("does not match the checksum written with it")
