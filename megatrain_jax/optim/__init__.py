"""The optimizer: the Optax chain with exact global-norm clipping and the NaN guard
(`chain`), AdamW in place on the host's pinned buffers (`host_adamw`), and Muon with its
Newton–Schulz in a dtype of choice (`muon`).

    opt = build_optimizer(cfg)               # an Optax transformation (reference, device)
    opt = build_stream_optimizer(cfg)        # HostAdamW where a host kernel exists
"""

from megatrain_jax.optim.chain import (
    apply_update,
    build_optimizer,
    build_stream_optimizer,
    clip_scale,
    decay_mask,
    learning_rate,
    sum_of_squares,
)
from megatrain_jax.optim.host_adamw import HostAdamW
from megatrain_jax.optim.muon import muon_dimensions

__all__ = ["HostAdamW", "apply_update", "build_optimizer", "build_stream_optimizer",
           "clip_scale", "decay_mask", "learning_rate", "muon_dimensions", "sum_of_squares"]
