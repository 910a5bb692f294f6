"""FP8 projections (`model.fp8_matmuls`): a dot of two tensors in FP8 with per-tensor current
scaling, and the check that a GPU has FP8 tensor cores.

    y = fp8.scaled_dot(x, w)      # x [..., K], w [K, N] in the compute dtype -> [..., N]

Each operand is scaled so that its largest magnitude (amax, of this very tensor: no history
kept across steps) lands on the FP8 format's largest finite value, rounded to FP8, multiplied
with fp32 accumulation, and the product unscaled in fp32. The forward rounds activations and
weights to E4M3 (more mantissa); the backward rounds the incoming gradient to E5M2 (more
range) and reuses the forward's E4M3 operands, so the backward keeps FP8 tensors only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from megatrain_jax.config.errors import ConfigError

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FORMATS = (jnp.dtype(E4M3), jnp.dtype(E5M2))
# The name of a projection's output (`project`): what a layer that saves its matmuls' outputs
# keeps of an FP8 dot, whose own output is fp32 (stream/programs.py).
OUTPUT_NAME = "fp8_projection"
# FP8 tensor cores: Ada (8.9), Hopper (9.0) and later.
MIN_COMPUTE_CAPABILITY = (8, 9)


def quantize(x, fp8_dtype):
    """(x * scale rounded to `fp8_dtype`, 1 / scale fp32) with x's amax mapped onto the
    format's largest value. An all-zero x gets scale 1."""
    top = float(jnp.finfo(fp8_dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    scale = jnp.where(amax > 0, top / jnp.where(amax > 0, amax, 1.0), 1.0)
    # The clip keeps fp32 rounding of amax * scale from leaving the range: e4m3fn has no
    # infinity, and a value past its largest would become NaN.
    q = jnp.clip(x32 * scale, -top, top).astype(fp8_dtype)
    return q, 1.0 / scale


def _dot(a, b, contract_a: int, contract_b: int):
    """a and b's dot over one axis each, accumulated in fp32."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def project(x, w):
    """scaled_dot(x, w), its output named OUTPUT_NAME for jax.checkpoint's policies."""
    return checkpoint_name(scaled_dot(x, w), OUTPUT_NAME)


def is_fp8_dot(prim, *avals) -> bool:
    """Whether a primitive of a traced program is a dot of FP8 operands."""
    return prim is jax.lax.dot_general_p and any(
        getattr(a, "dtype", None) in FORMATS for a in avals)


@jax.custom_vjp
def scaled_dot(x, w):
    """x [..., K] @ w [K, N] as an FP8 dot (E4M3 operands, per-tensor current scaling), in
    x's dtype. Its gradients are FP8 dots too (E5M2 gradient against the E4M3 operands)."""
    return _forward(x, w)[0]


def _forward(x, w):
    qx, sx = quantize(x, E4M3)
    qw, sw = quantize(w, E4M3)
    y = _dot(qx, qw, x.ndim - 1, 0) * (sx * sw)
    return y.astype(x.dtype), (qx, sx, qw, sw, x.dtype, w.dtype)


def _backward(saved, g):
    qx, sx, qw, sw, x_dtype, w_dtype = saved
    qg, sg = quantize(g, E5M2)
    dx = _dot(qg, qw, qg.ndim - 1, 1) * (sg * sw)  # [..., N] . [K, N] over N
    k, n = qx.shape[-1], qg.shape[-1]
    dw = _dot(qx.reshape(-1, k), qg.reshape(-1, n), 0, 0) * (sx * sg)  # over the tokens
    # The forward's dtypes come back as zero-size arrays' dtypes: custom_vjp residuals must
    # be arrays, not dtype objects.
    return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


def _forward_rule(x, w):
    y, (qx, sx, qw, sw, x_dtype, w_dtype) = _forward(x, w)
    return y, (qx, sx, qw, sw, jnp.zeros((0,), x_dtype), jnp.zeros((0,), w_dtype))


scaled_dot.defvjp(_forward_rule, _backward)


def check_devices(devices) -> None:
    """Refuses model.fp8_matmuls=true on a GPU without FP8 tensor cores (older than Ada or
    Hopper), naming it. The CPU runs FP8 dots (XLA emulates them): allowed, for tests."""
    for device in devices:
        if device.platform != "gpu":
            continue
        capability = getattr(device, "compute_capability", None)
        if capability is None:  # not a CUDA device (ROCm): FP8 dots are not known to work
            found = "no CUDA compute capability"
        else:
            major, minor = (int(part) for part in str(capability).split(".")[:2])
            if (major, minor) >= MIN_COMPUTE_CAPABILITY:
                continue
            found = f"compute capability {capability}"
        raise ConfigError(
            f"model.fp8_matmuls=true needs a GPU with FP8 tensor cores (compute capability "
            f"8.9 or later: Ada, Hopper, Blackwell); {device.device_kind} has {found}: set "
            "model.fp8_matmuls=false.")
