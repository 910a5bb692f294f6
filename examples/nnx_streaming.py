"""Train a custom Flax NNX transformer with the streaming step (host-resident state).

    python examples/nnx_streaming.py --steps 20

The model is written the ordinary NNX way: an embedding, a list of identical blocks and a
head. `streaming.from_nnx` splits each into parameters and one compiled template, keeps the
parameters and AdamW state in host memory and streams the blocks through the device.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from megatrain_jax import streaming
from megatrain_jax.io.data import ByteTokenizer, bundled_text

VOCAB, DIM, HEADS, LAYERS, SEQ = 256, 32, 4, 3, 32


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        # no bias: a key bias has an exactly-zero gradient that Adam would turn into noise
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, rngs=rngs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):  # x [B, S, D]
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads) for t in (q, k, v))
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
        x = x + self.out(attn)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Head(nnx.Module):
    def __init__(self, dim: int, vocab: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.proj = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, x):
        return self.proj(self.norm(x))


def build(seed: int = 0):
    rngs = nnx.Rngs(seed)
    embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    blocks = [Block(DIM, HEADS, rngs) for _ in range(LAYERS)]
    return embed, blocks, Head(DIM, VOCAB, rngs)


def summed_loss(logits, batch):
    """Cross-entropy summed over tokens; the step divides by the batch's token count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"])


def batches(batch_size: int = 8, seed: int = 0):
    tokens = ByteTokenizer().encode(bundled_text())
    key = jax.random.key(seed)
    while True:
        key, sub = jax.random.split(key)
        starts = jax.random.randint(sub, (batch_size,), 0, len(tokens) - SEQ - 1)
        rows = jnp.stack([jnp.asarray(tokens[s:s + SEQ + 1]) for s in starts.tolist()])
        yield {"inputs": rows[:, :-1], "targets": rows[:, 1:],
               "mask": jnp.ones((batch_size, SEQ), jnp.float32)}


def main(steps: int = 20) -> list[float]:
    embed, blocks, head = build()
    step = streaming.from_nnx(embed, blocks, head, summed_loss, optax.adamw(3e-3),
                              clip_norm=1.0, micro_batches=2)
    state = step.init_state()
    losses = []
    for _, batch in zip(range(steps), batches()):
        state, metrics = step.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        print(f"step {len(losses):3d}  loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
