"""Compact Adam moments (`optim.state_dtype`): bfloat16, or 8-bit codes with a scale per block.

fp32 AdamW keeps 8 bytes of moments per parameter; `bfloat16` keeps 4 and `int8` about 2.03.
Master weights stay fp32 in every mode, and the step's arithmetic stays fp32: the stored
moments are widened, the new moments and the update are computed in fp32 exactly as
`optax.adamw` does, the update uses these fp32 moments, and only then are they stored
compactly. Matrices (ndim >= 2) get compact moments; vectors (norms, biases) keep fp32, a
negligible share of the bytes.

    opt = compact_adam(schedule, b1, b2, eps, weight_decay, mask, state_dtype="int8")

The same functions serve the reference trainer and the device update (JAX) and the host
kernel's NumPy fallback (`host_moments`); the numba kernel (host_compact.py) implements
this arithmetic element for element, and the tests hold the two to bit equality.

`bfloat16`: the fp32 moment rounded to nearest even. With b2 close to 1 an update of nu
smaller than half a bf16 unit (about 0.2%) is lost: (1 - b2) should stay above about 0.005.

`int8`: each row of a matrix is cut into blocks of BLOCK values along its last axis; a block
stores its largest magnitude (fp32) and one byte per value, the nearest entry of a fixed
table of 255 values in [-1, 1] (mu) or [0, 1] (the square root of nu). The tables are
decade-spaced, with twice as many points in each decade as in the one below it (SIGNED: 1,
2, ..., 64 points per decade over 1e-6..1; UNSIGNED: 2, ..., 128), so a value is kept to a
few percent of itself over six decades and to under 1% near the block's top, where the
updates that matter are: the same idea as 8-bit Adam's dynamic quantization. nu is stored
as its square root because Adam divides by sqrt(nu): the code's relative error is then the
denominator's, and six decades of sqrt(nu) span twelve of nu. A nonzero nu never rounds to
zero (it would divide by eps alone): it takes the smallest nonzero code. Blocks of 256 cost
4/256 byte per value for the scale and keep outliers from flattening more than a block.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.config import MOMENT_BLOCK as BLOCK


def _table(points_per_decade: list[int]) -> np.ndarray:
    """Positive values in (0, 1]: decade d (of len(points) ending at 1) holds its count of
    evenly spaced points, the decade's top included."""
    top_decade = len(points_per_decade) - 1
    values = [10.0 ** (d - top_decade) * np.linspace(0.1, 1.0, n + 1)[1:]
              for d, n in enumerate(points_per_decade)]
    return np.concatenate(values)


_positive = _table([2**d for d in range(7)])                   # 127 values
SIGNED = np.concatenate([-_positive[::-1], [0.0], _positive]).astype(np.float32)
UNSIGNED = np.concatenate([[0.0], _table([2**(d + 1) for d in range(7)])]).astype(np.float32)
# A value's code is the count of midpoints below it: the nearest entry, ties to the lower.
SIGNED_MID = ((SIGNED[1:] + SIGNED[:-1]) / np.float32(2)).astype(np.float32)
UNSIGNED_MID = ((UNSIGNED[1:] + UNSIGNED[:-1]) / np.float32(2)).astype(np.float32)
SIGNED_ZERO = int(np.flatnonzero(SIGNED == 0)[0])


def code_starts(mid: np.ndarray) -> np.ndarray:
    """For the host kernel: per value of an fp32's top 16 bits, the count of midpoints below
    every value with those bits. A value's code is this start, plus one where the next
    midpoint is below the value: a bucket of values (1/128 of an octave) never holds two
    midpoints, whose gaps are wider (checked here)."""
    keys = np.arange(1 << 16, dtype=np.uint32)
    lowest = np.where(keys < 0x8000, keys << 16, (keys << 16) | 0xFFFF).view(np.float32)
    highest = np.where(keys < 0x8000, (keys << 16) | 0xFFFF, keys << 16).view(np.float32)
    finite = np.isfinite(lowest) & np.isfinite(highest)
    starts = np.searchsorted(mid, np.where(finite, lowest, 0.0), side="left")
    ends = np.searchsorted(mid, np.where(finite, highest, 0.0), side="left")
    assert np.all(ends - starts <= 1), "a bucket holds two midpoints: use more bits"
    return starts.astype(np.uint8)


