"""A whole Flax model's parameters in its user's layout, and the streamed parts they become.

A model keeps its parameters in one nested dict: for NNX, `nnx.to_pure_dict` of its
`nnx.Param` state; for Linen, its `params` collection. The pieces sit in it at paths: the
embedding's (one or more, applied in order), the blocks', the head's (one or more). The
blocks are a stack, one subtree whose leaves carry a leading layer axis (`nnx.vmap` +
`nnx.scan`, `nn.scan`), or a list, one subtree per layer under keys 0 … L-1.

`Layout` cuts such a tree into the engine's parts {"embed", "layers", "head"} and puts
trained parts back together in the same layout. A stacked leaf is sliced layer by layer where
it lives: in host memory through a NumPy view, so the whole stack never visits the device
(a model bigger than the GPU converts); on the device there (it fits, since it is there).
`ModelStep` is the streaming step that reads a model this way and gives its weights back.

    layout = Layout.of(tree, embed=[("embed",)], blocks=("blocks",), head=[("head",)],
                       stacked=True)
    parts = layout.parts(tree, placement)              # fresh host copies, layer by layer
    tree = layout.user_tree(state.params, placement, "device")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from megatrain_jax.stream import StreamEngine, StreamState
from megatrain_jax.streaming.errors import TemplateError
from megatrain_jax.streaming.functions import clip_fix, run_checks
from megatrain_jax.streaming.optimizer_view import key_paths, model_view, probe, viewed
from megatrain_jax.streaming.randomness import with_rng_rows

KeyPath = tuple  # keys into nested dicts: str, or int for list items (NNX)
PLACES = ("device", "host")


def parse_path(spec) -> KeyPath:
    """"blocks", "decoder.blocks", "decoder/layers/0" or a tuple -> a tuple of keys (digits
    become ints: NNX list items)."""
    keys = spec.replace("/", ".").split(".") if isinstance(spec, str) else list(spec)
    return tuple(int(k) if isinstance(k, str) and k.isdigit() else k for k in keys)


def path_str(path: KeyPath) -> str:
    return ".".join(map(str, path))


def get_path(tree, path: KeyPath):
    node = tree
    for i, key in enumerate(path):
        if not isinstance(node, Mapping) or (key not in node and str(key) not in node):
            names = sorted(map(str, node)) if isinstance(node, Mapping) else []
            raise TemplateError(f"no parameters at '{path_str(path)}': "
                                f"'{path_str(path[:i]) or 'the model'}' holds {names}")
        node = node[key] if key in node else node[str(key)]
    return node


def _leaf_paths(tree, prefix: KeyPath = ()) -> list[KeyPath]:
    if not isinstance(tree, Mapping):
        return [prefix]
    return [p for key, sub in tree.items() for p in _leaf_paths(sub, prefix + (key,))]


def _set_path(tree: dict, path: KeyPath, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _host_copy(leaf, placement, index: int | None = None):
    """A fresh copy in host memory of `leaf`, or of its layer `index`, taken where it lives:
    host-held arrays through a NumPy view (never the whole array on the device), device
    arrays on the device. Fresh, because the host update writes the store in place."""
    if isinstance(leaf, jax.Array) and not placement.in_host_memory(leaf):
        return placement.place(leaf if index is None else leaf[index])
    view = np.asarray(leaf)
    return placement.place(np.array(view if index is None else view[index]))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the embedding, the blocks and the head sit in a model's parameter tree."""

    embed: tuple[KeyPath, ...]
    blocks: KeyPath
    head: tuple[KeyPath, ...]
    stacked: bool
    num_layers: int

    @classmethod
    def of(cls, tree, embed, blocks: KeyPath, head, stacked: bool) -> "Layout":
        """Checks the paths against `tree`: each exists, none holds another, and together
        they hold every parameter (one left out would silently never train)."""
        pieces = [*embed, blocks, *head]
        for k, path in enumerate(pieces):
            get_path(tree, path)
            if path in pieces[k + 1:]:  # e.g. a tied embedding: two parts, trained apart
                raise TemplateError(
                    f"'{path_str(path)}' is named twice: each parameter must belong to one "
                    "piece. To tie the head to the embedding, name the embedding module's "
                    f"method in head, e.g. head=(..., '{path_str(path)}.attend').")
            for other in pieces:
                if other != path and other[:len(path)] == path:
                    raise TemplateError(f"'{path_str(other)}' lies inside '{path_str(path)}':"
                                        " the embed, blocks and head must not overlap")
        for leaf in _leaf_paths(tree):
            if not any(leaf[:len(p)] == p for p in pieces):
                raise TemplateError(
                    f"parameter '{path_str(leaf)}' is in none of embed, blocks, head "
                    f"({', '.join(map(path_str, pieces))}): it would never be trained. Name "
                    "every piece the forward pass uses, in order (e.g. head=('norm', 'out')).")
        stack = get_path(tree, blocks)
        if stacked:
            sizes = {path_str(p): np.shape(get_path(stack, p))[:1] for p in _leaf_paths(stack)}
            if len(set(sizes.values())) != 1 or () in sizes.values():
                raise TemplateError(f"the blocks at '{path_str(blocks)}' do not share a leading "
                                    f"layer axis: leading sizes {sizes}")
            num_layers = next(iter(sizes.values()))[0]
        else:
            num_layers = len(stack)
            if {str(k) for k in stack} != {str(i) for i in range(num_layers)}:
                raise TemplateError(f"the blocks at '{path_str(blocks)}' are not a list: keys "
                                    f"{list(stack)}")
        return cls(tuple(embed), blocks, tuple(head), stacked, num_layers)

    def example(self, tree) -> dict:
        """One part of each kind as ShapeDtypeStructs, {"embed", "layer", "head"}: what
        `build_engine` traces its templates with."""
        shape = lambda t, cut: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(np.shape(a)[cut:], a.dtype), t)
        stack = get_path(tree, self.blocks)
        layer = shape(stack, 1) if self.stacked else shape(self.listed(tree)[0], 0)
        return {"embed": shape(self.pieces(tree, self.embed), 0), "layer": layer,
                "head": shape(self.pieces(tree, self.head), 0)}

    def part_paths(self, tree) -> dict:
        """Where each part's leaves sit in `tree`, in the part's flattening order:
        {"embed", "head": [key path], "layers": [[key path] per layer]}."""
        def under(paths, part):
            keyed = {path_str(p): p for p in paths}
            return [keyed[k[0]] + tuple(k[1:]) for k in key_paths(part)]

        layer = key_paths(self.example(tree)["layer"])
        prefixes = ([self.blocks] * self.num_layers if self.stacked else
                    [self.blocks + (self._list_key(tree, i),) for i in range(self.num_layers)])
        return {"embed": under(self.embed, self.pieces(tree, self.embed)),
                "head": under(self.head, self.pieces(tree, self.head)),
                "layers": [[prefix + p for p in layer] for prefix in prefixes]}

    def _list_key(self, tree, i: int):
        return i if i in get_path(tree, self.blocks) else str(i)

    def pieces(self, tree, paths) -> dict:
        """{path string: subtree} of `paths`, in order (a part of the engine)."""
        return {path_str(p): get_path(tree, p) for p in paths}

    def listed(self, tree) -> list:
        """The blocks' subtrees, layer by layer, when they are a list."""
        stack = get_path(tree, self.blocks)
        return [stack[i] if i in stack else stack[str(i)] for i in range(self.num_layers)]

    def parts(self, tree, placement) -> dict:
        """The engine's parts as fresh host copies, made one layer at a time."""
        copy = lambda t: jax.tree.map(lambda a: _host_copy(a, placement), t)  # noqa: E731
        stack = get_path(tree, self.blocks)
        if self.stacked:
            layers = [jax.tree.map(lambda a, i=i: _host_copy(a, placement, i), stack)
                      for i in range(self.num_layers)]
        else:
            layers = [copy(layer) for layer in self.listed(tree)]
        return {"embed": copy(self.pieces(tree, self.embed)), "layers": layers,
                "head": copy(self.pieces(tree, self.head))}

    def user_tree(self, params: dict, placement, where: str = "device") -> dict:
        """The engine's parts back in the user's layout, as new arrays on the device or in
        host memory (stacked blocks restacked leaf by leaf in host memory, then moved)."""
        if where not in PLACES:
            raise ValueError(f"where must be one of {PLACES}, got {where!r}")
        if where == "host":
            put = lambda a: placement.place(np.array(np.asarray(a)))  # noqa: E731
        else:
            put = lambda a: placement.to_device(a, copy=True)  # noqa: E731
        tree: dict = {}
        for paths, part in ((self.embed, params["embed"]), (self.head, params["head"])):
            for path in paths:
                _set_path(tree, path, jax.tree.map(put, part[path_str(path)]))
        layers = params["layers"]
        if self.stacked:  # one leaf's stack at a time in host memory
            move = placement.place if where == "host" else placement.to_device
            blocks = jax.tree.map(lambda *xs: move(np.stack([np.asarray(x) for x in xs])),
                                  *layers)
        else:
            blocks = {i: jax.tree.map(put, layer) for i, layer in enumerate(layers)}
        _set_path(tree, self.blocks, blocks)
        return tree


