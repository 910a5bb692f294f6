"""Building blocks of a Llama-family layer: RMSNorm, rotary embeddings exact at long
positions, attention (XLA, cuDNN or blockwise), a SwiGLU MLP that can run in sequence tiles,
and a cross-entropy computed in token chunks so that the full logits never exist.

Dims: B batch, S sequence, D hidden, H query heads, K kv heads, E head dim, F ffn, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.config import RopeScaling, auto
from megatrain_jax.model import blockwise, fp8


def rms_norm(x, weight, eps: float):
    """Normalizes in fp32 whatever the compute dtype, then returns x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies [E/2] in float64, on the host, with Llama-3.1-style band scaling
    when asked. They depend on the config only; `rope_angles` turns them into exact angles."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
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
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, blended)
    return np.where(wavelen < high_wavelen, inv, scaled)


_DIGIT = 12  # bits per base-4096 digit of a frequency's turns, and of a position's low part


def _turn_digits(inv_freq: np.ndarray) -> np.ndarray:
    """int32 [4, E/2]: the first four base-4096 digits of each frequency's turns per position
    (inv_freq / 2pi, fractional part), 48 bits: truncation errs by < 2**-48 turns a position."""
    turns = np.mod(np.asarray(inv_freq, np.float64) / (2 * math.pi), 1.0)
    digits = []
    for _ in range(4):
        turns = turns * 2**_DIGIT
        digits.append(np.floor(turns))
        turns = turns - digits[-1]
    return np.stack(digits).astype(np.int32)


def rope_angles(positions, inv_freq: np.ndarray):
    """(cos, sin) [..., E/2] fp32 of positions [...] (int, |p| < 2**24) times inv_freq.

    fp32 `positions * inv_freq` is off by up to 0.03 rad at 5e5 positions (the product's own
    rounding; the frequency's adds as much). Here the angle is reduced in whole turns exactly:
    the position splits into p = hi * 4096 + lo (12 bits each) and the turns per position into
    four 12-bit digits m_k (float64 on the host), so every product hi*m_k, lo*m_k is an exact
    fp32 integer, and so is its fractional part once scaled by a power of two. Summing those
    fractions, each kept in [-1/2, 1/2], errs by a few 2**-25 turns: |error| < 1e-6 rad.
    """
    m = jnp.asarray(_turn_digits(inv_freq)).astype(jnp.float32)  # int constants: never trained
    p = positions.astype(jnp.int32)[..., None]
    hi = jnp.right_shift(p, _DIGIT).astype(jnp.float32)  # arithmetic shift: negatives too
    lo = jnp.bitwise_and(p, 2**_DIGIT - 1).astype(jnp.float32)
    # p * turns = sum_k (hi * 4096 + lo) * m_k * 4096**-k; hi * m_1 is whole turns. Smallest
    # first, so that the rounding of the large ones comes last and once.
    terms = [lo * m[3] * 2.0**-48, hi * m[3] * 2.0**-36, lo * m[2] * 2.0**-36,
             hi * m[2] * 2.0**-24, lo * m[1] * 2.0**-24, hi * m[1] * 2.0**-12,
             lo * m[0] * 2.0**-12]
    turns = jnp.zeros_like(terms[0])
    for t in terms:
        turns = turns + (t - jnp.round(t))
        turns = turns - jnp.round(turns)
    angle = turns * jnp.float32(2 * math.pi)
    return jnp.cos(angle), jnp.sin(angle)


def rotate(x, cos, sin):
    """Rotates x [B, S, N, E] by cos, sin [B, S, E/2]; halves convention (as Hugging Face)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def apply_rope(x, positions, inv_freq):
    """Rotates x [B, S, N, E] by positions [B, S] and host frequencies `inv_freq` [E/2]."""
    return rotate(x, *rope_angles(positions, inv_freq))


def pick_attention(requested: str, dtype, seq_len: int = 0, packed: bool = False) -> str:
    """What `model.attention=requested` runs here at `seq_len`, for rows with segment ids
    where `packed` (config/auto.py's rule)."""
    return auto.attention_path(requested, seq_len, jax.default_backend() == "gpu",
                               jnp.dtype(dtype).itemsize, packed)


def attention(q, k, v, implementation: str, segment_ids=None, chunk: int = 0):
    """Causal grouped-query attention. q [B, S, H, E], k and v [B, S, K, E], H % K == 0.

    `blockwise` runs over chunks of `chunk` tokens (0: config/auto.py's) and never holds
    [S, S] scores; `xla` and `cudnn` are jax.nn.dot_product_attention's.
    """
    if implementation == "blockwise":
        return blockwise.attention(q, k, v, segment_ids, auto.attention_chunk(chunk, q.shape[1]))
    mask = None
    if segment_ids is not None:  # packed sequences: attend only within one's own segment
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation=implementation
    )


def project(x, w, float8: bool = False):
    """x [..., K] @ w [K, N]: a projection of the layer, as an FP8 dot where `float8`
    (model.fp8_matmuls; fp8.py), else in the operands' dtype."""
    if float8:
        return fp8.project(x, w)
    return jnp.einsum("...k,kn->...n", x, w)


def swiglu(x, w_gate, w_up, w_down, float8: bool = False):
    gate = project(x, w_gate, float8)
    up = project(x, w_up, float8)
    return project(jax.nn.silu(gate) * up, w_down, float8)


def residual_mlp(x, norm, w_gate, w_up, w_down, eps: float, dtype, tile: int = 0,
                 float8: bool = False):
    """x + SwiGLU(RMSNorm(x)) of x [B, S, D], the weights cast to `dtype` here; its three
    projections FP8 dots where `float8`.

    With `tile` > 0 the B*S tokens go through in tiles of `tile` (the last one padded), each
    recomputed in the backward (jax.checkpoint): only one tile's [tile, F] activations ever
    exist, and a token's arithmetic is the same as untiled. The weights arrive as the fp32
    masters and are cast inside a tile, so that their gradient sums over tiles in fp32.
    """

    def block(h, norm, w_gate, w_up, w_down):
        def cast(w):
            return w.astype(dtype)

        return h + swiglu(rms_norm(h, cast(norm), eps), cast(w_gate), cast(w_up), cast(w_down),
                          float8)

    weights = (norm, w_gate, w_up, w_down)
    if not tile:
        return block(x, *weights)
    b, s, d = x.shape
    n = b * s
    flat = x.reshape(n, d)
    pad = (-n) % tile
    if pad:  # zero rows: their norm is 0 * rsqrt(eps), no NaN, and they are cut off below
        flat = jnp.pad(flat, ((0, pad), (0, 0)))
    one_tile = jax.checkpoint(lambda t: block(t, *weights))
    out = jax.lax.map(one_tile, flat.reshape(-1, tile, d))  # n/tile, tile, D
    return out.reshape(-1, d)[:n].reshape(b, s, d)


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
