"""Bytes of optimizer state a parameter, by optimizer and `optim.state_dtype`, without JAX:
what the memory estimates (memory.py), `plan` and the planner count.

    optimizer_bytes(cfg)                  # a layer's parameter: 8.0 for fp32 AdamW
    optimizer_bytes(cfg, "edges")         # the embedding's and the head's
    state_bytes(cfg, layer_params, edge_params)
    model_state_bytes(cfg)                # the whole model's

Most optimizers keep the same state for every parameter. Muon keeps one momentum for each
layer matrix (4 bytes in fp32, 2 in bf16) and AdamW's two moments for the embedding, the
head, norms and biases (optim/muon.py: `muon_dimensions`).
"""

from __future__ import annotations

from megatrain_jax.config.schema import MOMENT_BLOCK, Config, ModelConfig

OPT_STATE_FLOATS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1}
PARTS = ("layers", "edges")


def optimizer_bytes(cfg: Config, part: str = "layers") -> float:
    """Bytes of optimizer state per parameter of a layer (`layers`) or of the embedding and
    the head (`edges`): fp32 moments, or Adam's in optim.state_dtype (optim/compact.py;
    vectors keep fp32, a negligible share), or Muon's (`muon_bytes`)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if cfg.optim.name == "muon":
        return muon_bytes(cfg, part)
    if cfg.optim.state_dtype == "bfloat16":
        return 4.0
    if cfg.optim.state_dtype == "int8":
        return 2 * (1 + 4 / MOMENT_BLOCK)  # a byte per value, an fp32 scale per block
    return 4.0 * OPT_STATE_FLOATS[cfg.optim.name]


def muon_bytes(cfg: Config, part: str = "layers") -> float:
    """Muon's state per parameter: the momentum (optim.state_dtype: optax's mu_dtype, which
    also stores AdamW's first moment) for matrices; both moments (the second in fp32) for
    the rest. A layer's share of vectors is small: 4.0 a layer parameter in fp32 at 7b."""
    momentum = 2.0 if cfg.optim.state_dtype == "bfloat16" else 4.0
    adam = momentum + 4.0
    if part == "edges":
        return adam
    m = cfg.model
    matrices = matrix_params(m)
    return (momentum * matrices + adam * (m.params_per_layer - matrices)) / m.params_per_layer


def matrix_params(m: ModelConfig) -> int:
    """Parameters of a layer's 2-D weights (the attention's four projections, the MLP's
    three): all but its norms, biases and q/k norms."""
    d, dh, h, k, f = m.hidden, m.dh, m.heads, m.kv_heads, m.ffn
    return d * dh * (h + 2 * k) + h * dh * d + 3 * d * f


def state_bytes(cfg: Config, layer_params, edge_params):
    """Bytes of optimizer state of `layer_params` layer parameters and `edge_params` of the
    embedding and the head (ints, or arrays of them)."""
    total = optimizer_bytes(cfg) * layer_params + optimizer_bytes(cfg, "edges") * edge_params
    return total.astype("int64") if hasattr(total, "astype") else int(total)


def model_state_bytes(cfg: Config) -> int:
    """Bytes of optimizer state of the whole model: its layers' and its edges'."""
    m = cfg.model
    layers = m.layers * m.params_per_layer
    return state_bytes(cfg, layers, m.num_params - layers)
