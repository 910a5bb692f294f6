"""Are one layer's fp32 weight gradients bf16 values, with and without XLA's excess precision?

The layer casts each fp32 weight to bf16 before its matmuls, so the program's weight gradient
is a bf16 value cast to fp32, and `stream.grad_dtype=auto` sends it in bf16. The step's
programs are compiled with `xla_allow_excess_precision=False` (stream/programs.py), under
which XLA may not skip the rounding of a bf16 value. This compiles the engine's own layer
programs (one micro-batch, the gradient summed into a zero accumulator) both ways at a
config's width and shape, on this device, and reports for each: the share of weight-gradient
elements that are bf16 values, the seconds of the layer's forward and backward (median of
repeats), and the largest relative difference between the two settings' gradients.

    python benchmarks/investigations/excess_precision.py 7b --out excess.json [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def median_seconds(fn, make_args, repeats: int = 7) -> float:
    import jax

    jax.block_until_ready(fn(*make_args()))  # compile and warm
    times = []
    for _ in range(repeats):
        args = jax.block_until_ready(make_args())
        began = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def bf16_share(tree) -> float:
    import jax
    import jax.numpy as jnp

    leaves = [leaf for leaf in jax.tree.leaves(tree) if leaf.ndim >= 2]  # the matmul weights
    exact = sum(int(jnp.sum(leaf == leaf.astype(jnp.bfloat16).astype(leaf.dtype)))
                for leaf in leaves)
    return exact / sum(leaf.size for leaf in leaves)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--out", default="")
    args, overrides = ap.parse_known_args()

    import jax
    import jax.numpy as jnp
    import optax

    from megatrain_jax import model
    from megatrain_jax.config import load_config
    from megatrain_jax.stream import programs
    from megatrain_jax.stream.placement import Placement
    from megatrain_jax.train import trainers

    cfg = load_config(args.config, [*overrides, "stream.grad_dtype=float32"])
    m, d = cfg.model, cfg.data
    p = model.init_layer(m, jax.random.key(0))
    shape = (1, d.batch_size // d.micro_batches, d.seq_len, m.hidden)  # one micro-batch
    xs = jax.random.normal(jax.random.key(1), shape, m.compute_dtype)
    dy = jax.random.normal(jax.random.key(2), shape, m.compute_dtype)
    sq = jnp.zeros((), jnp.float32)
    rows, grads = {}, {}
    for name, options in (("excess allowed", {}), ("as written", programs.COMPILER_OPTIONS)):
        # The engine's own layer programs (fp32 gradients, no cast), compiled with `options`.
        programs.COMPILER_OPTIONS = options
        run = programs.build_programs(trainers.llama_templates(cfg), optax.sgd(0.0), 0.0,
                                      Placement())
        _, dw, _ = grads[name] = run.layer_backward(p, xs, dy + 0, {}, sq)
        rows[name] = {"bf16_share": bf16_share(dw),
                      "forward_s": median_seconds(run.layer_forward, lambda: (p, xs, {})),
                      "backward_s": median_seconds(run.layer_backward,
                                                   lambda: (p, xs, dy + 0, {}, sq))}

    def rel_diff(a, b):
        return max(float(jnp.max(jnp.abs(u - v)) / jnp.maximum(jnp.max(jnp.abs(v)), 1e-30))
                   for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    result = {"config": args.config, "overrides": overrides, "shape": list(shape),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows,
              "rel_diff_between": rel_diff(grads["as written"][1], grads["excess allowed"][1])}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'setting':16s}{'bf16 share':>12s}{'forward s':>12s}{'backward s':>12s}")
    for name, row in rows.items():
        print(f"{name:16s}{row['bf16_share']:12.6f}{row['forward_s']:12.5f}{row['backward_s']:12.5f}")
    print(f"largest relative difference of the weight gradients: {result['rel_diff_between']:.3e}")


if __name__ == "__main__":
    main()
