"""Peer: DeepSpeed ZeRO-3 offloading weights and optimizer state to the CPU, a standard shape.

    bash benchmarks/peers/deepspeed_wheels.sh      # here, once: DeepSpeed and its needs in .whl/
    python benchmarks/peers/deepspeed_offload.py 3b --steps 4 --warmup 2 [--out FILE]
    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/peers/deepspeed_offload.py 7b --steps 4 --warmup 2 [--out FILE]

The other offloading peer, the one most teams reach for: `transformers`' LlamaForCausalLM
built under `deepspeed.zero.Init` (transformers' own ZeRO-3 path: each layer is partitioned
to pinned host memory as it is made, then initialized as transformers does it, gathered; no
whole model on the GPU or the host), driven by a DeepSpeed engine with ZeRO stage 3,
`offload_param` and `offload_optimizer` on the CPU with pinned memory, bf16 compute, fp32
master weights, gradients and AdamW states (DeepSpeedCPUAdam, lr 1e-5, weight decay 0.01)
in host memory where the CPU runs the optimizer step, global-norm clipping at 1.0, gradient
checkpointing per layer; the workload of torch_common.py, `--batch` sequences per GPU, each
rank its own. DeepSpeed 0.19's ZeRO-3 offload holds 20 host bytes per parameter (bf16
weights 2 and gradients 2, fp32 master weights 4 and gradients 4, two moments 8), plus the
pinned allocator's power-of-two rounding and cache: 7b (6.74e9 parameters) needs more than
125 GiB of host. Rank 0 prints one JSON object with bench_step.py's fields: tokens/s of all
the GPUs, device memory of GPU 0, host RSS summed over the ranks.

DeepSpeed is built here as a pure-Python wheel (deepspeed_wheels.sh); its CPU Adam op is
compiled at first use with the machine's C++ compiler and ninja, before the timed init
(`op_build_s`). The `deepspeed` launcher works too (its `--local_rank` is accepted).
PyTorch, transformers and DeepSpeed are needed here only; they are never dependencies of the
project.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import types

import torch
import torch.distributed as dist
import torch_common
from transformers import LlamaForCausalLM


def ds_config(args) -> dict:
    """ZeRO-3 with weights and optimizer on the CPU, pinned: DeepSpeed's offload recipe."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": args.pin_memory},
            "offload_optimizer": {"device": "cpu", "pin_memory": args.pin_memory},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build(config, ds: dict):
    """The model, partitioned as it is made, and transformers' ZeRO-3 config (None where
    transformers could not take it: then torch's default init of the layers)."""
    import deepspeed
    from transformers.integrations import deepspeed as hf_ds

    try:  # held (transformers keeps a weak reference) while the model trains, as Trainer does
        hf_config = hf_ds.HfDeepSpeedConfig(ds)
    except ImportError:  # no `accelerate`: zero.Init alone
        hf_ds.unset_hf_deepspeed_config()
        with deepspeed.zero.Init(config_dict_or_path=ds):
            return LlamaForCausalLM(config), None
    # zero.Init around the constructor, then transformers' init of each gathered layer
    return LlamaForCausalLM._from_config(config), hf_config


def pinned_peaks() -> dict | None:
    """The pinned host allocator's peaks (GiB), where this torch reports them."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    return {k: v / 2**30 for k, v in stats.items() if k.endswith("bytes.peak")}


def train(args) -> tuple[dict, int]:
    """The JSON object, every rank's numbers gathered in, and this process's rank."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder

    for handler in deepspeed.utils.logger.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29532")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", str(args.local_rank or 0))
    os.environ.setdefault("WORLD_SIZE", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    torch.manual_seed(args.seed)
    if world > 1:  # torchrun sets OMP_NUM_THREADS=1 per rank: the CPU optimizer's share of cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    t0 = time.perf_counter()
    CPUAdamBuilder().load()  # JIT-compiled once per machine (then cached), outside init_s
    op_build_s = time.perf_counter() - t0

    config = torch_common.llama_config(args.shape, args.seq)
    ds = ds_config(args)
    t0 = time.perf_counter()
    model, hf_config = build(config, ds)
    checkpointed = torch_common.checkpoint_layers(model)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-5, weight_decay=0.01,
                                 adamw_mode=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    init_s = time.perf_counter() - t0

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # clips, steps on the CPU, zeroes the gradients
        return loss.detach()

    device = torch.device("cuda", local)
    args.seed += rank  # each rank's own batches
    times, losses = torch_common.timed_steps(step, args, config.vocab_size, device)
    # ZeRO-3 leaves each parameter an empty stand-in (numel 0): result() gets their count.
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    counted = types.SimpleNamespace(parameters=lambda: [torch.empty(params, device="meta")])
    out = torch_common.result(
        "deepspeed-zero3-cpu-offload", args, counted, times, losses, device, init_s=init_s,
        gradient_checkpointing=checkpointed, world_size=world,
        system=f"deepspeed {deepspeed.__version__}", deepspeed=deepspeed.__version__,
        op_build_s=op_build_s, transformers_init=hf_config is not None,
        pinned_host_peak_gib=pinned_peaks(), deepspeed_config=ds_config(args))
    rss = [None] * world
    dist.all_gather_object(rss, out["peak_host_rss_gib"])
    for key in ("tokens_per_step", "tokens_per_s", "model_tflops"):  # every GPU's tokens
        out[key] *= world
    out["peak_host_rss_gib"] = sum(rss)
    out["host_bytes_per_param"] = out["peak_host_rss_gib"] * 2**30 / params
    return out, rank


def main() -> None:
    parser = torch_common.parser(__doc__.splitlines()[0])
    parser.add_argument("--no-pin-memory", dest="pin_memory", action="store_false",
                        help="offload to pageable host memory (no rounding, slower copies)")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # the op build's and DeepSpeed's prints
        out, rank = train(args)
    if rank == 0:
        torch_common.emit(out, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
