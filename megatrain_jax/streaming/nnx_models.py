"""Flax NNX in the streaming step: a whole model as its users write it, or loose modules.

    model = Model(cfg, rngs=nnx.Rngs(0))          # blocks made with nnx.vmap, or an nnx.List
    step = streaming.from_nnx_model(model, summed_loss, optax.adamw(3e-4), clip_norm=1.0)
    state = step.init_state()                     # the model's weights, layer by layer, to host
    state, metrics = step.train_step(state, batch)
    step.params_to(model, state)                  # trained weights back in place; then model(x)
    step.export(state, "trained/")                # orbax: nnx.to_pure_dict of the Params

The model's pieces are named by attribute (or dotted path): `embed` and `head`, each one
module or a sequence applied in order (e.g. head=("norm", "lm_head")), and `blocks`, either a
stack made with `nnx.vmap` (leading layer axis, the layout `nnx.scan` applies) or a list of
modules of one class. The step computes head(blocks(embed(batch["inputs"]))), one block at a
time: the model's own `__call__` is not used, so it must do no more than that. A block that
returns a (carry, output) pair, as an `nnx.scan` body may, passes its carry on.

Only `nnx.Param` variables train. A model holding any other state (`nnx.BatchStat`, the RNG
streams of a `Dropout` built with `rngs` or a stored `nnx.Rngs`, caches) is refused with the
variable's name: the step recomputes each block in the backward pass and gives every block
one template, so state that changes as it runs has no consistent value.
"""

from __future__ import annotations

from typing import Callable, Sequence

import optax
from flax import nnx

from megatrain_jax.streaming.functions import (
    StreamingStep,
    TemplateError,
    build_engine,
    check_layers,
    from_functions,
)
from megatrain_jax.streaming.layout import Layout, ModelStep, parse_path, path_str


def refuse_non_params(module, name: str | None = None) -> None:
    """Raises TemplateError naming the first variable of `module` that is not an nnx.Param."""
    name = name or type(module).__name__
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.Param):
            where = ".".join([name, *map(str, path)])
            raise TemplateError(
                f"{where} is an nnx.{type(node).__name__}, not an nnx.Param: the streaming "
                "step trains parameters only and carries no other state (it recomputes each "
                "block in the backward pass). Build the model without it: LayerNorm or "
                "RMSNorm instead of BatchNorm, Dropout without rngs (deterministic), no "
                "stored nnx.Rngs or caches.")


def _pure_params(module) -> dict:
    params = nnx.state(module, nnx.Param)
    return nnx.to_pure_dict(params) if hasattr(nnx, "to_pure_dict") else params.to_pure_dict()


def _graphdef(module):
    return nnx.split(module, nnx.Param)[0]


def _carry(out):
    return out[0] if isinstance(out, tuple) else out


def _chain(graphdefs: list, p: dict, x):
    """Applies the pieces in order, each merged with its own parameters."""
    for key, graphdef in graphdefs:
        x = nnx.merge(graphdef, p[key])(x)
    return x


def _is_list(node) -> bool:
    return isinstance(node, (list, tuple)) or (hasattr(nnx, "List") and
                                               isinstance(node, nnx.List))


def _submodule(model, path: tuple):
    node = model
    for i, key in enumerate(path):
        found = node[key] if isinstance(key, int) and _is_list(node) else getattr(node, str(key),
                                                                                  None)
        if found is None:
            raise TemplateError(f"{type(model).__name__} has no '{path_str(path[:i + 1])}'")
        node = found
    return node


def _paths(spec) -> list[tuple]:
    return [parse_path(spec)] if isinstance(spec, str) else [parse_path(s) for s in spec]


def _same_template(modules: Sequence) -> object:
    """The graph definition shared by every layer module, or a TemplateError naming the
    first that differs."""
    graphdefs = [_graphdef(m) for m in modules]
    for i, graphdef in enumerate(graphdefs[1:], start=1):
        if graphdef != graphdefs[0]:
            raise TemplateError(
                f"layer {i} ({type(modules[i]).__name__}) is not built like layer 0 "
                f"({type(modules[0]).__name__}); every layer must be the same template.")
    return graphdefs[0]


def from_nnx_model(model, head_loss: Callable, optimizer: optax.GradientTransformation, *,
                   embed="embed", blocks="blocks", head="head", **options) -> ModelStep:
    """A streaming step for a whole NNX model; `head_loss(outputs, batch)` returns the loss
    summed over the micro-batch. `options` are `from_functions`'. The step reads the model's
    weights at `init_state()` and writes them back at `params_to(model, state)`."""
    refuse_non_params(model)
    tree = _pure_params(model)
    embed_paths, head_paths, blocks_path = _paths(embed), _paths(head), parse_path(blocks)
    stack = _submodule(model, blocks_path)
    layout = Layout.of(tree, embed_paths, blocks_path, head_paths, stacked=not _is_list(stack))
    if layout.stacked:
        if not isinstance(stack, nnx.Module):
            raise TemplateError(f"'{path_str(blocks_path)}' is a {type(stack).__name__}, "
                                "neither an nnx.vmap stack of modules nor a list of them")
        block_def = _graphdef(stack)  # the stack's graph, merged with one layer's slices
    else:
        block_def = _same_template(list(stack))
        check_layers(layout.listed(tree))
    embed_defs = [(path_str(p), _graphdef(_submodule(model, p))) for p in embed_paths]
    head_defs = [(path_str(p), _graphdef(_submodule(model, p))) for p in head_paths]
    engine = build_engine(
        embed=lambda p, batch: _chain(embed_defs, p, batch["inputs"]),
        layer=lambda p, x: _carry(nnx.merge(block_def, p)(x)),
        head_loss=lambda p, x, batch: head_loss(_chain(head_defs, p, x), batch),
        optimizer=optimizer, example=layout.example(tree), **options)
    return ModelStep(engine, layout, read_params=lambda: _pure_params(model),
                     write_back=_write_back)


def _write_back(model, tree: dict):
    """`tree` (a pure dict of the model's Params) into `model`, in place. `model` may be the
    one trained or a fresh or abstract (`nnx.eval_shape`) instance of its class."""
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, tree)
    nnx.update(model, params)
    return model


def from_nnx(embed, layers: Sequence, head, head_loss: Callable,
             optimizer: optax.GradientTransformation, **options) -> StreamingStep:
    """A streaming step from loose Flax NNX modules.

    embed(batch["inputs"]) -> x; each layer(x) -> x (all of one class and shape);
    head(x) -> outputs; head_loss(outputs, batch) -> summed loss.
    """
    for name, module in (("embed", embed), *((f"layer {i}", m) for i, m in enumerate(layers)),
                         ("head", head)):
        refuse_non_params(module, name)
    embed_def, head_def = _graphdef(embed), _graphdef(head)
    layer_def = _same_template(layers)
    return from_functions(
        embed=lambda p, batch: nnx.merge(embed_def, p)(batch["inputs"]),
        layer=lambda p, x: nnx.merge(layer_def, p)(x),
        head_loss=lambda p, x, batch: head_loss(nnx.merge(head_def, p)(x), batch),
        params={"embed": _pure_params(embed), "layers": [_pure_params(m) for m in layers],
                "head": _pure_params(head)},
        optimizer=optimizer, **options,
    )
