"""Where every byte of the training state lives: the one owner of memory kinds.

A model's state is split into parts, in streaming order: `embed`, `layer 0` … `layer L-1`,
`head`. Each part's fp32 parameters and Optax state have one home: host memory (the
`pinned_host` memory kind, streamed through the GPU at every visit) or, for the first
`resident_layers` layers and with `resident_embeddings` the embedding and the head, GPU
memory for the whole run. `Placement` answers which, moves trees between the two kinds,
builds the state in place part by part, and gives the abstract shapes (with shardings) that
a checkpoint restores into. No other module names a memory kind (tests grep for one). No
transfer reads the optimizer state of a host part that only the host update (`HostAdamW`)
writes: with `plain_state` it lives in plain host memory, JAX's CPU client's, outside XLA's
pinned pool and its bookkeeping (1/32 of the pool), split as the weights are (`state_home`).

    placement = Placement(resident_layers=2, resident_embeddings=True)
    params = placement.init_params(init_embed, init_layer, init_head, num_layers=32)
    opt_state = placement.init_opt_state(optimizer.init, params)
    placement.is_resident(3)         # streaming index: 0 embed, 1..L layers, L+1 head
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from megatrain_jax.stream.mesh import MICRO_ROWS, cpu_stand_ins, state_spec

HOST_KIND = "pinned_host"
DEVICE_KIND = "device"
PLAIN_KIND = "unpinned_host"  # on the CPU client's devices: the host's memory, not XLA's pool


def part_names(num_layers: int) -> list[str]:
    """The parts in streaming order, as timelines, metrics and the update queue name them."""
    return ["embed", *(f"layer {i}" for i in range(num_layers)), "head"]


def parts(tree: dict) -> list:
    """A model-shaped dict {"embed", "layers": [...], "head"} as a list in streaming order."""
    return [tree["embed"], *tree["layers"], tree["head"]]


def from_parts(items: list) -> dict:
    """The inverse of `parts`."""
    return {"embed": items[0], "layers": list(items[1:-1]), "head": items[-1]}


def map_parts(fn: Callable, *trees: dict) -> dict:
    """Applies fn(part, *same_parts_of_other_trees) to each part of model-shaped dicts."""
    return from_parts([fn(*group) for group in zip(*(parts(t) for t in trees))])


def memory_kinds(tree) -> set[str]:
    """The memory kinds the arrays of `tree` live in."""
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def pinned_bytes(tree) -> int:
    """Bytes of `tree`'s arrays this process holds in pinned host memory, every shard's."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
               if getattr(getattr(leaf, "sharding", None), "memory_kind", None) == HOST_KIND
               for shard in leaf.addressable_shards)


