"""The check of an NNX model's pieces against its own forward, once, on the first batch.

First, in one abstract trace of the model's forward, the block's class's `__call__` is
watched: the arguments the model passes its blocks besides x must be those the step passes
(block_args.py). Then the model runs in eval mode (`nnx.view(model, deterministic=True)`:
dropout off) on every row of the batch, with the methods of its embed and head pieces
watched (their classes' methods wrapped while it runs) so that each piece's input and output
are seen; the pieces, applied in order, must agree (pieces.check_against_model names the
first that does not).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import numpy as np
from flax import nnx

from megatrain_jax.stream.placement import Placement
from megatrain_jax.streaming.block_args import call_args, check_block_call, shapes_of
from megatrain_jax.streaming.layout import Layout, get_path, path_str
from megatrain_jax.streaming.nnx_pieces import find, nnx_pieces, pure_params, resolve
from megatrain_jax.streaming.pieces import check_against_model, concrete, slices
from megatrain_jax.streaming.randomness import without_rng_rows


def _eval_view(model):
    """The model with dropout off (deterministic), sharing its arrays."""
    if hasattr(nnx, "view"):
        return nnx.view(model, deterministic=True, raise_if_not_found=False)
    copy = nnx.merge(*nnx.split(model))
    copy.eval()
    return copy


def model_check(model, specs: tuple, layout: Layout, block_args: Callable | None = None
                ) -> Callable:
    """check(batch): the block's arguments as the model passes them, then the pieces,
    applied in order, against the model's own forward on every row of batch["inputs"], in
    eval mode. The second is skipped for a model whose weights are in host memory: too big
    to run whole on the device."""
    embed_paths, blocks_path, head_specs = specs

    def check(batch: dict) -> None:
        rows = without_rng_rows(batch)
        inputs, call = np.asarray(rows["inputs"]), call_args(block_args, rows)
        view = _eval_view(model)
        _check_block_call(view, blocks_path, layout, inputs, call)
        if any(Placement().in_host_memory(a) for a in jax.tree.leaves(pure_params(model))
               if isinstance(a, jax.Array)):
            return
        tree = pure_params(view)
        embed_p, block, head_p = nnx_pieces(view, embed_paths, blocks_path, head_specs,
                                            layout.stacked)
        embed_part = layout.pieces(tree, layout.embed)
        head_part = layout.pieces(tree, layout.head)
        layers = slices(get_path(tree, blocks_path), layout.num_layers, layout.stacked)

        def stage(piece):
            part = embed_part if piece.part == "embed" else head_part
            return piece.name, lambda p, x: piece.apply(p, x, None), piece.params(part)

        def blocks(params, x):
            for p in params:
                x = block.apply(p, x, None, *call)
            return x

        stages = [*map(stage, embed_p), (block.name, blocks, layers), *map(stage, head_p)]
        wanted = {}
        for spec in (*embed_paths, *head_specs):
            module, method, _, _ = resolve(view, spec, embed_paths)
            wanted[(id(module), method or "__call__")] = (module, path_str(spec))
        graphdef, state = nnx.split(view)
        forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
        check_against_model(stages, lambda x: _recorded(view, wanted, x), inputs,
                            lambda: forward(state, inputs), blocks=block.name)

    return check


def _check_block_call(view, blocks_path: tuple, layout: Layout, inputs, call) -> None:
    """The arguments the model's forward passes its first block call, seen in an abstract
    trace (shapes and dtypes only), against the step's `call`."""
    stack = find(view, blocks_path)
    cls = type(stack) if layout.stacked else type(list(stack)[0])
    seen = {}

    def record(module, method, args, kwargs, out):
        if isinstance(module, cls) and args:
            seen.setdefault("call", (args[1:], kwargs))

    graphdef, state = nnx.split(view)
    with _wrapped({(cls, "__call__")}, record):
        jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), shapes_of(state), inputs)
    check_block_call(path_str(blocks_path), cls.__call__, seen.get("call"), call)


@contextlib.contextmanager
def _wrapped(methods: set, record: Callable):
    """Each (class, method name) of `methods` wrapped while the block under `with` runs:
    record(module, method name, args, kwargs, output) sees every call."""
    originals = {(cls, m): (cls.__dict__.get(m), getattr(cls, m)) for cls, m in methods}

    def recording(method, original):
        def call(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            record(self, method, args, kwargs, out)
            return out
        return call

    try:
        for (cls, method), (_, original) in originals.items():
            setattr(cls, method, recording(method, original))
        yield
    finally:
        for (cls, method), (own, _) in originals.items():
            if own is None:
                delattr(cls, method)
            else:
                setattr(cls, method, own)


def _recorded(model, wanted: dict, inputs):
    """model(inputs), and {name: (input, output)} of the first concrete call of each wanted
    (module id, method): the classes' methods wrapped while it runs."""
    calls = {}

    def record(module, method, args, kwargs, out):
        _, name = wanted.get((id(module), method), (None, None))
        if name and name not in calls and args and concrete(args[0], out):
            calls[name] = (args[0], out)

    with _wrapped({(type(module), method) for (_, method), (module, _) in wanted.items()},
                  record):
        outputs = model(inputs)
    return outputs, calls
