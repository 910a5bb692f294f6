"""The roofline of one streamed step, from measured rates (docs/design.md, "The step's bound").

    rates = Rates(h2d_gbps=54.6, d2h_gbps=54.4, layer_forward_s=0.014, layer_backward_s=0.03,
                  head_s=0.02, optimizer_gparams=4.7)
    bound(cfg.model, rates)["step_s"]

Two bounds are given. `ideal_s` is the perfect pipeline (docs/design.md): the largest of total
compute, weight traffic, gradient traffic and optimizer time. `step_s` is the bound of the
exact schedule this engine runs: global-norm clipping needs every gradient before any
update, and the next forward needs each layer's update, so a step is at best

    forward  = max(layers' forward compute, one weight pass H2D,
                   host optimizer slowed by the weight pass beside it,
                   host memory traffic of the update and the weight pass)
  + head     = head forward and backward, embedding backward
  + backward = max(layers' backward compute, one weight pass H2D (but the layers that keep
                   the forward's: stream.keep_weights), gradients D2H,
                   host memory traffic of that weight pass and the gradients,
                   the speculative share of the optimizer slowed by both transfers beside it)

The head term is serial whatever the schedule: the head computes on the last layer's output
with its own updated weights, so it follows the last part's update, and the backward starts
from its gradient; the embedding's backward needs layer 0's. With the update on the device
(`stream.update=device`) the optimizer is serial too: forward + head + backward + optimizer.

The host memory terms count bytes through the host's DRAM: during the forward the host
update reads parameters, gradients and both moments and writes back three of them
(`HOST_UPDATE_BYTES` per parameter) while the weight pass's DMA reads the weights; during the
backward the DMA reads the weights again and writes the gradients. They share one memory, so
however the update and the DMA are scheduled, a phase lasts about its bytes over the host's
bandwidth (a little less where the cache serves some: the weight pass may read a part its
update has just written). Where the host's memory is slow, this term is the step.

The DMA and the update do not share it as one pool, though: the update, alone, draws less
than the memory gives both together, and while a transfer runs it gets less than alone. So
the optimizer's time in a phase is its time alone plus, per transfer beside it, the share of
its rate that transfer takes (`update_loss_h2d`, `update_loss_d2h`: one less the streaming
kernel's own rate beside a copy each way over its rate alone) times the transfer's seconds.

The rates: a preset of the machine (planning/presets.py), or measured (tools/measure.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from megatrain_jax.config import ModelConfig, host_update, layer_grad_dtype
from megatrain_jax.planning import recompute
from megatrain_jax.planning.memory import PlacementPlan, optimizer_bytes, plan_of, saved_per_layer
from megatrain_jax.planning.probe import planned_devices

# Host memory bytes of the in-place AdamW per parameter: p, g, mu, nu read; p, mu, nu written.
HOST_UPDATE_BYTES = 28


@dataclasses.dataclass(frozen=True)
class Rates:
    h2d_gbps: float  # pinned_host -> device
    d2h_gbps: float  # device -> pinned_host
    layer_forward_s: float  # one layer, this step's tokens, weights resident
    layer_backward_s: float  # one layer: recompute + VJP
    head_s: float  # head forward/backward + embedding backward: serial with the passes
    optimizer_gparams: float  # optimizer update rate, G params/s
    overlapped_update: bool = True  # host update overlapping the next forward
    host_memory_gbps: float = 0.0  # the host DRAM's bandwidth; 0: unknown, no such term
    # Seconds of the host update's work lost per second of a transfer beside it, to the device
    # and back: 1 - a streaming kernel's rate beside that copy over its rate alone; 0: none.
    update_loss_h2d: float = 0.0
    update_loss_d2h: float = 0.0
    # One layer's backward from the activations its forward saved (stream.keep_layers: no
    # recompute of its matmuls); 0: unknown, SAVED_SHARE of a forward less than a backward.
    layer_backward_saving_s: float = 0.0
    # The GPU memory's bandwidth, which the resident parts' update streams their state
    # through (RESIDENT_UPDATE_BYTES a parameter); 0: unknown, that update left out.
    device_memory_gbps: float = 0.0
    newton_schulz_s: float = 0.0  # Muon's on the GPU a step, all layers (device_update.py)

    @classmethod
    def from_result(cls, result: dict) -> "Rates":
        """The rates in a dict with more (measure's); fields with defaults may be missing."""
        return cls(**{f.name: result[f.name] for f in dataclasses.fields(cls)
                      if f.name in result or f.default is dataclasses.MISSING})

    def saved_by_saving(self) -> float:
        """Seconds a layer's backward saves by taking the activations its forward saved."""
        if self.layer_backward_saving_s > 0:
            return max(self.layer_backward_s - self.layer_backward_saving_s, 0.0)
        return SAVED_SHARE * self.layer_forward_s


# A layer that saved its activations (stream.keep_layers) still recomputes its attention and
# elementwise work in the backward: it saves about this share of a forward (7b at 16 x 1024
# on the H200: every layer resident, 11,597 tokens/s; with every layer saving, 13,617).
SAVED_SHARE = 0.62
RESIDENT_UPDATE_BYTES = 28  # GPU memory bytes of a resident update: p, g, m, v in; p, m, v out


def _most(*terms):
    """The largest of the terms, element by element (of arrays: placements, shares)."""
    return functools.reduce(np.maximum, terms)


def bound(model: ModelConfig, rates: Rates, bytes_per_param: int = 4,
          resident_layers: int = 0, grad_bytes: float = 4, update_bytes: float | None = None,
          speculate=0.0, kept_layers: int = 0, resident_embeddings: bool = False,
          saving_layers: int = 0, attention_layers: int = 0, attention_s: float = 0.0,
          host_input_bytes: float = 0.0, recomputed_layers=0, fetched_again=0) -> dict:
    """Seconds per component and both bounds, for one step of `model` at the given rates.

    `grad_bytes`: bytes per streamed parameter of the gradients that travel to the host and
    that the update reads there (`gradient_bytes(cfg)`: 2 for bf16 layer gradients).
    `update_bytes`: host memory bytes per parameter of the host update (`update_bytes(cfg)`;
    None: fp32 moments, HOST_UPDATE_BYTES with the gradients at `grad_bytes`).
    `speculate`: the share of the update that runs beside the backward (a step whose speculative
    stand, stream.speculate; True: all of it): that share's time and bytes move from the
    forward to the backward, and the next forward still waits for one part's update after it.
    It may be an array of shares: every term is then an array, one element a share.

    `resident_layers` kept in GPU memory, and with `resident_embeddings` the embedding and
    head, neither travel nor load the host: the link, the host optimizer and the host memory
    carry the other parameters only; their own update runs on the GPU after the backward, at
    its memory's speed (`Rates.device_memory_gbps`). The `kept_layers` (streamed layers that
    keep their forward's weights, or save their activations) take weights their forward kept:
    the backward fetches the rest. The `saving_layers` backward does not recompute their
    matmuls (`Rates.saved_by_saving`), the `attention_layers` do not attend again
    (`attention_s` each). `host_input_bytes` of saved layer inputs wait on pinned host: out
    in the forward, back in the backward. `recomputed_layers` run their forward again in the
    backward (stream.recompute_inputs), `fetched_again` of them fetching their weights.
    """
    p = streamed_params(model, resident_layers, resident_embeddings)
    refetched = 1 - (kept_layers - fetched_again) * model.params_per_layer / np.maximum(p, 1)
    weight_pass = bytes_per_param * p / (rates.h2d_gbps * 1e9)
    inputs_out = host_input_bytes / (rates.d2h_gbps * 1e9)
    inputs_in = host_input_bytes / (rates.h2d_gbps * 1e9)
    gradients = grad_bytes * p / (rates.d2h_gbps * 1e9)
    forward = model.layers * rates.layer_forward_s
    backward = (model.layers * rates.layer_backward_s - saving_layers * rates.saved_by_saving()
                - attention_layers * attention_s + recomputed_layers * rates.layer_forward_s)
    head = rates.head_s
    optimizer = p / (rates.optimizer_gparams * 1e9)
    on_gpu = model.num_params - p
    resident_update = (on_gpu * RESIDENT_UPDATE_BYTES / (rates.device_memory_gbps * 1e9)
                       if rates.device_memory_gbps else 0.0)
    if update_bytes is None:
        update_bytes = HOST_UPDATE_BYTES - (4 - grad_bytes)
    share = np.asarray(speculate, float) * (1.0 if rates.overlapped_update else 0.0)
    host = _host_memory_seconds(p, rates, bytes_per_param, grad_bytes, update_bytes, share,
                                refetched, host_input_bytes)
    h2d_back = refetched * weight_pass + inputs_in
    h2d, host_total = weight_pass + h2d_back, host["forward"] + host["backward"]
    ideal = _most(forward + head + backward, h2d, gradients + inputs_out, optimizer, host_total)
    backward_step = _most(backward, h2d_back, gradients, host["backward"])
    forward_step = _most(forward, weight_pass, inputs_out)
    # The host update beside each phase's transfers, which slow it while they run (none: the
    # update on the device is serial).
    update_forward = update_backward = 0.0 * share
    if rates.overlapped_update:
        update_forward = _beside_transfers((1 - share) * optimizer,
                                           (rates.update_loss_h2d, weight_pass),
                                           (rates.update_loss_d2h, inputs_out))
        update_backward = _beside_transfers(share * optimizer,
                                            (rates.update_loss_h2d, h2d_back),
                                            (rates.update_loss_d2h, gradients))
        last_layer = model.params_per_layer / (rates.optimizer_gparams * 1e9)
        paced = _most(forward_step, update_forward, host["forward"]) + head
        step = np.where(share > 0, paced + _most(backward_step, update_backward) + last_layer,
                        paced + backward_step)
    else:
        step = forward_step + head + backward_step + optimizer
    step = step + resident_update + rates.newton_schulz_s
    terms = {
        "compute_forward_s": forward, "compute_head_s": head, "compute_backward_s": backward,
        "h2d_per_pass_s": weight_pass, "h2d_backward_s": h2d_back, "inputs_to_host_s": inputs_out,
        "d2h_s": gradients, "optimizer_s": optimizer, "resident_update_s": resident_update,
        # The host update's own seconds where it runs beside the GPU's work (not on the device).
        "host_update_s": optimizer * (1.0 if rates.overlapped_update else 0.0),
        "host_memory_forward_s": host["forward"], "host_memory_backward_s": host["backward"],
        "update_forward_s": update_forward, "update_backward_s": update_backward,
        "newton_schulz_s": rates.newton_schulz_s, "ideal_s": ideal, "step_s": step,
    }
    if np.ndim(step):
        return terms
    terms = {name: float(value) for name, value in terms.items()}
    terms["limited_by"] = _limit(forward + head + rates.newton_schulz_s, backward, h2d,
                                 gradients, optimizer, host_total)
    return terms


def _beside_transfers(work_s, *transfers: tuple[float, float]):
    """Seconds of `work_s` of host update run beside transfers (loss, seconds) that start with
    it: while one runs the update loses `loss` of each second, so an update that outlasts them
    takes loss x their seconds more, one that ends first is slowed throughout."""
    transfers = [(loss, seconds) for loss, seconds in transfers if np.any(seconds > 0)]
    lost = sum(loss * seconds for loss, seconds in transfers)
    kept = 1 - sum(loss for loss, _ in transfers)
    slowed = np.minimum(work_s + lost, work_s / kept) if kept > 0 else work_s + lost
    return np.where(work_s > 0, slowed, 0.0)


def streamed_params(model: ModelConfig, resident_layers: int = 0,
                    resident_embeddings: bool = False) -> int:
    """Parameters that live on the host: all but those of the layers kept on the GPU, and of
    the embedding and the head where they are kept there."""
    layers = (model.layers - resident_layers) * model.params_per_layer
    return layers + (1 - resident_embeddings) * model.embedding_params


def host_params(cfg) -> int:
    """`streamed_params` of a resolved cfg's run (every placement key pinned: planner.py)."""
    plan = plan_of(cfg)
    return streamed_params(cfg.model, plan.resident_layers, plan.resident_embeddings)


def bound_for(cfg, rates: Rates, devices: int | None = None) -> dict:
    """`bound` of a resolved cfg's step (its placement: `memory.plan_of`) over `devices` GPUs
    (None: the run's) where its speculative update stands: the parts not started by the
    backward's end follow it, so the step takes the best of `speculate_shares`."""
    devices = planned_devices(cfg) if devices is None else devices
    share = best_speculate_share(cfg, rates, devices)[0]
    return bound_of(cfg, plan_of(cfg), rates, devices, share)


def speculate_shares(cfg) -> np.ndarray:
    """The shares of the update a step that does not clip may run during its backward: SHARES
    up to stream.speculate_share where it speculates (stream.speculate on or auto, the host
    kernel with fp32 moments: a rounded moment cannot be undone), else 0 alone."""
    speculates = (cfg.stream.speculate != "off" and host_update(cfg)
                  and cfg.optim.state_dtype == "float32")
    return SHARES[SHARES <= cfg.stream.speculate_share + 1e-9] if speculates else SHARES[:1]


def best_speculate_share(cfg, rates: Rates, devices: int | None = None) -> tuple[float, float]:
    """(share, bound seconds): the smallest of `speculate_shares` whose bound is the shortest
    (a step whose speculative update stands); 0 where speculating does not pay. The bound is
    flat from where the backward's host memory is full to where the forward's stops binding."""
    devices = planned_devices(cfg) if devices is None else devices
    shares = speculate_shares(cfg)
    seconds = bound_of(cfg, plan_of(cfg), rates, devices, shares)["step_s"]
    k = int(np.flatnonzero(seconds <= seconds.min() * (1 + 1e-9))[0])
    return float(shares[k]), float(seconds[k])


# The shares of the update a step that does not clip may run during the backward.
SHARES = np.linspace(0.0, 1.0, 21)


def bound_of(cfg, placement, rates: Rates, devices: int, share=0.0) -> dict:
    """`bound` of cfg's step under a placement (a PlacementPlan, or the planner's dict of
    arrays, one element a candidate), `share` of the update during the backward."""
    if isinstance(placement, dict):
        placement = PlacementPlan(**{f.name: placement[f.name]
                                     for f in dataclasses.fields(PlacementPlan)})
    p, m = placement, cfg.model
    grad = gradient_bytes_at(cfg, p.resident_layers, p.resident_embeddings, devices)
    return bound(
        m, rates, resident_layers=p.resident_layers, grad_bytes=grad,
        update_bytes=8 + grad + 2 * optimizer_bytes(cfg), speculate=share,
        kept_layers=p.unfetched(m.layers), resident_embeddings=p.resident_embeddings,
        saving_layers=p.saving_layers, attention_layers=p.attention_layers,
        attention_s=rates.layer_forward_s * attention_share(cfg),
        host_input_bytes=recompute.host_saved(cfg, p) * saved_per_layer(cfg),
        recomputed_layers=p.recomputed_inputs, fetched_again=recompute.fetched_again(cfg, p))


def attention_share(cfg) -> float:
    """The share of a layer's forward FLOPs its causal attention takes (QK^T and PV over half
    the scores): what a layer that keeps its attention does not compute again."""
    m, d = cfg.model, cfg.data
    attention = d.seq_len * m.heads * m.dh
    return attention / (attention + m.params_per_layer)


def gradient_bytes(cfg, devices: int | None = None) -> float:
    """Bytes per host-held parameter of a resolved cfg's step's gradients over `devices` GPUs
    (None: the run's, `planned_devices`): layers' in bf16 where the engine sends them so
    (stream.grad_dtype: config/auto.py), the rest fp32."""
    plan = plan_of(cfg)
    devices = planned_devices(cfg) if devices is None else devices
    return float(gradient_bytes_at(cfg, plan.resident_layers, plan.resident_embeddings,
                                   devices))


def gradient_bytes_at(cfg, resident_layers, resident_embeddings, devices: int):
    """`gradient_bytes` with the given resident layers and embeddings (arrays allowed)."""
    m = cfg.model
    streamed = streamed_params(m, resident_layers, resident_embeddings)
    layers = (m.layers - resident_layers) * m.params_per_layer
    layer_bytes = 2 if layer_grad_dtype(cfg, devices) == "bfloat16" else 4
    return (layer_bytes * layers + 4 * (streamed - layers)) / np.maximum(streamed, 1)


def update_bytes(cfg, devices: int | None = None) -> float:
    """Host memory bytes per host-held parameter of the in-place update: the weights read and
    written (8), the gradients read (`gradient_bytes` over `devices`), both moments read and
    written as optim.state_dtype stores them (16 in fp32, 8 in bf16, about 4.06 in int8).
    Vectors keep fp32 moments in every form: a share too small to count."""
    return 8 + gradient_bytes(cfg, devices) + 2 * optimizer_bytes(cfg)


def _host_memory_seconds(params: int, rates: Rates, bytes_per_param: int, grad_bytes: float,
                         update_bytes: float, share, refetched: float = 1.0,
                         input_bytes: float = 0.0) -> dict:
    """Seconds of host DRAM traffic in the forward (the weight pass, the saved inputs going
    out and the overlapped update but its speculated `share`) and in the backward (the
    `refetched` share of the weight pass, the inputs coming back, the gradients and that
    share); 0 where the bandwidth is unknown. A device update is bound by the link, not by
    host memory, so it adds nothing here."""
    if rates.host_memory_gbps <= 0:
        return {"forward": 0.0 * share, "backward": 0.0 * share}
    update = update_bytes if rates.overlapped_update else 0
    per_byte = params / (rates.host_memory_gbps * 1e9)
    inputs = input_bytes / (rates.host_memory_gbps * 1e9)
    return {"forward": (bytes_per_param + (1 - share) * update) * per_byte + inputs,
            "backward": (refetched * bytes_per_param + grad_bytes + share * update) * per_byte
            + inputs}


def _limit(forward, backward, h2d, gradients, optimizer, host_memory) -> str:
    costs = {"compute": forward + backward, "h2d": h2d, "d2h": gradients,
             "optimizer": optimizer, "host_memory": host_memory}  # the largest names the limit
    return max(costs, key=costs.get)


def compute_bound_tokens(model: ModelConfig, rates: Rates, tokens: int,
                         resident_layers: int = 0, resident_embeddings: bool = False,
                         kept_layers: int = 0, saving_layers: int = 0) -> int:
    """Tokens per step from which this engine's schedule is bound by compute alone.

    Layer compute grows linearly with tokens; transfers and the optimizer do not. The step is
    compute-bound once the forward outlasts the weight stream (and the host update that paces
    it) and the backward outlasts its own weight fetches (none for the `kept_layers`, which
    take the weights their forward fetched) and the gradients' return. `rates` were measured
    at `tokens` per step.
    """
    b = bound(model, rates, resident_layers=resident_layers,
              resident_embeddings=resident_embeddings, kept_layers=kept_layers,
              saving_layers=saving_layers)
    forward_per_token = b["compute_forward_s"] / tokens
    backward_per_token = b["compute_backward_s"] / tokens
    # The host update that paces the forward, slowed by the weight stream beside it (0 for an
    # update on the device, which does not overlap the forward).
    paced = max(b["h2d_per_pass_s"], b["host_memory_forward_s"], b["update_forward_s"])
    if forward_per_token <= 0 or backward_per_token <= 0:
        return 0
    backward_paced = max(b["h2d_backward_s"], b["d2h_s"], b["host_memory_backward_s"])
    return math.ceil(max(paced / forward_per_token, backward_paced / backward_per_token))
