"""What the PyTorch peers share: the standard shapes read from configs/, the model config,
the batches, the timed loop and the JSON they print.

The workload is bench_step.py's: a random-init Llama-shaped `transformers` model (untied,
no biases) of a shipped config's shape, batches of random token ids drawn from a fixed seed
(a new batch each step), AdamW (lr 1e-5, weight decay 0.01 on every parameter: the project
spares norms, the same work), global-norm clipping at 1.0, bf16 compute, gradient
checkpointing per layer. `--warmup` steps, then the median of `--steps`. The JSON holds
bench_step.py's fields where they apply, so rows compare.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import emit  # noqa: E402, F401  (the peers' one JSON object, as every benchmark's)

from megatrain_jax.planning.presets import PEAK_FLOPS  # noqa: E402  (a table: JAX not started)

SHAPES = sorted(p.stem for p in (ROOT / "configs").glob("*.json"))


def parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("shape", choices=SHAPES, help="a shipped config (configs/SHAPE.json)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    return parser


def llama_config(shape: str, seq: int) -> LlamaConfig:
    """The `transformers` config of a shipped config's model section."""
    model = json.loads((ROOT / "configs" / f"{shape}.json").read_text())["model"]
    heads = model["heads"]
    return LlamaConfig(
        vocab_size=model["vocab_size"], hidden_size=model["hidden"],
        intermediate_size=model["ffn"], num_hidden_layers=model["layers"],
        num_attention_heads=heads, num_key_value_heads=model.get("kv_heads", heads),
        head_dim=model.get("head_dim") or model["hidden"] // heads,
        rms_norm_eps=model.get("norm_eps", 1e-5), max_position_embeddings=seq,
        tie_word_embeddings=model.get("tie_embeddings", False), attn_implementation="sdpa")


def checkpoint_layers(model: torch.nn.Module) -> bool:
    """Turns on per-layer activation checkpointing (renamed in transformers 5); whether on."""
    enable = (getattr(model, "activation_checkpointing_enable", None)
              or model.gradient_checkpointing_enable)
    enable()
    model.config.use_cache = False
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def timed_steps(step, args, vocab: int, device: torch.device) -> tuple[list, list]:
    """Seconds and loss of each of `warmup + steps` calls of step(ids); each call is timed
    until its loss is on the host and the device is idle."""
    generator = torch.Generator().manual_seed(args.seed)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
        t0 = time.perf_counter()
        losses.append(float(step(ids)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {i} {times[-1]:.3f} s loss {losses[-1]:.4f}", file=sys.stderr)
    return times, losses


def result(peer: str, args, model: torch.nn.Module, times: list, losses: list,
           device: torch.device, **extra) -> dict:
    """bench_step.py's fields for a peer's run."""
    params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.seq
    step_s = statistics.median(times[args.warmup:])
    model_flops = 6 * params * tokens / step_s
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    cuda = device.type == "cuda"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "peer": peer, "shape": args.shape, "config": args.shape, "torch": torch.__version__,
        "device": name, "params": params, "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s, "median_step_s": step_s, "step_s": times,
        "model_tflops": model_flops / 1e12, "mfu": model_flops / peak if peak else None,
        "peak_device_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_device_reserved_gib":
            torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "peak_host_rss_gib": rss / 2**30, "host_bytes_per_param": rss / params,
        "losses": losses, **extra,
    }
