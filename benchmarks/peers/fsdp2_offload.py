"""Peer: PyTorch FSDP2 with CPUOffloadPolicy, world size 1, on a standard shape.

    python benchmarks/peers/fsdp2_offload.py 3b --steps 4 --warmup 2 [--out FILE]

The offloading peer: `transformers`' LlamaForCausalLM built in fp32 on the host, every layer
and the whole model wrapped by `fully_shard` with CPU offload, so fp32 master weights,
gradients and AdamW states (lr 1e-5, weight decay 0.01) live in host memory and the CPU
runs the optimizer step; bf16 compute (MixedPrecisionPolicy), gradient checkpointing per
layer, global-norm clipping at 1.0; the workload of torch_common.py. It holds about 20.5
host bytes per parameter. Prints one JSON object with bench_step.py's fields.

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
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.manual_seed(args.seed)

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

    device = torch.device("cuda", 0)
    times, losses = torch_common.timed_steps(step, args, config.vocab_size, device)
    torch_common.emit(torch_common.result("pytorch-fsdp2-cpu-offload", args, model, times,
                                          losses, device, init_s=init_s,
                                          gradient_checkpointing=checkpointed), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
