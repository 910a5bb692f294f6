"""Probe: the host AdamW kernel's rate on anonymous NumPy memory against XLA's pinned_host
buffers, and what backs them (THP, shmem); again after shmem THP is turned on if root."""
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, ".")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1")
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "40")


def sh(c):
    r = subprocess.run(c, shell=True, capture_output=True, text=True)
    print(f"$ {c}\n{(r.stdout + r.stderr).strip()[:800]}", flush=True)


sh("cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/"
   "shmem_enabled /sys/kernel/mm/transparent_hugepage/defrag; id -u")
sh("grep -iE 'huge|shmem' /proc/meminfo; nproc; "
   "lscpu | grep -iE 'model name|thread|socket|numa|L3'")
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from megatrain_jax.optim.host_adamw import _numba_kernel, writable  # noqa: E402

N = int(os.environ.get("PROBE_N", 256 * 2**20))
k = _numba_kernel()
f = np.float32
args = (f(1.0), f(0.9), f(0.1), f(0.95), f(0.05), f(1e-8), f(0.5), f(0.5), f(-1e-5), f(0.01), False)


def rate(p, g, mu, nu, label):
    k((p,), (g,), (mu,), (nu,), *args)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        k((p,), (g,), (mu,), (nu,), *args)
        ts.append(time.perf_counter() - t)
    s = statistics.median(ts)
    print(f"RATE {label}: {N / s / 1e9:.2f} G params/s ({26 * N / s / 1e9:.0f} GB/s)", flush=True)


def numpy_arrays():
    return (np.ones(N, np.float32), np.ones(N, np.uint16), np.ones(N, np.float32),
            np.ones(N, np.float32))


def pinned_arrays():
    dev = jax.devices()[0]
    sh_ = SingleDeviceSharding(dev, memory_kind="pinned_host")
    out = []
    for dt in (np.float32, np.uint16, np.float32, np.float32):
        a = jax.device_put(np.ones(N, np.float32) if dt is np.float32 else
                           jax.numpy.ones(N, jax.numpy.bfloat16), sh_)
        out.append(a)
    views = [writable(a) for a in out]
    views[1] = views[1].view(np.uint16) if views[1].dtype != np.uint16 else views[1]
    return out, views


a = numpy_arrays()
rate(*a, "numpy (anonymous)")
sh("grep -iE 'AnonHuge|ShmemHuge|ShmemPmd' /proc/meminfo")
del a
keep, v = pinned_arrays()
sh("grep -iE 'AnonHuge|ShmemHuge|ShmemPmd|Shmem:' /proc/meminfo")
rate(*v, "pinned_host (XLA)")
sh(f"grep -E 'AnonHugePages|ShmemPmdMapped|FilePmdMapped' /proc/{os.getpid()}/smaps_rollup")
THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
try:
    original = open(THP).read().split("[")[1].split("]")[0]
except (OSError, IndexError):
    original = "never"
for setting in ("always", "advise"):
    sh(f"echo {setting} > /sys/kernel/mm/transparent_hugepage/shmem_enabled && cat "
       "/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    keep2, v2 = pinned_arrays()
    sh(f"grep -E 'AnonHugePages|ShmemPmdMapped|FilePmdMapped' /proc/{os.getpid()}/smaps_rollup")
    rate(*v2, f"pinned_host after shmem_enabled={setting}")
    del keep2, v2
rate(*v, "pinned_host (first buffers, again)")
sh(f"echo {original} > {THP}; cat {THP}")
