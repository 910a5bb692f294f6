"""Where a run's state and activations live, decided once before the engine is built: the
step's bound from the machine's rates (`roofline`), the rates of known machines (`presets`),
and the planner that spends the GPU's room where it buys the most step time (`planner`).
Pure Python, no JAX: `megatrain-jax plan` and `train` decide before the backend starts."""
