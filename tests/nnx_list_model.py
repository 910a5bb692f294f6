"""A small NNX model the Flax tests train through the streaming step: a token embedding, a
list of blocks, a head (`positions` adds learned positions the way GPTs do: a sibling of
the token embedding, added to it in __call__), and a summed masked cross-entropy."""

import jax.numpy as jnp
import optax
from flax import nnx

VOCAB, DIM, SEQ = 64, 16, 8


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class ListModel(nnx.Module):
    def __init__(self, rngs, positions=False):
        self.wte = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.wpe = nnx.Embed(SEQ, DIM, rngs=rngs) if positions else None
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(jnp.arange(tokens.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def summed_loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"])
