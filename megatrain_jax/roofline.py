"""The roofline of one streamed step, from measured rates (DESIGN.md, "Roofline of one step").

    rates = Rates(h2d_gbps=54.6, d2h_gbps=54.4, layer_forward_s=0.014, layer_backward_s=0.03,
                  head_s=0.02, optimizer_gparams=4.7)
    bound(cfg.model, rates)["step_s"]

Two bounds are given. `ideal_s` is the perfect pipeline of DESIGN.md: the largest of total
compute, weight traffic, gradient traffic and optimizer time. `step_s` is the bound of the
exact schedule this engine runs: global-norm clipping needs every gradient before any
update, and the next forward needs each layer's update, so a step is at best

    forward  = max(forward compute, one weight pass H2D, host optimizer)   (paced by updates)
  + backward = max(backward compute, one weight pass H2D, gradients D2H)

With the update on the device (`stream.update=device`) the optimizer is serial instead:
forward + backward + optimizer.
"""

from __future__ import annotations

import dataclasses

from megatrain_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Rates:
    h2d_gbps: float  # pinned_host -> device
    d2h_gbps: float  # device -> pinned_host
    layer_forward_s: float  # one layer, this step's tokens, weights resident
    layer_backward_s: float  # one layer: recompute + VJP
    head_s: float  # embed forward + head forward/backward + embed backward
    optimizer_gparams: float  # optimizer update rate, G params/s
    overlapped_update: bool = True  # host update overlapping the next forward


def bound(model: ModelConfig, rates: Rates, bytes_per_param: int = 4) -> dict:
    """Seconds per component and both bounds, for one step of `model` at the given rates."""
    p = model.num_params
    weight_pass = bytes_per_param * p / (rates.h2d_gbps * 1e9)
    gradients = bytes_per_param * p / (rates.d2h_gbps * 1e9)
    forward = model.layers * rates.layer_forward_s + rates.head_s
    backward = model.layers * rates.layer_backward_s
    optimizer = p / (rates.optimizer_gparams * 1e9)
    ideal = max(forward + backward, 2 * weight_pass, gradients, optimizer)
    if rates.overlapped_update:
        step = max(forward, weight_pass, optimizer) + max(backward, weight_pass, gradients)
    else:
        step = max(forward, weight_pass) + max(backward, weight_pass, gradients) + optimizer
    return {
        "compute_forward_s": forward, "compute_backward_s": backward,
        "h2d_per_pass_s": weight_pass, "d2h_s": gradients, "optimizer_s": optimizer,
        "ideal_s": ideal, "step_s": step,
        "limited_by": _limit(forward, backward, weight_pass, gradients, optimizer),
    }


def _limit(forward, backward, weight_pass, gradients, optimizer) -> str:
    costs = {"compute": forward + backward, "h2d": 2 * weight_pass, "d2h": gradients,
             "optimizer": optimizer}
    return max(costs, key=costs.get)


def compute_bound_tokens(model: ModelConfig, rates: Rates, tokens: int) -> int:
    """Tokens per step at which compute reaches the largest transfer/optimizer cost.

    Layer compute grows linearly with tokens; transfers and the optimizer do not. `rates`
    were measured at `tokens` per step.
    """
    b = bound(model, rates)
    per_token = (b["compute_forward_s"] + b["compute_backward_s"]) / tokens
    other = max(2 * b["h2d_per_pass_s"], b["d2h_s"], b["optimizer_s"])
    return int(other / per_token) if per_token > 0 else 0
