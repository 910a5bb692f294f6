"""Several devices: one mesh axis, `data`, over which the batch is split and the state sharded.

Data parallel over N devices, with one copy of the state. Every leaf of the host state (fp32
weights, moments, gradients) is split along one dimension into N shards, one per device, in
pinned host memory: each device fetches only its shard of a part, and the part's program
gathers the whole weights over the devices' links before it computes; the weights'
gradients are summed and scattered back in the transpose of that gather, so each device sends
only its shard of them to the host. The host's memory and every host link carry 1/N of a
part's bytes, however many devices there are. A leaf that no dimension of which divides by N
(a norm's scale of odd width, a scalar count) is kept whole on every device instead.

    mesh = make_mesh(4)                             # the first 4 devices, axis "data"
    spec = state_spec((4096, 11008), 4)             # P("data", None)
    templates = shard_templates(templates, mesh)    # the same functions, over the mesh

A mesh of one device is no mesh: `make_mesh` returns None and the engine runs as on one GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

AXIS = "data"
ROWS = PartitionSpec(AXIS)             # a batch-major array: its rows split over the devices
MICRO_ROWS = PartitionSpec(None, AXIS)  # [M micro-batches, rows, ...]: each one's rows split


def make_mesh(size: int = 0, devices: list | None = None) -> Mesh | None:
    """A one-axis mesh over the first `size` devices (0: all of them, of every process);
    None for a single device."""
    devices = list(devices if devices is not None else jax.devices())
    size = size or len(devices)
    if size > len(devices):
        raise ValueError(f"mesh.data={size} asks for more devices than the {len(devices)} "
                         f"there are ({devices[0].platform}); set mesh.data <= {len(devices)}")
    if size < 1:
        raise ValueError(f"mesh.data must be >= 0 (0: every device), got {size}")
    if size == 1:
        return None
    return Mesh(np.array(devices[:size]), (AXIS,))


def state_spec(shape: tuple, n: int) -> PartitionSpec:
    """Where a state leaf of `shape` is split over n devices: along its first dimension that
    n divides (the first is preferred: each shard is then a contiguous run of the whole),
    else not at all (every device holds it whole)."""
    for dim, length in enumerate(shape):
        if length % n == 0:
            return PartitionSpec(*(None,) * dim, AXIS)
    return PartitionSpec()


def sharded_dim(spec: PartitionSpec) -> int | None:
    """The dimension a `state_spec` splits, or None."""
    return next((d for d, axis in enumerate(spec) if axis == AXIS), None)


def shard_templates(templates, mesh: Mesh):
    """The templates' functions run over the mesh: each device computes its rows of the
    batch with the whole weights, gathered from the shards. Results are global arrays, so
    the programs built on them (value and gradient, sums of squares, the clip scale) mean on N
    devices what they mean on one."""
    t, n = templates, mesh.size

    def specs(tree):
        return jax.tree.map(lambda a: state_spec(a.shape, n), tree)

    def whole(tree, tree_specs):
        return jax.tree.map(
            lambda a, s: a if sharded_dim(s) is None else
            jax.lax.all_gather(a, AXIS, axis=sharded_dim(s), tiled=True), tree, tree_specs)

    def over_mesh(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def embed(p, batch):
        ps = specs(p)
        return over_mesh(lambda p_, b_: t.embed(whole(p_, ps), b_), (ps, ROWS), ROWS)(p, batch)

    def layer(p, x, batch, *index):  # index: (i,) with Templates.layer_index, else ()
        ps = specs(p)
        return over_mesh(lambda p_, x_, b_, *i_: t.layer(whole(p_, ps), x_, b_, *i_),
                         (ps, ROWS, ROWS, *(PartitionSpec(),) * len(index)), ROWS)(
                             p, x, batch, *index)

    def head_loss(h, e, x, batch, denom):
        # Each device's loss is its rows' share (over the whole batch's denominator); their
        # sum, outside, is the loss. A [1] per device keeps the sum's gradient exact: one.
        hs = specs(h)
        if e is None:
            local = over_mesh(lambda h_, x_, b_, d_: t.head_loss(whole(h_, hs), None, x_, b_,
                                                                 d_)[None],
                              (hs, ROWS, ROWS, PartitionSpec()), ROWS)
            return jnp.sum(local(h, x, batch, denom))
        es = specs(e)
        local = over_mesh(lambda h_, e_, x_, b_, d_: t.head_loss(whole(h_, hs), whole(e_, es),
                                                                 x_, b_, d_)[None],
                          (hs, es, ROWS, ROWS, PartitionSpec()), ROWS)
        return jnp.sum(local(h, e, x, batch, denom))

    return dataclasses.replace(t, embed=embed, layer=layer, head_loss=head_loss)


def cpu_stand_ins(mesh: Mesh | None, device: jax.Device) -> "Mesh | jax.Device | None":
    """The CPU devices that stand for the GPUs of `mesh` (or `device`) in the host's plain
    memory (placement.py's `plain_state`): a mesh of them shaped as `mesh`, the k-th CPU
    device for the k-th local GPU (on a CPU, the devices themselves), or the one for
    `device`. None where the CPU client has too few (a mesh of N needs N:
    planning/probe.set_cpu_devices) or several processes run."""
    try:
        cpus = jax.local_devices(backend="cpu")
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
        return None
    wanted = [device] if mesh is None else list(mesh.devices.flat)
    if jax.process_count() > 1:
        return None
    if device.platform == "cpu":  # the devices themselves
        stand_ins = wanted
    else:
        index = [jax.local_devices(backend=device.platform).index(d) for d in wanted]
        if max(index) >= len(cpus):
            return None
        stand_ins = [cpus[i] for i in index]
    if mesh is None:
        return stand_ins[0]
    return Mesh(np.array(stand_ins).reshape(mesh.devices.shape), mesh.axis_names)
