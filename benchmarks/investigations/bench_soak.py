"""Host memory over many steps: does the process grow, and with what?

    python benchmarks/investigations/bench_soak.py 1b --steps 1500 --every 100 [--tracemalloc] \
        [--renew-every N] [key=value ...]

Trains `--steps` steps of the config in this process, each synced on its loss, and records
every `--every` steps the host RSS now (by kind: heap, mapped files), the GPU bytes in use
and Python's live object count. The JSON gives the growth per step after the first record
(a least-squares slope, bytes per step) and, after the last step, the RSS once glibc has
returned its free memory to the system (`malloc_trim`): growth that this gives back is
freed memory the allocator kept, not a leak. `--tracemalloc` adds the Python allocation
sites that grew most between the first record and the last (it slows the steps).
`--renew-every N` moves the host weights to new buffers every N steps instead of the engine's
RENEW_EVERY (0: never), to see the growth the renewal bounds.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402

from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.tools import plan  # noqa: E402  (no JAX yet: the pool is sized first)


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (x, y) points (0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def trimmed_rss() -> int | None:
    """RSS after glibc's malloc_trim(0) (None where there is no glibc)."""
    from megatrain_jax.stream.updates import release_free_heap
    from megatrain_jax.train.machine import host_rss_now_bytes

    return host_rss_now_bytes() if release_free_heap() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--renew-every", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_intermixed_args()
    if args.renew_every is not None and args.renew_every < 0:
        parser.error(f"--renew-every {args.renew_every}: give a number of steps, or 0 for never")

    cfg = load_config(args.config, args.overrides)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    plan.set_pool_env(cfg)

    import jax
    import numpy as np

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.stream import engine
    from megatrain_jax.train import make_trainer
    from megatrain_jax.train.machine import host_rss_parts_bytes, memory_record

    if args.renew_every is not None:
        engine.RENEW_EVERY = args.renew_every or sys.maxsize
    trainer, data = make_trainer(cfg), TokenSource(cfg)
    state = trainer.init(jax.random.key(cfg.loop.seed))
    records, first_snapshot, start = [], None, time.perf_counter()
    for step in range(1, args.steps + 1):
        state, metrics = trainer.train_step(state, data.batch_at(step))
        loss = float(np.asarray(metrics["loss"]))
        if step % args.every:
            continue
        state.wait()
        records.append({"step": step, "loss": loss, "seconds": time.perf_counter() - start,
                        "objects": len(gc.get_objects()), **memory_record(),
                        **{f"rss_{k}_bytes": v for k, v in host_rss_parts_bytes().items()}})
        print(f"step {step}: RSS now {records[-1]['host_rss_now_bytes'] / 2**20:.1f} MiB, "
              f"{records[-1]['objects']} objects", file=sys.stderr, flush=True)
        if args.tracemalloc and first_snapshot is None:
            tracemalloc.start(8)
            first_snapshot = tracemalloc.take_snapshot()
    state.wait()
    result = {"config": args.config, "overrides": args.overrides, "steps": args.steps,
              "renew_every": engine.RENEW_EVERY, "records": records}
    kept = records[1:]  # the first record holds compilation and the first steps' growth
    for key in ("host_rss_now_bytes", "rss_anon_bytes", "rss_file_bytes", "device_bytes_now",
                "objects"):
        if all(r.get(key) is not None for r in kept):
            result[f"{key}_per_step"] = slope([(r["step"], r[key]) for r in kept])
    if first_snapshot is not None:
        growth = tracemalloc.take_snapshot().compare_to(first_snapshot, "traceback")
        result["tracemalloc_top"] = [{"bytes": s.size_diff, "count": s.count_diff,
                                      "where": s.traceback.format()[-6:]} for s in growth[:8]]
        tracemalloc.stop()
    gc.collect()
    result["rss_before_trim_bytes"] = memory_record()["host_rss_now_bytes"]
    result["rss_after_trim_bytes"] = trimmed_rss()
    emit(result, args.out)


if __name__ == "__main__":
    main()
