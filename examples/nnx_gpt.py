"""Train a GPT written the way the Flax NNX docs teach it, then restore and use it.

    python examples/nnx_gpt.py --steps 60

Pre-norm LayerNorm blocks with causal attention and a GELU MLP, stacked by `nnx.vmap` and
applied by `nnx.scan`; learned position embeddings; a head tied to the token embedding
(`self.embed.wte.attend`); dropout built with `rngs`; AdamW whose weight-decay mask spares
biases, norms and positions; a loss masked by `batch["loss_mask"]`. The streaming step takes
the model as it is: `embed`, `blocks` and `head` name its pieces, `head="...wte.attend"` ties
the head, `rng_seed` draws every dropout key, `mask_key` names the loss mask. The trained
weights go back into the model, out to an orbax checkpoint, and into a fresh model from it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from megatrain_jax import streaming
from megatrain_jax.io.data import ByteTokenizer, bundled_text

VOCAB, DIM, HEADS, LAYERS, SEQ, DROPOUT = 256, 32, 4, 2, 32, 0.1


class Embeddings(nnx.Module):
    """Token and learned position embeddings, added, then dropout: one piece for the step."""

    def __init__(self, rngs: nnx.Rngs):
        self.wte = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.wpe = nnx.Embed(SEQ, DIM, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, tokens):  # tokens [B, S] -> x [B, S, D]
        return self.drop(self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1])))


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # No bias: a key bias cannot change attention (softmax ignores it), so its gradient
        # is rounding noise, which Adam would turn into full-size steps.
        self.qkv = nnx.Linear(DIM, 3 * DIM, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(DIM, DIM, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, x):  # causal self-attention, x [B, S, D]
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3 * HEADS, DIM // HEADS), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM // HEADS)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.drop(self.proj(y.reshape(b, s, DIM)))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = Attention(rngs)
        self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.ln2(x)))))


class GPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = Embeddings(rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(rngs)

        self.blocks = make_blocks(rngs)  # one Block whose variables are [LAYERS, ...]
        self.ln_f = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, tokens):  # tokens [B, S] -> logits [B, S, V]
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def through(x, block):
            return block(x)

        x = through(self.embed(tokens), self.blocks)
        return self.embed.wte.attend(self.ln_f(x))  # the head tied to the token embedding


def summed_loss(logits, batch):
    """Cross-entropy summed over the tokens the mask keeps; the step divides by their count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["loss_mask"])


def decay_mask(params):
    """Weight decay on kernels and the token table; none on biases, norms or positions."""
    def decays(path, _):
        names = [str(k.key) for k in path if hasattr(k, "key")]  # dict keys: the param path
        return names[-1] == "kernel" or names[-3:-1] == ["embed", "wte"]
    return jax.tree_util.tree_map_with_path(decays, params)


def optimizer(lr: float = 3e-3):
    return optax.adamw(lr, weight_decay=0.1, mask=decay_mask)


def batches(batch_size: int = 8, seed: int = 0):
    """Random windows of the bundled text as byte tokens; the first quarter of each row's
    targets is masked out (a prompt, say), so the mask's sum is what the loss divides by."""
    tokens = ByteTokenizer().encode(bundled_text())
    rng = np.random.default_rng(seed)
    mask = np.ones((batch_size, SEQ), np.float32)
    mask[:, :SEQ // 4] = 0.0
    while True:
        starts = rng.integers(0, len(tokens) - SEQ - 1, batch_size)
        rows = np.stack([tokens[s:s + SEQ + 1] for s in starts])
        yield {"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": mask}


def build(model: GPT, example_batch: dict, clip_norm: float = 1.0, **options):
    return streaming.from_nnx_model(
        model, summed_loss, optimizer(), clip_norm=clip_norm, embed="embed",
        blocks="blocks", head=("ln_f", "embed.wte.attend"), rng_seed=0,
        mask_key="loss_mask", example_batch=example_batch, **options)


def mean_loss(model: GPT, batch: dict) -> float:
    """The model's own forward, evaluated with dropout off."""
    logits = nnx.view(model, deterministic=True)(batch["inputs"])
    return float(summed_loss(logits, batch) / jnp.sum(batch["loss_mask"]))


def main(steps: int = 60, clip_norm: float = 1.0, folder: str | None = None) -> dict:
    """Trains, puts the weights back, exports them and restores a fresh model from the
    checkpoint. Returns what a caller may look at: the model, the step, the final state, the
    batches, each step's metrics and the restored model."""
    data = batches()
    trained = [next(data) for _ in range(steps)]
    model = GPT(nnx.Rngs(0))
    step = build(model, trained[0], clip_norm)
    state, history = step.init_state(), []
    for i, batch in enumerate(trained):
        state, metrics = step.train_step(state, batch)
        history.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
        if (i + 1) % 20 == 0 or i + 1 == steps:
            print(f"step {i + 1:3d}  loss {history[-1]['loss']:.3f}  "
                  f"grad_norm {history[-1]['grad_norm']:.3f}")
    step.params_to(model, state)
    path = step.export(state, Path(folder or tempfile.mkdtemp()) / "gpt")
    restored = GPT(nnx.Rngs(1))  # a fresh model, then the checkpoint's weights into it
    params = nnx.state(restored, nnx.Param)
    nnx.replace_by_pure_dict(params, ocp.StandardCheckpointer().restore(path))
    nnx.update(restored, params)
    held_out = next(batches(seed=1))
    print(f"held-out loss: trained {mean_loss(model, held_out):.3f}, "
          f"restored {mean_loss(restored, held_out):.3f}")
    return {"model": model, "step": step, "state": state, "batches": trained,
            "history": history, "restored": restored, "held_out": held_out}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    main(parser.parse_args().steps)
