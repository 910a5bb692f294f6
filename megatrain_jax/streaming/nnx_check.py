"""The check of an NNX model's pieces against its own forward, once, on one row.

The model runs in eval mode (`nnx.view(model, deterministic=True)`: dropout off), with the
methods of its embed and head pieces watched (their classes' methods wrapped while it runs)
so that each piece's input and output are seen; the pieces, applied in order, must agree
(pieces.check_against_model names the first that does not).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx

from megatrain_jax.stream.placement import Placement
from megatrain_jax.streaming.layout import Layout, get_path, path_str
from megatrain_jax.streaming.nnx_pieces import nnx_pieces, pure_params, resolve
from megatrain_jax.streaming.pieces import check_against_model, concrete, slices


def _eval_view(model):
    """The model with dropout off (deterministic), sharing its arrays."""
    if hasattr(nnx, "view"):
        return nnx.view(model, deterministic=True, raise_if_not_found=False)
    copy = nnx.merge(*nnx.split(model))
    copy.eval()
    return copy


def model_check(model, specs: tuple, layout: Layout) -> Callable:
    """check(batch): the pieces, applied in order, against the model's own forward on one
    row of batch["inputs"], in eval mode. Skipped for a model whose weights are in host
    memory: too big to run whole on the device."""
    embed_paths, blocks_path, head_specs = specs

    def check(batch: dict) -> None:
        if any(Placement().in_host_memory(a) for a in jax.tree.leaves(pure_params(model))
               if isinstance(a, jax.Array)):
            return
        view = _eval_view(model)
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
                x = block.apply(p, x, None)
            return x

        stages = [*map(stage, embed_p), (block.name, blocks, layers), *map(stage, head_p)]
        wanted = {}
        for spec in (*embed_paths, *head_specs):
            module, method, _, _ = resolve(view, spec, embed_paths)
            wanted[(id(module), method or "__call__")] = (module, path_str(spec))
        inputs = np.asarray(batch["inputs"])[:1]
        graphdef, state = nnx.split(view)
        forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
        check_against_model(stages, lambda x: _recorded(view, wanted, x), inputs,
                            lambda: forward(state, inputs))

    return check


def _recorded(model, wanted: dict, inputs):
    """model(inputs), and {name: (input, output)} of the first concrete call of each wanted
    (module id, method): the classes' methods wrapped while it runs."""
    calls, originals = {}, {}
    for (_, method), (module, _) in wanted.items():
        cls = type(module)
        originals.setdefault((cls, method), (cls.__dict__.get(method), getattr(cls, method)))

    def recording(method, original):
        def call(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            _, name = wanted.get((id(self), method), (None, None))
            if name and name not in calls and args and concrete(args[0], out):
                calls[name] = (args[0], out)
            return out
        return call

    try:
        for (cls, method), (_, original) in originals.items():
            setattr(cls, method, recording(method, original))
        outputs = model(inputs)
    finally:
        for (cls, method), (own, _) in originals.items():
            if own is None:
                delattr(cls, method)
            else:
                setattr(cls, method, own)
    return outputs, calls
