"""The streaming train step around your own model: pure functions, Flax NNX or Linen.

Host-resident parameters and Optax state, one compiled layer template, the layers streamed
through the device (see `megatrain_jax.stream`). The ways in, from the most general:

    functions.py     from_functions(embed, layer, head_loss, params, optimizer): pure functions
    nnx_models.py    from_nnx(embed, layers, head, ...): NNX modules
    linen_models.py  from_linen(embed, embed_params, layer, ...): Linen modules

    step = streaming.from_nnx(embed, blocks, head, summed_loss, optax.adamw(3e-4))
    state = step.init_state()
    state, metrics = step.train_step(state, batch)
"""

from megatrain_jax.streaming.functions import (
    StreamingStep,
    TemplateError,
    build_engine,
    check_layers,
    check_no_captured_arrays,
    from_functions,
)
from megatrain_jax.streaming.linen_models import from_linen
from megatrain_jax.streaming.nnx_models import from_nnx, refuse_non_params

__all__ = ["StreamingStep", "TemplateError", "build_engine", "check_layers",
           "check_no_captured_arrays", "from_functions", "from_linen", "from_nnx",
           "refuse_non_params"]
