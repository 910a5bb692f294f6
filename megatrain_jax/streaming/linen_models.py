"""Flax Linen in the streaming step: a model whose blocks are an nn.scan stack, or modules.

    variables = model.init(key, tokens)           # blocks: nn.scan(Block, ...) in setup()
    step = streaming.from_linen_model(model, variables, summed_loss, optax.adamw(3e-4),
                                      clip_norm=1.0, example_batch=batch)
    state = step.init_state()                     # the stack, layer by layer, to host memory
    state, metrics = step.train_step(state, batch)
    variables = step.params_to(variables, state)  # {"params": ...}; model.apply(variables, x)
    step.export(state, "trained/")                # orbax: {"params": ...}

Each piece is named by attribute (a submodule made in `setup`, whose parameters sit under the
same name) or given as a (path, module) pair, the module being what computes it: the way for
submodules made inside an `@nn.compact` method, e.g. blocks=("blocks", Block(dim)). `embed`
and `head` may be sequences applied in order; a head piece may be a method, "wte.attend" (or
("wte.attend", nn.Embed(V, D))): of a module inside an embedding piece, it ties the head to
the embedding. `blocks` is an `nn.scan` stack (parameters with a leading layer axis,
`variable_axes={"params": 0}`); named by attribute, one layer is computed by the class that
was scanned (Flax's lifted classes derive from it). A block is called as
block(x, *block_args(micro_batch)) (nn.scan's broadcast inputs: a padding mask, position
ids; block_args.py), or without them as block(x), or block(x, None) when its `__call__`
takes a second required argument (nn.scan's scanned input); when it returns a
(carry, output) pair, its carry passes on.

Only the `params` collection trains: variables holding other collections (batch_stats,
cache) are refused, naming them. With `rng_seed`, every piece is applied with
`rngs={"dropout": key}`, its key drawn per step and piece (randomness.py). The step computes
head(blocks(embed(batch["inputs"]))), and checks once, on every row of the first batch,
that the model's own `__call__` computes the same (linen_check.py), naming the argument or
the first piece that differs.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Sequence

import flax
import flax.linen as nn
import jax
import optax
from flax.core import unfreeze

from megatrain_jax.streaming.errors import TemplateError, entry_point
from megatrain_jax.streaming.functions import (
    ENGINE_OPTIONS,
    StreamingStep,
    build_engine,
    contract_of,
    from_functions,
    pending_checks,
    template_checks,
)
from megatrain_jax.streaming.layout import (
    Layout,
    ModelStep,
    get_path,
    model_optimizer,
    parse_path,
    path_str,
)
from megatrain_jax.streaming.linen_check import model_check
from megatrain_jax.streaming.pieces import Piece, model_templates, tied, tied_hint


def _scanned_class(module: nn.Module) -> type:
    """The user's class under Flax's lifted ones (nn.scan, nn.remat, … subclass it)."""
    return next(c for c in type(module).__mro__ if c.__module__ != nn.scan.__module__)


def _one_layer(module: nn.Module, name: str) -> nn.Module:
    """A module that computes one layer of the nn.scan stack `module`."""
    cls = _scanned_class(module)
    if cls is type(module):
        raise TemplateError(f"blocks='{name}' is a {cls.__name__}, not an nn.scan stack: pass "
                            f"blocks=('{name}', <the module that computes one block>)")
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
              if f.init and f.name not in ("parent", "name")}
    return cls(**fields)


def _is_method(module: nn.Module, name) -> bool:
    return isinstance(name, str) and callable(getattr(type(module), name, None)) and \
        not isinstance(getattr(type(module), name), nn.Module)


def _resolve(model, variables, spec, argument: str) -> tuple[tuple, nn.Module, str | None]:
    """(the module's path, the module, its method or None) of one piece: a pair, or a
    setup attribute of `model`; either may end in a method's name ("wte.attend")."""
    if not isinstance(spec, str):
        path, module = parse_path(spec[0]), spec[1]
        try:
            get_path(variables["params"], path)
        except TemplateError:
            if len(path) > 1 and _is_method(module, path[-1]):
                return path[:-1], module, path[-1]
            raise
        return path, module, None
    path, node = parse_path(spec), model.bind(variables)
    for i, key in enumerate(path):
        if 0 < i == len(path) - 1 and _is_method(node, key):
            return path[:-1], node.clone(parent=None), str(key)
        try:
            node = getattr(node, str(key))
        except AttributeError:
            raise TemplateError(
                f"{argument}: {type(model).__name__} has no attribute '{path_str(path)}' "
                "(submodules made in an @nn.compact method are not attributes): pass "
                f"('{spec}', module) with the module that computes it") from None
    return path, node.clone(parent=None), None


def _head(model, variables, spec, head, embed_paths: list) -> tuple:
    """_resolve of a head piece; one the model lacks is refused with the tied head to name,
    if the model has embedding tables (an `embedding` parameter) in its embedding pieces."""
    try:
        return _resolve(model, variables, spec, "head")
    except TemplateError as error:
        tables = {}
        for path in embed_paths:
            leaves = jax.tree_util.tree_flatten_with_path(get_path(variables["params"], path))[0]
            for keys, leaf in leaves:
                names = tuple(k.key for k in keys)
                if names[-1:] == ("embedding",):
                    tables[path_str(path + names[:-1])] = leaf.shape[0]
        name = lambda s: s if isinstance(s, str) else path_str(parse_path(s[0]))  # noqa: E731
        hint = tied_hint(name(spec), [name(s) for s in _specs(head)], tables)
        raise TemplateError(f"{error}{hint}") from None


def _specs(spec) -> list:
    single = isinstance(spec, str) or (len(spec) == 2 and isinstance(spec[1], nn.Module))
    return [spec] if single else list(spec)


def _extra_args(module: nn.Module) -> tuple:
    """None for each required positional argument of `__call__` after x (nn.scan's xs)."""
    arguments = list(inspect.signature(type(module).__call__).parameters.values())[2:]
    return tuple(None for a in arguments if a.default is a.empty and
                 a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD))


