"""The rates of one streamed step, measured on the device (planning/roofline.py's inputs): the
link both ways on pinned copies of the model's own layers, a layer's forward and backward,
the head, the host optimizer, and the host memory's bandwidth beside a weight transfer.

    rates = measure_rates(cfg)                          # two of cfg's layers, random tokens
    result = measure(cfg, engine, state, batch)         # a running engine's, and its bound

Starts JAX (the callers import this module only once the pinned pool is sized).
"""

from __future__ import annotations

import dataclasses
import statistics
import timeit

from megatrain_jax.planning.presets import at_optimizer_rate
from megatrain_jax.planning.roofline import Rates, bound_for, update_bytes


def median_seconds(fn, repeats: int = 3) -> float:
    """Median wall time of `repeats` calls of fn, after one warm-up call (compilation)."""
    fn()
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def measure(cfg, engine, state, batch, optimizer_gparams: float = 0.0) -> dict:
    """The rates, measured on this model's own layers and templates, and the bound.

    `state` may hold fewer layers than `cfg.model` (a few suffice); the bound is for
    `cfg.model`. The optimizer's rate is `optimizer_gparams` when given (this model's own
    update, timed by the caller), else that of an update of `plan.OPTIMIZER_SAMPLE`
    parameters; the sample's rate is reported either way (`optimizer_sample_gparams`). The
    host memory's bandwidth is the largest of a streaming kernel's alone
    (`host_memory_kernel_gbps`), the same kernel's and a weight transfer's together
    (`host_memory_shared_gbps`: the DMA adds to what the kernel draws), and what the host
    update moved at the optimizer's rate. The update's losses beside the transfers
    (`update_loss_h2d`, `update_loss_d2h`) are from the kernel's own rate beside a copy of the
    layers each way (`host_memory_left_by_h2d_gbps`, `..._d2h_gbps`) against its rate alone.
    `cfg` is the engine's, resolved (its placement pinned: planning/planner.py); `kept_layers`
    in the result counts its layers whose backward fetches no weights (saving, or keeping
    the forward's weights).
    """
    import jax
    import jax.numpy as jnp

    from megatrain_jax.planning.memory import plan_of
    from megatrain_jax.tools import plan
    from megatrain_jax.train import machine

    place, run, block = engine.placement, engine.programs, jax.block_until_ready
    params = state.params
    # The link is timed from pinned host memory, as the engine streams: resident layers
    # (already on the device, where a transfer would be a no-op) are copied there first.
    # The pinned pool is sized with room for these copies (plan.measurement_bytes, measuring).
    layers = block(place.to_host(params["layers"][: plan.MEASURED_LAYERS]))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(layers))
    h2d = median_seconds(lambda: block(place.to_device(layers)))
    on_device = block(place.to_device(layers))
    d2h = median_seconds(lambda: block(place.to_host(on_device)))

    weights, embed, head = on_device[0], *place.to_device((params["embed"], params["head"]))
    b, denom = engine.device_batch(batch)
    xs = block(run.embed_forward(embed, b))
    zero = jnp.zeros((), jnp.float32)
    forward = median_seconds(lambda: block(run.layer_forward(weights, xs, b)))
    backward = median_seconds(
        lambda: block(run.layer_backward(weights, xs, jnp.ones_like(xs), b, zero)))
    # A saving layer's forward and its backward from the saved activations (keep_layers).
    saving = median_seconds(lambda: block(run.layer_backward_saved(
        run.layer_saving(weights, xs, b)[1], jnp.ones_like(xs), zero)))

    def head_and_embed_backward():  # the serial work: it follows the last update
        _, dxs, _, dembed, sq = run.head(head, embed, xs, b, denom)
        block(run.embed_backward(embed, b, dxs, dembed, sq))

    head_s = median_seconds(head_and_embed_backward)
    sample = _optimizer_rate(engine)
    alone = machine.memory_gbps()
    weights_in = (lambda: block(place.to_device(layers)), nbytes)
    weights_out = (lambda: block(place.to_host(on_device)), nbytes)  # as gradients go back
    shared = machine.memory_gbps(beside=weights_in)
    # What each transfer leaves the kernel (0.0 without numba, as `alone`): the update's loss
    # while it runs.
    left = {way: machine.memory_gbps(beside=move, own=True)
            for way, move in (("h2d", weights_in), ("d2h", weights_out))}
    loss = {way: min(max(1 - gbps / alone, 0.0), 1.0) if alone else 0.0
            for way, gbps in left.items()}
    rates = at_optimizer_rate(
        Rates(nbytes / h2d / 1e9, nbytes / d2h / 1e9, forward, backward, head_s, 0.0,
              overlapped_update=engine.host_optimizer is not None,
              update_loss_h2d=loss["h2d"], update_loss_d2h=loss["d2h"],
              layer_backward_saving_s=max(saving - forward, 1e-9),
              device_memory_gbps=_device_memory_gbps(on_device)),
        optimizer_gparams or sample, max(alone, shared), update_bytes(cfg))
    kept = plan_of(cfg).unfetched(cfg.model.layers)
    return {**dataclasses.asdict(rates), **bound_for(cfg, rates, place.devices),
            "kept_layers": kept,
            "optimizer_sample_gparams": sample, "host_memory_kernel_gbps": alone,
            "host_memory_shared_gbps": shared, "host_memory_left_by_h2d_gbps": left["h2d"],
            "host_memory_left_by_d2h_gbps": left["d2h"]}


