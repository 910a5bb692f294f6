"""The shards of a checkpoint's arrays: which block of the whole each file holds, whether a
checkpoint's files hold every element, and any block read back from the files that hold it.

    region = region_of(shard.index, shape)       # ((start, stop), ...): one per dimension
    problem = coverage_problem(shape, regions)   # None when the regions tile the whole array
    block = read_region(folder, shards, region, dtype)   # a NumPy array of that block

A shard is a dict: {"region": [[start, stop], ...], "file", "bytes", "checksum"}; its file
holds the block in row-major order (array_files.py). An array written whole by one process
is one shard covering it. Each file is read whole, since its checksum covers the whole, and
checked; a block that is a contiguous run of the one asked for (a split along the first
dimension, the state's usual one) is read straight into place, any other through a buffer of
its own size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatrain_jax.io import array_files
from megatrain_jax.io.array_files import Damaged

Region = tuple[tuple[int, int], ...]


def whole(shape) -> Region:
    return tuple((0, int(n)) for n in shape)


def region_of(index: tuple, shape) -> Region:
    """The region of a JAX shard index (a tuple of slices, one per dimension)."""
    return tuple((s.start or 0, n if s.stop is None else s.stop)
                 for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)),
                                 shape))


def as_region(value) -> Region:
    """A region from its JSON form ([[start, stop], ...])."""
    return tuple((int(start), int(stop)) for start, stop in value)


def volume(region: Region) -> int:
    return int(np.prod([stop - start for start, stop in region], dtype=np.int64))


def intersect(a: Region, b: Region) -> Region | None:
    both = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return both if all(start < stop for start, stop in both) else None


def coverage_problem(shape, regions: list[Region]) -> str | None:
    """Why `regions` (the tiles of one sharding, so distinct tiles never overlap) do not hold
    every element of an array of `shape` once, or None when they do."""
    for region in regions:
        if len(region) != len(shape) or any(not 0 <= a <= b <= n
                                             for (a, b), n in zip(region, shape)):
            return f"a shard's block {list(map(list, region))} lies outside the shape {shape}"
    if len(set(regions)) != len(regions):
        return "two shards hold the same block"
    held, size = sum(map(volume, regions)), int(np.prod(shape, dtype=np.int64))
    if held != size:
        return f"its shards hold {held} of its {size} elements"
    return None


def _local(inner: Region, outer: Region) -> tuple[slice, ...]:
    """`inner` as an index of a block that holds `outer` (a view, also of a 0-d block)."""
    return (*(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer)), Ellipsis)


def read_region(folder: Path, shards: list[dict], region: Region, dtype) -> np.ndarray:
    """The block `region` of an array stored as `shards` in `folder`, in memory of its own
    (array_files.mapped_empty); raises Damaged naming the file and what is wrong."""
    shape = tuple(b - a for a, b in region)
    block = array_files.mapped_empty(shape, dtype)
    for shard in shards:
        stored = as_region(shard["region"])
        both = intersect(stored, region)
        if both is None:
            continue
        path = folder / shard["file"]
        target = block[_local(both, region)]
        try:
            if both == stored and target.flags.c_contiguous:  # read straight into place
                array_files.read_array(path, shard["bytes"], dtype, shard["checksum"],
                                       into=array_files.byte_view(target))
                continue
            source = array_files.mapped_empty(tuple(b - a for a, b in stored), dtype)
            array_files.read_array(path, shard["bytes"], dtype, shard["checksum"],
                                   into=array_files.byte_view(source))
        except Damaged as e:
            raise Damaged(f"{path} {e}") from None
        target[...] = source[_local(both, stored)]
        del source
    return block
