"""The pieces of a hybrid update: some layers updated on the host, others on the device.

    python benchmarks/investigations/bench_hybrid_update.py [--shape 7b] [--host-layers 8] \\
        [--device-layers 4]

After the backward, the host AdamW updates its layers in place on the pinned buffers while
the GPU updates others from gradients it kept: their parameters and Adam moments travel in,
are updated, and travel back into the same pinned buffers. This times, on layers of the
given shape: the host update of `--host-layers` layers alone; the device update of
`--device-layers` layers alone, three ways (`program`: one program per layer that moves its
state in and out itself; `explicit`: copies in, then the write-back into the same buffers in a
program of its own; `put`: copies in and out to new host buffers); and each device way beside
the host update, since both draw on the same host memory. Prints one JSON object; the short
table goes to stderr.

Why side by side: the host update is bound by the host's memory, and the device update's
transfers read and write that same memory, so each slows the other; what they add together,
not alone, says whether a hybrid update pays (benchmarks/RESULTS.md has the figures).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="7b")
    parser.add_argument("--host-layers", type=int, default=8)
    parser.add_argument("--device-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from megatrain_jax.config import load_config
    from megatrain_jax.tools import plan

    cfg = load_config(args.shape)
    layer_bytes = 16 * cfg.model.params_per_layer
    plan.set_pool_env(load_config(args.shape, ["model.layers=%d" % (
        args.host_layers + 2 * args.device_layers)]))

    import jax
    import jax.numpy as jnp

    from megatrain_jax import model, optim
    from megatrain_jax.optim.host_adamw import HostAdamW
    from megatrain_jax.stream.placement import Placement
    from megatrain_jax.tools.measure import median_seconds

    place = Placement()
    opt = HostAdamW(1e-4, 0.9, 0.95, 1e-8, weight_decay=0.1, mask=optim.decay_mask)
    shapes = model.abstract_layer(cfg.model)
    full = jax.jit(lambda v: jax.tree.map(lambda s: jnp.full(s.shape, v, s.dtype), shapes))
    init = place.host_jit(opt.optax.init)

    def host_layer(grads_on_device: bool):
        p = place.to_host(full(0.01))
        g = full(1e-3) if grads_on_device else place.to_host(full(1e-3))
        return p, g, init(p)

    host_set = [host_layer(False) for _ in range(args.host_layers)]
    device_set = [host_layer(True) for _ in range(args.device_layers)]
    jax.block_until_ready((host_set, device_set))
    scale, skip = place.to_host((jnp.float32(1.0), jnp.bool_(False)))
    device_scale, device_skip = place.to_device((scale, skip))

    def apply(p, g, s, sc, sk):
        return optim.apply_update(opt.optax, p, g, s, sc, sk)

    in_program = place.host_jit(apply, donate_argnums=(0, 2))
    on_device = jax.jit(apply, donate_argnums=(0, 2))
    write_back = jax.jit(lambda dst, src: src, donate_argnums=0, out_shardings=place.host)

    def device_way(update_one):
        """Updates every device-set layer with update_one(p, g, s) -> (p, g, s), waits."""

        def run():
            device_set[:] = [update_one(p, g, s) for p, g, s in device_set]
            jax.block_until_ready(device_set)

        return run

    def through_device(write):  # copies in, update on the device, write(host_old, new) back
        def one(p, g, s):
            dev_p, dev_s = place.to_device((p, s))
            new_p, new_s = on_device(dev_p, g, dev_s, device_scale, device_skip)
            return write(p, new_p), g, write(s, new_s)

        return one

    def program(p, g, s):  # one program moves the state in and out itself
        new_p, new_s = in_program(p, g, s, scale, skip)
        return new_p, g, new_s

    run_program = device_way(program)
    run_explicit = device_way(through_device(write_back))
    run_put = device_way(through_device(lambda _old, new: place.to_host(new)))

    def run_host():
        for p, g, s in host_set:
            opt.update(p, g, s, 1.0)

    def timed(fn) -> float:
        return median_seconds(fn, args.repeats)

    def together(device_fn) -> tuple[float, float]:
        """(host seconds, device seconds) with both started at once."""
        device_fn()  # compiled
        host_s, dev_s = [], []
        def host_from(t0):
            run_host()
            host_s.append(time.perf_counter() - t0)

        for _ in range(args.repeats):
            t0 = time.perf_counter()
            worker = threading.Thread(target=host_from, args=(t0,))
            worker.start()
            device_fn()
            dev_s.append(time.perf_counter() - t0)
            worker.join()
        mid = len(host_s) // 2
        return sorted(host_s)[mid], sorted(dev_s)[mid]

    def pointer():
        return jax.tree.leaves(device_set[0][0])[0].unsafe_buffer_pointer()

    host_alone = timed(run_host)
    before = pointer()
    program_alone = timed(run_program)
    program_in_place = pointer() == before
    explicit_alone = timed(run_explicit)
    explicit_in_place = pointer() == before
    put_alone = timed(run_put)
    host_beside_program, program_beside = together(run_program)
    host_beside_explicit, explicit_beside = together(run_explicit)
    host_beside_put, put_beside = together(run_put)
    per = cfg.model.params_per_layer
    h, d = args.host_layers, args.device_layers
    result = {
        "device": jax.devices()[0].device_kind, "shape": args.shape, "params_per_layer": per,
        "host_layers": h, "device_layers": d, "layer_state_bytes": layer_bytes,
        "program_in_place": program_in_place, "explicit_in_place": explicit_in_place,
        "host_alone_s_per_layer": host_alone / h,
        "device_program_alone_s_per_layer": program_alone / d,
        "device_explicit_alone_s_per_layer": explicit_alone / d,
        "device_put_alone_s_per_layer": put_alone / d,
        "host_beside_put_s_per_layer": host_beside_put / h,
        "device_put_beside_s_per_layer": put_beside / d,
        "host_beside_program_s_per_layer": host_beside_program / h,
        "device_program_beside_s_per_layer": program_beside / d,
        "host_beside_explicit_s_per_layer": host_beside_explicit / h,
        "device_explicit_beside_s_per_layer": explicit_beside / d,
    }
    print(f"{args.shape} layer ({per / 1e6:.0f}M params), ms per layer; written in place: "
          f"program {program_in_place}, explicit {explicit_in_place}", file=sys.stderr)
    for key, value in result.items():
        if key.endswith("_s_per_layer"):
            gps = per / value / 1e9
            print(f"  {key[:-12]:24s} {1e3 * value:7.1f} ms  {gps:5.2f} G params/s",
                  file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
