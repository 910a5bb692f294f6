"""Flax NNX modules in the streaming step: an embedding, a list of layers, a head.

    step = streaming.from_nnx(embed, blocks, head, summed_loss, optax.adamw(3e-4))

Only `nnx.Param` variables train. A module holding any other state (`nnx.BatchStat`, the RNG
streams of a `Dropout` built with `rngs`, a stored `nnx.Rngs`, caches) is refused with the
variable's name: the step recomputes each layer in the backward pass and gives every layer
one template, so state that changes as it runs has no consistent value.
"""

from __future__ import annotations

from typing import Callable, Sequence

import optax
from flax import nnx

from megatrain_jax.streaming.functions import StreamingStep, TemplateError, from_functions


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
