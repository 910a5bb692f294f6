"""The host AdamW under the conditions of a real step: alone, beside the weight stream (H2D
from the same host memory), beside every visible GPU's weight and gradient streams at once
(H2D and D2H on each, as a mesh's step moves them), and beside a busy core (the runtime's and
Python's threads).

    python benchmarks/bench_host_update.py [--mparams 202] [--repeats 6] [--out FILE]

In the engine the update of step N runs while the forward of step N+1 streams weights from
the same host memory, so its rate there, not alone, paces the forward. This measures each
kernel schedule in each condition on one layer-sized set of pinned buffers, and the host's
memory bandwidth (numba read / copy / triad) as the ceiling. Prints one JSON object; the
short table goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit  # noqa: E402


def _kernels(numba, adamw):
    """The update kernel and the probes: a busy loop, read, copy and triad over fp32."""
    import math
    import types

    @numba.njit(nogil=True)
    def spin(n):
        x = 0.0
        for i in range(n):
            x += math.sqrt(i)
        return x

    @numba.njit(parallel=True, nogil=True, fastmath=True)
    def read(a):
        total = 0.0
        for i in numba.prange(a.size):
            total += a[i]
        return total

    @numba.njit(parallel=True, nogil=True)
    def copy(a, b):
        for i in numba.prange(a.size):
            b[i] = a[i]

    @numba.njit(parallel=True, nogil=True)
    def triad(out, a, b):
        for i in numba.prange(a.size):
            out[i] = a[i] + 0.5 * b[i]

    return types.SimpleNamespace(static=adamw, spin=spin, read=read, copy=copy, triad=triad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mparams", type=int, default=202, help="parameters, millions")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--stream-gib", type=float, default=4.0)
    parser.add_argument("--threads", default="15,12",
                        help="thread counts to try beside all of them, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numba
    import numpy as np

    from megatrain_jax.optim import host_adamw
    from megatrain_jax.stream.placement import Placement
    from megatrain_jax.tools.measure import median_seconds

    place = Placement()
    n = args.mparams * 10**6
    f = np.float32
    arrays = place.to_host([jnp.full((n,), v, jnp.float32) for v in (0.1, 1e-3, 1e-4, 1e-6)])
    jax.block_until_ready(arrays)
    views = [host_adamw.writable(a) for a in arrays]
    leaf = [(view,) for view in views]  # the kernel takes a leaf's shards: here one
    scalars = (f(1.0), f(0.9), f(0.1), f(0.95), f(0.05), f(1e-8), f(0.1), f(0.05), f(-1e-5),
               f(0.01), False)  # fp32 moments: bias corrections divide

    kernels = _kernels(numba, host_adamw._numba_kernel())

    def timed(fn) -> float:
        return median_seconds(fn, args.repeats)

    def schedule(name):
        if name == "static":
            return lambda: kernels.static(*leaf, *scalars)
        if name.startswith("threads"):
            threads = min(int(name.split("=")[1]), numba.config.NUMBA_NUM_THREADS)

            def fewer():
                previous = numba.get_num_threads()
                numba.set_num_threads(threads)
                try:
                    kernels.static(*leaf, *scalars)
                finally:
                    numba.set_num_threads(previous)

            return fewer
        chunk = int(name.split("=")[1])  # the kernel's tasks (host_adamw.CHUNK elements each)

        def run():
            previous = numba.set_parallel_chunksize(chunk)
            try:
                kernels.static(*leaf, *scalars)
            finally:
                numba.set_parallel_chunksize(previous)

        return run

    # Background load: the weight stream (H2D of pinned buffers, as the forward does); and
    # for "dma", on every GPU at once, that and a gradient stream (D2H) of half its size.
    def stream_source(device, gib):
        placed = Placement(device=device)
        return placed, placed.to_host([jnp.ones((int(gib * 2**28) // 8,), jnp.float32,
                                                device=device) for _ in range(8)])

    source = stream_source(jax.devices()[0], args.stream_gib)[1]
    streams = [(p, s, p.to_device(s[:4])) for p, s in
               (stream_source(d, args.stream_gib / 2) for d in jax.devices())]
    jax.block_until_ready((source, streams))
    stream_bytes = sum(a.nbytes for a in source)

    class Background:
        def __init__(self, kind):
            self.kind, self.stop, self.moved, self.seconds = kind, threading.Event(), 0, 0.0
            self.thread = threading.Thread(target=self.run, daemon=True)

        def run(self):
            t0 = time.perf_counter()
            while not self.stop.is_set():
                if self.kind == "h2d":
                    jax.block_until_ready(place.to_device(source))
                    self.moved += stream_bytes
                elif self.kind == "dma":  # each GPU's weights in, gradients out, at once
                    moved = [(p.to_device(s), p.to_host(g)) for p, s, g in streams]
                    jax.block_until_ready(moved)
                    self.moved += sum(a.nbytes for a in jax.tree.leaves(moved))
                else:
                    kernels.spin(20_000_000)
            self.seconds = time.perf_counter() - t0

        def __enter__(self):
            self.thread.start()
            time.sleep(0.3)
            return self

        def __exit__(self, *exc):
            self.stop.set()
            self.thread.join()

    rows = []
    # static: each thread one equal run of the tasks; dynamic=K: threads take K tasks at a time
    variants = ["static", "dynamic=1", "dynamic=16",
                *(f"threads={t}" for t in args.threads.split(",") if t)]
    for condition in ("alone", "h2d", "dma", "spin"):
        for variant in variants:
            run = schedule(variant)
            if condition == "alone":
                seconds, h2d = timed(run), None
            else:
                with Background(condition) as bg:
                    seconds = timed(run)
                h2d = bg.moved / bg.seconds / 1e9 if condition in ("h2d", "dma") else None
            rows.append({"condition": condition, "variant": variant,
                         "gparams_per_s": n / seconds / 1e9, "h2d_gbps_beside": h2d})

    # The host memory's ceiling, with the same threads.
    a, b, c = views[0], views[2], views[3]
    bandwidth = {
        "read_gbps": 4 * n / timed(lambda: kernels.read(a)) / 1e9,
        "copy_gbps": 8 * n / timed(lambda: kernels.copy(a, b)) / 1e9,
        "triad_gbps": 12 * n / timed(lambda: kernels.triad(b, a, c)) / 1e9,
    }
    h2d_alone = stream_bytes / timed(lambda: jax.block_until_ready(place.to_device(source))) / 1e9
    result = {"device": jax.devices()[0].device_kind, "params": n,
              "gpus": jax.device_count(), "numba_threads": numba.get_num_threads(),
              "threading_layer": numba.threading_layer(), "h2d_gbps_alone": h2d_alone,
              **bandwidth, "update_bytes_per_param": 28, "rows": rows}
    for r in rows:
        beside = (f"  copies beside {r['h2d_gbps_beside']:.1f} GB/s" if r["h2d_gbps_beside"]
                  else "")
        print(f"{r['condition']:6s} {r['variant']:14s} {r['gparams_per_s']:5.2f} G params/s "
              f"({28 * r['gparams_per_s']:.0f} GB/s){beside}", file=sys.stderr)
    print(f"memory: read {bandwidth['read_gbps']:.0f} copy {bandwidth['copy_gbps']:.0f} triad "
          f"{bandwidth['triad_gbps']:.0f} GB/s; H2D alone {h2d_alone:.1f} GB/s; layer "
          f"{result['threading_layer']}, {result['numba_threads']} threads", file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
