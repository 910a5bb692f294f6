"""Random keys for dropout and other stochastic layers: one schedule, derived from a seed.

Every piece of the model gets its own key at every step, a pure function of five numbers:

    key = rng_key(seed, step, part, chunk, piece)
        = fold_in(fold_in(fold_in(fold_in(jax.random.key(seed), step), part), chunk), piece)

`step` is the state's step (`StreamState.step`: a resumed state continues the schedule);
`part` is the part's index in streaming order: 0 the embedding, i + 1 layer i, L + 1 the
head; `chunk` numbers the equal runs of rows the step computes apart (the batch cut into
micro_batches x devices runs, in order: 0 with one micro-batch on one device); `piece` is the
piece's place in its part (0 for a layer; embed=("a", "b") gives "a" 0 and "b" 1). The key
is the same in the forward and in the backward's recompute, so both draw the same mask.

A reference that wants the same losses applies each piece with the same key: NNX reseeds
the piece's RNG streams, `nnx.reseed(piece, <tag>=key)` for each stream tag it holds; Linen
applies it with `rngs={"dropout": key}`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The batch entry the step adds when it draws keys: [B, 2] int32, each row's (step, chunk).
RNG_ROWS = "_megatrain_rng_rows"


def rng_key(seed: int, step, part, chunk=0, piece=0) -> jax.Array:
    """The key of one piece at one step (module docstring): a typed key, jax.random.key."""
    key = jax.random.key(seed)
    for value in (step, part, chunk, piece):
        key = jax.random.fold_in(key, value)
    return key


def with_rng_rows(batch: dict, step: int, chunks: int) -> dict:
    """`batch` and its RNG_ROWS: every row's step and chunk (rows cut into `chunks` runs)."""
    rows = len(next(iter(batch.values())))
    if rows % chunks:
        raise ValueError(f"the batch's {rows} rows do not cut into {chunks} equal runs "
                         "(micro_batches x devices)")
    chunk = np.repeat(np.arange(chunks, dtype=np.int32), rows // chunks)
    return {**batch, RNG_ROWS: np.stack([np.full(rows, step, np.int32), chunk], axis=1)}


def without_rng_rows(batch: dict) -> dict:
    """The batch as its user made it (what head_loss and the normalizer see)."""
    return {k: v for k, v in batch.items() if k != RNG_ROWS} if RNG_ROWS in batch else batch


def piece_key(seed: int | None, batch: dict, part, piece: int = 0):
    """A piece's key inside a template, from the micro-batch's RNG_ROWS (all its rows share
    a step and a chunk; a batch without them, as the construction checks run, is step 0's
    chunk 0); None when the step draws no keys."""
    if seed is None:
        return None
    step, chunk = (batch[RNG_ROWS][0, 0], batch[RNG_ROWS][0, 1]) if RNG_ROWS in batch else (0, 0)
    return rng_key(seed, step, jnp.asarray(part, jnp.int32), chunk, piece)
