"""What this machine has, read without JAX, so that a run can be sized before JAX starts: the
GPUs the process may use, the first one's memory (nvidia-smi), the host memory available."""

from __future__ import annotations

import functools
import os
import subprocess


def _visible() -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES names, in its order; None where it is not set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [d.strip() for d in visible.split(",") if d.strip()]


@functools.cache
def gpu_count() -> int:
    """The GPUs the run may use: those CUDA_VISIBLE_DEVICES names where it is set (as JAX
    sees them), else those nvidia-smi lists (asked once: the fitting searches estimate many
    configs); 1 without any."""
    if (visible := _visible()) is not None:
        return max(len(visible), 1)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return max(len(out.stdout.split()), 1) if out.returncode == 0 else 1
    except (OSError, subprocess.TimeoutExpired):
        return 1


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@functools.cache
def gpu_name() -> str | None:
    """The name of the run's first GPU (`NVIDIA H200`) from nvidia-smi; None without one."""
    first = (_visible() or ["0"])[0]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                              "-i", first], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpu_memory_bytes() -> int | None:
    """Total memory of the run's first GPU (CUDA_VISIBLE_DEVICES's first) from nvidia-smi;
    None without an NVIDIA GPU."""
    first = (_visible() or ["0"])[0]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits", "-i", first],
                             capture_output=True, text=True, timeout=20)
        return int(float(out.stdout.split()[0])) * 2**20 if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def planned_devices(cfg) -> int:
    """The GPUs a run uses: mesh.data, or (0) every GPU `gpu_count` finds; 1 without any.
    The plan is per GPU, for one process."""
    return cfg.mesh.data or gpu_count()


def set_cpu_devices(devices: int) -> None:
    """Gives JAX's CPU client `devices` devices (XLA_FLAGS, before JAX starts) where it has
    fewer: the plain host memory of the optimizer state over a mesh of that many GPUs, a CPU
    device standing for each (stream/placement.py). A count already given is kept."""
    flags = os.environ.get("XLA_FLAGS", "")
    if devices > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
