"""Peer: PyTorch with the whole model resident on the GPU, on a standard shape.

    python benchmarks/peers/torch_resident.py 7b --steps 4 --warmup 2 [--compile] [--out FILE]
    python benchmarks/peers/torch_resident.py tiny --device cpu --batch 2 --seq 32  # a check

What a team with a large GPU would run without offload: `transformers`' LlamaForCausalLM
built on the device in fp32 (the master weights), bf16 autocast for compute, gradient
checkpointing per layer, fused AdamW (lr 1e-5, weight decay 0.01) with its state on the
device, global-norm clipping at 1.0; the workload of torch_common.py. Its peak GPU memory is
about 16 bytes per parameter (weights, gradients, two moments) plus activations: 7b needs
about 105 GiB. Prints one JSON object with bench_step.py's fields.

PyTorch and transformers are needed here only; they are never dependencies of the project.
"""

from __future__ import annotations

import time

import torch
import torch_common
from transformers import LlamaForCausalLM


def main() -> None:
    parser = torch_common.parser(__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a check of the logic")
    parser.add_argument("--compile", action="store_true",
                        help="each decoder layer compiled with torch.compile (the faster peer)")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = torch_common.llama_config(args.shape, args.seq)
    t0 = time.perf_counter()
    with device:  # built where it stays: no fp32 copy of the model in host memory
        model = LlamaForCausalLM(config)
    checkpointed = torch_common.checkpoint_layers(model)
    if args.compile:  # the layers are alike: one compiled program serves all of them
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        for layer in model.model.layers:
            layer.compile()
    model.train()
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01,
                                      fused=True)
        fused = True
    except RuntimeError:  # no fused kernel for this device in this torch
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
        fused = False
    init_s = time.perf_counter() - t0

    def step(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses = torch_common.timed_steps(step, args, config.vocab_size, device)
    torch_common.emit(torch_common.result(
        "pytorch-resident", args, model, times, losses, device, init_s=init_s,
        fused_adamw=fused, autocast="bfloat16", gradient_checkpointing=checkpointed,
        compiled_layers=args.compile), args.out)


if __name__ == "__main__":
    main()
