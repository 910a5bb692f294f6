"""Blocks the model calls with more than x: a padding mask and position ids (block_args).

An HF-style decoder computes `keep = tokens != 0` (left padding) and position ids counted
from each row's first real token, and scans `block(x, keep, positions)`. Trained through
`block_args` on left-padded batches cut into two micro-batches, NNX and Linen, the steps'
losses are those of jax.grad + optax on the model's own forward (rel <= 1e-5, clipping at
every step); without `block_args`, or with other values than the model's, it is refused,
naming the argument, or the rows where the outputs differ (row 0 has no padding)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax import streaming

VOCAB, DIM, HEADS, SEQ, LAYERS, ROWS = 32, 16, 2, 8, 2, 4
STEPS, CLIP = 6, 0.1
PADDING = [0, 3, 1, 5]  # left padding of each row: row 0 has none


def _attention(qkv, keep, positions):
    """Causal attention over the kept keys, q and k rotated by `positions` (RoPE)."""
    b, s, _ = qkv.shape
    q, k, v = jnp.split(qkv.reshape(b, s, 3 * HEADS, DIM // HEADS), 3, axis=2)
    if positions is not None:
        half = DIM // HEADS // 2
        angle = positions[:, :, None, None] / 10.0 ** (jnp.arange(half) / half)
        cos, sin = jnp.cos(angle), jnp.sin(angle)
        rotate = lambda t: jnp.concatenate([  # noqa: E731
            t[..., :half] * cos - t[..., half:] * sin, t[..., :half] * sin + t[..., half:] * cos],
            axis=-1)
        q, k = rotate(q), rotate(k)
    allowed = jnp.tril(jnp.ones((s, s), bool)) & keep[:, None, None, :]
    scores = jnp.where(allowed, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM // HEADS), -1e9)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return y.reshape(b, s, DIM)


def _keep_and_positions(tokens):
    keep = tokens != 0
    return keep, jnp.maximum(jnp.cumsum(keep, axis=-1) - 1, 0)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.qkv = nnx.Linear(DIM, 3 * DIM, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x, keep=None, positions=None):
        keep = jnp.ones(x.shape[:2], bool) if keep is None else keep
        return x + self.out(_attention(self.qkv(self.norm(x)), keep, positions))


class Decoder(nnx.Module):
    def __init__(self, rngs, positions=False):
        self.positions = positions
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = _stack(rngs)  # one Block whose parameters are [LAYERS, ...]
        self.ln_f = nnx.LayerNorm(DIM, rngs=rngs)
        self.lm_head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        keep, positions = _keep_and_positions(tokens)
        extra = (keep, positions) if self.positions else (keep,)

        @nnx.scan(in_axes=(nnx.Carry, 0, *[None] * len(extra)), out_axes=nnx.Carry)
        def through(x, block, *extra):
            return block(x, *extra)

        return self.lm_head(self.ln_f(through(self.embed(tokens), self.blocks, *extra)))


def _stack(rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)

    return make(rngs)


class LinenBlock(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, keep):  # nn.scan body; keep broadcast to every layer
        qkv = nn.Dense(3 * DIM, use_bias=False, dtype=self.dtype)(nn.LayerNorm()(x))
        return x + nn.Dense(DIM, dtype=self.dtype)(_attention(qkv, keep, None)), None


class LinenDecoder(nn.Module):
    def setup(self):
        self.embed = nn.Embed(VOCAB, DIM)
        self.blocks = nn.scan(LinenBlock, variable_axes={"params": 0},
                              split_rngs={"params": True}, in_axes=nn.broadcast,
                              length=LAYERS)()
        self.ln_f = nn.LayerNorm()
        self.lm_head = nn.Dense(VOCAB)

    def __call__(self, tokens):
        x, _ = self.blocks(self.embed(tokens), tokens != 0)
        return self.lm_head(self.ln_f(x))


def _batches():
    """Left-padded rows (pad id 0), each step's padding rolled over the rows; the loss counts
    the targets of real tokens."""
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        tokens = rng.integers(1, VOCAB, (ROWS, SEQ + 1)).astype(np.int32)
        for row, pad in enumerate(np.roll(PADDING, step)):
            tokens[row, :pad] = 0
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
               "mask": (tokens[:, :-1] != 0).astype(np.float32)}


def summed_loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"])


def _reference(forward, params, batches):
    """jax.grad + optax through the model's own forward, the clip in the chain: losses."""
    opt = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(1e-2))

    @jax.jit
    def step(params, opt_state, batch):
        loss_of = lambda p: summed_loss(forward(p, batch["inputs"]), batch) / jnp.sum(  # noqa: E731
            batch["mask"])
        (loss, grads) = jax.value_and_grad(loss_of)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    opt_state, history = opt.init(params), []
    for batch in batches:
        params, opt_state, loss, norm = step(params, opt_state, batch)
        history.append([float(loss), float(norm)])
    return history


