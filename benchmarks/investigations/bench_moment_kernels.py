"""The host AdamW kernel's rate per form of the moments (optim.state_dtype), on one matrix.

    python benchmarks/investigations/bench_moment_kernels.py [--rows 4096] [--columns 8192] \
        [--state-dtypes float32,bfloat16,int8] [--repeats 7] [--out FILE]

Each form updates the same pinned matrix in place through `HostAdamW.update`, the engine's
own call: one untimed update (it compiles the kernel and fills the moments), then the median
of `--repeats` updates of the same step (the step counts set back each time, so the bias
corrections, which the engine computes once a step for all parts, are not timed). Prints
one JSON object; a short table goes to stderr. The rate is parameters per second over every
core numba uses (NUMBA_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--columns", type=int, default=8192)
    parser.add_argument("--state-dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import jax
    import numba
    import numpy as np
    import optax

    from megatrain_jax.optim import HostAdamW, decay_mask, host_adamw
    from megatrain_jax.stream.placement import Placement
    from megatrain_jax.tools.measure import median_seconds

    rng = np.random.default_rng(0)
    shape, place = (args.rows, args.columns), Placement()
    weights = rng.normal(size=shape).astype(np.float32) * 0.02
    grads = place.place({"w": rng.normal(size=shape).astype(np.float32) * 1e-3})
    rows = []
    for state_dtype in args.state_dtypes.split(","):
        host = HostAdamW(optax.constant_schedule(1e-4), 0.9, 0.95, 1e-8, weight_decay=0.1,
                         mask=decay_mask, state_dtype=state_dtype)
        state = place.place(jax.tree.map(np.array, host.optax.init({"w": weights})))
        params = place.place({"w": weights.copy()})
        jax.block_until_ready((params, state, grads))

        counts = [view for leaf in (state[0].count, state[-1].count)
                  for view in host_adamw.shard_views(leaf)]

        def update(params=params, state=state, host=host, counts=counts):
            # The same step again: the engine computes the step's bias corrections once for
            # all its parts (an XLA power, for compact moments), so they come from the cache.
            for count in counts:
                count[0] = 1
            host.update(params, grads, state, np.float32(1.0))

        seconds = median_seconds(update, args.repeats)
        rows.append({"state_dtype": state_dtype, "kernel": host.kernel,
                     "seconds": seconds, "gparams_per_s": weights.size / seconds / 1e9})
        print(f"{state_dtype:9s} {rows[-1]['gparams_per_s']:.3f} G params/s "
              f"({seconds * 1e3:.1f} ms, {host.kernel})", file=sys.stderr)
    emit({"device": jax.devices()[0].device_kind, "params": weights.size,
          "numba_threads": numba.get_num_threads(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
