"""An NNX model's pieces: found by path, merged with their parameters, applied.

Each piece's graph definition is split from the model once (the parameters, and the RNG
streams' state as a template); `apply(params, x, key)` merges it with a part's parameters,
reseeds its RNG streams with `key` as `nnx.reseed` does, and calls it (or its method). A
stack made with `nnx.vmap` is merged with one layer's slices: a module of one layer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from flax import nnx

from megatrain_jax.streaming.errors import TemplateError
from megatrain_jax.streaming.layout import parse_path, path_str
from megatrain_jax.streaming.pieces import Piece


def pure_params(module) -> dict:
    params = nnx.state(module, nnx.Param)
    return nnx.to_pure_dict(params) if hasattr(nnx, "to_pure_dict") else params.to_pure_dict()


def graphdef_of(module):
    return nnx.split(module, nnx.Param, ...)[0]


def _carry(out):
    return out[0] if isinstance(out, tuple) else out


def is_list(node) -> bool:
    return isinstance(node, (list, tuple)) or (hasattr(nnx, "List") and
                                               isinstance(node, nnx.List))


def find(model, path: tuple):
    node = model
    for i, key in enumerate(path):
        found = node[key] if isinstance(key, int) and is_list(node) else getattr(node, str(key),
                                                                                  None)
        if found is None:
            raise TemplateError(f"{type(model).__name__} has no '{path_str(path[:i + 1])}'")
        node = found
    return node


def specs(spec) -> list[tuple]:
    return [parse_path(spec)] if isinstance(spec, str) else [parse_path(s) for s in spec]


def same_template(modules: Sequence) -> object:
    """The graph definition shared by every layer module, or a TemplateError naming the
    first that differs."""
    graphdefs = [graphdef_of(m) for m in modules]
    for i, graphdef in enumerate(graphdefs[1:], start=1):
        if graphdef != graphdefs[0]:
            raise TemplateError(
                f"layer {i} ({type(modules[i]).__name__}) is not built like layer 0 "
                f"({type(modules[0]).__name__}); every layer must be the same template.")
    return graphdefs[0]


def _rng_template(module, layer: int | None = None):
    """The module's RNG streams' state as plain arrays (sliced to one layer of a stack:
    merged inside a trace, they become that trace's variables) and their tags."""
    rng_state = nnx.to_pure_dict(nnx.split(module, nnx.RngState, ...)[1])
    if layer is not None:
        rng_state = jax.tree.map(lambda a: a[layer], rng_state)
    tags = sorted({node.tag for _, node in nnx.iter_graph(module)
                   if isinstance(node, nnx.RngStream)})
    return rng_state, tags


def _applier(graphdef, rng_state, tags: list, method: str | None = None,
             carry: bool = False) -> Callable:
    """apply(params, x, key, args=(), kwargs=None): the module merged with `params`, its RNG
    streams reseeded with `key` (when there is one), then called (or its `method`) on x and
    the arguments after it."""

    def apply(params, x, key, args=(), kwargs=None):
        module = nnx.merge(graphdef, params, rng_state)
        if key is not None and tags:
            nnx.reseed(module, **{tag: key for tag in tags})
        out = (getattr(module, method) if method else module)(x, *args, **(kwargs or {}))
        return _carry(out) if carry else out

    return apply


def resolve(model, spec: tuple, embed_paths: list):
    """(module, method or None, the module's path, the embedding piece holding it or None)
    of an embed or head piece `spec`: a module, or a method of one ("wte.attend")."""
    *module_path, last = spec
    parent = find(model, tuple(module_path))
    target = getattr(parent, str(last), None) if not isinstance(last, int) else None
    if callable(target) and not isinstance(target, nnx.Module):
        module, method, path = parent, str(last), tuple(module_path)
    else:
        module, method, path = find(model, spec), None, spec
    owner = next((p for p in embed_paths if path[:len(p)] == p), None)
    return module, method, path, owner


def _piece(model, spec: tuple, part: str, embed_paths: list) -> Piece:
    """One embed or head piece; a head method of a module inside an embedding piece takes
    the embedding's parameters: the head is tied to it."""
    module, method, path, owner = resolve(model, spec, embed_paths)
    if part == "head" and method and owner is not None:
        part, key, subpath = "embed", path_str(owner), path[len(owner):]
    else:
        key, subpath = path_str(path), ()
    return Piece(path_str(spec), part, key, subpath,
                 _applier(graphdef_of(module), *_rng_template(module), method), method)


def nnx_pieces(model, embed: list, blocks: tuple, head: list, stacked: bool):
    """(embed pieces, the block, head pieces) of `model` (the one trained, or a view)."""
    embed_pieces = [_piece(model, p, "embed", embed) for p in embed]
    head_pieces = [_piece(model, p, "head", embed) for p in head]
    stack = find(model, blocks)
    if stacked:
        graphdef, rng = graphdef_of(stack), _rng_template(stack, layer=0)
    else:
        graphdef, rng = same_template(list(stack)), _rng_template(list(stack)[0])
    block = Piece(path_str(blocks), "layer", None, (), _applier(graphdef, *rng, carry=True))
    return embed_pieces, block, head_pieces
