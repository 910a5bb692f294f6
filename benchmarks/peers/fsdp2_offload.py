"""Peer: PyTorch FSDP2 with CPUOffloadPolicy, world size 1, on a standard shape.

    python benchmarks/peers/fsdp2_offload.py 3b --steps 4 --warmup 2 [--out FILE]

The same workload as bench_step.py: a random-init Llama-shaped model (vocab 32000, untied,
no biases), batch 16 x 1024 random token ids from a fixed seed, fp32 master weights and
AdamW states on the host (lr 1e-5, weight decay 0.01), bf16 compute, global-norm clipping
at 1.0, activation checkpointing per layer. Prints one JSON object with the fields
bench_step.py prints, so the two can be compared line by line.

PyTorch and transformers are needed here only; they are never dependencies of the project.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

# hidden, layers, heads, ffn: BENCHMARKS.md's standard shapes
SHAPES = {"1b": (2048, 16, 16, 5504), "3b": (3072, 26, 24, 8192), "7b": (4096, 32, 32, 11008)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.manual_seed(0)

    hidden, layers, heads, ffn = SHAPES[args.shape]
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    t0 = time.perf_counter()
    model = LlamaForCausalLM(config)  # fp32, on the CPU
    model.gradient_checkpointing_enable()
    params = sum(p.numel() for p in model.parameters())
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mixed, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mp_policy=mixed, offload_policy=CPUOffloadPolicy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    init_s = time.perf_counter() - t0

    generator = torch.Generator().manual_seed(0)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, 32000, (args.batch, args.seq), generator=generator).cuda()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))  # waits for the step
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {step} {times[-1]:.3f} s loss {losses[-1]:.4f}", file=sys.stderr)

    step_s = statistics.median(times[args.warmup:])
    tokens = args.batch * args.seq
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "peer": "pytorch-fsdp2-cpu-offload", "shape": args.shape, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "params": params, "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s, "median_step_s": step_s, "step_s": times,
        "model_tflops": 6 * params * tokens / step_s / 1e12,
        "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_host_rss_gib": rss / 2**30, "host_bytes_per_param": rss / params,
        "losses": losses, "init_s": init_s,
    }
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
