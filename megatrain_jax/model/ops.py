"""Building blocks of a Llama-family layer: RMSNorm, rotary embeddings, attention, SwiGLU,
and a cross-entropy computed in token chunks so that the full logits never exist.

Dims: B batch, S sequence, D hidden, H query heads, K kv heads, E head dim, F ffn, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from megatrain_jax.config import RopeScaling


def rms_norm(x, weight, eps: float):
    """Normalizes in fp32 whatever the compute dtype, then returns x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling):
    """Inverse frequencies [E/2], with Llama-3.1-style band scaling when asked."""
    # iota, not arange: an op in the trace rather than a constant captured by it
    steps = jax.lax.iota(jnp.float32, head_dim // 2) * 2
    inv = 1.0 / (theta ** (steps / head_dim))
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind != "llama3":
        return inv
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, blended)
    return jnp.where(wavelen < high_wavelen, inv, scaled)


def apply_rope(x, positions, inv_freq):
    """Rotates x [B, S, N, E] by positions [B, S]; halves convention (as Hugging Face stores)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # B S E/2
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def pick_attention(requested: str, dtype) -> str | None:
    """`auto`: cuDNN on a GPU with a 16-bit dtype (it needs one), XLA otherwise."""
    if requested == "xla":
        return "xla"
    if requested == "cudnn":
        return "cudnn"
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and jnp.dtype(dtype).itemsize == 2 else "xla"


def attention(q, k, v, implementation: str | None, segment_ids=None):
    """Causal grouped-query attention. q [B, S, H, E], k and v [B, S, K, E], H % K == 0."""
    mask = None
    if segment_ids is not None:  # packed sequences: attend only within one's own segment
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation=implementation
    )


def swiglu(x, w_gate, w_up, w_down):
    gate = jnp.einsum("bsd,df->bsf", x, w_gate)
    up = jnp.einsum("bsd,df->bsf", x, w_up)
    return jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, w_down)


def chunked_cross_entropy(hidden, out_weight, targets, mask, chunk: int):
    """Sum over tokens of mask * cross-entropy, without materializing [N, V] logits.

    hidden [N, D], out_weight [D, V], targets [N] int, mask [N] float. Tokens are split into
    chunks of `chunk`; each chunk's logits are recomputed in the backward pass (checkpoint).
    """
    n = hidden.shape[0]
    chunk = min(chunk, n)
    pad = (-n) % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad))
        mask = jnp.pad(mask, (0, pad))
    steps = (n + pad) // chunk

    @jax.checkpoint
    def chunk_loss(h, t, m):
        logits = jnp.einsum("nd,dv->nv", h, out_weight, preferred_element_type=jnp.float32)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        return jnp.sum((logz - picked) * m)

    def body(total, xs):
        return total + chunk_loss(*xs), None

    shaped = (
        hidden.reshape(steps, chunk, -1),
        targets.reshape(steps, chunk),
        mask.reshape(steps, chunk).astype(jnp.float32),
    )
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), shaped)
    return total
