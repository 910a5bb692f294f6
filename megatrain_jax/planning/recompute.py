"""Recomputed inputs (stream.recompute_inputs) in the planner's counts: which of a placement's
saved inputs exist, how many the backward holds at once, what the recompute fetches again.

The rule is the schedule's (stream/schedule.py: `recomputed_inputs`): of the P plain layers
(before those that keep their attention or their activations), D save no input, and the
K = P - D that do start runs of layers as even as can be, run m at layer m·P // K. Here it is
counted in closed form, so that the planner counts it over arrays of placements at once
(tests/test_recompute_inputs.py checks the two against each other):

    plain_layers(cfg, plan)         # P
    host_saved(cfg, plan)           # saved inputs that wait on the host
    backward_inputs(plan, plain)    # inputs the recompute adds on the GPU at once
    fetched_again(cfg, plan)        # layers whose weights the recompute fetches once more
    fewest(host_bytes, most, room)  # the fewest recomputed inputs with which the host fits

A recomputed input costs one more forward of its layer in the backward (roofline.py) and
saves its bytes: the planner drops the fewest that make the host fit (planner.py).
"""

from __future__ import annotations

import numpy as np

from megatrain_jax.config.schema import Config
from megatrain_jax.planning.bisection import least


def plain_layers(cfg: Config, plan):
    """P: the layers that may recompute their input, those before the layers that keep their
    activations (plan.saving_layers) and, before them, their attention."""
    return np.maximum(0, cfg.model.layers - plan.saving_layers - plan.attention_layers)


def _runs_below(a, plain, saving):
    """How many of the `saving` runs over `plain` layers start below layer a (a <= plain):
    run m starts at m·P // K, below a where m < a·K / P."""
    return np.minimum(saving, -(-a * saving // np.maximum(plain, 1)))


def host_saved(cfg: Config, plan):
    """Saved inputs that wait on the host: those of the first plan.host_inputs layers that
    save theirs (all of them where none is recomputed)."""
    plain, inputs = plain_layers(cfg, plan), cfg.model.layers - plan.saving_layers
    h = np.minimum(plan.host_inputs, inputs)
    below = _runs_below(np.minimum(h, plain), plain, plain - plan.recomputed_inputs)
    return below + np.maximum(0, h - plain)


def longest_run(plan, plain):
    """The most layers a run holds: its saved input's and the recomputed ones after it."""
    return -(-plain // np.maximum(plain - plan.recomputed_inputs, 1))


def backward_inputs(plan, plain, on_host):
    """Inputs on the GPU at once beyond those the forward saved there, while a run's backward
    goes: the run's recomputed inputs, and its saved one where `on_host` ones wait there
    (brought ahead of its turn, for the recompute). 0 where none is recomputed."""
    some = plan.recomputed_inputs > 0
    return some * (longest_run(plan, plain) - 1 + np.minimum(on_host, 1))


def backward_weights(plan, plain, prefetch_depth: int):
    """Layers' weights the recompute of a run holds on the GPU at once (beside the backward's
    own): up to the prefetch depth ahead of the one computing."""
    some = plan.recomputed_inputs > 0
    return some * np.minimum(longest_run(plan, plain) - 1, prefetch_depth + 1)


def fetched_again(cfg: Config, plan):
    """Layers whose weights a recompute fetches: those that run their forward again (each
    run's but its last layer: as many as the recomputed inputs), but the resident ones and
    those that keep the weights their forward fetched (the last plan.weight_layers before
    the saving layers)."""
    plain, d = plain_layers(cfg, plan), plan.recomputed_inputs
    saving = plain - d
    first = cfg.model.layers - plan.saving_layers
    hi = np.maximum(plan.resident_layers, np.minimum(plain, first - plan.weight_layers))
    # Layer l runs again where layer l + 1 saves no input: count those in [lo + 1, hi + 1).
    a = np.clip(plan.resident_layers + 1, 1, plain)
    b = np.clip(hi + 1, a, plain)
    recomputed = (b - a) - (_runs_below(b, plain, saving) - _runs_below(a, plain, saving))
    return (d > 0) * recomputed


def fewest(host_bytes, most, room: int):
    """Element by element, the fewest recomputed inputs in [0, most] (arrays) for which
    host_bytes(d) fits `room` (none where it fits as it is), else the fewest that bring it to
    its least. Each costs a layer's forward in the backward and saves an input's bytes where
    it would have waited."""
    zero = np.zeros_like(most)
    if (host_bytes(zero) <= room).all():
        return zero
    most = np.maximum(most, 0)
    room = np.maximum(room, host_bytes(most))
    return least(lambda d: host_bytes(d) <= room, zero, most)
