"""Memory plan: what a config needs on the host and on the GPU, computed without JAX.

    estimate(cfg)      -> {component: bytes} for host and device
    check_fits(cfg)    -> raises ConfigError with the numbers when the host cannot hold it

Runs before JAX starts, so that the pinned host pool can be sized from the model.
"""

from __future__ import annotations

import os

from megatrain_jax.config import Config, ConfigError

GiB = 2**30
OPT_STATE_FLOATS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1}


def estimate(cfg: Config) -> dict:
    m, d, s = cfg.model, cfg.data, cfg.stream
    params = m.num_params
    layer = m.params_per_layer
    act_bytes = 2 if m.compute_dtype == "bfloat16" else 4
    saved = m.layers * d.tokens_per_step * m.hidden * act_bytes
    host = {
        "master_weights": 4 * params,
        "optimizer_state": 4 * OPT_STATE_FLOATS[cfg.optim.name] * params,
        "gradients": 4 * params,
        "saved_inputs": saved if s.saved_inputs == "pinned_host" else 0,
    }
    # On the device: weights in flight (current + prefetched), gradients leaving, the
    # embedding kept for the step, saved inputs, and one micro-batch's layer workspace.
    edge = m.vocab_size * m.hidden * 4
    micro_tokens = d.tokens_per_step // d.micro_batches
    workspace = micro_tokens * (6 * m.hidden + 3 * m.ffn) * 4 + min(s.loss_chunk, micro_tokens) \
        * m.vocab_size * 4 * 2
    device = {
        "weights_in_flight": (s.prefetch_depth + 1) * 4 * max(layer, edge),
        "gradients_in_flight": 2 * 4 * max(layer, edge),
        "embedding": edge,
        "saved_inputs": saved if s.saved_inputs == "device" else 0,
        "workspace": workspace,
    }
    if cfg.loop.trainer == "reference":
        device = {"whole_model_state": 16 * params, "workspace": workspace, "saved": saved}
        host = {}
    return {"host": host, "device": device, "host_total": sum(host.values()),
            "device_total": sum(device.values())}


def host_memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pinned_pool_bytes(cfg: Config) -> int:
    """The pinned host pool to ask XLA for: host state plus a margin for transfers."""
    if cfg.stream.host_memory_gb:
        return int(cfg.stream.host_memory_gb * GiB)
    return int(estimate(cfg)["host_total"] * 1.1) + 2 * GiB


def check_fits(cfg: Config) -> None:
    need = estimate(cfg)["host_total"]
    have = host_memory_available()
    if have is not None and need > have:
        raise ConfigError(
            f"The model needs {need / GiB:.1f} GiB of host memory for its state "
            f"({cfg.model.num_params / 1e9:.2f}B params: fp32 weights, optimizer state and "
            f"gradients) but only {have / GiB:.1f} GiB is available. Use a smaller model or a "
            "machine with more RAM."
        )


def set_pool_env(cfg: Config) -> None:
    """Sizes XLA's pinned host pool before JAX starts; a value already in the environment wins."""
    gib = pinned_pool_bytes(cfg) // GiB + 1
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(gib))
