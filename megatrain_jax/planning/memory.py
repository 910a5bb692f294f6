"""GPU memory of a streamed step, without JAX: the bytes each choice of placement holds on
each GPU (the weights and gradients in flight, one layer's working set, resident layers and
embeddings, saved activations and inputs, kept attention and weights), and the host state.

    acts = activations(cfg)                          # choices and bytes at cfg's batch shape
    plan = PlacementPlan(resident_layers=20, weight_layers=3)
    device = device_bytes(cfg, plan, devices=1)      # {component: bytes} on each GPU
    host = host_state_bytes(cfg, plan, devices=1)    # {component: bytes} on the host

Which placement a run takes is the planner's decision (planning/planner.py), made once from
these bytes and the step's bound. Here, beside the planner and below the trainers, so that
both count the same bytes. The attention path and the MLP tile follow config/auto.py, the rules
the model itself runs by.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatrain_jax.config import auto
from megatrain_jax.config.schema import Config, layer_grad_dtype, pinned
from megatrain_jax.planning import recompute
from megatrain_jax.planning.optimizer_state import optimizer_bytes, state_bytes

GiB = 2**30
SAVED_IN_FLIGHT = 2  # host-held inputs on the GPU at once in the backward: in use, and next
# GPU memory a placement leaves free beyond the estimate, which came out up to 2.4 GiB under
# the peak measured on the H200 (7b streamed at a 24 GiB budget; benchmarks/RESULTS.md,
# "Placement") and up to 4 GiB over where layers save their activations.
HEADROOM = 3 * GiB


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """Where a run's state and activations live, layer by layer (planning/planner.py decides).

    Layers in order: the first `resident_layers` keep their weights and optimizer state on
    the GPU and update there; the last `saving_layers` save their activations in the forward
    and recompute none in the backward (stream.keep_layers); the `attention_layers` before
    those keep their attention's output (stream.keep_attention); the `weight_layers`
    streamed layers before those keep the weights their forward fetched
    (stream.keep_weights); the first `host_inputs` layers' saved inputs wait on pinned host,
    the others' on the GPU; `recomputed_inputs` layers before those that keep anything save
    none (stream.recompute_inputs: planning/recompute.py). With `resident_embeddings` the
    embedding and the head live and update on the GPU.
    """

    resident_layers: int = 0
    resident_embeddings: bool = False
    saving_layers: int = 0
    attention_layers: int = 0
    weight_layers: int = 0
    host_inputs: int = 0
    recomputed_inputs: int = 0

    def streamed_saving(self, layers: int) -> int:
        """The saving layers that stream (not resident): their backward fetches no weights."""
        return np.minimum(self.saving_layers, layers - self.resident_layers)

    def unfetched(self, layers: int) -> int:
        """Streamed layers whose backward fetches no weights: saving, or keeping them."""
        return self.weight_layers + self.streamed_saving(layers)


def plan_of(cfg: Config) -> PlacementPlan:
    """The placement a resolved cfg pins (planning/planner.py's `resolve`): every placement key
    a number, or on/off, device/pinned_host. Refuses a cfg the planner has not resolved."""
    s, layers = cfg.stream, cfg.model.layers
    counts = {k: pinned(getattr(s, k)) for k in
              ("resident_layers", "keep_layers", "keep_attention", "keep_weights",
               "recompute_inputs")}
    unresolved = [k for k, v in counts.items() if v is None]
    unresolved += [k for k in ("resident_embeddings", "saved_inputs") if getattr(s, k) == "auto"]
    if unresolved:
        raise ValueError(f"stream.{unresolved[0]}={getattr(s, unresolved[0])} is not resolved: "
                         "plan the placement first (planning/planner.py: resolve)")
    saving = counts["keep_layers"]
    host = {"device": 0, "pinned_host": layers - saving}.get(s.saved_inputs)
    return PlacementPlan(counts["resident_layers"], s.resident_embeddings == "on", saving,
                         counts["keep_attention"], counts["keep_weights"],
                         int(s.saved_inputs) if host is None else host,
                         counts["recompute_inputs"])


def device_bytes(cfg: Config, plan: PlacementPlan, devices: int = 1) -> dict:
    """{component: bytes} on each GPU of a streamed step over `devices` GPUs at its peak,
    under `plan` (whose fields may be arrays: the planner's candidates, one element each).

    Two moments may be the peak: the backward's start, when every saved activation, input
    and kept tensor is held, and its end, when these are gone and the resident layers hold
    their gradients (they update after the backward). So the resident layers' gradients
    count as far as they outgrow what the backward has let go (`resident_gradients`).
    Against the peaks measured on the H200 (7b, 3b, 14b; benchmarks/RESULTS.md,
    "Placement"), this comes out at most about 1.4 GiB under (and up to 4 GiB over with
    saving layers): HEADROOM covers the rest."""
    local, n, m = local_config(cfg, devices), devices, cfg.model
    device = fixed_bytes(cfg, devices, plan)
    on, layer = plan.resident_embeddings, m.params_per_layer
    device["embedding"] = (1 - on) * device["embedding"]  # resident: used where it lives
    state = 4 + optimizer_bytes(cfg)
    held = {
        "kept_layers": plan.saving_layers * saved_by_keeping(local),
        "saved_inputs": inputs_on_gpu(cfg, plan) * saved_per_layer(local),
        "kept_attention": plan.attention_layers * kept_per_layer(local),
        "kept_weights": plan.weight_layers * weights_per_layer(cfg, n),
    }
    # The kept tensors are made all through the forward: the backward's temporaries need one
    # more layer's working set free beside them, in one piece.
    keeping = (plan.attention_layers + plan.weight_layers) > 0
    gradients = plan.resident_layers * resident_grad_bytes(cfg, devices) * layer // n
    device.update({
        "resident_layers": plan.resident_layers * int(state * layer) // n,
        "resident_embeddings": on * resident_embedding_bytes(cfg, n),
        **held,
        "kept_working_set": keeping * device["workspace"],
        "recomputed_inputs": recomputed_bytes(cfg, plan, devices),  # mid-backward: as if
        # at its start, beside everything held there (an upper bound)
        "resident_gradients": _positive(gradients - sum(held.values())),
    })
    return device


def _positive(x):  # max(x, 0), of arrays too
    return x * (x > 0)


def whole(x):
    """Bytes as whole numbers: an int, or an array of them."""
    return x.astype(np.int64) if isinstance(x, np.ndarray) else int(x)


def resident_grad_bytes(cfg: Config, devices: int = 1) -> int:
    """Bytes a parameter of a resident layer's gradient, held from its backward to the
    update: bf16 where the layer's gradients are bf16 values (config/auto.py), else fp32."""
    return 2 if layer_grad_dtype(cfg, devices) == "bfloat16" else 4


def inputs_on_gpu(cfg: Config, plan: PlacementPlan) -> int:
    """Layers' saved inputs on the GPU at the backward's peak: those that wait there, and
    SAVED_IN_FLIGHT of those that wait on the host, coming back."""
    on_host = recompute.host_saved(cfg, plan)
    return inputs_saved(cfg, plan) - on_host + np.minimum(SAVED_IN_FLIGHT, on_host)


def recomputed_bytes(cfg: Config, plan: PlacementPlan, devices: int = 1) -> int:
    """Each GPU's bytes the backward's recompute of inputs adds at once (planning/recompute.py):
    a run's recomputed inputs (and its saved one, brought from the host for it), and the
    weights of the layers it runs again."""
    plain = recompute.plain_layers(cfg, plan)
    inputs = recompute.backward_inputs(plan, plain, recompute.host_saved(cfg, plan))
    weights = recompute.backward_weights(plan, plain, cfg.stream.prefetch_depth)
    return (inputs * saved_per_layer(local_config(cfg, devices))
            + weights * weights_per_layer(cfg, devices))


def fixed_bytes(cfg: Config, devices: int = 1, plan: PlacementPlan | None = None) -> dict:
    """Each GPU's bytes of the streaming itself: weights in flight (the part computing and
    `prefetch_depth` fetched ahead), gradients leaving (two parts'), the fetched embedding,
    and one micro-batch's layer working set. Over a mesh of n a 1/n shard of every part, the
    computing part's weights gathered whole, and its gradient whole until scattered. Under
    `plan` only streamed parts travel: none where every part is resident."""
    m, s, n = cfg.model, cfg.stream, devices
    plan = PlacementPlan() if plan is None else plan
    edge = m.vocab_size * m.hidden * 4
    layers = m.layers - plan.resident_layers  # streamed layers
    edges = 1 - plan.resident_embeddings
    part = np.maximum((layers > 0) * 4 * m.params_per_layer, edges * edge)  # the largest
    parts = layers + 2 * edges
    gathered = part if n > 1 else 0
    return {
        "weights_in_flight": np.minimum(s.prefetch_depth + 1, parts) * part // n + gathered,
        "gradients_in_flight": np.minimum(2, parts) * part // n + gathered,
        "embedding": edge // n,
        "workspace": activations(local_config(cfg, n))["working_set_total"],
    }


def local_config(cfg: Config, devices: int) -> Config:
    """cfg with one GPU's rows of the batch (its 1/n where they split)."""
    rows = cfg.data.batch_size
    if devices == 1 or rows % devices:
        return cfg
    return replaced(cfg, "data", batch_size=rows // devices)


def host_state_bytes(cfg: Config, plan: PlacementPlan, devices: int = 1) -> dict:
    """{component: bytes} of the state pinned on the host under `plan`, for all GPUs: the
    weights, optimizer state and gradients of the parts that live there, and the saved
    inputs that wait there."""
    m = cfg.model
    layers = (m.layers - plan.resident_layers) * m.params_per_layer
    edges = (1 - plan.resident_embeddings) * m.embedding_params
    return {
        "master_weights": 4 * (layers + edges),
        "optimizer_state": state_bytes(cfg, layers, edges),
        "gradients": resident_grad_bytes(cfg, devices) * layers + 4 * edges,
        "saved_inputs": recompute.host_saved(cfg, plan) * saved_per_layer(cfg),
    }


def resident_embedding_bytes(cfg: Config, devices: int = 1) -> int:
    """GPU bytes of the embedding and the head living there (`stream.resident_embeddings`):
    weights, optimizer state and the step's gradients, each GPU its 1/n."""
    return int(resident_bytes_per_param(cfg) * cfg.model.embedding_params) // devices


def resident_bytes_per_param(cfg: Config) -> float:
    """GPU bytes per parameter of the embedding or head whose state lives there: fp32
    weights, the optimizer state, the step's fp32 gradients."""
    return 4 + optimizer_bytes(cfg, "edges") + 4


def weights_per_layer(cfg: Config, devices: int = 1) -> int:
    """Bytes of one layer's fetched fp32 weights on each GPU (its 1/n shard over n GPUs)."""
    return 4 * cfg.model.params_per_layer // devices


def kept_per_layer(cfg: Config) -> int:
    """Bytes a layer keeps for its backward with `stream.keep_attention`: the whole batch's
    attention output [B, S, H, E] in the compute dtype and an fp32 statistic a row and head."""
    m = cfg.model
    return cfg.data.tokens_per_step * m.heads * (m.dh * act_bytes(cfg) + 4)


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


def inputs_saved(cfg: Config, plan: PlacementPlan) -> int:
    """How many layers save their input for the backward's recompute: all but the saving
    layers, which keep their matmuls' outputs, and those that recompute their input."""
    return cfg.model.layers - plan.saving_layers - plan.recomputed_inputs
