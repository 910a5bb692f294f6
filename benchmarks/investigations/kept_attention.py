"""One layer's backward with its attention kept (`stream.keep_attention`) against attending
again: the same gradients? how much faster? One layer of a config's width, batch 1, its
compute dtype, random weights and input, on this device's attention path.

    python benchmarks/investigations/kept_attention.py 7b --lengths 8192,32768,131072 \\
        --out kept.json

For each length: the path, whether this jax can keep it, the largest relative difference of
the layer's gradients (weights and input) between the two and between two calls of the
plain backward (the backend's own run-to-run spread), and the seconds of the layer's
forward, of its backward attending again (the engine's layer_backward: recompute and VJP)
and of its backward with the kept attention (each the second of two calls). A table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def timed(fn, *args) -> tuple[float, object]:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm
    began = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - began, out


def probe(cfg, seq: int) -> dict:
    import jax
    import jax.numpy as jnp

    from megatrain_jax import model
    from megatrain_jax.model import replay

    m = cfg.model
    p = model.init_layer(m, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, seq, m.hidden), m.compute_dtype)
    dy = jax.random.normal(jax.random.key(2), x.shape, m.compute_dtype)
    path = model.attention_path(m, seq)
    row = {"seq_len": seq, "path": path, "keeps": replay.keeps(path)}

    def backward(layer, *kept):
        return jax.jit(lambda p_, x_, *k: jax.vjp(lambda a, b: layer(a, b, *k), p_, x_)[1](dy))

    def rel_diff(a, b):
        diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))
                                                / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)),
                             a, jax.tree.map(lambda t: t.astype(jnp.float32), b))
        return max(jax.tree.leaves(diffs))

    try:
        row["forward_s"], _ = timed(jax.jit(lambda p_, x_: model.layer(p_, x_, m)), p, x)
        row["keeping_forward_s"], (_, kept) = timed(
            jax.jit(lambda p_, x_: model.layer_keeping_attention(p_, x_, m)), p, x)
        plain = backward(lambda a, b: model.layer(a, b, m))
        row["backward_s"], again = timed(plain, p, x)
        row["repeat_rel_diff"] = rel_diff(plain(p, x), again)  # the backend's own spread
        row["replaying_backward_s"], replayed = timed(
            backward(lambda a, b, k: model.layer_replaying_attention(a, b, k, m)), p, x, kept)
    except Exception as e:  # noqa: BLE001 - a limit is a result here
        row["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return row
    row["max_rel_diff"] = rel_diff(replayed, again)
    row["saved_s"] = row["backward_s"] - row["replaying_backward_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--out", default="")
    args, overrides = ap.parse_known_args()

    import jax

    from megatrain_jax.config import load_config
    from megatrain_jax.model import replay

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"cuDNN entry points: {replay.cudnn_available()}", flush=True)
    rows = []
    for seq in (int(n) for n in args.lengths.split(",")):
        cfg = load_config(args.config, [f"model.max_seq_len={max(seq, 4096)}", *overrides])
        rows.append(probe(cfg, seq))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'tokens':>8} {'path':>9} {'fwd s':>7} {'bwd s':>7} {'kept bwd s':>10} "
          f"{'saved':>6} {'rel diff':>9} {'repeat':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['seq_len']:>8} {r['path']:>9}  error: {r['error'][:80]}")
            continue
        print(f"{r['seq_len']:>8} {r['path']:>9} {r['forward_s']:7.3f} {r['backward_s']:7.3f} "
              f"{r['replaying_backward_s']:10.3f} {r['saved_s'] / r['backward_s']:6.1%} "
              f"{r['max_rel_diff']:9.2e} {r['repeat_rel_diff']:9.2e}")


if __name__ == "__main__":
    main()