@dataclasses.dataclass
class ModelStep:
    """A streaming step built from a whole Flax model: its engine, the model's layout, and
    how to read the model's parameter tree and write one back."""

    engine: StreamEngine
    layout: Layout
    read_params: Callable[[], dict]  # the model's parameter tree, as it is now
    write_back: Callable  # (target, tree) -> the user's model or variables
    saved_tree: Callable = lambda tree: tree  # tree -> what `export` writes
    checks: list = dataclasses.field(default_factory=list)  # run on the first batch
    entry: str = "from_nnx_model"
    rng_seed: int | None = None  # draws a key per step, part and chunk (randomness.py)

    def init_state(self) -> StreamState:
        """The host store from the model's current weights, one layer at a time (a stack is
        sliced in host memory when it lives there), and the optimizer state beside it."""
        parts = self.layout.parts(self.read_params(), self.engine.placement)
        return self.engine.state_from_params(parts, copy=False)

    def train_step(self, state: StreamState, batch: dict) -> tuple[StreamState, dict]:
        """One step; with `rng_seed`, the batch carries each row's step and chunk, from which
        every piece draws its key (randomness.py)."""
        run_checks(self, batch)
        if self.rng_seed is not None:
            chunks = self.engine.micro_batches * self.engine.placement.devices
            batch = with_rng_rows(batch, state.step, chunks)
        return self.engine.train_step(state, batch)

    def user_params(self, state: StreamState, where: str = "device") -> dict:
        """The trained parameters as a nested dict in the model's own layout (stacked blocks
        when they came stacked), new arrays on the device or in host memory (`where`)."""
        return self.layout.user_tree(state.params, self.engine.placement, where)

    def params_to(self, target, state: StreamState, where: str = "device"):
        """The trained weights in the user's model: an NNX module (updated in place and
        returned) or Linen variables (a new dict), on the device or in host memory."""
        return self.write_back(target, self.user_params(state, where))

    def export(self, state: StreamState, directory) -> Path:
        """Writes the trained parameters in the model's own layout as an orbax checkpoint
        (`ocp.StandardCheckpointer().restore(path)` reads it back). They pass through host
        memory, never all on the device. The folder must not exist yet."""
        import orbax.checkpoint as ocp

        path = Path(directory).absolute()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, self.saved_tree(self.user_params(state, "host")))
        checkpointer.wait_until_finished()
        checkpointer.close()
        return path


def model_optimizer(optimizer, forms: list, tree, layout: Layout, entry: str):
    """The optimizer seeing each part inside the model's tree, in the first of `forms` (the
    tree in the layouts its user's optax code may see) that it accepts, once probed
    (optimizer_view.py); a HostAdamW (megatrain's own in-place update) as it is."""
    import optax

    if not isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    paths = key_paths(tree)
    views = [model_view(form, paths, layout.part_paths(tree), layout.example(tree),
                        layout.stacked) for form in forms]
    shapes = [(np.shape(a), a.dtype) for a in jax.tree.leaves(tree)]
    names = [path_str(p) for p in paths]
    return viewed(optimizer, probe(optimizer, views, shapes, names, clip_fix(entry)))
