"""The cost of the update on the GPU (`stream.update=device`, or an optimizer without a host
kernel, such as Muon): the link bytes of the streamed parts and Muon's Newton–Schulz FLOPs.

    up, down = link_bytes(cfg)                # bytes a streamed parameter, each way
    device_update_gparams(cfg, 53.3, 53.3)    # the link's rate of the update, a streamed param
    newton_schulz_flops(cfg)                  # FLOPs a step, every layer's matrices
    newton_schulz_seconds(cfg, 651.0)         # their seconds a step (roofline's own term)

After the backward each streamed part's weights, gradients and optimizer state go to the
GPU, one compiled program updates them, and the weights and state come back; resident
parts are updated where they live. The link carries the streamed parts only, but Muon's
Newton–Schulz runs for every layer's matrices, resident or streamed, after the backward and
before the next forward: the bound counts it once a step (`Rates.newton_schulz_s`).

Muon's matrices each run `ns_steps` iterations of X <- a X + (b A + c A A) X,
A = X X^T, on X of m x n with m <= n (optax transposes the taller ones): A takes 2 m^2 n
FLOPs, A A 2 m^3 and the product with X 2 m^2 n, so

    FLOPs a matrix a step = ns_steps x (4 m^2 n + 2 m^3)

which at 7b (32 layers of four 4096 x 4096 projections and three 4096 x 11008) is about
6.9e14 a step: about 1 s on an H100 or H200 in bf16 (optim.muon.ns_dtype), 2 in fp32.
"""

from __future__ import annotations

from megatrain_jax.config import Config, layer_grad_dtype
from megatrain_jax.planning.optimizer_state import model_state_bytes

# fp32 matmuls at XLA's default precision on an H100 or H200 run as TF32, at about half the
# rate of the bf16 layer matmuls the presets measure (an estimate; bench_step measures the
# update itself).
FP32_MATMUL_SHARE = 0.5


def layer_matrices(cfg: Config) -> list[tuple[int, int]]:
    """The (rows, columns) of one layer's 2-D weights: Muon's matrices."""
    m = cfg.model
    d, q, kv, f = m.hidden, m.heads * m.dh, m.kv_heads * m.dh, m.ffn
    return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


def newton_schulz_flops(cfg: Config) -> float:
    """FLOPs of one step's Newton–Schulz over every layer's matrices (0 but for Muon)."""
    if cfg.optim.name != "muon":
        return 0.0
    steps = cfg.optim.muon.ns_steps
    per_layer = sum(steps * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3)
                    for r, c in layer_matrices(cfg))
    return float(per_layer * cfg.model.layers)


def link_bytes(cfg: Config, devices: int = 1) -> tuple[float, float]:
    """(to the GPU, back) bytes a streamed parameter of the update on the GPU: the fp32
    weights, the gradients (bf16 for layers where they travel so) and the optimizer state
    up; the weights and the state back. Averaged over a whole streamed model."""
    m = cfg.model
    layers = m.layers * m.params_per_layer
    edges = m.num_params - layers
    grads = 2 if layer_grad_dtype(cfg, devices) == "bfloat16" else 4
    state = model_state_bytes(cfg)
    up = (4 * m.num_params + grads * layers + 4 * edges + state) / m.num_params
    return up, (4 * m.num_params + state) / m.num_params


def device_update_gparams(cfg: Config, h2d_gbps: float, d2h_gbps: float,
                          devices: int = 1) -> float:
    """G params/s of the update on the GPU of streamed parameters: each one's link bytes,
    both ways at once (the Newton–Schulz is `newton_schulz_seconds`, for every layer)."""
    up, down = link_bytes(cfg, devices)
    return 1e-9 / max(up / (h2d_gbps * 1e9), down / (d2h_gbps * 1e9))


def newton_schulz_seconds(cfg: Config, layer_tflops: float) -> float:
    """Seconds a step of the Newton–Schulz of every layer's matrices (every device computes
    each matrix whole): at the layers' bf16 matmul rate `layer_tflops` in bfloat16
    (optim.muon.ns_dtype), at FP32_MATMUL_SHARE of it in float32."""
    share = FP32_MATMUL_SHARE if cfg.optim.muon.ns_dtype == "float32" else 1.0
    return newton_schulz_flops(cfg) / (layer_tflops * share * 1e12)


def update_lines(cfg: Config, streamed: int, devices: int = 1) -> list[str]:
    """`plan`'s line on the update on the GPU of `streamed` host-held parameters."""
    up, down = link_bytes(cfg, devices)
    line = (f"update on the GPU: {up:.1f} bytes a host-held parameter to the GPU and "
            f"{down:.1f} back ({up * streamed / 1e9:.0f} and {down * streamed / 1e9:.0f} GB a "
            f"step)")
    if flops := newton_schulz_flops(cfg):
        line += f"; Newton–Schulz {flops / 1e12:,.0f} TFLOP a step (every layer's matrices)"
    return [line]
