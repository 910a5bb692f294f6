"""The staging area of a run's saves (io/staging.py): the host memory a checkpoint's capture
copies the state into before training goes on.

    staging_pinned_bytes(cfg, devices)   # pinned bytes of the capture on each GPU
"""

from __future__ import annotations

from megatrain_jax.config import Config
from megatrain_jax.planning.optimizer_state import model_state_bytes
from megatrain_jax.config.schema import pinned


def staging_pinned_bytes(cfg: Config, devices: int) -> int:
    """Pinned bytes a save's capture of the GPU's state takes on each GPU (io/staging.py):
    the resident parts' weights and optimizer state, or K parts' at most where the save is
    staged K parts at a time (stream.save_staging)."""
    m, s = cfg.model, cfg.stream
    per_param = (4 * m.num_params + model_state_bytes(cfg)) / m.num_params
    resident = (pinned(s.resident_layers) or 0) * m.params_per_layer
    if s.resident_embeddings == "on":
        resident += m.embedding_params
    parts = pinned(s.save_staging)
    if parts is not None:
        resident = min(resident, parts * max(m.params_per_layer, m.embedding_params))
    return int(per_param * resident / devices)
