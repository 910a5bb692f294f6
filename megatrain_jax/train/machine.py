"""What this machine offers and what the process uses: peak FLOP/s for MFU, the host memory's
bandwidth, GPU bytes (peak and now), host RSS (peak and now). Read after JAX has started."""

from __future__ import annotations

import functools
import resource
import threading
import time
from typing import Callable

import jax
import numpy as np

from megatrain_jax.planning.presets import PEAK_FLOPS


def peak_flops(devices: int = 1) -> float | None:
    """The dense bf16 peak of `devices` devices like the first (a mesh's GPUs together), the
    denominator of MFU; None for a device kind not in PEAK_FLOPS."""
    kind = jax.local_devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
    return peak * devices if peak else None


def _device_stats() -> dict:
    """The allocator statistics of the process's fullest device (the largest peak; several
    GPUs of a mesh peak alike, within the few arrays one of them holds alone), where the
    backend reports them (GPUs; not the CPU)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    return max(stats, key=lambda s: s.get("peak_bytes_in_use") or 0)


def peak_device_bytes() -> int | None:
    """Peak bytes in use on the process's fullest device, where the backend reports it."""
    return _device_stats().get("peak_bytes_in_use")


def host_rss_bytes() -> int:
    """Peak resident set size of this process."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_rss_now_bytes() -> int:
    """Resident set size of this process now (Linux: /proc/self/statm; elsewhere the peak),
    which shows memory given back, as after a checkpoint's write."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return host_rss_bytes()


def host_rss_parts_bytes() -> dict[str, int]:
    """This process's resident memory now by kind (Linux /proc/self/status; empty elsewhere):
    `anon` (the heap, pinned buffers), `file` (mapped files: the CUDA, cuDNN and XLA
    libraries' code among them) and `shmem`. What the runtime holds beyond the state is
    mostly one or the other."""
    parts = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    found = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in parts:
                    found[parts[key]] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return {}
    return found


def memory_record() -> dict:
    """The process's memory for a metrics record: GPU peak and now (the bytes in use now show
    growth that the peak, set early, would hide), host RSS peak and now."""
    stats = _device_stats()
    return {"peak_device_bytes": stats.get("peak_bytes_in_use"),
            "device_bytes_now": stats.get("bytes_in_use"),
            "host_rss_bytes": host_rss_bytes(), "host_rss_now_bytes": host_rss_now_bytes()}


@functools.cache  # one kernel per process, compiled once
def _scale_add():
    """The streaming kernel of memory_gbps, `a += 0.5 * b` on all cores; None without numba."""
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(parallel=True, nogil=True, cache=True)
    def scale_add(a, b):
        for i in numba.prange(a.size):
            a[i] = a[i] + np.float32(0.5) * b[i]

    return scale_add


def memory_gbps(mfloats: int = 128, repeats: int = 3,
                beside: tuple[Callable[[], object], int] | None = None,
                window_s: float = 0.5, own: bool = False) -> float:
    """The host memory's bandwidth in GB/s, from an in-place streaming kernel on all cores.

    `a += 0.5 * b` over two arrays of `mfloats` M fp32 values (far past any cache) moves 12
    bytes per element: a and b read, a written, like the update's own read-modify-write
    traffic. Without numba, 0.0: a single-threaded NumPy loop would understate it.

    `beside`, a pair (move, nbytes): move() carries nbytes through the host memory (a copy of
    pinned buffers to the device), run again and again on a thread while the kernel runs for
    at least `window_s`; the result is then both's bytes over the window, what the host
    memory gives the update and the link's DMA at once, as in a step. The kernel alone
    does not draw all of it (an H200 machine: 110.9 GB/s alone, 127.8 beside a copy of two
    7b layers to the GPU; benchmarks/RESULTS.md, 2026-11-25). With `own`, the kernel's bytes
    alone over that window: what the transfer leaves the update.
    """
    if (scale_add := _scale_add()) is None:
        return 0.0
    n = mfloats * 2**20
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    scale_add(a, b)  # compiled, pages touched
    if beside is None:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            scale_add(a, b)
            best = min(best, time.perf_counter() - start)
        return 12 * n / best / 1e9
    move, nbytes = beside
    stop, finished = threading.Event(), []

    def stream():
        while not stop.is_set():
            move()
            finished.append(time.perf_counter())

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    while not finished and thread.is_alive():  # the link busy before the window opens
        time.sleep(0.001)
    start, passes = time.perf_counter(), 0
    while passes < repeats or time.perf_counter() - start < window_s:
        scale_add(a, b)
        passes += 1
    end = time.perf_counter()
    stop.set()
    thread.join()
    # Whole copies that ended in the window: about as many bytes as the link moved in it.
    moved = 0 if own else nbytes * sum(1 for t in finished if start < t <= end)
    return (12 * n * passes + moved) / (end - start) / 1e9
