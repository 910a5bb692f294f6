"""Measures the roofline's inputs: H2D, D2H and both-at-once bandwidth through the memory
kinds, and the rates of the optimizer updates on a layer-sized pytree: the Optax update
streamed through the device (stream.update=device) and the in-place host AdamW with each
kernel (stream.update=host).

    python benchmarks/bench_transfer.py [--gib 2] [--update-mparams 256] [--out FILE]

Prints one JSON object. Run it in the same device call as bench_step.py so that the bound
and the achieved time come from the same machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit  # noqa: E402

from megatrain_jax.tools.measure import median_seconds  # noqa: E402


def _host_update_rate(place, kernel, params, grads) -> float | None:
    """G params/s of the in-place host AdamW with one kernel (None: kernel not installed)."""
    from megatrain_jax import optim
    from megatrain_jax.optim.host_adamw import HostAdamW

    try:
        host = HostAdamW(1e-4, weight_decay=0.01, mask=optim.decay_mask, kernel=kernel)
    except ImportError:
        return None
    state = place.host_jit(host.optax.init)(params)
    seconds = median_seconds(lambda: host.update(params, grads, state, 1.0), repeats=5)
    return sum(a.size for a in params.values()) / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--chunks", type=int, default=8, help="arrays the buffer is split into")
    parser.add_argument("--update-mparams", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    from megatrain_jax import optim
    from megatrain_jax.stream.placement import Placement

    place = Placement()
    n = int(args.gib * 2**30 / 4 / args.chunks)
    nbytes = n * 4 * args.chunks
    on_device = [jnp.full((n,), i, jnp.float32) for i in range(args.chunks)]
    on_host = place.to_host(on_device)
    jax.block_until_ready((on_device, on_host))

    h2d = median_seconds(lambda: jax.block_until_ready(place.to_device(on_host)), repeats=5)
    d2h = median_seconds(lambda: jax.block_until_ready(place.to_host(on_device)), repeats=5)
    both = median_seconds(
        lambda: jax.block_until_ready((place.to_device(on_host), place.to_host(on_device))),
        repeats=5,
    )

    # The engine's update: AdamW over host state, grads and the clip scale given.
    m = args.update_mparams * 2**20 // 4
    params = place.to_host({f"w{i}": jnp.ones((m,), jnp.float32) * 0.1 for i in range(4)})
    grads = place.to_host(jax.tree.map(lambda a: a * 0.01, params))
    opt = optax.adamw(1e-4, weight_decay=0.01, mask=optim.decay_mask)
    state = place.host_jit(opt.init)(params)
    scale, skip = place.to_host((jnp.float32(1.0), jnp.bool_(False)))
    update = place.host_jit(
        lambda p, g, s, c, k: optim.apply_update(opt, p, g, s, c, k), donate_argnums=(0, 2)
    )
    box = {"p": params, "s": state}

    def run_update():
        box["p"], box["s"] = update(box["p"], grads, box["s"], scale, skip)
        jax.block_until_ready(box["p"])

    upd = median_seconds(run_update, repeats=5)
    count = 4 * m
    params = box["p"]  # the originals were donated to the update
    box.clear()
    host_rates = {k: _host_update_rate(place, k, params, grads) for k in ("numba", "numpy")}
    result = {
        "device": jax.devices()[0].device_kind, "bytes": nbytes, "chunks": args.chunks,
        "h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9,
        "bidirectional_total_gbps": 2 * nbytes / both / 1e9,
        "update_params": count, "update_gparams_per_s": count / upd / 1e9,
        "update_kind": "engine host_jit (state streamed through the device)",
        "host_update_gparams_per_s": host_rates,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
