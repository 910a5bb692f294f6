"""Train an NNX language model written the usual scanned way, then use it as usual.

    python examples/nnx_scanned.py --steps 20
    python examples/nnx_scanned.py --devices 4   # data parallel over 4 devices

The blocks are one stacked module, made with `nnx.vmap` (each parameter gains a leading layer
axis) and applied with `nnx.scan`, as deep Flax models usually are. `from_nnx_model` slices
the stack into the per-layer host store and trains it with the streaming step; `params_to`
writes the trained weights back into the model, which then runs its own `model(tokens)`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from megatrain_jax import streaming
from megatrain_jax.io.data import ByteTokenizer, bundled_text

VOCAB, DIM, LAYERS, SEQ = 256, 32, 2, 16


class Block(nnx.Module):
    """A pre-norm residual MLP block (examples/nnx_streaming.py has one with attention)."""

    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):  # x [B, S, D]
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(DIM, rngs)

        self.blocks = make_blocks(rngs)  # one Block whose parameters are [LAYERS, ...]
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.lm_head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):  # tokens [B, S] -> logits [B, S, V]
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def through(x, block):
            return block(x)

        x = through(self.embed(tokens), self.blocks)
        return self.lm_head(self.norm(x))


def summed_loss(logits, batch):
    """Cross-entropy summed over tokens; the step divides by the batch's token count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"])


def optimizer():
    return optax.adamw(3e-3)


def batches(batch_size: int = 4, seed: int = 0):
    """Random windows of the bundled text, as byte tokens."""
    tokens = ByteTokenizer().encode(bundled_text())
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - SEQ - 1, batch_size)
        rows = np.stack([tokens[s:s + SEQ + 1] for s in starts])
        yield {"inputs": rows[:, :-1], "targets": rows[:, 1:],
               "mask": np.ones((batch_size, SEQ), np.float32)}


def main(steps: int = 20, clip_norm: float = 1.0, devices: int = 1):
    """Trains, puts the weights back into the model and evaluates it the model's own way.
    Returns (model, step, state, metrics of each step) for a caller to look at."""
    model = Model(nnx.Rngs(0))
    step = streaming.from_nnx_model(model, summed_loss, optimizer(), clip_norm=clip_norm,
                                    embed="embed", blocks="blocks", head=("norm", "lm_head"),
                                    mesh=streaming.make_mesh(devices))
    state = step.init_state()
    history = []
    for _, batch in zip(range(steps), batches()):
        state, metrics = step.train_step(state, batch)
        history.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
        print(f"step {len(history):3d}  loss {history[-1]['loss']:.3f}  "
              f"grad_norm {history[-1]['grad_norm']:.3f}")
    step.params_to(model, state)  # the stacked blocks come back stacked
    logits = model(batch["inputs"])
    print(f"the model's own forward on the last batch: loss "
          f"{float(summed_loss(logits, batch) / jnp.sum(batch['mask'])):.3f}")
    return model, step, state, history


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=1,
                        help="devices to run data parallel over (the batch's 4 rows split)")
    args = parser.parse_args()
    main(args.steps, devices=args.devices)
