"""Flax Linen modules in the streaming step: one module as the layer template.

    step = streaming.from_linen(embed, embed_params, layer, layer_params, head, head_params,
                                summed_loss, optax.adamw(3e-4))
"""

from __future__ import annotations

from typing import Callable, Sequence

import optax

from megatrain_jax.streaming.functions import StreamingStep, from_functions


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
