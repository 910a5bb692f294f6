"""XLA's pinned host pool: which of the host state's bytes it holds, the cap each GPU's pool
gets, and what a run takes of the host beyond its state (the pool's margin and bookkeeping,
the runtimes).

    host = memory.host_state_bytes(cfg, plan)        # {component: bytes} on the host
    pinned = pooled(cfg, host)                       # those bytes in XLA's pinned pool
    cap = pool_gib(cfg, holds(cfg, pinned, 1), 1)    # XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
    overhead = host_overhead(cfg, pinned, 1, sum(host.values()) - pinned)
"""

from __future__ import annotations

import numpy as np

from megatrain_jax.config import host_update
from megatrain_jax.config.schema import Config
from megatrain_jax.planning.memory import GiB, whole
from megatrain_jax.planning.staging import staging_pinned_bytes


def pooled(cfg: Config, host: dict):
    """Bytes of the host state `host` (host_state_bytes) in XLA's pinned pool: all but the
    optimizer state that only the host update reads, which lives in plain host memory
    (stream/placement.py), beside the pool and its bookkeeping."""
    plain = host_update(cfg) and cfg.stream.plain_optimizer_state
    return sum(v for k, v in host.items() if k != "optimizer_state" or not plain)



# Host memory of a streamed run beyond its state and its pinned pool: the JAX, CUDA and XLA
# runtimes, their libraries, compiled programs, the trainer's own arrays. Measured on the H200
# (jax 0.11.2) as the resident memory outside the pool less the pool's bookkeeping: 5.30, 5.38
# and 5.41 GiB at 3b, 7b and 14b (benchmarks/RESULTS.md, "The planner against a run").
RUNTIME = 5.4 * GiB
# XLA's pinned host allocator (a BFC allocator) keeps one 8-byte chunk handle for every 256
# bytes of its regions, in the process's heap: 1/32 of the pool (3.2 GiB beside 7b's 103 GiB,
# measured 3.7 GiB of glibc's large mappings).
POOL_BOOKKEEPING = 1 / 32
POOL_MARGIN = 2 * GiB  # pinned bytes beyond the state: transfers' staging, rounding


def pool_share(cfg: Config, pinned, devices: int):
    """The bytes of `pinned` bytes of host state that each of n GPUs holds: 1/n where the
    state's leaves split over them (stream/mesh.py splits a leaf along a dimension n divides,
    and every weight matrix has the model's width as one; leaves too small to split fit in
    the margin), else the whole (a replica each)."""
    return pinned // devices if cfg.model.hidden % devices == 0 else pinned


def holds(cfg: Config, pinned, devices: int, saving: bool = True):
    """Bytes all GPUs' pools hold for a resolved cfg with `pinned` bytes of host state: that
    and, in a run that saves (not `export` or `sample`), each GPU's share of the save's
    capture (planning/staging.py), for which `train` raises each cap."""
    return pinned + devices * (staging_pinned_bytes(cfg, devices) if saving else 0)


def pool_gib(cfg: Config, pinned, devices: int, extra: int = 0):
    """Each GPU's pool cap in whole GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) for `pinned` bytes
    of host state over `devices` GPUs: its share, the margin and `extra`, rounded up; or
    stream.host_memory_gb where it is set."""
    if cfg.stream.host_memory_gb:
        return int(cfg.stream.host_memory_gb * GiB) // GiB + 1
    return (pool_share(cfg, pinned, devices) + POOL_MARGIN + extra) // GiB + 1


def host_overhead(cfg: Config, pinned, devices: int, plain=0) -> dict:
    """Host bytes of a run beyond its `pinned` state and its `plain` one (all GPUs'; `pooled`
    says which is which): replicas where leaves do not split, the pool's unfilled margin
    (each GPU's pinned allocator grows its regions up to its cap, and pinned memory is
    resident once the state fills most of it), the pool allocator's bookkeeping, and the
    runtimes. A run whose pool holds no state (all of it on the GPU, or in plain memory)
    never grows that pool: no margin, no bookkeeping. Arrays of `pinned` give arrays."""
    pool = devices * pool_gib(cfg, pinned, devices) * GiB  # one allocator a GPU
    pool = pool * (np.asarray(pinned) > 0)
    held = devices * pool_share(cfg, pinned, devices)
    replicas = held - pinned + devices * pool_share(cfg, plain, devices) - plain
    return {"replicas": replicas, "pool_margin": np.maximum(0, pool - held),
            "pool_bookkeeping": whole(pool * POOL_BOOKKEEPING),
            "runtime": int(RUNTIME)}