SIGNED_STARTS, UNSIGNED_STARTS = code_starts(SIGNED_MID), code_starts(UNSIGNED_MID)


class Int8Moment(NamedTuple):
    """One matrix's moment in 8 bits: `codes` [..., F] index the table, `scales`
    [..., ceil(F / BLOCK)] are each block's largest magnitude."""

    codes: jax.Array
    scales: jax.Array


def is_compact(param) -> bool:
    return len(param.shape) >= 2


def blocks_of(columns: int) -> int:
    return -(-columns // BLOCK)


def zeros(param, state_dtype: str, signed: bool):
    """The zero moment of `param` in `state_dtype` (fp32 for vectors)."""
    if state_dtype == "float32" or not is_compact(param):
        return jnp.zeros(param.shape, jnp.float32)
    if state_dtype == "bfloat16":
        return jnp.zeros(param.shape, jnp.bfloat16)
    zero_code = SIGNED_ZERO if signed else 0
    return Int8Moment(jnp.full(param.shape, zero_code, jnp.uint8),
                      jnp.zeros((*param.shape[:-1], blocks_of(param.shape[-1])), jnp.float32))


# ----- widen and store, for any array module (jax.numpy or numpy) --------------------------

def _per_block(xp, x):
    """[..., F] -> [..., blocks, BLOCK], the tail zero-padded."""
    f = x.shape[-1]
    pad = blocks_of(f) * BLOCK - f
    if pad:
        x = xp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], blocks_of(f), BLOCK)


def _per_value(xp, x, columns: int):
    return x.reshape(*x.shape[:-2], -1)[..., :columns]


def widen(xp, moment, signed: bool):
    """The fp32 moment (nu itself, not its root) from its stored form."""
    if not isinstance(moment, Int8Moment):
        return moment.astype(np.float32)
    table = xp.asarray(SIGNED if signed else UNSIGNED)
    values = _per_block(xp, table[moment.codes]) * moment.scales[..., None]
    values = _per_value(xp, values, moment.codes.shape[-1])
    return values if signed else values * values


def store(xp, value, like, signed: bool):
    """`value` (fp32, nu itself) in the stored form of `like`."""
    if not isinstance(like, Int8Moment):
        return value.astype(like.dtype)
    if not signed:
        value = xp.sqrt(value)
    blocks = _per_block(xp, value)
    scales = xp.max(xp.abs(blocks), axis=-1)
    # A product with the scale's reciprocal: the same in every program (XLA may or may not
    # turn a division by a broadcast into one) and in the host kernel.
    unit = blocks * (np.float32(1) / xp.where(scales > 0, scales, np.float32(1)))[..., None]
    codes = xp.searchsorted(xp.asarray(SIGNED_MID if signed else UNSIGNED_MID), unit)
    if not signed:  # a nonzero nu keeps a nonzero code
        codes = xp.where((codes == 0) & (unit > 0), 1, codes)
    codes = _per_value(xp, codes, value.shape[-1]).astype(np.uint8)
    return Int8Moment(codes, scales.astype(np.float32))


def moments(xp, g, mu, nu, b1: float, b2: float):
    """The step's fp32 moments from the gradient and the stored ones, and their new stored
    forms: (m, v, mu', nu')."""
    m = (1 - b1) * g + b1 * widen(xp, mu, signed=True)
    v = (1 - b2) * (g * g) + b2 * widen(xp, nu, signed=False)
    return m, v, store(xp, m, mu, signed=True), store(xp, v, nu, signed=False)


# ----- the Optax transformation ----------------------------------------------------------

