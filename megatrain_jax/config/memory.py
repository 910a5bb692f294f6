"""GPU memory of a streamed step, without JAX: the weights and gradients in flight, the saved
layer inputs, one layer's working set, how the inputs split between GPU and host when GPU
memory runs short (`stream.saved_inputs=auto`), how many layers keep their attention's
output for the backward in the room left (`stream.keep_attention=auto`), whether the
embedding and the head live on the GPU in the room left after that
(`stream.resident_embeddings=auto`), and how many layers keep the weights their forward
fetched, in the room left last (`stream.keep_weights=auto`).

    acts = activations(cfg)                 # choices and bytes at cfg's batch and sequence
    device, host_saved = step_bytes(cfg, devices=1, gpu=141 * GiB)
    host_layers = saved_on_host(cfg, gpu, devices=1)   # what the trainer places for auto
    keeping = keep_attention_layers(cfg, gpu, devices=1)  # the last layers that keep it
    on_gpu = embeddings_resident(cfg, gpu, devices=1)     # the embedding and head's home
    weights = keep_weights_layers(cfg, gpu, devices=1)    # layers whose weights stay fetched
    cfg = resolved(cfg, gpu, devices=1)     # auto settled as the trainer settles it

Here, below the trainers, so that the trainer resolves `auto` by the same arithmetic as the
planner (tools/plan.py, which adds the host's side). The attention path and the MLP tile
follow config/auto.py, the rules the model itself runs by.
"""

from __future__ import annotations

import dataclasses

from megatrain_jax.config import auto
from megatrain_jax.config.schema import MOMENT_BLOCK, Config, layers_fetched_twice

GiB = 2**30
# Host-held layer inputs on the GPU at once in the backward: the one in use and the next.
SAVED_IN_FLIGHT = 2
# GPU memory `auto` leaves free beyond the estimate: the estimate has come out up to 1.4 GiB
# under the measured peak (7b at 1 x 32768 on the H200).
SPLIT_HEADROOM = 2 * GiB
OPT_STATE_FLOATS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1}


def optimizer_bytes(cfg: Config) -> float:
    """Bytes of optimizer state per parameter: fp32 moments, or Adam's in
    optim.state_dtype (optim/compact.py; vectors keep fp32, a negligible share)."""
    if cfg.optim.state_dtype == "bfloat16":
        return 4.0
    if cfg.optim.state_dtype == "int8":
        return 2 * (1 + 4 / MOMENT_BLOCK)  # a byte per value, an fp32 scale per block
    return 4.0 * OPT_STATE_FLOATS[cfg.optim.name]


def step_bytes(cfg: Config, devices: int, gpu: int | None) -> tuple[dict, int]:
    """({component: bytes} on each GPU of a streamed step over `devices` GPUs, bytes of saved
    inputs on the host for all of them). `gpu`: the bytes each GPU has, which
    `stream.saved_inputs=auto` splits the inputs by (None: unknown, all on the GPU)."""
    local, device, room = _without_inputs(cfg, devices, gpu)
    device["saved_inputs"], on_host = saved_bytes(local, room)
    left = None if room is None else room - device["saved_inputs"]
    device["kept_attention"] = _keeping(local, devices, left) * kept_per_layer(local)
    left = None if left is None else left - device["kept_attention"]
    device["resident_embeddings"] = 0
    if _resident_embeddings(local, devices, left, device["embedding"]):
        # Used where they live: the fetched copy of the embedding goes.
        device["resident_embeddings"] = resident_embedding_bytes(local, devices)
        left = None if left is None else left + device["embedding"] - device[
            "resident_embeddings"]
        device["embedding"] = 0
    device["kept_weights"] = (_keeping_weights(local, devices, left)
                              * weights_per_layer(local, devices))
    return device, on_host * devices  # every GPU's share, in the one host


def resident_embedding_bytes(cfg: Config, devices: int = 1) -> int:
    """GPU bytes of the embedding and the head living there (`stream.resident_embeddings`):
    weights, optimizer state and the step's gradients, each GPU its 1/n."""
    return int(resident_bytes_per_param(cfg) * cfg.model.embedding_params) // devices