def _device_memory_gbps(tree) -> float:
    """The GPU memory's bandwidth, from an elementwise update of `tree` on the device (reads
    and writes each byte once)."""
    import jax

    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 0.5 + 1.0, t))
    nbytes = 2 * sum(a.nbytes for a in jax.tree.leaves(tree))
    return nbytes / median_seconds(lambda: jax.block_until_ready(step(tree))) / 1e9


def _optimizer_rate(engine) -> float:
    """G params/s of the engine's update on a sample of fp32 parameters in pinned memory."""
    import jax
    import jax.numpy as jnp

    from megatrain_jax.tools.plan import OPTIMIZER_SAMPLE

    place = engine.placement
    n = OPTIMIZER_SAMPLE
    params = place.place({"w": jnp.full((n // 2**12, 2**12), 0.01, jnp.float32)})
    grads = place.place({"w": jnp.full((n // 2**12, 2**12), 1e-3, jnp.float32)})
    state = place.host_jit(engine.optimizer.init)(params)
    if engine.host_optimizer is not None:
        seconds = median_seconds(lambda: engine.host_optimizer.update(params, grads, state, 1.0))
    else:
        scale, skip = place.place((jnp.float32(1.0), jnp.bool_(False)))
        box = [params, state]

        def update():
            box[:] = engine.programs.update_host(box[0], grads, box[1], scale, skip)
            jax.block_until_ready(box)

        seconds = median_seconds(update)
    return n / seconds / 1e9


def measure_rates(cfg) -> Rates:
    """The rates for `cfg`, measured on two of its layers with random tokens: link
    bandwidths, layer and head times, optimizer rate. The two layers stream (no resident
    layers); the bound counts cfg's own."""
    import jax

    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train.trainers import StreamTrainer

    small = measured_config(cfg)
    trainer = StreamTrainer(small)
    state = trainer.init(jax.random.key(0))
    rates = Rates.from_result(measure(small, trainer.engine, state,
                                      TokenSource(small).batch_at(0)))
    return rates


def measured_config(cfg):
    """What `measure_rates` trains to measure `cfg`'s rates: two of its layers, every part
    streamed (the link and the host update are what it times), random tokens. The pinned
    pool is sized for it (`plan --measure`) before JAX starts."""
    from megatrain_jax.planning.memory import PlacementPlan
    from megatrain_jax.planning.planner import pinned_config

    return pinned_config(dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, layers=min(cfg.model.layers, 2), hf_path=""),
        data=dataclasses.replace(cfg.data, source="random"),
        loop=dataclasses.replace(cfg.loop, trainer="stream")), PlacementPlan())