def _trained(step, batches):
    state, history = step.init_state(), []
    for batch in batches:
        state, metrics = step.train_step(state, batch)
        history.append([float(metrics["loss"]), float(metrics["grad_norm"])])
    return history


def _agree(history, reference):
    assert all(norm > CLIP for _, norm in reference)  # clipping acts at every step
    np.testing.assert_allclose(history, reference, rtol=1e-5)


PIECES = {"embed": "embed", "blocks": "blocks", "head": ("ln_f", "lm_head")}


def _nnx_step(model, batch, **options):
    return streaming.from_nnx_model(model, summed_loss, optax.adamw(1e-2), clip_norm=CLIP,
                                    micro_batches=2, example_batch=batch, **PIECES, **options)


def test_nnx_padding_mask_and_positions_train_like_jax_grad():
    batches = list(_batches())
    model = Decoder(nnx.Rngs(0), positions=True)
    graphdef, params = nnx.split(model, nnx.Param)
    reference = _reference(lambda p, x: nnx.merge(graphdef, p)(x), params, batches)
    step = _nnx_step(model, batches[0],
                     block_args=lambda batch: _keep_and_positions(batch["inputs"]))
    _agree(_trained(step, batches), reference)


def test_linen_broadcast_mask_trains_like_jax_grad():
    batches, model = list(_batches()), LinenDecoder()
    variables = jax.jit(model.init)(jax.random.key(0), batches[0]["inputs"])
    reference = _reference(lambda p, x: model.apply({"params": p}, x), variables["params"],
                           batches)
    step = streaming.from_linen_model(
        model, variables, summed_loss, optax.adamw(1e-2), clip_norm=CLIP, micro_batches=2,
        example_batch=batches[0], head=("ln_f", "lm_head"),
        block_args=lambda batch: {"keep": batch["inputs"] != 0})
    _agree(_trained(step, batches), reference)


@pytest.mark.parametrize("positions, block_args, message", [
    (False, None, r"the model calls 'blocks' with keep \(bool\[4, 8\]\) besides x, and the "
                  r"step would call it without.*Pass block_args=fn\(batch\)"),
    (True, lambda b: (b["inputs"] != 0,), r"the model calls 'blocks' with positions "
                                          r"\(int32\[4, 8\]\) besides x"),
    (False, lambda b: (b["inputs"] != 0, b["inputs"]), r"block_args gives 'blocks' "
                                                       r"positions \(int32\[4, 8\]\), which "
                                                       r"the model does not pass it"),
    (False, lambda b: (b["inputs"][:, None] != 0,), r"block_args gives 'blocks' keep as "
                                                    r"bool\[4, 1, 8\], the model passes "
                                                    r"bool\[4, 8\]"),
])
def test_nnx_block_arguments_unlike_the_model_are_refused_by_name(positions, block_args,
                                                                  message):
    batch = next(_batches())
    with pytest.raises(streaming.TemplateError, match=r"from_nnx_model\(\): " + message):
        _nnx_step(Decoder(nnx.Rngs(0), positions), batch, block_args=block_args)


def test_linen_blocks_unlike_the_model_are_refused_saying_what_differs():
    """Without block_args: the mask is named. A bfloat16 (path, module) pair for fp32
    blocks: the output of 'blocks' differs (by how much, in which rows), and the pair's
    settings are what to look at."""
    model, batch = LinenDecoder(), next(_batches())
    variables = jax.jit(model.init)(jax.random.key(0), batch["inputs"])

    def step(**pieces):
        return streaming.from_linen_model(model, variables, summed_loss, optax.sgd(0.1),
                                          head=("ln_f", "lm_head"), example_batch=batch,
                                          **pieces)

    with pytest.raises(streaming.TemplateError, match=r"from_linen_model\(\): the model calls "
                       r"'blocks' with keep \(bool\[4, 8\]\) besides x"):
        step()
    with pytest.raises(streaming.TemplateError, match=r"the output of 'blocks' differs from "
                       r"what the model gives 'ln_f' \(float32\[4, 8, 16\], relative difference "
                       r"[\d.e-]+, in rows 0, 1, 2, 3 of 4\).*built with the model's own "
                       r"settings \(dtype"):
        step(blocks=("blocks", LinenBlock(jnp.bfloat16)),
             block_args=lambda b: (b["inputs"] != 0,))


def test_a_difference_outside_row_0_is_caught_naming_the_rows():
    """A mask of the right shape but other values (nothing masked) agrees on row 0, which
    has no padding, and differs in the padded rows 1-3: refused, naming 'blocks'."""
    batch = next(_batches())
    assert (batch["inputs"][0] != 0).all() and (batch["inputs"][1:] == 0).any()
    with pytest.raises(streaming.TemplateError, match=r"the output of 'blocks' differs from "
                       r"what the model gives 'ln_f' \(float32\[4, 8, 16\], relative "
                       r"difference [\d.e-]+, in rows 1, 2, 3 of 4\).*block_args"):
        _nnx_step(Decoder(nnx.Rngs(0)), batch,
                  block_args=lambda b: (jnp.ones(b["inputs"].shape, bool),))
