"""Drop the streaming step into an existing hand-written training loop.

    python examples/custom_loop.py --steps 30

The loop below is ordinary: your data, your schedule of evaluation and logging. Only the
line that computes the update changes: `state, metrics = step.train_step(state, batch)`.
Parameters are plain pytrees, so reading them back (for evaluation here) is a device_put away.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from megatrain_jax import streaming

DIM, LAYERS = 24, 6


def embed(p, batch):
    return batch["inputs"] @ p["w"]


def layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"]) * p["gate"]


def head_loss(p, x, batch):
    return jnp.sum((x @ p["w"] - batch["y"]) ** 2)


def init_params(key):
    keys = jax.random.split(key, LAYERS + 2)
    layers = [{"w": jax.random.normal(k, (DIM, DIM)) / DIM**0.5, "b": jnp.zeros(DIM),
               "gate": jnp.full((DIM,), 0.5)} for k in keys[1:-1]]
    return {"embed": {"w": jax.random.normal(keys[0], (4, DIM)) / 2},
            "layers": layers,
            "head": {"w": jax.random.normal(keys[-1], (DIM, 1)) / DIM**0.5}}


def evaluate(params, batch) -> float:
    """Whole-model loss from host parameters, for a validation number."""
    x = embed(params["embed"], batch)
    for p in params["layers"]:
        x = layer(p, x)
    return float(head_loss(params["head"], x, batch)) / batch["y"].shape[0]


def main(steps: int = 30) -> list[float]:
    key = jax.random.key(0)
    x = jax.random.normal(key, (128, 4))
    data = {"inputs": x, "y": jnp.sum(jnp.sin(x), axis=1, keepdims=True)}
    train, valid = jax.tree.map(lambda a: a[:96], data), jax.tree.map(lambda a: a[96:], data)

    step = streaming.from_functions(embed, layer, head_loss, init_params(key),
                                    optax.adamw(3e-3, weight_decay=1e-4), clip_norm=1.0,
                                    micro_batches=4, example_batch=train,
                                    mask_key=None)  # no mask: the loss divides by the rows
    state = step.init_state()
    losses = []
    for i in range(steps):
        state, metrics = step.train_step(state, train)
        losses.append(float(metrics["loss"]))
        if (i + 1) % 10 == 0:
            valid_loss = evaluate(state.params, valid)
            print(f"step {i + 1:3d}  train {losses[-1]:.4f}  valid {valid_loss:.4f}  "
                  f"grad norm {float(metrics['grad_norm']):.3f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    main(parser.parse_args().steps)
