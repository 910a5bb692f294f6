"""`sample` on a GPU: greedy decoding with the KV cache against decoding without it, and the
speed of the prompt's pass and of each new token, for random weights of shipped shapes.

    PYTHONPATH=. python benchmarks/bench_sample.py                       # 1b and 7b
    PYTHONPATH=. python benchmarks/bench_sample.py --configs 1b --new-tokens 128

1. Check (tiny shape, fp32, matmuls at full precision): the cached greedy tokens equal those
   of recomputing the whole sequence's logits for every new token (`model.logits`).
2. Speed, per config and dtype (float32, bfloat16): the prompt's pass (--prompt-tokens), the
   time a new token takes (the difference of a long and a one-token generation, compiling
   excluded), and the weight bytes read per second that implies (decoding reads every weight
   once a token, so HBM bandwidth bounds it).

Writes $OUT/bench_sample.json (or ./bench_sample.json) and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatrain_jax import model  # noqa: E402
from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.io.data import ByteTokenizer  # noqa: E402
from megatrain_jax.stream.placement import Placement  # noqa: E402
from megatrain_jax.train import sample  # noqa: E402


def loaded(cfg, dtype: str) -> sample.LoadedModel:
    """Random weights of `cfg` on the device, in `dtype`, as load_model gives them."""
    params = model.init(cfg, jax.random.key(0))
    cast = lambda t: jax.tree.map(lambda a: a.astype(dtype), t)  # noqa: E731
    tree = {"embed": cast(params["embed"]), "layers": cast(model.stack_layers(params["layers"])),
            "head": cast(params["head"])}
    del params
    return sample.LoadedModel(dataclasses.replace(cfg, compute_dtype=dtype),
                              Placement().to_device(tree), ByteTokenizer(), frozenset(), "random")


def check(new_tokens: int = 24) -> dict:
    with jax.default_matmul_precision("highest"):
        cfg = load_config("tiny", ["model.compute_dtype=float32", "model.layers=3"]).model
        m = loaded(cfg, "float32")
        prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 20))
        cached = sample.generate(m, prompt, new_tokens)
        params = model.init(cfg, jax.random.key(0))
        ids, plain = list(prompt), []
        logits = jax.jit(lambda p, t: model.logits(p, t, cfg))
        for _ in range(new_tokens):
            plain.append(int(np.argmax(np.asarray(logits(params, np.asarray([ids])))[0, -1])))
            ids.append(plain[-1])
    return {"new_tokens": new_tokens, "equal": cached == plain, "cached": cached,
            "plain": plain}


def speed(name: str, dtype: str, prompt_tokens: int, new_tokens: int) -> dict:
    cfg = load_config(name).model
    m = loaded(cfg, dtype)
    prompt = list(np.random.default_rng(1).integers(0, cfg.vocab_size, prompt_tokens))
    sample.generate(m, prompt, new_tokens)  # compiles the prefill and the step
    one, one_s = sample.timed(sample.generate, m, prompt, 1)
    many, many_s = sample.timed(sample.generate, m, prompt, new_tokens)
    per_token = (many_s - one_s) / max(len(many) - 1, 1)
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(m.params))
    return {"config": name, "dtype": dtype, "params": cfg.num_params,
            "prompt_tokens": prompt_tokens, "new_tokens": len(many),
            "prompt_and_one_s": one_s, "per_token_ms": 1e3 * per_token,
            "tokens_per_s": 1 / per_token, "weight_gb_per_s": weight_bytes / per_token / 1e9,
            "peak_gpu_gib": _peak_gib()}


def _peak_gib() -> float | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30 or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="1b,7b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    result = {"device": jax.local_devices()[0].device_kind, "jax": jax.__version__,
              "check": check(), "speed": []}
    for name in args.configs.split(","):
        for dtype in args.dtypes.split(","):
            result["speed"].append(speed(name, dtype, args.prompt_tokens, args.new_tokens))
            jax.clear_caches()
    out = Path(os.environ.get("OUT", ".")) / "bench_sample.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}\ncheck: cached greedy == recomputed greedy for "
          f"{result['check']['new_tokens']} tokens: {result['check']['equal']}")
    print(f"{'config':8s}{'dtype':10s}{'prompt+1 s':>12s}{'ms/token':>10s}{'tokens/s':>10s}"
          f"{'weights GB/s':>14s}{'peak GiB':>10s}")
    for r in result["speed"]:
        print(f"{r['config']:8s}{r['dtype']:10s}{r['prompt_and_one_s']:12.3f}"
              f"{r['per_token_ms']:10.2f}{r['tokens_per_s']:10.1f}{r['weight_gb_per_s']:14.0f}"
              f"{r['peak_gpu_gib'] or 0:10.1f}")


if __name__ == "__main__":
    main()
