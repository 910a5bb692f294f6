"""Flax NNX in the streaming step: a whole model as its users write it, or loose modules.

    model = GPT(cfg, rngs=nnx.Rngs(0))            # blocks made with nnx.vmap, or an nnx.List
    step = streaming.from_nnx_model(model, summed_loss, optax.adamw(3e-4), clip_norm=1.0,
                                    embed="embed", head=("ln_f", "embed.wte.attend"),
                                    rng_seed=0, example_batch=batch)
    state = step.init_state()                     # the model's weights, layer by layer, to host
    state, metrics = step.train_step(state, batch)
    step.params_to(model, state)                  # trained weights back in place; then model(x)
    step.export(state, "trained/")                # orbax: nnx.to_pure_dict of the Params

The model's pieces are named by attribute (or dotted path): `embed` and `head`, each one
module or a sequence applied in order (e.g. head=("norm", "lm_head")), and `blocks`, either a
stack made with `nnx.vmap` (leading layer axis, the layout `nnx.scan` applies) or a list of
modules of one class. A head piece may be a method of a module, "wte.attend": inside an
embedding piece, it ties the head to the embedding. The step computes
head(blocks(embed(batch["inputs"]))), one block at a time, each called with
`block_args(micro_batch)` after x when the model passes its blocks more (a padding mask,
position ids: block_args.py), and checks once, on every row of the example (or first)
batch, that this is what the model's own `__call__` computes (in eval mode: dropout off),
naming the argument or the first piece that differs. A block that returns a
(carry, output) pair, as an `nnx.scan` body may, passes its carry on.

Only `nnx.Param` variables train. RNG streams (a `Dropout` built with `rngs`) are reseeded
for every piece at every step from `rng_seed` (randomness.py), as `nnx.reseed` does; any
other state (`nnx.BatchStat`, caches) is refused with the variable's name: the step
recomputes each block in the backward pass, so state that changes as it runs has no
consistent value.
"""

from __future__ import annotations

from typing import Callable, Sequence

import optax
from flax import nnx

from megatrain_jax.streaming.errors import TemplateError, entry_point
from megatrain_jax.streaming.functions import (
    ENGINE_OPTIONS,
    StreamingStep,
    build_engine,
    check_layers,
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
from megatrain_jax.streaming.nnx_check import model_check
from megatrain_jax.streaming.nnx_pieces import (
    find,
    graphdef_of,
    is_list,
    nnx_pieces,
    pure_params,
    resolve,
    same_template,
    specs,
)
from megatrain_jax.streaming.pieces import model_templates, tied, tied_hint


def refuse_non_params(module, name: str | None = None, rngs: bool = False) -> None:
    """Raises TemplateError naming the first variable of `module` that is not an nnx.Param
    (nor, with `rngs`, an RNG stream's key or count)."""
    name = name or type(module).__name__
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable) or isinstance(node, nnx.Param):
            continue
        if rngs and isinstance(node, nnx.RngState):
            continue
        where = ".".join([name, *map(str, path)])
        advice = ("Build the model without it: LayerNorm or RMSNorm instead of BatchNorm, no "
                  "caches." if rngs else "Build it without: LayerNorm or RMSNorm instead of "
                  "BatchNorm, Dropout without rngs; for dropout, use from_nnx_model(..., "
                  "rng_seed=), which reseeds RNG streams at every step.")
        raise TemplateError(
            f"{where} is an nnx.{type(node).__name__}, not an nnx.Param: the streaming step "
            "trains parameters only and carries no other state (it recomputes each block in "
            f"the backward pass). {advice}")


def _layout(model, tree, embed: list, blocks: tuple, head: list) -> Layout:
    """The layout of the pieces' parameters: a tied head piece has none of its own. A head
    piece the model lacks is refused with the tied head to name, if the model has one."""
    head_params = []
    for spec in head:
        try:
            _, method, path, owner = resolve(model, spec, embed)
            if not (method and owner is not None):
                get_path(tree, path)
                head_params.append(path)
        except TemplateError as error:
            tables = {path_str(p): node.num_embeddings for p, node in nnx.iter_graph(model)
                      if isinstance(node, nnx.Embed) and any(p[:len(e)] == e for e in embed)}
            hint = tied_hint(path_str(spec), [path_str(h) for h in head], tables)
            raise TemplateError(f"head: {error}{hint}") from None
    stack = find(model, blocks)
    layout = Layout.of(tree, embed, blocks, head_params, stacked=not is_list(stack))
    if layout.stacked and not isinstance(stack, nnx.Module):
        raise TemplateError(f"blocks='{path_str(blocks)}' is a {type(stack).__name__}, "
                            "neither an nnx.vmap stack of modules nor a list of them")
    return layout


