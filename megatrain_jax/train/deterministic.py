"""Bit-for-bit repeatable runs (`loop.deterministic=true`).

    set_env()        # before JAX starts: the command line does it
    check()          # in `train`: refuses a run whose JAX started without it

On the GPU, XLA's fastest scatter-adds and some autotuned reductions add in an order that
varies from run to run, so two runs of one config part in the last bits after a few steps.
`--xla_gpu_deterministic_ops=true` makes XLA pick only kernels of a fixed order (and cuDNN's
deterministic attention backward); it is read once, when the GPU backend starts. The CPU's
kernels are deterministic already, over a mesh of CPU devices too.
"""

from __future__ import annotations

import os

FLAG = "--xla_gpu_deterministic_ops=true"


def set_env(environ=os.environ) -> None:
    """Adds the flag to XLA_FLAGS (read when JAX's backend starts)."""
    flags = environ.get("XLA_FLAGS", "")
    if FLAG not in flags.split():
        environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()


def check() -> None:
    """Sets the flag where JAX's backends have not started; raises ConfigError where they
    have started without it (the flag would be ignored)."""
    from megatrain_jax.config import ConfigError

    if FLAG in os.environ.get("XLA_FLAGS", "").split():
        return
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", lambda: True)()
    if not started:
        set_env()
        return
    import jax

    if jax.default_backend() == "cpu":
        return  # the CPU's kernels are deterministic as they are
    raise ConfigError(
        f"loop.deterministic=true needs XLA_FLAGS={FLAG} before JAX starts, and JAX has "
        "started here without it; set it in the environment (the command line, "
        "`megatrain-jax train`, sets it itself).")
