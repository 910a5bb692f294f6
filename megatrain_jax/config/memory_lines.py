"""What `megatrain-jax plan` says of a step's GPU memory, from config/memory.py's arithmetic:
the gradients' dtype, the attention path and MLP tile, the saved inputs and their split, the
kept attention and weights, the embeddings' home, and one layer's working set.

    lines = describe(cfg, gpu=141 * 2**30, devices=1)
"""

from __future__ import annotations

from typing import Callable

from megatrain_jax.config import auto
from megatrain_jax.config.memory import (
    GiB,
    activations,
    embeddings_resident,
    inputs_saved,
    keep_attention_layers,
    keep_weights_layers,
    kept_per_layer,
    replaced,
    resident_embedding_bytes,
    saved_on_host,
    weights_per_layer,
)
from megatrain_jax.config.schema import Config, layer_grad_dtype


def describe(cfg: Config, gpu: int | None, devices: int = 1) -> list[str]:
    """The plan's lines on the gradients' dtype and the activations; `gpu`: the bytes XLA may
    use on each GPU, if known."""
    acts = activations(cfg)
    m, d = cfg.model, cfg.data
    path = acts["attention"]
    if path == "blockwise":
        path += f" in chunks of {acts['attention_chunk']:,} tokens"
    if cfg.model.attention == "auto":
        path += (f" (auto: cuDNN up to {auto.CUDNN_MAX_SEQ:,} tokens with bf16 on a GPU, XLA "
                 f"up to {auto.XLA_MAX_SEQ:,} otherwise, blockwise beyond)")
    tile = acts["mlp_tile"]
    per, layers = acts["saved_per_layer"], inputs_saved(cfg)
    grads = layer_grad_dtype(cfg, devices)
    lines = [
        f"layer gradients to the host in {grads} (stream.grad_dtype={cfg.stream.grad_dtype})",
        f"activations ({d.batch_size // d.micro_batches} x {d.seq_len:,} tokens per "
        f"micro-batch, {m.compute_dtype}):",
        f"  attention             {path}",
        "  MLP                   " + (f"tiles of {tile:,} tokens, recomputed in the backward"
                                       if tile else "untiled"),
        f"  saved layer inputs    {per / GiB:.2f} GiB per layer, {layers * per / GiB:.2f} GiB "
        f"for {layers} layers (stream.saved_inputs={cfg.stream.saved_inputs})",
    ]
    if gpu is not None:
        on_host = saved_on_host(replaced(cfg, "stream", saved_inputs="auto"), gpu, devices)
        on_gpu = layers - on_host
        now = " (stream.saved_inputs=auto)" if cfg.stream.saved_inputs == "auto" else \
            ", as stream.saved_inputs=auto places them"
        lines.append(f"  split by GPU room     {on_gpu} layers' inputs on the GPU "
                     f"({on_gpu * per / GiB:.2f} GiB), {on_host} on pinned host "
                     f"({on_host * per / GiB:.2f} GiB){now}")
    lines.append(_kept_line(cfg, gpu, "attention", kept_per_layer(cfg),
                            lambda: keep_attention_layers(cfg, gpu, devices),
                            "the last {n} layers keep it ({gib:.2f} GiB), their backward does "
                            "not attend again"))
    lines.append(_embeddings_line(cfg, gpu, devices))
    lines.append(_kept_line(cfg, gpu, "weights", weights_per_layer(cfg, devices),
                            lambda: keep_weights_layers(cfg, gpu, devices),
                            "{n} layers keep them ({gib:.2f} GiB), their backward fetches none"))
    lines.append("  per-layer working set (one micro-batch, the layer's backward; the MLP's "
                 "activations and the attention's gradients are not held at once):")
    for name, n in acts["working_set"].items():
        lines.append(f"    {name:22s}{n / GiB:8.2f} GiB")
    lines.append(f"    {'total':22s}{acts['working_set_total'] / GiB:8.2f} GiB")
    return lines


def _kept_line(cfg: Config, gpu: int | None, what: str, per: int, layers: Callable[[], int],
               keeping: str) -> str:
    """`describe`'s line on stream.keep_<what>: bytes per layer, and how many layers keep it
    (`keeping` said of them), or that `auto` finds them at the start where the GPU is unknown."""
    setting = getattr(cfg.stream, f"keep_{what}")
    line = f"  {'kept ' + what:22s}{per / GiB:.2f} GiB per layer (stream.keep_{what}={setting})"
    if setting == "auto" and gpu is None:
        return line + ": as many layers as the GPU's room holds, found at the start"
    n = layers()
    return line + (": " + keeping.format(n=n, gib=n * per / GiB) if n else ": none")


def _embeddings_line(cfg: Config, gpu: int | None, devices: int) -> str:
    """`describe`'s line on stream.resident_embeddings."""
    setting = cfg.stream.resident_embeddings
    line = (f"  {'embedding and head':22s}{resident_embedding_bytes(cfg, devices) / GiB:.2f} "
            f"GiB on the GPU with their state (stream.resident_embeddings={setting})")
    if setting == "auto" and gpu is None:
        return line + ": where the GPU's room holds them, found at the start"
    if embeddings_resident(cfg, gpu, devices):
        return line + ": there, updated there; the host holds the layers only"
    return line + ": no, streamed and updated on the host"
