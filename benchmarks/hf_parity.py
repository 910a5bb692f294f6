"""Logits of a Hugging Face folder through megatrain_jax against `transformers` (GPU or CPU).

    python3 benchmarks/hf_parity.py FOLDER [--moved-from SOURCE]

Prints the largest absolute logit difference (both sides fp32; set
JAX_DEFAULT_MATMUL_PRECISION=highest for full-precision matmuls on the JAX side) and, with
--moved-from, how far one weight matrix moved from another folder's (training happened).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from safetensors import safe_open

from megatrain_jax import model
from megatrain_jax.config import load_config
from megatrain_jax.io import hf


def tensor(folder: Path, name: str) -> np.ndarray:
    index = folder / hf.INDEX
    file = json.loads(index.read_text())["weight_map"][name] if index.exists() else hf.WEIGHTS
    with safe_open(str(folder / file), "np") as f:
        return f.get_tensor(name).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--moved-from", type=Path)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = load_config(None, [f"model.hf_path={args.folder}", "model.compute_dtype=float32",
                             "model.attention=xla"]).model
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 64))
    ours = np.asarray(model.logits(hf.load_params(args.folder, cfg, put=jax.device_put),
                                   tokens, cfg))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        args.folder, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        theirs = theirs_model(torch.tensor(tokens).to(device)).logits.float().cpu().numpy()
    precision = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION", "default")
    diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
    print(f"{args.folder} (JAX matmul precision {precision}): max abs logit difference "
          f"{diff:.2e} (logits up to {scale:.1f})")
    if args.moved_from:
        name = "model.layers.0.mlp.down_proj.weight"
        moved = np.abs(tensor(args.folder, name) - tensor(args.moved_from, name)).max()
        print(f"{name} moved from {args.moved_from} by at most {float(moved):.2e}")


if __name__ == "__main__":
    main()
