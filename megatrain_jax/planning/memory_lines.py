"""What `megatrain-jax plan` says of a step's GPU memory and placement, from planning/memory.py's
arithmetic: the gradients' dtype, the attention path and MLP tile, one layer's working set,
and the placement a resolved config pins, as a table of layers.

    lines = describe(cfg, devices=1)        # cfg resolved: tools/plan.py's `resolved`
"""

from __future__ import annotations

from megatrain_jax.config import auto
from megatrain_jax.config.schema import Config, layer_grad_dtype
from megatrain_jax.planning.memory import GiB, activations, plan_of
from megatrain_jax.planning.recompute import plain_layers
from megatrain_jax.stream.schedule import recomputed_inputs


def describe(cfg: Config, devices: int = 1) -> list[str]:
    """The plan's lines on the gradients' dtype, the activations and the placement of a
    resolved cfg over `devices` GPUs."""
    acts = activations(cfg)
    m, d = cfg.model, cfg.data
    path = acts["attention"]
    if path == "blockwise":
        path += f" in chunks of {acts['attention_chunk']:,} tokens"
    if cfg.model.attention == "auto":
        path += (f" (auto: cuDNN up to {auto.CUDNN_MAX_SEQ:,} tokens with bf16 on a GPU, XLA "
                 f"up to {auto.XLA_MAX_SEQ:,} otherwise, blockwise beyond)")
    tile = acts["mlp_tile"]
    grads = layer_grad_dtype(cfg, devices)
    lines = [
        f"layer gradients to the host in {grads} (stream.grad_dtype={cfg.stream.grad_dtype})",
        f"activations ({d.batch_size // d.micro_batches} x {d.seq_len:,} tokens per "
        f"micro-batch, {m.compute_dtype}):",
        f"  attention             {path}",
        "  MLP                   " + (f"tiles of {tile:,} tokens, recomputed in the backward"
                                       if tile else "untiled"),
        "  per-layer working set (one micro-batch, the layer's backward; the MLP's "
        "activations and the attention's gradients are not held at once):",
    ]
    for name, n in acts["working_set"].items():
        lines.append(f"    {name:22s}{n / GiB:8.2f} GiB")
    lines.append(f"    {'total':22s}{acts['working_set_total'] / GiB:8.2f} GiB")
    return lines


def placement_lines(cfg: Config, pins: Config | None = None) -> list[str]:
    """A resolved cfg's placement as a table of layer ranges: where each range's state lives,
    what its backward takes (recompute from the saved input, or the forward's saved
    activations; the fetched or the kept weights), and where its saved input waits. `pins`:
    the config as given, whose set keys are marked as pinned."""
    plan, layers = plan_of(cfg), cfg.model.layers
    recomputed = recomputed_inputs(int(plain_layers(cfg, plan)), plan.recomputed_inputs)
    rows, start = [], 0
    for i in range(1, layers + 1):
        if i == layers or _layer_row(plan, layers, i, recomputed) != _layer_row(
                plan, layers, start, recomputed):
            first = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            rows.append((f"{first} ({i - start})",
                         *_layer_row(plan, layers, start, recomputed)))
            start = i
    lines = [f"  {'layers':12s}{'state':11s}{'backward':50s}saved input on"]
    lines += [f"  {a:12s}{b:11s}{c:50s}{e}" for a, b, c, e in rows]
    home = "GPU, updated there" if plan.resident_embeddings else "host, streamed"
    lines.append(f"  embedding and head: {home}")
    if pins is not None:
        pinned = [k for k in ("resident_layers", "resident_embeddings", "keep_layers",
                              "keep_attention", "keep_weights", "saved_inputs",
                              "recompute_inputs")
                  if getattr(pins.stream, k) != "auto"]
        if pinned:
            lines.append("  pinned by the config: " + ", ".join(
                f"stream.{k}={getattr(pins.stream, k)}" for k in pinned))
    return lines


def _layer_row(plan, layers: int, i: int, recomputed) -> tuple[str, str, str]:
    """(state, what the backward takes, where the saved input waits) of layer i, where the
    `recomputed` layers save none."""
    resident = i < plan.resident_layers
    saving_from = layers - plan.saving_layers
    state = "resident" if resident else "streamed"
    if i >= saving_from:
        return state, "saved activations (no recompute)", "-"
    recompute = ("recompute, attention kept" if i >= saving_from - plan.attention_layers
                 else "recompute")
    if resident:
        weights = ""
    elif i >= saving_from - plan.weight_layers:
        weights = ", forward's weights kept"
    else:
        weights = ", weights fetched again"
    if i in recomputed:
        return state, recompute + weights, "none: recomputed"
    return state, recompute + weights, "host" if i < plan.host_inputs else "GPU"