def placed_shapes(tree, shardings) -> object:
    """ShapeDtypeStructs of `tree`'s leaves with `shardings` (a tree of the same structure):
    a target to restore into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


class Placement:
    """The devices' two memory kinds, the home of each part, and the moves between them.

    On one device every array is whole on it. With a `mesh` of N devices (stream/mesh.py),
    each state leaf is split into N shards along one dimension, in both memory kinds, and a
    batch's rows are split over the devices; moves keep an array's split and change only its
    memory kind.
    """

    def __init__(self, resident_layers: int = 0, device: jax.Device | None = None,
                 saved_inputs: str | int = DEVICE_KIND, mesh: Mesh | None = None,
                 resident_embeddings: bool = False, plain_state: bool = False):
        if resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {resident_layers}")
        if saved_inputs not in (DEVICE_KIND, HOST_KIND) and not (
                isinstance(saved_inputs, int) and saved_inputs >= 0):
            raise ValueError(f"saved_inputs must be '{DEVICE_KIND}', '{HOST_KIND}' or a count "
                             f"of layers >= 0, got {saved_inputs!r}")
        self.resident_layers, self.resident_embeddings = resident_layers, resident_embeddings
        self.layers: int | None = None  # the model's, once `check` has seen it
        # Where the layer inputs saved for the backward wait: the GPU, or pinned host memory
        # (fetched back ahead of need, like the weights) when the GPU is short of room; a
        # count k puts the first k layers' there, whose inputs the backward needs last.
        self.host_inputs = {DEVICE_KIND: 0, HOST_KIND: None}.get(saved_inputs, saved_inputs)
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.devices = 1 if self.mesh is None else self.mesh.size
        self.device = (self.mesh.devices.flat[0] if self.mesh is not None
                       else device or jax.devices()[0])
        self.plain_home = cpu_stand_ins(self.mesh, self.device) if plain_state else None

    # ----- shardings -----------------------------------------------------------------------

    def sharding(self, shape: tuple, kind: str = HOST_KIND) -> Sharding:
        """Where a state leaf of `shape` lives in memory `kind` (each device's shard of it; in
        PLAIN_KIND on the CPU devices standing for the GPUs, stream/mesh.cpu_stand_ins)."""
        home = self.plain_home if kind == PLAIN_KIND and self.plain_home is not None else (
            self.device if self.mesh is None else self.mesh)
        if isinstance(home, Mesh):
            return NamedSharding(home, state_spec(tuple(shape), self.devices), memory_kind=kind)
        return SingleDeviceSharding(home, memory_kind=kind)

    def shardings(self, tree, kind: str = HOST_KIND):
        return jax.tree.map(lambda a: self.sharding(jnp.shape(a), kind), tree)

    def constrain(self, tree):
        """Inside a program: a state tree (a gradient) split as its home splits it."""
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.shardings(tree, DEVICE_KIND))

    def gathered(self, tree):
        """Inside a program: a state tree whole on every device of the mesh (each gathers the
        others' shards), so that what follows computes on whole leaves as on one device."""
        if self.mesh is None:
            return tree
        whole = NamedSharding(self.mesh, PartitionSpec(), memory_kind=DEVICE_KIND)
        return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: whole, tree))

    def batch_sharding(self) -> Sharding:
        """Where a micro-batched array [M, rows, ...] of the batch lives: its rows split."""
        if self.mesh is None:
            return SingleDeviceSharding(self.device, memory_kind=DEVICE_KIND)
        return NamedSharding(self.mesh, MICRO_ROWS, memory_kind=DEVICE_KIND)

    # ----- homes ---------------------------------------------------------------------------

    def is_resident(self, index: int) -> bool:
        """Whether the part at streaming `index` (0 embed, 1..L layers, L+1 head) lives in
        GPU memory for the whole run. The rule: the first `resident_layers` layers do, and
        with `resident_embeddings` the embedding and the head."""
        if self.resident_embeddings:
            if self.layers is None:
                raise RuntimeError("Placement.check(num_layers) comes first: the head's index "
                                   "follows the model's layer count")
            if index in (0, self.layers + 1):
                return True
        return 1 <= index <= self.resident_layers

    def home(self, index: int) -> str:
        """The memory kind of the part at streaming `index`."""
        return DEVICE_KIND if self.is_resident(index) else HOST_KIND

    def state_home(self, index: int) -> str:
        """The memory kind of the optimizer state of the part at streaming `index`: the part's,
        or PLAIN_KIND for a host part with `plain_state` (its CPU stand-ins found)."""
        plain = self.plain_home is not None and not self.is_resident(index)
        return PLAIN_KIND if plain else self.home(index)

    def check(self, num_layers: int) -> None:
        """Takes the model's layer count, refusing more resident layers than it has."""
        if self.resident_embeddings and self.layers not in (None, num_layers):
            raise ValueError(f"this placement keeps the head of a {self.layers}-layer model "
                             f"on the GPU, not of a {num_layers}-layer one: one engine a model")
        self.layers = num_layers
        if self.resident_layers > num_layers:
            raise ValueError(f"resident_layers ({self.resident_layers}) exceeds the model's "
                             f"{num_layers} layers")

    def input_on_host(self, layer: int) -> bool:
        """Whether layer `layer`'s saved input waits in pinned host memory for the backward."""
        return self.host_inputs is None or layer < self.host_inputs

    def in_host_memory(self, array) -> bool:
        return isinstance(array, jax.Array) and array.sharding.memory_kind == HOST_KIND

    # ----- moves ---------------------------------------------------------------------------

    def place(self, tree, kind: str = HOST_KIND, copy: bool = False):
        """Starts copies of `tree`'s leaves (from anywhere) to their shardings in `kind`. With
        several processes, each passes the whole of every leaf and places its own shards."""
        shardings = self.shardings(tree, kind)
        if jax.process_count() > 1:
            return jax.tree.map(_from_whole, tree, shardings)
        return _put(tree, shardings, copy)

    def place_batch(self, micro_batches: dict) -> dict:
        """Micro-batched arrays [M, rows, ...] (whole, in host memory) on the devices."""
        return jax.tree.map(lambda a: _from_whole(a, self.batch_sharding()), micro_batches)

    def to_host(self, tree):
        """Starts device -> host copies; returns at once (the copies complete asynchronously)."""
        return self._move(tree, HOST_KIND)

    def to_device(self, tree, copy: bool = False):
        """Starts host -> device copies; returns at once. An array already there is returned
        as it is, unless `copy`."""
        return self._move(tree, DEVICE_KIND, copy)

    def _move(self, tree, kind: str, copy: bool = False):
        def target(a):
            if isinstance(a, jax.Array):
                return a.sharding.with_memory_kind(kind)
            return self.sharding(jnp.shape(a), kind)

        return _put(tree, jax.tree.map(target, tree), copy)

    def renew(self, tree):
        """The same values in new host buffers, each old one deleted as soon as its copy is
        made (so the copy costs one leaf of memory). For buffers used again and again: XLA's
        GPU client keeps a record per host-to-device copy of a buffer that lives on (about
        1.5 KB each, measured with jax 0.11.2), freed only with the buffer. Leaves not in
        host memory are returned as they are."""
        def fresh(a):
            if not self.in_host_memory(a):
                return a
            shards = [jax.device_put(np.asarray(s.data), s.data.sharding, may_alias=False)
                      for s in a.addressable_shards]
            new = jax.make_array_from_single_device_arrays(a.shape, a.sharding, shards)
            jax.block_until_ready(new)
            a.delete()
            return new

        return jax.tree.map(fresh, tree)

    def place_params(self, params: dict, copy: bool = True) -> dict:
        """Each part of `params` (anywhere) moved to its home. Parts already at home are taken
        as they are, except device arrays with `copy` (a resident part's update donates its
        buffers, which must not be the caller's)."""
        self.check(len(params["layers"]))
        return from_parts([self.place(part, self.home(k), copy and self.is_resident(k))
                           for k, part in enumerate(parts(params))])

    def host_jit(self, fn: Callable, donate_argnums=()) -> Callable:
        """Jits `fn` over host-resident state: moved to the device inside, results to host.
        Every argument and result is a state tree (or a scalar), split as state is."""

        def on_device(*args):
            return fn(*jax.device_put(args, self.shardings(args, DEVICE_KIND)))

        return self._jit_with_homes(on_device, HOST_KIND, donate_argnums)

    def device_jit(self, fn: Callable, donate_argnums=()) -> Callable:
        """Jits `fn` over device-resident state, its results split as state is."""
        return self._jit_with_homes(fn, DEVICE_KIND, donate_argnums)

    def _jit_with_homes(self, fn: Callable, kind: str, donate_argnums) -> Callable:
        """jax.jit of `fn` whose results get state shardings in `kind`, from their shapes,
        found once per shape of the arguments."""
        if self.mesh is None:
            return jax.jit(fn, out_shardings=self.sharding((), kind),
                           donate_argnums=donate_argnums)
        compiled = {}

        def call(*args):
            key = jax.tree.structure(args), tuple((jnp.shape(a), jnp.result_type(a))
                                                   for a in jax.tree.leaves(args))
            if key not in compiled:
                results = jax.eval_shape(fn, *args)
                compiled[key] = jax.jit(fn, out_shardings=self.shardings(results, kind),
                                        donate_argnums=donate_argnums)
            return compiled[key](*args)

        return call

    # ----- building state at home ----------------------------------------------------------

    def init_params(self, init_embed: Callable, init_layer: Callable, init_head: Callable,
                    num_layers: int, on_part: Callable | None = None) -> dict:
        """Parameters built part by part and moved home before the next is made: the whole
        model never exists on the device. `init_layer(i)` gives layer i's parameters.
        `on_part(what)`, if given, follows each part once it is home ("layer 3 weights")."""
        self.check(num_layers)
        makers = [init_embed, *(lambda i=i: init_layer(i) for i in range(num_layers)),
                  init_head]
        return from_parts([_landed(self.place(make(), self.home(k)), on_part, f"{name} weights")
                           for k, (make, name) in enumerate(zip(makers,
                                                                part_names(num_layers)))])

    def init_opt_state(self, opt_init: Callable, params: dict,
                       on_part: Callable | None = None) -> dict:
        """Optax state of each part, created on the device and stored in its `state_home`
        (in PLAIN_KIND made on the CPU: none of it passes through the pinned pool);
        `on_part(what)` as in init_params ("layer 3 optimizer state")."""
        on_host, on_device = self.host_jit(opt_init), self.device_jit(opt_init)
        names = part_names(len(params["layers"]))

        def init(k, p):
            if self.state_home(k) != PLAIN_KIND:
                return on_device(p) if self.is_resident(k) else on_host(p)
            plain = self.shardings(jax.eval_shape(opt_init, p), PLAIN_KIND)
            return jax.jit(opt_init, out_shardings=plain)(self.place(p, PLAIN_KIND, copy=True))

        return from_parts([_landed(init(k, p), on_part, f"{names[k]} optimizer state")
                           for k, p in enumerate(parts(params))])

    def abstract_state(self, abstract_params: dict, opt_init: Callable) -> dict:
        """{"params", "opt_state"} as ShapeDtypeStructs in each part's home: a restore
        target. Checkpoints do not depend on the homes: any placement restores any."""
        self.check(len(abstract_params["layers"]))
        opt_state = map_parts(lambda p: jax.eval_shape(opt_init, p), abstract_params)
        homes = {"params": self.home, "opt_state": self.state_home}
        return {name: from_parts([placed_shapes(part, self.shardings(part, homes[name](k)))
                                  for k, part in enumerate(parts(tree))])
                for name, tree in (("params", abstract_params), ("opt_state", opt_state))}


