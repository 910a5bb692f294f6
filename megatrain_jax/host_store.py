"""Where persistent state lives: per-part pytrees on the `pinned_host` memory kind.

The host store is the one place, with the engine, that names memory kinds. A model's state is
split into parts: `embed`, `layers[i]` for every transformer layer, and `head`. Each part's
fp32 parameters and Optax state sit in host memory; the GPU sees a part only while the
engine streams it through.

    placement = Placement()
    params = init_host_params(placement, init_embed, init_layer, init_head, num_layers)
    opt_state = init_host_opt_state(placement, optimizer, params)
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import SingleDeviceSharding

HOST_KIND = "pinned_host"
DEVICE_KIND = "device"


class Placement:
    """Shardings of one device's two memory kinds and the transfers between them."""

    def __init__(self, device: jax.Device | None = None):
        self.device = device or jax.devices()[0]
        self.host = SingleDeviceSharding(self.device, memory_kind=HOST_KIND)
        self.on_device = SingleDeviceSharding(self.device, memory_kind=DEVICE_KIND)

    def to_host(self, tree):
        """Starts device -> host copies; returns at once (the copies complete asynchronously)."""
        return jax.device_put(tree, self.host)

    def to_device(self, tree, copy: bool = False):
        """Starts host -> device copies; returns at once. An array already there is returned
        as it is, unless `copy`."""
        return jax.device_put(tree, self.on_device, may_alias=False if copy else None)

    def host_jit(self, fn: Callable, donate_argnums=()) -> Callable:
        """Jits `fn` over host-resident inputs: moved to the device inside, results to host."""

        def on_device(*args):
            return fn(*jax.device_put(args, self.on_device))

        return jax.jit(on_device, out_shardings=self.host, donate_argnums=donate_argnums)


def parts(tree: dict):
    """Yields (name, subtree) for the parts of a model-shaped dict, in streaming order."""
    yield "embed", tree["embed"]
    for i, layer in enumerate(tree["layers"]):
        yield f"layers.{i}", layer
    yield "head", tree["head"]


def map_parts(fn: Callable, *trees: dict) -> dict:
    """Applies fn(part, *more_parts) to each part of model-shaped dicts."""
    return {
        "embed": fn(*(t["embed"] for t in trees)),
        "layers": [fn(*ls) for ls in zip(*(t["layers"] for t in trees))],
        "head": fn(*(t["head"] for t in trees)),
    }


def init_host_params(placement: Placement, init_embed, init_layer, init_head,
                     num_layers: int, resident: int = 0) -> dict:
    """Builds parameters part by part straight into host memory; never the whole on device.

    `init_layer(i)` gives layer i's parameters (on any device); each is moved to pinned_host
    before the next is made, except the first `resident` layers, which stay on the device.
    """
    params = {"embed": placement.to_host(init_embed()), "layers": [], "head": None}
    for i in range(num_layers):
        move = placement.to_device if i < resident else placement.to_host
        params["layers"].append(move(init_layer(i)))
    params["head"] = placement.to_host(init_head())
    return params


def init_host_opt_state(placement: Placement, optimizer, params: dict) -> dict:
    """Optax state of each part, created on the device and stored where the part lives:
    pinned_host, or the device for a part kept there."""
    host_init, device_init = placement.host_jit(optimizer.init), jax.jit(optimizer.init)
    return map_parts(lambda p: device_init(p) if on_device(p) else host_init(p), params)


def placed_shapes(tree, sharding) -> object:
    """ShapeDtypeStructs of `tree`'s leaves with `sharding`: a target to restore into."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        tree)


def on_device(part) -> bool:
    """Whether a part lives in device memory (a layer kept on the GPU) rather than the host."""
    return jax.tree.leaves(part)[0].sharding.memory_kind == DEVICE_KIND


def memory_kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}

