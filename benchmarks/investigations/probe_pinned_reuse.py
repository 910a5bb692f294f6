"""Host memory kept per transfer of pinned_host buffers, by pattern (the engine's renewal of
its host weights rests on the first line).

    python benchmarks/investigations/probe_pinned_reuse.py

64 arrays of 1 MiB in pinned host memory, 1,500 iterations of each pattern; the RSS growth
from iteration 100 on, in bytes per array per iteration:
    h2d_persist    the same host buffers copied to the device every iteration
    d2h_fresh      new host buffers from the device, dropped
    h2d_fresh      new host buffers every iteration, each copied to the device
    pointer        block_until_ready and unsafe_buffer_pointer (the host kernel's way in)
    shard_data     each shard's data and pointer
    h2d_then_ptr   h2d_persist, then pointer on the host buffers
    h2d_then_shard h2d_persist, then pointer on each host buffer's shard data
    h2d_then_block h2d_persist, then block_until_ready on the host buffers
    h2d_then_only_ptr  h2d_persist, then unsafe_buffer_pointer alone on the host buffers
    h2d_tree       the same host buffers copied as one tree per call (as the engine fetches a part)
    h2d_compute    the same host buffers copied and read by a program; only its output is waited on
    engine_like    two tree copies read by a program, then each shard's pointer (the engine's step)

    python benchmarks/investigations/probe_pinned_reuse.py h2d_persist h2d_then_shard  # some
"""

import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatrain_jax.train.machine import host_rss_now_bytes  # noqa: E402

ARRAYS, SIZE, ITERATIONS, SKIP = 64, 1 << 18, 1500, 100
MODES = ("h2d_persist", "d2h_fresh", "h2d_fresh", "pointer", "shard_data", "h2d_then_ptr",
         "h2d_then_shard", "h2d_then_block", "h2d_then_only_ptr", "h2d_tree", "h2d_compute",
         "engine_like")


@jax.jit
def _read(arrays):
    return sum(a[0] for a in arrays)


def iterate(mode: str, xs: list, ys: list, host, gpu) -> list:
    if mode.startswith("h2d_then") or mode == "h2d_persist":
        jax.block_until_ready([jax.device_put(x, gpu) for x in xs])
    if mode == "d2h_fresh":
        jax.block_until_ready([jax.device_put(y, host) for y in ys])
    if mode == "h2d_fresh":
        xs = [jax.device_put(y, host) for y in ys]
        jax.block_until_ready([jax.device_put(x, gpu) for x in xs])
    if mode in ("pointer", "h2d_then_ptr"):
        for x in xs:
            x.block_until_ready()
            x.unsafe_buffer_pointer()
    if mode == "h2d_then_block":
        for x in xs:
            x.block_until_ready()
    if mode == "h2d_then_only_ptr":
        for x in xs:
            x.unsafe_buffer_pointer()
    if mode == "h2d_tree":
        jax.block_until_ready(jax.device_put(xs, [gpu] * len(xs)))
    if mode == "h2d_compute":
        _read([jax.device_put(x, gpu) for x in xs]).block_until_ready()
    if mode == "engine_like":
        for _ in range(2):  # the forward's fetch and the backward's
            _read(jax.device_put(xs, [gpu] * len(xs))).block_until_ready()
        for x in xs:  # the host update's view of each shard (host_adamw.writable)
            for shard in x.addressable_shards:
                shard.data.block_until_ready()
                shard.data.unsafe_buffer_pointer()
    if mode in ("shard_data", "h2d_then_shard"):
        for x in xs:
            [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
    return xs


def main() -> None:
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    gpu = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    print(f"{'pattern':14} {'B/array/iter':>13} {'s':>6}")
    chosen = sys.argv[1:] or MODES
    unknown = sorted(set(chosen) - set(MODES))
    if unknown:
        sys.exit(f"unknown patterns {unknown}: choose from {', '.join(MODES)}")
    for mode in chosen:
        xs = [jax.device_put(np.ones(SIZE, np.float32), host) for _ in range(ARRAYS)]
        ys = jax.block_until_ready([jax.device_put(x, gpu) for x in xs])
        start = time.perf_counter()
        for i in range(ITERATIONS):
            xs = iterate(mode, xs, ys, host, gpu)
            if i == SKIP:
                first = host_rss_now_bytes()
        growth = (host_rss_now_bytes() - first) / (ITERATIONS - SKIP - 1) / ARRAYS
        print(f"{mode:14} {growth:13.1f} {time.perf_counter() - start:6.1f}", flush=True)


if __name__ == "__main__":
    main()
