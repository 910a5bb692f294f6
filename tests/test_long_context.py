"""Long sequences: rotary angles exact far out, the blockwise attention, the sequence-tiled
MLP, a streamed step with both against the plain reference, and the planner's activation
accounting (CPU, fp32, a width-32 model)."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.config import RopeScaling
from megatrain_jax.model import ops

GiB = 2**30
LLAMA31 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


# ----- rotary embeddings -------------------------------------------------------------------

def _reference_frequencies(head_dim, theta, s):
    """Llama 3.1's frequencies, written out element by element in float64."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / math.pow(theta, i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen > s.original_max_position / s.low_freq_factor:
            f = f / s.factor
        elif wavelen >= s.original_max_position / s.high_freq_factor:
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            f = (1 - smooth) * f / s.factor + smooth * f
        out.append(f)
    return np.array(out)


def test_rope_angles_are_exact_near_half_a_million_positions():
    inv = ops.rope_frequencies(128, 500000.0, LLAMA31)
    np.testing.assert_allclose(inv, _reference_frequencies(128, 500000.0, LLAMA31), rtol=1e-15)
    positions = np.concatenate([np.arange(524287 - 255, 524288), [2**24 - 1, -524287, 0, 1]])
    cos, sin = jax.jit(ops.rope_angles, static_argnums=1)(
        jnp.asarray(positions[None], jnp.int32), tuple(inv))
    angles = positions[None, :, None].astype(np.float64) * inv  # float64 throughout
    assert np.max(np.abs(np.asarray(cos) - np.cos(angles))) < 1e-6
    assert np.max(np.abs(np.asarray(sin) - np.sin(angles))) < 1e-6
    # The plain fp32 product misses by far more at these positions: the test can tell.
    naive = positions[None, :, None].astype(np.float32) * inv.astype(np.float32)
    assert np.max(np.abs(np.cos(naive.astype(np.float64)) - np.cos(angles))) > 1e-3
    # Rotating a vector: as float64 does it, to fp32 rounding.
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, positions.size, 2, 128)))
    x1, x2 = x[..., :64], x[..., 64:]
    c, s = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    expected = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    rotated = ops.apply_rope(jnp.asarray(x), jnp.asarray(positions[None]), inv)
    np.testing.assert_allclose(rotated, expected, atol=5e-6)
