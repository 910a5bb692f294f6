"""Where a streamed run's host memory goes beyond its pinned pool, stage by stage.

    python benchmarks/investigations/host_heap.py 1b --steps 3 [key=value ...] --out heap.json

At each stage of a run's start (the interpreter with numpy; jax imported; the backend up;
the trainer built; the state at home; the first step, compiled; the later steps; after
returning the heap's free pages) it records the process's resident memory by kind (anon,
file, shmem: the pinned pool is shmem; and the peak) and glibc's own account of its heap (mallinfo2:
bytes in use and free in its arenas, and in its own large mappings). Anonymous memory
beyond glibc's is mapped by others: the CUDA driver and the libraries it loads. A table of
the stages and what each added is printed last.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatrain_jax.stream.updates import release_free_heap  # noqa: E402  (no JAX in it)
from megatrain_jax.train.machine import host_rss_bytes, host_rss_parts_bytes  # noqa: E402

GiB = 2**30


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def glibc_heap() -> dict[str, int]:
    """glibc's heap: `in_use` (allocated in its arenas), `free` (held free in them) and
    `mapped` (its own mmap'ed large blocks); empty without glibc's mallinfo2."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    info = fn()
    return {"in_use": info.uordblks, "free": info.fordblks, "mapped": info.hblkhd}


def record(stages: list, name: str, began: float) -> None:
    row = {"stage": name, "seconds": round(time.perf_counter() - began, 2),
           "peak": host_rss_bytes(), **host_rss_parts_bytes(),
           **{f"glibc_{k}": v for k, v in glibc_heap().items()}}
    stages.append(row)
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    args, overrides = ap.parse_known_args()

    began, stages = time.perf_counter(), []
    record(stages, "start", began)
    from megatrain_jax.config import load_config
    from megatrain_jax.tools import plan

    cfg = load_config(args.config, overrides)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    plan.set_pool_env(cfg)
    import jax

    record(stages, "jax imported", began)
    jax.devices()
    record(stages, "backend up", began)
    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import make_trainer

    trainer = make_trainer(cfg)
    record(stages, "trainer built", began)
    state = trainer.init(jax.random.key(cfg.loop.seed))
    jax.block_until_ready(state.wait().params)
    record(stages, "state at home", began)
    data = TokenSource(cfg)
    for step in range(args.steps):
        state, metrics = trainer.train_step(state, data.batch_at(step))
        float(np.asarray(metrics["loss"]))
        state.wait()
        record(stages, "first step" if step == 0 else f"step {step + 1}", began)
    release_free_heap()
    record(stages, "heap trimmed", began)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "overrides": overrides,
                                              "params": cfg.model.num_params,
                                              "pool_gb": os.environ[
                                                  "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"],
                                              "stages": stages}, indent=1) + "\n")
    print(f"{'stage':14} {'anon':>7} {'+anon':>7} {'file':>6} {'shmem':>7} {'glibc use':>9} "
          f"{'free':>6} {'mapped':>7} {'peak':>7}  (GiB)")
    last = 0
    for r in stages:
        anon = r.get("anon", 0)
        print(f"{r['stage']:14} {anon / GiB:7.2f} {(anon - last) / GiB:+7.2f} "
              f"{r.get('file', 0) / GiB:6.2f} {r.get('shmem', 0) / GiB:7.2f} "
              f"{r.get('glibc_in_use', 0) / GiB:9.2f} {r.get('glibc_free', 0) / GiB:6.2f} "
              f"{r.get('glibc_mapped', 0) / GiB:7.2f} {r['peak'] / GiB:7.2f}")
        last = anon


if __name__ == "__main__":
    main()