def resident_bytes_per_param(cfg: Config) -> float:
    """GPU bytes per parameter of a part whose state lives there: fp32 weights, the optimizer
    state, the step's fp32 gradients."""
    return 4 + optimizer_bytes(cfg) + 4


def _resident_embeddings(local: Config, devices: int, room: int | None, fetched: int) -> bool:
    setting = local.stream.resident_embeddings
    if setting != "auto":
        return setting == "on"
    # The working set the kept attention and weights leave free stays free beside them too.
    if room is None:
        return False
    return room + fetched - activations(local)["working_set_total"] >= resident_embedding_bytes(
        local, devices)


def embeddings_resident(cfg: Config, gpu: int | None, devices: int = 1) -> bool:
    """Whether the embedding and the head, with their optimizer state, live on the GPU under
    `stream.resident_embeddings`: `on`, `off`, or `auto` where the GPU's room left after the
    saved inputs and the kept attention holds them (not where the room is unknown)."""
    return step_bytes(cfg, devices, gpu)[0]["resident_embeddings"] > 0


def resolved(cfg: Config, gpu: int | None, devices: int = 1) -> Config:
    """cfg with `stream.resident_embeddings` settled to on or off, as the trainer settles it
    on GPUs of `gpu` bytes (the host's share of the state and its traffic follow it)."""
    return with_resident_embeddings(cfg, embeddings_resident(cfg, gpu, devices))


def with_resident_embeddings(cfg: Config, on: bool) -> Config:
    """cfg with `stream.resident_embeddings` set to on or off."""
    return replaced(cfg, "stream", resident_embeddings="on" if on else "off")


def keep_weights_layers(cfg: Config, gpu: int | None, devices: int = 1) -> int:
    """How many streamed layers, the last ones before the saving layers, keep on the GPU the
    weights their forward fetched for their backward, which then fetches none, under
    `stream.keep_weights`: `on` every such layer, `off` none, a number that many, `auto` as
    many as the GPU room left after the saved inputs and the kept attention holds, less one
    more layer's working set (none where the room is unknown)."""
    device, _ = step_bytes(cfg, devices, gpu)
    return device["kept_weights"] // weights_per_layer(cfg, devices)


def unfetched_layers(cfg: Config, gpu: int | None, devices: int = 1) -> int:
    """The layers whose backward fetches no weights, taking those its forward kept: the
    saving layers (stream.keep_layers) and those that keep their weights (keep_weights)."""
    return keep_weights_layers(cfg, gpu, devices) + cfg.stream.keep_layers


def weights_per_layer(cfg: Config, devices: int = 1) -> int:
    """Bytes of one layer's fetched fp32 weights on each GPU (its 1/n shard over n GPUs)."""
    return 4 * cfg.model.params_per_layer // devices


