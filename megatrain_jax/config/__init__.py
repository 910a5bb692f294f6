"""Configuration: frozen dataclasses (`schema`), read from JSON or gin files with `a.b=c`
overrides (`load`); a Hugging Face folder's config.json fixes the model's fields (`hf`).

    cfg = load_config("demo", ["model.layers=4", "loop.steps=50"])
"""

from megatrain_jax.config.load import (
    apply_overrides,
    from_dict,
    load_config,
    load_run_config,
    resolve_config_path,
    save_config,
    shipped_configs,
    to_dict,
)
from megatrain_jax.config.optimizers import HOST_OPTIMIZERS, MuonConfig, host_update
from megatrain_jax.config.schema import (
    CHOICES,
    MOMENT_BLOCK,
    STATE_DTYPES,
    Config,
    ConfigError,
    DataConfig,
    LoopConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    RopeScaling,
    ScheduleConfig,
    StreamConfig,
    layer_grad_dtype,
    validate,
)

__all__ = [
    "CHOICES", "HOST_OPTIMIZERS", "MOMENT_BLOCK", "Config", "ConfigError", "DataConfig",
    "LoopConfig", "MeshConfig", "ModelConfig", "MuonConfig", "OptimConfig", "RopeScaling",
    "STATE_DTYPES", "ScheduleConfig", "StreamConfig",
    "apply_overrides", "from_dict", "host_update", "layer_grad_dtype", "load_config",
    "load_run_config", "resolve_config_path", "save_config", "shipped_configs", "to_dict",
    "validate",
]