def _applier(module: nn.Module, method: str | None, name: str, block: bool = False):
    """apply(params, x, key, args=(), kwargs=None): `module` (or its method) on x and the
    arguments after it, rngs={"dropout": key}. A block given no arguments gets None for each
    one its `__call__` requires (nn.scan's xs)."""
    nones = _extra_args(module) if block else ()

    def apply(params, x, key, args=(), kwargs=None):
        rngs = None if key is None else {"dropout": key}
        extra = args if args or kwargs else nones
        try:
            out = module.apply({"params": params}, x, *extra, **(kwargs or {}), rngs=rngs,
                               method=method)
        except flax.errors.InvalidRngError as error:
            raise TemplateError(f"'{name}' draws random numbers ({error}): pass "
                                "rng_seed=<int>, from which the step draws a key for every "
                                "piece at every step") from error
        return out[0] if block and isinstance(out, tuple) else out

    return apply


def linen_pieces(model, variables, embed, blocks, head):
    """(embed pieces, the block, head pieces, head parameter paths) of the model."""
    embed_found = [(s, *_resolve(model, variables, s, "embed")) for s in _specs(embed)]
    embed_paths = [path for _, path, _, _ in embed_found]

    def piece(spec, path, module, method, part):
        name = spec if isinstance(spec, str) else path_str(parse_path(spec[0]))
        owner = next((p for p in embed_paths if path[:len(p)] == p), None)
        if part == "head" and method and owner is not None:
            return Piece(name, "embed", path_str(owner), path[len(owner):],
                         _applier(module, method, name), method)
        return Piece(name, part, path_str(path), (), _applier(module, method, name), method)

    embeds = [piece(*found, "embed") for found in embed_found]
    heads = [piece(s, *_head(model, variables, s, head, embed_paths), "head")
             for s in _specs(head)]
    blocks_path, stack, _ = _resolve(model, variables, blocks, "blocks")
    block = stack if not isinstance(blocks, str) else _one_layer(stack, blocks)
    name = path_str(blocks_path)
    return embeds, Piece(name, "layer", None, (), _applier(block, None, name, block=True)), \
        heads, blocks_path


@entry_point(options=ENGINE_OPTIONS)
def from_linen_model(model: nn.Module, variables, head_loss: Callable,
                     optimizer: optax.GradientTransformation, *, embed="embed",
                     blocks="blocks", head="head", rng_seed: int | None = None,
                     block_args: Callable | None = None, check_model: bool = True,
                     **options) -> ModelStep:
    """A streaming step for a Linen model with an nn.scan stack of blocks, from its
    `variables`; `head_loss(outputs, batch)` returns the loss summed over the micro-batch
    (the contract: contract.py). `rng_seed`: each piece's dropout key (randomness.py);
    `block_args(batch)`: the blocks' arguments after x, nn.scan's broadcast inputs
    (block_args.py); `check_model=False` skips the check against the model's own forward.
    `options` are `from_functions`'."""
    others = sorted(set(variables) - {"params"})
    if others:
        raise TemplateError(f"variables: they hold collections {others} besides 'params': "
                            "the streaming step trains parameters only and carries no other "
                            "state")
    tree = variables["params"]
    embeds, block, heads, blocks_path = linen_pieces(model, variables, embed, blocks, head)
    layout = Layout.of(tree, [parse_path(p.key) for p in embeds], blocks_path,
                       [parse_path(p.key) for p in heads if p.part == "head"], stacked=True)
    embed_fn, layer_fn, head_fn, checked = model_templates(
        embeds, block, heads, head_loss, layout.num_layers, rng_seed, block_args)
    example, flags = layout.example(tree), {"tied": tied(heads),
                                            "layer_index": rng_seed is not None}
    checks = [template_checks(embed_fn, checked[0], head_fn, example, contract_of(options),
                              **flags, layer_inputs=checked[1])]
    if check_model:  # first: it names the piece at fault where the others would just fail
        checks.insert(0, model_check(model, variables, (embeds, block, heads), layout,
                                     block_args))
    checks = pending_checks(checks, options.pop("example_batch", None))
    forms = [tree] + ([unfreeze(tree)] if not isinstance(tree, dict) else [])
    optimizer = model_optimizer(optimizer, forms, tree, layout, "from_linen_model")
    engine = build_engine(embed_fn, layer_fn, head_fn, optimizer, example, **flags, **options)
    return ModelStep(engine, layout, read_params=lambda: tree, write_back=_write_back,
                     saved_tree=lambda params: {"params": params}, checks=checks,
                     entry="from_linen_model", rng_seed=rng_seed)


def _write_back(variables, tree: dict) -> dict:
    """New variables {"params": tree}, checked against the structure of `variables`."""
    if jax.tree.structure(unfreeze(variables["params"])) != jax.tree.structure(tree):
        raise TemplateError("the variables given are not laid out like the model trained")
    return {"params": tree}


@entry_point(options=ENGINE_OPTIONS)
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