def _keeping_weights(local: Config, devices: int, room: int | None) -> int:
    s, layers = local.stream, layers_fetched_twice(local)
    if s.keep_weights.isdigit():  # a number of layers (validate keeps it within them)
        return min(layers, int(s.keep_weights))
    if s.keep_weights != "auto":
        return layers if s.keep_weights == "on" else 0
    if room is None:
        return 0
    # The kept weights are fetched all through the forward, as the kept attention is made:
    # the backward's temporaries need one more layer's working set free beside them.
    room -= activations(local)["working_set_total"]
    return max(0, min(layers, room // weights_per_layer(local, devices)))


def keep_attention_layers(cfg: Config, gpu: int | None, devices: int = 1) -> int:
    """How many layers, the last ones before the saving layers (`stream.keep_layers`, which
    keep more), keep their attention's output and statistics for the backward under
    `stream.keep_attention`: `on` every such layer, `off` none, `auto` as many as the GPU room
    left after the saved inputs holds, less one more layer's working set (none where that
    room is unknown, for rows shorter than auto.KEEP_ATTENTION_FROM, where the attention
    cannot keep them, or over several GPUs)."""
    local, device, room = _without_inputs(cfg, devices, gpu)
    if room is not None:
        room -= saved_bytes(local, room)[0]
    return _keeping(local, devices, room)


def _keeping(local: Config, devices: int, room: int | None) -> int:
    s = local.stream.keep_attention
    layers = max(0, local.model.layers - local.stream.keep_layers)  # saving layers keep more
    if s != "auto":
        return layers if s == "on" else 0
    acts = activations(local)
    if (room is None or devices > 1 or local.data.seq_len < auto.KEEP_ATTENTION_FROM
            or acts["attention"] not in auto.KEEPS_ATTENTION):
        return 0
    # Beside the kept tensors, one more layer's working set stays free: the backward's
    # temporaries are one allocation, which the kept tensors, made all through the forward,
    # can leave no room for in one piece (7b at 1 x 131072 on an 80 GB H100: 14 layers kept
    # by the room alone ran out of memory in the backward, asking for 19.5 GiB).
    room -= acts["working_set_total"]
    return max(0, min(layers, room // kept_per_layer(local)))


def kept_per_layer(cfg: Config) -> int:
    """Bytes a layer keeps for its backward with `stream.keep_attention`: the whole batch's
    attention output [B, S, H, E] in the compute dtype and an fp32 statistic a row and head."""
    m = cfg.model
    return cfg.data.tokens_per_step * m.heads * (m.dh * act_bytes(cfg) + 4)


def saved_on_host(cfg: Config, gpu: int | None, devices: int = 1) -> int:
    """How many layers' inputs `stream.saved_inputs` puts on pinned host (the first ones) on
    GPUs of `gpu` bytes each: `auto` keeps as many on the GPU as its room allows."""
    s = cfg.stream.saved_inputs
    if s != "auto":
        return inputs_saved(cfg) if cfg.stream.saved_inputs == "pinned_host" else 0
    local, _, room = _without_inputs(cfg, devices, gpu)
    return saved_split(local, room)[1]


def _without_inputs(cfg: Config, n: int, gpu: int | None) -> tuple[Config, dict, int | None]:
    """(cfg with one GPU's rows of the batch, each GPU's bytes but the saved inputs, the room
    left for those: `gpu` less the rest and SPLIT_HEADROOM, None if `gpu` is)."""
    m, s = cfg.model, cfg.stream
    layer = m.params_per_layer
    # Per GPU of a mesh of n: a 1/n shard of every part and of the rows of the batch; the
    # computing part's weights gathered whole, and its gradient whole until scattered.
    rows = cfg.data.batch_size // n if cfg.data.batch_size % n == 0 else cfg.data.batch_size
    local = replaced(cfg, "data", batch_size=rows)
    edge = m.vocab_size * m.hidden * 4
    part = 4 * max(layer, edge)
    state = resident_bytes_per_param(cfg)
    device = {
        # Weights in flight (current + prefetched), gradients leaving, the embedding kept for
        # the step, saved inputs, and one micro-batch's layer workspace.
        "weights_in_flight": (s.prefetch_depth + 1) * part // n + (part if n > 1 else 0),
        "gradients_in_flight": 2 * part // n + (part if n > 1 else 0),
        "embedding": edge // n,
        "saved_inputs": 0,
        "workspace": activations(local)["working_set_total"],
        "resident_layers": int(state * s.resident_layers * layer) // n,
        "kept_layers": s.keep_layers * saved_by_keeping(local),
    }
    room = None if gpu is None else gpu - sum(device.values()) - SPLIT_HEADROOM
    return local, device, room


def replaced(cfg: Config, section: str, **values) -> Config:
    """cfg with some values of one section replaced: replaced(cfg, "data", seq_len=4096)."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                    **values)})


def act_bytes(cfg: Config) -> int:
    return 2 if cfg.model.compute_dtype == "bfloat16" else 4


def saved_by_keeping(cfg: Config) -> int:
    """Bytes one layer of `stream.keep_layers` keeps on the GPU from its forward to its
    backward (programs.SAVED_BY_SAVING_LAYERS): its weights (in bf16 where `saves_cast_weights`,
    else fp32) and, in the compute dtype, the whole batch's input and those outputs of its
    matmuls with the weights that the backward reads (q, k, v, the attention's projection,
    the MLP's gate and up)."""
    m = cfg.model
    per_token = 2 * m.hidden + (m.heads + 2 * m.kv_heads) * m.dh + 2 * m.ffn
    weights = act_bytes(cfg) if saves_cast_weights(cfg) else 4
    return cfg.data.tokens_per_step * per_token * act_bytes(cfg) + weights * m.params_per_layer


def saves_cast_weights(cfg: Config) -> bool:
    """Whether a saving layer may keep its weights as the layer casts them (Templates'
    saving_dtype): with bf16 compute the Llama layer casts every weight before use, and, its
    MLP untiled, uses each once, so no loop in the layer sums a weight's gradient in bf16."""
    tokens = cfg.data.tokens_per_step // cfg.data.micro_batches
    return (cfg.model.compute_dtype == "bfloat16"
            and not auto.mlp_tile(cfg.stream.mlp_tile, tokens))


def inputs_saved(cfg: Config) -> int:
    """How many layers save their input for the backward's recompute: all but the last
    `stream.keep_layers`, which keep their matmuls' outputs instead."""
    return cfg.model.layers - cfg.stream.keep_layers


def saved_per_layer(cfg: Config) -> int:
    """Bytes of one layer's saved input: the whole batch's [B, S, D] in the compute dtype."""
    return cfg.data.tokens_per_step * cfg.model.hidden * act_bytes(cfg)


def activations(cfg: Config) -> dict:
    """The attention path, MLP tile and bytes of one layer's backward for one micro-batch.

    The backward recomputes the layer and holds its activations with their gradients. Per
    token: the input, norm, q, k, v and attention output (2D + (H+2K)E + HE in the compute
    dtype); the MLP's 3F, over one tile only when tiled; the gradients of q, k, v and the
    attention output ((H+2K)E + HE), which the attention's backward holds after the MLP's
    backward has let its activations go, so only the larger of those two counts; the
    attention's scores by path; the layer's weights in the compute dtype with their fp32
    gradient and its accumulator; one loss chunk's logits. Against the H200's peaks of 7b
    width (bf16, cuDNN, saved inputs on the GPU; plan.py's total): 16x1024 planned 18.1 GiB,
    measured 17.7; 1x32768 23.9 / 25.3; 1x131072 58.5 / 59.3; 2 layers at 1x524288 (tiled
    MLP, where the attention's gradients are the larger) 60.5 / 59.8.
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
        "attention_gradients": tokens * a * ((h + 2 * m.kv_heads) * e + h * e),
        "layer_weights": (a + 8) * m.params_per_layer,
        "loss_chunk": min(s.loss_chunk, tokens) * m.vocab_size * 4 * 2,
    }
    apart = min(working["mlp_activations"], working["attention_gradients"])  # not at once
    return {"attention": path, "attention_chunk": chunk if path == "blockwise" else 0,
            "mlp_tile": tile, "micro_batch_tokens": tokens, "saved_per_layer": saved_per_layer(cfg),
            "working_set": working, "working_set_total": sum(working.values()) - apart}


def saved_split(cfg: Config, room: int | None) -> tuple[int, int]:
    """(layers whose inputs stay on the GPU, layers whose inputs wait on pinned host), given
    `room` bytes of GPU memory left for saved inputs (None: unknown, all on the GPU).

    As many on the GPU as fit; when some go to the host, room is kept for SAVED_IN_FLIGHT of
    them coming back for the backward.
    """
    layers, per = inputs_saved(cfg), saved_per_layer(cfg)
    if room is None or layers * per <= room:
        return layers, 0
    on_gpu = max(0, min(layers, (room - SAVED_IN_FLIGHT * per) // per))
    return on_gpu, layers - on_gpu


def saved_bytes(cfg: Config, room: int | None = None) -> tuple[int, int]:
    """(GPU bytes, host bytes) of saved inputs under cfg's `stream.saved_inputs`; `auto`
    splits by `room` bytes left for them (see saved_split)."""
    layers, per = inputs_saved(cfg), saved_per_layer(cfg)
    if cfg.stream.saved_inputs == "device":
        return layers * per, 0
    if cfg.stream.saved_inputs == "pinned_host":
        return min(SAVED_IN_FLIGHT, layers) * per, layers * per
    on_gpu, on_host = saved_split(cfg, room)
    return (on_gpu + (min(SAVED_IN_FLIGHT, on_host) if on_host else 0)) * per, on_host * per
