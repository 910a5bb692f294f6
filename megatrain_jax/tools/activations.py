"""Activation memory of a step, without JAX: the saved layer inputs, one layer's working set,
and how the inputs split between GPU and host when GPU memory runs short.

    acts = activations(cfg)           # choices and bytes at cfg's batch and sequence
    on_gpu, on_host = saved_split(cfg, room)
    lines = describe(cfg, room)       # what `megatrain-jax plan` prints

The attention path and the MLP tile follow config/auto.py, the rules the model itself runs
by. The planner (plan.py) adds these to the weights and state it counts.
"""

from __future__ import annotations

from megatrain_jax.config import Config, auto

GiB = 2**30
# Host-held layer inputs on the GPU at once in the backward: the one in use and the next.
SAVED_IN_FLIGHT = 2


def act_bytes(cfg: Config) -> int:
    return 2 if cfg.model.compute_dtype == "bfloat16" else 4


def saved_per_layer(cfg: Config) -> int:
    """Bytes of one layer's saved input: the whole batch's [B, S, D] in the compute dtype."""
    return cfg.data.tokens_per_step * cfg.model.hidden * act_bytes(cfg)


def activations(cfg: Config) -> dict:
    """The attention path, MLP tile and bytes of one layer's backward for one micro-batch.

    The backward recomputes the layer and holds its activations with their gradients. Per
    token: the input, norm, q, k, v and attention output (2D + (H+2K)E + HE in the compute
    dtype) and the MLP's 3F, the MLP's over one tile only when tiled; the attention's scores
    by path; the layer's weights in the compute dtype with their fp32 gradient and its
    accumulator; one loss chunk's logits. Against the H200's peaks of 7b (bf16, cuDNN, saved
    inputs on the GPU; plan.py's total): 16x1024 planned 18.1 GiB, measured 17.7;
    1x32768 23.9 / 25.3; 1x131072 58.5 / 59.3.
    """
    m, d, s = cfg.model, cfg.data, cfg.stream
    a = act_bytes(cfg)
    rows, seq = d.batch_size // d.micro_batches, d.seq_len
    tokens = rows * seq
    path = auto.attention_path(m.attention, seq, on_gpu=True, dtype_bytes=a)
    chunk = auto.attention_chunk(s.attention_chunk, seq)
    tile = auto.mlp_tile(s.mlp_tile, tokens)
    h, e = m.heads, m.dh
    if path == "xla":  # fp32 scores and their gradient, probabilities in the compute dtype
        scores = rows * h * seq * seq * (8 + a)
    elif path == "cudnn":  # softmax statistics only
        scores = rows * h * seq * 4 * 2
    else:  # one block's scores, probabilities and gradients; fp32 row stats and accumulators
        scores = rows * h * (chunk * chunk * 4 * 4 + seq * 4 * 2 + chunk * e * 4 * 3)
    working = {
        "attention_activations": tokens * a * (2 * m.hidden + (h + 2 * m.kv_heads) * e + h * e),
        "attention_scores": scores,
        "mlp_activations": (tile or tokens) * a * 3 * m.ffn,
        "layer_weights": (a + 8) * m.params_per_layer,
        "loss_chunk": min(s.loss_chunk, tokens) * m.vocab_size * 4 * 2,
    }
    return {"attention": path, "attention_chunk": chunk if path == "blockwise" else 0,
            "mlp_tile": tile, "micro_batch_tokens": tokens, "saved_per_layer": saved_per_layer(cfg),
            "working_set": working, "working_set_total": sum(working.values())}


def saved_split(cfg: Config, room: int | None) -> tuple[int, int]:
    """(layers whose inputs stay on the GPU, layers whose inputs wait on pinned host), given
    `room` bytes of GPU memory left for saved inputs (None: unknown, all on the GPU).

    As many on the GPU as fit; when some go to the host, room is kept for SAVED_IN_FLIGHT of
    them coming back for the backward.
    """
    layers, per = cfg.model.layers, saved_per_layer(cfg)
    if room is None or layers * per <= room:
        return layers, 0
    on_gpu = max(0, min(layers, (room - SAVED_IN_FLIGHT * per) // per))
    return on_gpu, layers - on_gpu


def saved_bytes(cfg: Config, room: int | None = None) -> tuple[int, int]:
    """(GPU bytes, host bytes) of saved inputs under cfg's `stream.saved_inputs`; `auto`
    splits by `room` (see saved_split)."""
    layers, per = cfg.model.layers, saved_per_layer(cfg)
    if cfg.stream.saved_inputs == "device":
        return layers * per, 0
    if cfg.stream.saved_inputs == "pinned_host":
        return min(SAVED_IN_FLIGHT, layers) * per, layers * per
    on_gpu, on_host = saved_split(cfg, room)
    return (on_gpu + (min(SAVED_IN_FLIGHT, on_host) if on_host else 0)) * per, on_host * per


def describe(cfg: Config, room: int | None) -> list[str]:
    """The plan's activation lines; `room`: GPU bytes left for saved inputs, if known."""
    acts = activations(cfg)
    m, d = cfg.model, cfg.data
    path = acts["attention"]
    if path == "blockwise":
        path += f" in chunks of {acts['attention_chunk']:,} tokens"
    if cfg.model.attention == "auto":
        path += (f" (auto: cuDNN up to {auto.CUDNN_MAX_SEQ:,} tokens with bf16 on a GPU, XLA "
                 f"up to {auto.XLA_MAX_SEQ:,} otherwise, blockwise beyond)")
    tile = acts["mlp_tile"]
    per, layers = acts["saved_per_layer"], m.layers
    lines = [
        f"activations ({d.batch_size // d.micro_batches} x {d.seq_len:,} tokens per "
        f"micro-batch, {m.compute_dtype}):",
        f"  attention             {path}",
        "  MLP                   " + (f"tiles of {tile:,} tokens, recomputed in the backward"
                                       if tile else "untiled"),
        f"  saved layer inputs    {per / GiB:.2f} GiB per layer, {layers * per / GiB:.2f} GiB "
        f"for {layers} layers (stream.saved_inputs={cfg.stream.saved_inputs})",
    ]
    if room is not None:
        on_gpu, on_host = saved_split(cfg, room)
        lines.append(f"  split by GPU room     {on_gpu} layers' inputs on the GPU "
                     f"({on_gpu * per / GiB:.2f} GiB), {on_host} on pinned host "
                     f"({on_host * per / GiB:.2f} GiB), as stream.saved_inputs=auto is to "
                     "place them")
    lines.append("  per-layer working set (one micro-batch, the layer's backward):")
    for name, n in acts["working_set"].items():
        lines.append(f"    {name:22s}{n / GiB:8.2f} GiB")
    return lines
