"""The optimizer: the Optax chain with exact global-norm clipping and the NaN guard
(`chain`), and AdamW in place on the host's pinned buffers (`host_adamw`).

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
    muon_dimensions,
    sum_of_squares,
)
from megatrain_jax.optim.host_adamw import HostAdamW

__all__ = ["HostAdamW", "apply_update", "build_optimizer", "build_stream_optimizer",
           "clip_scale", "decay_mask", "learning_rate", "muon_dimensions", "sum_of_squares"]