def _landed(part, on_part: Callable | None, what: str):
    """`part`, after telling `on_part` `what` is in place (waiting for it first)."""
    if on_part is not None:
        jax.block_until_ready(part)
        on_part(what)
    return part


def _put(tree, shardings, copy: bool):
    """jax.device_put of `tree` to `shardings`, where NumPy leaves bound for CPU devices are
    first made arrays whose shards are buffers of their own (`_from_whole`)."""
    tree = jax.tree.map(lambda a, s: a if isinstance(a, jax.Array) or not _on_cpu(s)
                        else _from_whole(a, s), tree, shardings)
    return jax.device_put(tree, shardings, may_alias=False if copy else None)


def _on_cpu(sharding: Sharding) -> bool:
    return next(iter(sharding.device_set)).platform == "cpu"


def assemble(shape: tuple, sharding: Sharding, block: Callable) -> jax.Array:
    """An array of `sharding` whose shards are `block(index)` (NumPy): make_array_from_callback,
    except on the CPU, where every shard is made from a copy of its own. The CPU client makes
    an aligned NumPy array the shard's buffer (one buffer for every device given the same
    block), and the host update writes its state in place: a shard made from the caller's
    array would change it, and a block of several devices would be updated once per device."""
    if not _on_cpu(sharding):
        return jax.make_array_from_callback(shape, sharding, block)
    shards = [jax.device_put(np.array(block(index)),
                             SingleDeviceSharding(device, memory_kind=sharding.memory_kind))
              for device, index in sharding.addressable_devices_indices_map(shape).items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _from_whole(a, sharding: Sharding) -> jax.Array:
    """An array with `sharding` from the whole of it, of which each process places its own
    devices' shards."""
    whole = np.asarray(a)
    return assemble(whole.shape, sharding, lambda index: whole[index])
