"""Long sequences: rotary angles exact far out, the blockwise attention, the sequence-tiled
MLP, a streamed step with both against the plain reference, and the planner's activation
accounting (CPU, fp32, a width-32 model)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from conftest import max_rel_error

from megatrain_jax.config import RopeScaling, auto
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


# ----- attention ---------------------------------------------------------------------------

def _qkv(b, s, h, k, e, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (b, s, h, e)), jax.random.normal(keys[1], (b, s, k, e)),
            jax.random.normal(keys[2], (b, s, k, e)), jax.random.normal(keys[3], (b, s, h, e)))


def _value_and_vjp(impl, chunk=64):
    def run(q, k, v, dout, segments):
        out, vjp = jax.vjp(lambda *a: ops.attention(*a, impl, segments, chunk), q, k, v)
        return out, vjp(dout)
    return jax.jit(run)


def test_blockwise_attention_equals_xla():
    """200 tokens in chunks of 64 (the last one padded), two query heads per kv head; row 0
    packs three segments that attend within themselves only, row 1 is one sequence."""
    q, k, v, dout = _qkv(2, 200, 4, 2, 16)
    segments = jnp.stack([jnp.repeat(jnp.arange(1, 4), jnp.array([70, 64, 66]),
                                     total_repeat_length=200), jnp.ones(200, jnp.int32)])
    want, want_grads = _value_and_vjp("xla")(q, k, v, dout, segments)
    got, grads = _value_and_vjp("blockwise")(q, k, v, dout, segments)
    assert max_rel_error(got, want) <= 1e-5
    assert max_rel_error(grads, want_grads) <= 1e-5


def test_blockwise_attention_never_holds_the_score_matrix():
    q, k, v, _ = _qkv(1, 2048, 2, 1, 8)

    def temp_bytes(impl):
        fn = jax.jit(lambda q, k, v: jax.vjp(
            lambda *a: ops.attention(*a, impl, None, 128), q, k, v)[1](q))
        return fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    one_score_matrix = 2 * 2048 * 2048 * 4  # H S S fp32
    assert temp_bytes("xla") > one_score_matrix
    assert temp_bytes("blockwise") < one_score_matrix / 16


def test_auto_attention_path_by_length():
    assert auto.attention_path("auto", auto.CUDNN_MAX_SEQ, True, 2) == "cudnn"
    assert auto.attention_path("auto", auto.CUDNN_MAX_SEQ + 1, True, 2) == "blockwise"
    assert auto.attention_path("auto", auto.XLA_MAX_SEQ, False, 4) == "xla"
    assert auto.attention_path("auto", auto.XLA_MAX_SEQ + 1, True, 4) == "blockwise"
    assert auto.attention_path("xla", 10**6, True, 2) == "xla"