def scale_by_compact_adam(b1: float, b2: float, eps: float,
                          state_dtype: str) -> optax.GradientTransformation:
    """`optax.scale_by_adam` with moments stored in `state_dtype`; the state is an
    `optax.ScaleByAdamState` whose mu and nu leaves are arrays or `Int8Moment`s."""

    def init(params):
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: zeros(p, state_dtype, signed=True), params),
            nu=jax.tree.map(lambda p: zeros(p, state_dtype, signed=False), params))

    def update(updates, state, params=None):
        del params
        grads, treedef = jax.tree.flatten(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        count = optax.safe_int32_increment(state.count)
        # As optax computes them: an fp32 decay to an int32 power.
        # As optax computes them (an fp32 decay to an int32 power), applied as products with
        # their reciprocals: XLA turns a division by a scalar into such a product in some
        # programs and not in others; an explicit product is the same in every program and
        # in the host kernels.
        rbc1, rbc2 = (1 / (1 - jnp.asarray(b, jnp.float32) ** count) for b in (b1, b2))
        steps, new_mu, new_nu = [], [], []
        for g, mu, nu in zip(grads, mus, nus):
            m, v, mu, nu = moments(jnp, g, mu, nu, b1, b2)
            steps.append((m * rbc1) / (jnp.sqrt(v * rbc2) + eps))
            new_mu.append(mu)
            new_nu.append(nu)
        return treedef.unflatten(steps), optax.ScaleByAdamState(
            count, treedef.unflatten(new_mu), treedef.unflatten(new_nu))

    return optax.GradientTransformation(init, update)


def compact_adam(learning_rate: Callable, b1: float, b2: float, eps: float,
                 weight_decay: float, mask: Callable | None,
                 state_dtype: str) -> optax.GradientTransformation:
    """`optax.adamw` (`optax.adam` without weight decay) with compact moments: the same chain,
    so the state's layout (adam state first, the schedule's count last) is the same."""
    adam = scale_by_compact_adam(b1, b2, eps, state_dtype)
    if weight_decay:
        return optax.chain(adam, optax.add_decayed_weights(weight_decay, mask),
                           optax.scale_by_learning_rate(learning_rate))
    return optax.chain(adam, optax.scale_by_learning_rate(learning_rate))


def is_moment(x) -> bool:
    """A leaf of a moment tree: an array or an Int8Moment (for `jax.tree.leaves`)."""
    return isinstance(x, Int8Moment)


def convert(tree, target, put: Callable):
    """`tree` (arrays) with the moments of every Adam state in the form `target` holds them
    (a tree of the same state in another optim.state_dtype, as ShapeDtypeStructs or arrays).
    A moment of another form is widened to fp32 and stored anew on the host, then placed by
    `put(value, like)` (a target leaf); the other leaves are `tree`'s own. Moments rounded to
    a compact form stay rounded: widening them back gives the values they stood for."""

    def form(moment):  # "int8", or the dtype of a moment held as one array
        return "int8" if isinstance(moment, Int8Moment) else np.dtype(moment.dtype).name

    def convert_moments(like, moments, signed: bool):
        def one(like, moment):
            if form(like) == form(moment):
                return moment
            held = Int8Moment(*map(np.asarray, moment)) if isinstance(moment, Int8Moment) \
                else np.asarray(moment)
            stored = store(np, widen(np, held, signed), like, signed)
            if isinstance(stored, Int8Moment):
                return Int8Moment(put(stored.codes, like.codes), put(stored.scales, like.scales))
            return put(stored, like)

        return jax.tree.map(one, like, moments, is_leaf=is_moment)

    def convert_state(like, state):
        if not isinstance(like, optax.ScaleByAdamState):
            return state
        return state._replace(mu=convert_moments(like.mu, state.mu, signed=True),
                              nu=convert_moments(like.nu, state.nu, signed=False))

    return jax.tree.map(convert_state, target, tree,
                        is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))


# ----- the host kernel's NumPy fallback --------------------------------------------------

def host_moments(p, g, mu, nu, scale, b1, b2, eps, rbc1, rbc2, neg_lr, wd) -> None:
    """One step in place on NumPy views of a shard: p and g [rows, F] (g fp32), mu and nu as
    stored (bfloat16 arrays, or Int8Moments of views); every scalar an np.float32."""
    g = g * scale
    m, v, new_mu, new_nu = moments(np, g, mu, nu, b1, b2)
    u = (m * rbc1) / (np.sqrt(v * rbc2) + eps)
    if wd:
        u = u + wd * p
    p += neg_lr * u
    for old, new in ((mu, new_mu), (nu, new_nu)):
        if isinstance(old, Int8Moment):
            old.codes[...], old.scales[...] = new.codes, new.scales
        else:
            old[...] = new

