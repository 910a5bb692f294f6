"""What this machine offers and what the process uses: peak FLOP/s for MFU, GPU bytes (peak and
now), host RSS (peak and now). Read after JAX has started."""

from __future__ import annotations

import resource

import jax

# Dense bf16 peak by device kind, for MFU; unknown devices report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12}


def peak_flops() -> float | None:
    kind = jax.local_devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def _device_stats() -> dict:
    """Device 0's allocator statistics, where the backend reports them (GPUs; not the CPU)."""
    return jax.local_devices()[0].memory_stats() or {}


def peak_device_bytes() -> int | None:
    """Peak bytes in use on device 0, where the backend reports it."""
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
