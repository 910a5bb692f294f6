"""Flax Linen in the streaming step: a model whose blocks are an nn.scan stack, or modules.

    variables = model.init(key, tokens)           # blocks: nn.scan(Block, ...) in setup()
    step = streaming.from_linen_model(model, variables, summed_loss, optax.adamw(3e-4),
                                      clip_norm=1.0)
    state = step.init_state()                     # the stack, layer by layer, to host memory
    state, metrics = step.train_step(state, batch)
    variables = step.params_to(variables, state)  # {"params": ...}; model.apply(variables, x)
    step.export(state, "trained/")                # orbax: {"params": ...}

Each piece is named by attribute (a submodule made in `setup`, whose parameters sit under the
same name) or given as a (path, module) pair, the module being what computes it: the way for
submodules made inside an `@nn.compact` method, e.g. blocks=("blocks", Block(dim)). `embed`
and `head` may be sequences applied in order. `blocks` is an `nn.scan` stack (parameters
with a leading layer axis, `variable_axes={"params": 0}`); named by attribute, one layer is
computed by the class that was scanned (Flax's lifted classes derive from it). A block is
called as block(x), or block(x, None) when its `__call__` takes a second required argument
(nn.scan's scanned input); when it returns a (carry, output) pair, its carry passes on.

Only the `params` collection trains: variables holding other collections (batch_stats,
cache) are refused, naming them. The step computes head(blocks(embed(batch["inputs"]))): the
model's own `__call__` is not used, so it must do no more than that.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Sequence

import flax.linen as nn
import jax
import optax
from flax.core import unfreeze

from megatrain_jax.streaming.functions import (
    StreamingStep,
    TemplateError,
    build_engine,
    from_functions,
)
from megatrain_jax.streaming.layout import Layout, ModelStep, parse_path, path_str


def _scanned_class(module: nn.Module) -> type:
    """The user's class under Flax's lifted ones (nn.scan, nn.remat, … subclass it)."""
    return next(c for c in type(module).__mro__ if c.__module__ != nn.scan.__module__)


def _one_layer(module: nn.Module, name: str) -> nn.Module:
    """A module that computes one layer of the nn.scan stack `module`."""
    cls = _scanned_class(module)
    if cls is type(module):
        raise TemplateError(f"'{name}' is a {cls.__name__}, not an nn.scan stack: pass "
                            f"blocks=('{name}', <the module that computes one block>)")
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
              if f.init and f.name not in ("parent", "name")}
    return cls(**fields)


def _resolve(model, variables, spec, block: bool = False) -> tuple[tuple, nn.Module]:
    """(path, module) of one piece: given as a pair, or a setup attribute of `model`."""
    if not isinstance(spec, str):
        path, module = spec
        return parse_path(path), module
    path = parse_path(spec)
    node = model.bind(variables)
    for key in path:
        try:
            node = getattr(node, str(key))
        except AttributeError:
            raise TemplateError(
                f"{type(model).__name__} has no attribute '{path_str(path)}' (submodules made "
                f"in an @nn.compact method are not attributes): pass ('{spec}', module) with "
                "the module that computes it") from None
    return path, (_one_layer(node, spec) if block else node.clone(parent=None))


def _pieces(model, variables, spec) -> list[tuple[tuple, nn.Module]]:
    single = isinstance(spec, str) or (len(spec) == 2 and isinstance(spec[1], nn.Module))
    return [_resolve(model, variables, s) for s in ([spec] if single else spec)]


def _chain(pieces: list, p: dict, x):
    for key, module in pieces:
        x = module.apply({"params": p[key]}, x)
    return x


def _extra_args(module: nn.Module) -> tuple:
    """None for each required positional argument of `__call__` after x (nn.scan's xs)."""
    arguments = list(inspect.signature(type(module).__call__).parameters.values())[2:]
    return tuple(None for a in arguments if a.default is a.empty and
                 a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD))


def from_linen_model(model: nn.Module, variables, head_loss: Callable,
                     optimizer: optax.GradientTransformation, *, embed="embed",
                     blocks="blocks", head="head", **options) -> ModelStep:
    """A streaming step for a Linen model with an nn.scan stack of blocks, from its
    `variables`; `head_loss(outputs, batch)` returns the loss summed over the micro-batch.
    `options` are `from_functions`'."""
    others = sorted(set(variables) - {"params"})
    if others:
        raise TemplateError(f"the variables hold collections {others} besides 'params': the "
                            "streaming step trains parameters only and carries no other state")
    tree = variables["params"]
    embed_pieces = _pieces(model, variables, embed)
    head_pieces = _pieces(model, variables, head)
    blocks_path, block = _resolve(model, variables, blocks, block=True)
    layout = Layout.of(tree, [p for p, _ in embed_pieces], blocks_path,
                       [p for p, _ in head_pieces], stacked=True)
    embed_keyed = [(path_str(p), m) for p, m in embed_pieces]
    head_keyed = [(path_str(p), m) for p, m in head_pieces]
    extra = _extra_args(block)

    def layer(p, x):
        out = block.apply({"params": p}, x, *extra)
        return out[0] if isinstance(out, tuple) else out

    engine = build_engine(
        embed=lambda p, batch: _chain(embed_keyed, p, batch["inputs"]), layer=layer,
        head_loss=lambda p, x, batch: head_loss(_chain(head_keyed, p, x), batch),
        optimizer=optimizer, example=layout.example(tree), **options)
    return ModelStep(engine, layout, read_params=lambda: tree, write_back=_write_back,
                     saved_tree=lambda params: {"params": params})


def _write_back(variables, tree: dict) -> dict:
    """New variables {"params": tree}, checked against the structure of `variables`."""
    if jax.tree.structure(unfreeze(variables["params"])) != jax.tree.structure(tree):
        raise TemplateError("the variables given are not laid out like the model trained")
    return {"params": tree}


def from_linen(embed, embed_params, layer, layer_params: Sequence, head, head_params,
               head_loss: Callable, optimizer: optax.GradientTransformation,
               **options) -> StreamingStep:
    """A streaming step from Flax Linen modules and their `params` collections.

    `layer` is one module applied with each entry of `layer_params`.
    """

    def unwrap(p):
        return p["params"] if isinstance(p, dict) and set(p) == {"params"} else p

    return from_functions(
        embed=lambda p, batch: embed.apply({"params": p}, batch["inputs"]),
        layer=lambda p, x: layer.apply({"params": p}, x),
        head_loss=lambda p, x, batch: head_loss(head.apply({"params": p}, x), batch),
        params={"embed": unwrap(embed_params), "layers": [unwrap(p) for p in layer_params],
                "head": unwrap(head_params)},
        optimizer=optimizer, **options,
    )
