"""model.fp8_matmuls on a GPU: one decoder layer's forward and backward (the streamed step's
unit of work) with bf16 projections against FP8 ones, at shipped shapes, random weights.

    PYTHONPATH=. python benchmarks/bench_fp8.py                        # 3b and 7b, 16x1024
    PYTHONPATH=. python benchmarks/bench_fp8.py --configs 7b --tokens 8192

Per config and recipe: the layer's forward+backward time (median of --repeats, compiling
excluded), the TFLOP/s its projections' and attention's FLOPs imply, whether XLA compiled
the FP8 dots as cuBLASLt FP8 GEMMs (`__cublas$lt$matmul$f8` custom calls, counted), the
largest relative difference of the layer's output from bf16's, and the peak GPU memory.

Writes $OUT/bench_fp8.json (or ./bench_fp8.json) and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatrain_jax import model  # noqa: E402
from megatrain_jax.config import load_config  # noqa: E402


def _layer_step(cfg):
    """layer forward + backward of a sum: the gradients of the weights and of x."""
    def loss(p, x):
        return jnp.sum(model.layer(p, x, cfg).astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def measure(name: str, fp8: bool, tokens: int, seq: int, repeats: int) -> dict:
    base = load_config(name, ["model.compute_dtype=bfloat16"]).model
    cfg = dataclasses.replace(base, fp8_matmuls=fp8)
    p = model.init_layer(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (tokens // seq, seq, cfg.hidden), jnp.bfloat16)
    step = _layer_step(cfg)
    hlo = step.lower(p, x).compile().as_text()
    jax.block_until_ready(step(p, x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(p, x))
        times.append(time.perf_counter() - start)
    out = jax.jit(lambda p, x: model.layer(p, x, cfg))(p, x)
    matmul = 2 * tokens * (cfg.params_per_layer - 2 * cfg.hidden)
    attention = 2 * 2 * tokens * seq * cfg.heads * cfg.dh / 2  # causal: half of QK^T and PV
    seconds = float(np.median(times))
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"config": name, "recipe": "fp8" if fp8 else "bf16", "tokens": tokens, "seq": seq,
            "step_ms": 1e3 * seconds, "tflops": 3 * (matmul + attention) / seconds / 1e12,
            "fp8_gemms": hlo.count("cublas$lt$matmul$f8"), "out": np.asarray(out, np.float32),
            "peak_gpu_gib": stats.get("peak_bytes_in_use", 0) / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="3b,7b")
    parser.add_argument("--tokens", type=int, default=16 * 1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for name in args.configs.split(","):
        bf16 = measure(name, False, args.tokens, args.seq, args.repeats)
        fp8 = measure(name, True, args.tokens, args.seq, args.repeats)
        scale = float(np.max(np.abs(bf16["out"])))
        fp8["max_rel_diff"] = float(np.max(np.abs(fp8["out"] - bf16["out"]))) / scale
        bf16["max_rel_diff"] = 0.0
        fp8["speedup"] = bf16["step_ms"] / fp8["step_ms"]
        rows += [bf16, fp8]
        jax.clear_caches()
    for r in rows:
        del r["out"]
    result = {"device": jax.local_devices()[0].device_kind, "jax": jax.__version__,
              "rows": rows}
    out = Path(os.environ.get("OUT", ".")) / "bench_fp8.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['device']}, jax {result['jax']})")
    print(f"{'config':8s}{'recipe':8s}{'layer ms':>10s}{'TFLOP/s':>9s}{'speedup':>9s}"
          f"{'f8 GEMMs':>10s}{'rel diff':>10s}{'peak GiB':>10s}")
    for r in rows:
        print(f"{r['config']:8s}{r['recipe']:8s}{r['step_ms']:10.2f}{r['tflops']:9.0f}"
              f"{r.get('speedup', 1.0):9.2f}{r['fp8_gemms']:10d}{r['max_rel_diff']:10.3f}"
              f"{r['peak_gpu_gib']:10.1f}")


if __name__ == "__main__":
    main()
