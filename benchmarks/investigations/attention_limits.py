"""How long a sequence each attention path takes on this GPU, and how fast: one layer's causal
attention (forward, and forward with backward) at a config's heads, batch 1, bf16.

    python benchmarks/investigations/attention_limits.py 7b --lengths 131072,262144,524288 \
        --blockwise 32768 --out attention.json

For each length and path: whether it ran (or the error's first line), the seconds of the
forward and of forward + backward (the second of two calls; the first compiles), and the
rate in TFLOP/s counting the causal half of the score matrix (forward 2·H·S²·E flops: two
products of S²/2·E multiply-adds per head; the backward 2.5 times the forward). A table is
printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def timed(fn, *args) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm
    began = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - began


def probe(cfg, path: str, seq: int) -> dict:
    import jax
    import jax.numpy as jnp

    from megatrain_jax.model import ops

    m = cfg.model
    keys = jax.random.split(jax.random.key(seq), 3)
    q = jax.random.normal(keys[0], (1, seq, m.heads, m.dh), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, seq, m.kv_heads, m.dh), jnp.bfloat16)
            for key in keys[1:])

    def loss(q, k, v):
        return jnp.sum(ops.attention(q, k, v, path).astype(jnp.float32))

    forward = jax.jit(lambda q, k, v: ops.attention(q, k, v, path))
    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    flops = 2 * m.heads * seq * seq * m.dh  # two products, the causal half, 2 flops each
    row = {"path": path, "seq_len": seq}
    try:
        row["forward_s"] = timed(forward, q, k, v)
        row["forward_backward_s"] = timed(both, q, k, v)
    except Exception as e:  # noqa: BLE001 - the limit is what we are looking for
        row["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return row
    row["forward_tflops"] = flops / row["forward_s"] / 1e12
    row["forward_backward_tflops"] = 3.5 * flops / row["forward_backward_s"] / 1e12
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="7b")
    parser.add_argument("--lengths", default="131072,262144,524288")
    parser.add_argument("--blockwise", default="32768", help="lengths for the blockwise path")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

    import jax

    from megatrain_jax.config import load_config

    cfg = load_config(args.config, ["model.max_seq_len=16777216"])
    plan = [("cudnn", int(n)) for n in args.lengths.split(",") if n]
    plan += [("blockwise", int(n)) for n in args.blockwise.split(",") if n]
    rows = []
    for path, seq in plan:
        rows.append(probe(cfg, path, seq))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(
                {"config": args.config, "device": jax.devices()[0].device_kind,
                 "jax": jax.__version__, "heads": cfg.model.heads,
                 "kv_heads": cfg.model.kv_heads, "head_dim": cfg.model.dh, "rows": rows},
                indent=1) + "\n")
    print(f"\n{'path':10s}{'seq_len':>10s}{'fwd s':>9s}{'fwd+bwd s':>11s}{'TFLOP/s':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['path']:10s}{r['seq_len']:>10,d}  failed: {r['error'][:80]}")
        else:
            print(f"{r['path']:10s}{r['seq_len']:>10,d}{r['forward_s']:9.3f}"
                  f"{r['forward_backward_s']:11.3f}{r['forward_backward_tflops']:9.0f}")


if __name__ == "__main__":
    main()
