"""Where a run's state and activations live, decided once before the engine is built: the
bytes each placement holds on the GPU and the host (`memory`, with the optimizer's state per
parameter in `optimizer_state` and `plan`'s lines on them in `memory_lines`), the step's bound
from the machine's rates (`roofline`), the rates of known machines (`presets`), what this
machine has (`probe`), and the planner that spends the GPU's room where it buys the most step
time (`planner`).
Pure Python, no JAX: `megatrain-jax plan` and `train` decide before the backend starts."""
