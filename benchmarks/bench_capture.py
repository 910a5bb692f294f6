"""Measures what a checkpoint's capture costs: device arrays copied to pinned host memory (the
first time, while XLA's host pool grows, and again into the pool's reused memory) and to
pageable NumPy, host arrays copied by several threads into reused buffers, and the disk's
write and read rate with fsync. The planner's save figures come from these rates.

    python benchmarks/bench_capture.py [--gib 8] [--dir /tmp] [--out FILE]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit  # noqa: E402


def _timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _copy(sources, targets, threads: int) -> None:
    """Copies each source into its target in 64 MiB slices over `threads` threads."""
    import numpy as np

    slices = []
    for src, dst in zip(sources, targets):
        a, b = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
        step = 64 * 2**20
        slices += [(a[i:i + step], b[i:i + step]) for i in range(0, a.size, step)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda s: np.copyto(s[1], s[0]), slices))


def _touch(nbytes: int, threads: int) -> None:
    """Faults in `nbytes` of new anonymous memory over `threads` threads, then frees it."""
    import mmap

    import numpy as np

    region = mmap.mmap(-1, nbytes)
    step = -(-nbytes // threads)

    def touch(start: int) -> None:
        np.frombuffer(region, np.uint8)[start:start + step:4096].fill(1)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(touch, range(0, nbytes, step)))
    region.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--arrays", type=int, default=32)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pretouch-gib", type=float, default=0.0,
                        help="touch and free this much new memory with 16 threads first")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from megatrain_jax.io import array_files

    n = int(args.gib * 2**30 / 4 / args.arrays)
    gb = n * 4 * args.arrays / 1e9
    device = [jnp.full((n,), i, jnp.float32) for i in range(args.arrays)]
    jax.block_until_ready(device)
    host_kind = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    out = {"gb": gb}
    if args.pretouch_gib:
        out["pretouch_gbps"] = args.pretouch_gib * 2**30 / 1e9 / _timed(
            functools.partial(_touch, int(args.pretouch_gib * 2**30), 16))

    def to_pinned():
        return jax.block_until_ready([jax.device_put(a, host_kind) for a in device])

    pinned = []
    out["d2h_pinned_first_gbps"] = gb / _timed(lambda: pinned.append(to_pinned()))
    del pinned[:]
    out["d2h_pinned_reused_gbps"] = gb / _timed(lambda: pinned.append(to_pinned()))
    issue = time.perf_counter()
    staged = [jax.device_put(a, host_kind) for a in device]
    out["d2h_pinned_issue_s"] = time.perf_counter() - issue
    jax.block_until_ready(staged)
    view = array_files.host_bytes(staged[0])
    out["pinned_view_is_zero_copy"] = bool(
        view.ctypes.data == staged[0].addressable_shards[0].data.unsafe_buffer_pointer())
    del staged
    out["d2h_numpy_gbps"] = gb / _timed(lambda: [np.asarray(a) for a in device])
    # Donation after the capture: the staged copy must keep the value from before.
    x = jnp.arange(2**28, dtype=jnp.float32)
    y = jax.device_put(x, host_kind)
    x = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    out["donation_keeps_capture"] = bool(np.asarray(y)[-1] == 2**28 - 1)
    host = [array_files.host_bytes(a) for a in pinned[0]]
    targets = [array_files.mapped_empty(h.shape, h.dtype) for h in host]
    for threads in (1, 4, 8, 16):
        first = _timed(functools.partial(_copy, host, targets, threads))
        again = _timed(functools.partial(_copy, host, targets, threads))
        out[f"host_copy_{threads}t_gbps"] = [round(gb / first, 1), round(gb / again, 1)]
    path = args.dir / "bench_capture.bin"
    block = targets[0].reshape(-1).view(np.uint8)
    count = max(1, int(4e9 // block.size))

    def write():
        with open(path, "wb") as f:
            for _ in range(count):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    out["disk_write_gbps"] = count * block.size / 1e9 / _timed(write)
    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    out["disk_read_gbps"] = count * block.size / 1e9 / _timed(lambda: path.read_bytes())
    path.unlink()
    emit(out, args.out)


if __name__ == "__main__":
    main()