def _check_rngs(model, module_paths: list, rng_seed: int | None) -> None:
    """RNG streams must sit in a piece, and need `rng_seed` to draw their keys."""
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.RngState):
            continue
        where = path_str(path)
        if not any(path[:len(p)] == p for p in module_paths):
            raise TemplateError(f"the RNG stream variable '{where}' is in none of embed, "
                                "blocks, head: the step would never use it")
        if rng_seed is None:
            raise TemplateError(
                f"'{where}' belongs to an RNG stream (a Dropout built with rngs): pass "
                "rng_seed=<int>, from which the step draws a key for every piece at every "
                "step (the same in the backward's recompute), or build the model without it.")


@entry_point(options=ENGINE_OPTIONS)
def from_nnx_model(model, head_loss: Callable, optimizer: optax.GradientTransformation, *,
                   embed="embed", blocks="blocks", head="head", rng_seed: int | None = None,
                   block_args: Callable | None = None, check_model: bool = True,
                   **options) -> ModelStep:
    """A streaming step for a whole NNX model; `head_loss(outputs, batch)` returns the loss
    summed over the micro-batch (the contract: contract.py). `rng_seed` draws the keys of
    the model's RNG streams (randomness.py); `block_args(batch)` gives the blocks' arguments
    after x (block_args.py); `check_model=False` skips the check against the model's own
    forward. `options` are `from_functions`'. The step reads the model's weights at
    `init_state()` and writes them back at `params_to(model, state)`."""
    refuse_non_params(model, rngs=True)
    tree = pure_params(model)
    embed_paths, blocks_path, head_specs = specs(embed), parse_path(blocks), specs(head)
    layout = _layout(model, tree, embed_paths, blocks_path, head_specs)
    module_paths = [resolve(model, s, embed_paths)[2] for s in (*embed_paths, *head_specs)]
    _check_rngs(model, [*module_paths, blocks_path], rng_seed)
    if not layout.stacked:
        check_layers(layout.listed(tree))
    pieces = nnx_pieces(model, embed_paths, blocks_path, head_specs, layout.stacked)
    embed_fn, layer_fn, head_fn, checked = model_templates(
        *pieces, head_loss, layout.num_layers, rng_seed, block_args)
    example, flags = layout.example(tree), {"tied": tied(pieces[2]),
                                            "layer_index": rng_seed is not None}
    checks = [template_checks(embed_fn, checked[0], head_fn, example, contract_of(options),
                              **flags, layer_inputs=checked[1])]
    if check_model:  # first: it names the piece at fault where the others would just fail
        checks.insert(0, model_check(model, (embed_paths, blocks_path, head_specs), layout,
                                     block_args))
    checks = pending_checks(checks, options.pop("example_batch", None))
    params = nnx.state(model, nnx.Param)
    forms = [nnx.as_pure(params) if hasattr(nnx, "as_pure") else None, params, tree]
    optimizer = model_optimizer(optimizer, [f for f in forms if f is not None], tree, layout,
                                "from_nnx_model")
    engine = build_engine(embed_fn, layer_fn, head_fn, optimizer, example, **flags, **options)
    return ModelStep(engine, layout, read_params=lambda: pure_params(model),
                     write_back=_write_back, checks=checks, entry="from_nnx_model",
                     rng_seed=rng_seed)


def _write_back(model, tree: dict):
    """`tree` (a pure dict of the model's Params) into `model`, in place. `model` may be the
    one trained or a fresh or abstract (`nnx.eval_shape`) instance of its class."""
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, tree)
    nnx.update(model, params)
    return model


@entry_point(options=ENGINE_OPTIONS)
def from_nnx(embed, layers: Sequence, head, head_loss: Callable,
             optimizer: optax.GradientTransformation, **options) -> StreamingStep:
    """A streaming step from loose Flax NNX modules.

    embed(batch["inputs"]) -> x; each layer(x) -> x (all of one class and shape);
    head(x) -> outputs; head_loss(outputs, batch) -> summed loss.
    """
    for name, module in (("embed", embed), *((f"layer {i}", m) for i, m in enumerate(layers)),
                         ("head", head)):
        refuse_non_params(module, name)
    embed_def, head_def = graphdef_of(embed), graphdef_of(head)
    layer_def = same_template(layers)
    return from_functions(
        embed=lambda p, batch: nnx.merge(embed_def, p)(batch["inputs"]),
        layer=lambda p, x: nnx.merge(layer_def, p)(x),
        head_loss=lambda p, x, batch: head_loss(nnx.merge(head_def, p)(x), batch),
        params={"embed": pure_params(embed), "layers": [pure_params(m) for m in layers],
                "head": pure_params(head)},
        optimizer=optimizer, **options,
    )
