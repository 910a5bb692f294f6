"""The check of a Linen model's pieces against its own forward, once, on the first batch.

First, in one abstract trace of the model's forward, the call of its block (the scanned
module at the blocks' path) is watched: the arguments the model passes it besides x must be
those the step passes (block_args.py). Then the model runs on every row of the batch with
`nn.Dropout` made the identity (both in its own forward and in the pieces), its embed and
head pieces' calls watched by `nn.intercept_methods`, so that each piece's input and output
are seen; the pieces, applied in order, must agree (pieces.check_against_model names the
first that does not). Other random draws get the same fixed key in both.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import numpy as np

from megatrain_jax.stream.placement import Placement
from megatrain_jax.streaming.block_args import call_args, check_block_call, shapes_of
from megatrain_jax.streaming.layout import Layout, get_path, parse_path, path_str
from megatrain_jax.streaming.pieces import check_against_model, concrete, slices
from megatrain_jax.streaming.randomness import without_rng_rows


def _no_dropout(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.Dropout):
        return args[0]
    return next_fun(*args, **kwargs)


def model_check(model: nn.Module, variables, pieces: tuple, layout: Layout,
                block_args: Callable | None = None) -> Callable:
    """check(batch): the block's arguments as the model passes them, then the pieces,
    applied in order, against model.apply(variables, inputs) on every row of
    batch["inputs"]. The second is skipped for variables in host memory: a model too big to
    run whole on the device."""
    embeds, block, heads = pieces
    key = jax.random.key(0)

    def check(batch: dict) -> None:
        rows = without_rng_rows(batch)
        inputs, call = np.asarray(rows["inputs"]), call_args(block_args, rows)
        _check_block_call(model, variables, layout.blocks, inputs, call, key)
        tree = variables["params"]
        if any(Placement().in_host_memory(a) for a in jax.tree.leaves(tree)
               if isinstance(a, jax.Array)):
            return
        parts = {"embed": layout.pieces(tree, layout.embed),
                 "head": layout.pieces(tree, layout.head)}
        layers = slices(get_path(tree, layout.blocks), layout.num_layers, True)

        def stage(piece):
            return (piece.name, lambda p, x: piece.apply(p, x, key),
                    piece.params(parts[piece.part]))

        def blocks(params, x):
            for p in params:
                x = block.apply(p, x, key, *call)
            return x

        stages = [*map(stage, embeds), (block.name, blocks, layers), *map(stage, heads)]
        wanted = {}
        for piece in (*embeds, *heads):
            path = parse_path(piece.key) + piece.subpath
            wanted[(path, piece.method or "__call__")] = piece.name
        forward = jax.jit(lambda v, x: model.apply(v, x, rngs={"dropout": key}))
        with nn.intercept_methods(_no_dropout):
            check_against_model(stages, lambda x: _recorded(model, variables, wanted, x, key),
                                inputs, lambda: forward(variables, inputs), block.name)

    return check


def _check_block_call(model, variables, blocks_path: tuple, inputs, call, key) -> None:
    """The arguments the model's forward passes its block (the module called at the blocks'
    path), seen in an abstract trace (shapes and dtypes only), against the step's `call`."""
    seen = {}

    def record(next_fun, args, kwargs, context):
        if (tuple(context.module.path) == tuple(blocks_path) and args and "call" not in seen
                and context.method_name == "__call__"):
            seen["call"] = (args[1:], kwargs, type(context.module).__call__)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda v, x: model.apply(v, x, rngs={"dropout": key}),
                       shapes_of(variables), inputs)
    if "call" in seen:
        args, kwargs, call_fn = seen["call"]
        check_block_call(path_str(blocks_path), call_fn, (args, kwargs), call)


def _recorded(model, variables, wanted: dict, inputs, key):
    """model.apply(variables, inputs), and {name: (input, output)} of the first concrete
    call of each wanted (module path, method)."""
    calls = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        name = wanted.get((tuple(context.module.path), context.method_name))
        if name and name not in calls and args and concrete(args[0], out):
            calls[name] = (args[0], out)
        return out

    with nn.intercept_methods(record):
        outputs = model.apply(variables, inputs, rngs={"dropout": key})
    return outputs, calls
