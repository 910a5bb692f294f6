"""Train a Flax Linen model with the streaming step.

    python examples/linen_streaming.py --steps 20

One Linen module is the layer template; each layer has its own `params` collection, made
with `module.init`. `streaming.from_linen` keeps them all in host memory and applies the one
compiled template to each as it streams through.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from megatrain_jax import streaming

DIM, LAYERS, FEATURES = 16, 4, 8


class Residual(nn.Module):
    """x + W2 gelu(W1 norm(x)): a residual MLP block."""

    dim: int

    @nn.compact
    def __call__(self, x):
        h = nn.RMSNorm()(x)
        return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(h)))


def build(seed: int = 0):
    key = jax.random.key(seed)
    embed, layer, head = nn.Dense(DIM), Residual(DIM), nn.Dense(1)
    x = jnp.zeros((1, FEATURES))
    keys = jax.random.split(key, LAYERS + 2)
    embed_params = embed.init(keys[0], x)
    h = jnp.zeros((1, DIM))
    layer_params = [layer.init(k, h) for k in keys[1:-1]]
    head_params = head.init(keys[-1], h)
    return embed, embed_params, layer, layer_params, head, head_params


def summed_loss(prediction, batch):
    return jnp.sum((prediction[:, 0] - batch["y"]) ** 2)


def make_data(n: int = 64, seed: int = 1):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, FEATURES))
    y = jnp.sin(x @ jax.random.normal(kw, (FEATURES,)))
    return {"inputs": x, "y": y}


def main(steps: int = 20) -> list[float]:
    embed, embed_params, layer, layer_params, head, head_params = build()
    step = streaming.from_linen(embed, embed_params, layer, layer_params, head, head_params,
                                summed_loss, optax.adam(1e-2), prefetch_depth=1,
                                mask_key=None)  # no mask: the loss divides by the rows
    state = step.init_state()
    batch = make_data()
    losses = []
    for _ in range(steps):
        state, metrics = step.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        print(f"step {len(losses):3d}  mse {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
