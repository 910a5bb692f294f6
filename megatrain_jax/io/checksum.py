"""Checksums of checkpoint data: one 64-bit hash per array, computed at memory speed.

    checksum = Checksum(np.float32)
    for chunk in chunks:                 # uint8 views, in order; all but the last a multiple of 8
        checksum.update(chunk)
    checksum.hexdigest(), checksum.nonfinite

The hash is the sum, modulo 2**64, over the array's 64-bit words w_i of splitmix64(w_i + i·φ)
(φ the 64-bit golden ratio): changing any word changes it, and so does moving a word, since
each is mixed with its position. It catches damage, not tampering. The sum is additive over
chunks, so data is hashed as it streams to or from the disk. A numba kernel (no GIL, one core,
several GB/s: faster than disks write) does the work, with a NumPy fallback where numba does
not import. The same pass counts non-finite float32 values, so that a checkpoint never holds
one.
"""

from __future__ import annotations

import functools

import numpy as np

_PHI = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_F32_EXPONENT = 0x7F800000  # all ones: inf or NaN; two float32 values per 64-bit word


def _scan_numpy(words: np.ndarray, start: int, f32: bool) -> tuple[int, int]:
    index = np.arange(start, start + words.size, dtype=np.uint64)
    z = words + index * np.uint64(_PHI)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    total = int(np.sum(z ^ (z >> np.uint64(31)), dtype=np.uint64))
    bad = 0
    if f32:
        halves = words.view(np.uint32) & np.uint32(_F32_EXPONENT)
        bad = int(np.count_nonzero(halves == np.uint32(_F32_EXPONENT)))
    return total, bad


@functools.cache
def _kernel():
    """The numba kernel, compiled (or loaded from numba's cache) on first use; else NumPy."""
    try:
        import numba
    except ImportError:
        return _scan_numpy

    @numba.njit(nogil=True, cache=True)
    def scan(words, start, f32):
        phi, m1, m2 = np.uint64(_PHI), np.uint64(_M1), np.uint64(_M2)
        low, high = np.uint64(_F32_EXPONENT), np.uint64(_F32_EXPONENT << 32)
        s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
        total = np.uint64(0)
        bad = 0
        for i in range(words.size):
            w = words[i]
            if f32:
                bad += ((w & low) == low) + ((w & high) == high)
            z = w + (start + np.uint64(i)) * phi
            z = (z ^ (z >> s30)) * m1
            z = (z ^ (z >> s27)) * m2
            total += z ^ (z >> s31)
        return total, bad

    return lambda words, start, f32: tuple(int(v) for v in scan(words, np.uint64(start), f32))


class Checksum:
    """The hash of one array's bytes, fed in order, and its count of non-finite values."""

    def __init__(self, dtype, kernel=None):
        self.dtype = np.dtype(dtype)
        self._scan = kernel or _kernel()
        self._f32 = self.dtype == np.float32
        self._other_float = np.issubdtype(self.dtype, np.floating) and not self._f32
        self.total = self.nbytes = self.nonfinite = 0

    def update(self, chunk: np.ndarray) -> None:
        """Adds the next bytes (a uint8 array); only the last chunk may end off a word."""
        if self.nbytes % 8:
            raise ValueError("only the last chunk may have a size that is not a multiple of 8")
        whole = chunk.size - chunk.size % 8
        parts = [chunk[:whole]]
        if whole < chunk.size:  # the tail, zero-padded into one last word
            parts.append(np.zeros(8, np.uint8))
            parts[-1][:chunk.size - whole] = chunk[whole:]
        word = self.nbytes // 8
        for part in parts:
            total, bad = self._scan(part.view(np.uint64), word, self._f32)
            self.total = (self.total + total) % 2**64
            self.nonfinite += bad
            word += part.size // 8
        self.nbytes += chunk.size
        if self._other_float:
            self.nonfinite += int(np.count_nonzero(~np.isfinite(chunk.view(self.dtype))))

    def hexdigest(self) -> str:
        return f"{self.total:016x}"
