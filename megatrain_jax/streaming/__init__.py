"""The streaming train step around your own model: pure functions, Flax NNX or Linen.

Host-resident parameters and Optax state, one compiled layer template, the layers streamed
through the device (see `megatrain_jax.stream`). The ways in, from the most general:

    functions.py     from_functions(embed, layer, head_loss, params, optimizer): pure functions
    nnx_models.py    from_nnx_model(model, ...): a whole NNX model, blocks stacked by
                     nnx.vmap or listed; from_nnx(embed, layers, head, ...): loose modules
    linen_models.py  from_linen_model(model, variables, ...): a Linen model, blocks stacked
                     by nn.scan; from_linen(embed, embed_params, layer, ...): loose modules
    layout.py        a model's parameter tree <-> the per-layer store; ModelStep, which gives
                     trained weights back in the model's layout (`params_to`, `export`)
    pieces.py        a model's pieces, the templates made of them, and their check against
                     the model's own forward (nnx_pieces.py, nnx_check.py, linen_check.py)
    block_args.py    a block's arguments besides x (padding mask, positions): block_args=
    contract.py      the loss contract: mask_key, normalizer, reduction
    optimizer_view.py  the optimizer sees each part in the whole model's tree; the probe
                     that refuses global transforms (clip_by_global_norm: use clip_norm=)
    randomness.py    dropout keys: rng_key(seed, step, part, chunk, piece)
    errors.py        errors that name the entry point and the argument

    step = streaming.from_nnx_model(model, summed_loss, optax.adamw(3e-4), clip_norm=1.0)
    state = step.init_state()
    state, metrics = step.train_step(state, batch)
    step.params_to(model, state)          # then model(x) as usual

Every way in takes `mesh=make_mesh(n)` (or n) to run data parallel over n devices.
"""

from megatrain_jax.stream.mesh import make_mesh
from megatrain_jax.streaming.contract import LossContract
from megatrain_jax.streaming.errors import TemplateError
from megatrain_jax.streaming.functions import (
    StreamingStep,
    build_engine,
    check_layers,
    check_no_captured_arrays,
    from_functions,
)
from megatrain_jax.streaming.layout import Layout, ModelStep
from megatrain_jax.streaming.linen_models import from_linen, from_linen_model
from megatrain_jax.streaming.nnx_models import from_nnx, from_nnx_model, refuse_non_params
from megatrain_jax.streaming.randomness import rng_key

__all__ = ["Layout", "LossContract", "ModelStep", "StreamingStep", "TemplateError",
           "build_engine", "check_layers", "check_no_captured_arrays", "from_functions",
           "from_linen", "from_linen_model", "from_nnx", "from_nnx_model", "make_mesh",
           "refuse_non_params", "rng_key"]
