"""Peer: PyTorch FSDP2 with CPUOffloadPolicy, on one GPU or all of a node's, a standard shape.

    python benchmarks/peers/fsdp2_offload.py 3b --steps 4 --warmup 2 [--out FILE]
    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/peers/fsdp2_offload.py 7b --steps 4 --warmup 2 [--out FILE]

The offloading peer: `transformers`' LlamaForCausalLM built in fp32 on the host, every layer
and the whole model wrapped by `fully_shard` with CPU offload, so fp32 master weights,
gradients and AdamW states (lr 1e-5, weight decay 0.01) live in host memory and the CPU
runs the optimizer step; bf16 compute (MixedPrecisionPolicy), gradient checkpointing per
layer, global-norm clipping at 1.0; the workload of torch_common.py, `--batch` sequences per
GPU, each rank its own. It holds about 20.5 host bytes per parameter. Rank 0 prints one JSON
object with bench_step.py's fields: tokens/s of all the GPUs, device memory of GPU 0, host
RSS summed over the ranks.

PyTorch and transformers are needed here only; they are never dependencies of the project.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch_common
from transformers import LlamaForCausalLM

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )


def main() -> None:
    args = torch_common.parser(__doc__.splitlines()[0]).parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    # CPU-offloaded gradients meet in the norm's all-reduce on the host: gloo for those.
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    torch.cuda.set_device(local)
    torch.manual_seed(args.seed)
    if world > 1:  # torchrun sets OMP_NUM_THREADS=1 per rank: the CPU optimizer's share of cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    config = torch_common.llama_config(args.shape, args.seq)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(config)  # fp32, on the CPU
    checkpointed = torch_common.checkpoint_layers(model)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mixed, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mp_policy=mixed, offload_policy=CPUOffloadPolicy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    init_s = time.perf_counter() - t0

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    device = torch.device("cuda", local)
    args.seed += rank  # each rank's own batches
    times, losses = torch_common.timed_steps(step, args, config.vocab_size, device)
    out = torch_common.result("pytorch-fsdp2-cpu-offload", args, model, times, losses, device,
                              init_s=init_s, gradient_checkpointing=checkpointed,
                              world_size=world)
    rss = [None] * world
    dist.all_gather_object(rss, out["peak_host_rss_gib"])
    for key in ("tokens_per_step", "tokens_per_s", "model_tflops"):  # every GPU's tokens
        out[key] *= world
    out["peak_host_rss_gib"] = sum(rss)
    out["host_bytes_per_param"] = out["peak_host_rss_gib"] * 2**30 / out["params"]
    if rank == 0:
        torch_common.emit(out, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
