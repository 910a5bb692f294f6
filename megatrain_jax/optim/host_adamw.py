"""AdamW on the host, in place on the pinned buffers of the host store.

The streaming engine keeps every parameter and optimizer state in `pinned_host` arrays. An
update compiled by XLA reads them through the device and writes new buffers back; this one
instead writes the new values into the same host memory, so it costs one pass over the
bytes and no transfer, and it runs on a worker thread while the GPU computes.

    opt = HostAdamW(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask)
    opt_state = opt.optax.init(params)      # the very state `optax.adamw` keeps
    opt.update(params, grads, opt_state, scale=0.5)   # params and opt_state change in place

The arithmetic is `optax.adamw`'s, in fp32, leaf by leaf, and so is the state layout, so a
checkpoint or a reference run cannot tell the two apart. The kernel is a fused numba loop
(numba is a dependency) and, where numba cannot be imported, chunked NumPy on a thread pool,
about 18x slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.config import STATE_DTYPES
from megatrain_jax.optim import adamw_inverse, compact, host_compact
from megatrain_jax.optim.compact import Int8Moment
from megatrain_jax.optim.grad_bits import bf16_to_f32, numba_tools

_CTYPES = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.int32): ctypes.c_int32,
           np.dtype(jnp.bfloat16): ctypes.c_uint16,  # bf16 seen as its bits
           np.dtype(np.uint8): ctypes.c_uint8}


def writable(array: jax.Array) -> np.ndarray:
    """A writable NumPy view of a host-resident JAX array's buffer (no copy).

    JAX arrays are immutable to JAX; the engine owns the host store and writes into it
    only where no computation or transfer can be reading the buffer.
    """
    device = next(iter(array.devices()))
    if device.platform != "cpu" and array.sharding.memory_kind == device.default_memory().kind:
        raise ValueError("host updates need arrays in host memory, got one in memory kind "
                         f"{array.sharding.memory_kind!r}")
    array.block_until_ready()
    dtype = np.dtype(array.dtype)
    if dtype not in _CTYPES:
        raise TypeError(f"host updates support float32, int32, bfloat16 and uint8 leaves, not "
                        f"{dtype}")
    size = max(int(np.prod(array.shape)), 1)
    raw = (_CTYPES[dtype] * size).from_address(array.unsafe_buffer_pointer())
    return np.ctypeslib.as_array(raw).reshape(-1)


def on_host_cpu():
    """A context in which JAX computes on the host's CPU. The update's scalars (the learning
    rate, the bias corrections) are computed there: on the default device, a GPU, each would
    queue behind the step's dispatched compute and transfers, and the update with it."""
    try:
        return jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu): the default device
        return contextlib.nullcontext()


def shard_views(array: jax.Array) -> list[np.ndarray]:
    """`writable` views of this process's shards of a host array, in its devices' order (one
    view for an array on one device). A leaf split over a mesh has one shard per device; a
    leaf kept whole on every device has a copy per device, each updated alike."""
    return [writable(shard.data) for shard in array.addressable_shards]


def shard_index(array: jax.Array) -> list:
    return [shard.index for shard in array.addressable_shards]


# ----- kernels: p, mu, nu are flat fp32 views, g fp32 or bf16 bits (uint16); every scalar
# an np.float32 -----------------------------------------------------------------------------

def _adamw_numpy(p, g, mu, nu, scale, b1, omb1, b2, omb2, eps, bc1, bc2, neg_lr, wd,
                 pool: ThreadPoolExecutor, chunk: int = 1 << 15):
    """Chunked so the temporaries of each chunk stay in cache; chunks shared by threads."""

    def run(start: int):
        stop = min(start + chunk, p.size)
        ps, gs, ms, vs = p[start:stop], g[start:stop], mu[start:stop], nu[start:stop]
        if gs.dtype == np.uint16:
            gs = bf16_to_f32(gs)
        t1, t2 = np.multiply(gs, scale), np.empty_like(gs)
        np.multiply(t1, omb1, out=t2)
        np.multiply(ms, b1, out=ms)
        np.add(t2, ms, out=ms)                    # mu = (1-b1) g + b1 mu
        np.multiply(t1, t1, out=t1)
        np.multiply(t1, omb2, out=t1)
        np.multiply(vs, b2, out=vs)
        np.add(t1, vs, out=vs)                    # nu = (1-b2) g^2 + b2 nu
        np.divide(ms, bc1, out=t1)
        np.divide(vs, bc2, out=t2)
        np.sqrt(t2, out=t2)
        np.add(t2, eps, out=t2)
        np.divide(t1, t2, out=t1)                 # mu_hat / (sqrt(nu_hat) + eps)
        if wd:
            np.multiply(ps, wd, out=t2)
            np.add(t1, t2, out=t1)
        np.multiply(t1, neg_lr, out=t1)
        np.add(ps, t1, out=ps)

    list(pool.map(run, range(0, p.size, chunk)))


# Elements per task of the host kernel: each thread takes whole chunks, each within one shard.
CHUNK = 1 << 16


@functools.cache  # one per process: numba compiles a new closure again
def _numba_kernel() -> Callable | None:
    if (tools := numba_tools()) is None:
        return None
    numba, widen, store, _, _ = tools

    # error_model="numpy": a division by zero gives inf rather than raising; without it (and
    # with an index that could be negative) numba does not vectorize the loop.
    @numba.njit(parallel=True, nogil=True, fastmath=False, cache=True, error_model="numpy")
    def adamw(ps, gs, mus, nus, scale, b1, omb1, b2, omb2, eps, bc1, bc2, neg_lr, wd,
              reciprocal):
        """One leaf's update: ps, gs, mus, nus are tuples of its shards' flat views, every
        shard the same size (a one-tuple on one device), all updated in one parallel loop.
        mu and nu fp32, or bf16 bits (compact.py's `bfloat16`: read widened, stored rounded,
        the update from the fp32 values). bc1, bc2: the bias corrections, or with
        `reciprocal` (compact moments) their reciprocals, by which compact.py multiplies."""
        size = ps[0].size
        chunks = (size + CHUNK - 1) // CHUNK
        for task in numba.prange(len(ps) * chunks):
            shard = task // chunks
            start = (task - shard * chunks) * CHUNK
            stop = min(start + CHUNK, size)
            p, g = ps[shard][start:stop], gs[shard][start:stop]
            mu, nu = mus[shard][start:stop], nus[shard][start:stop]
            for i in range(p.size):
                gi = widen(g[i]) * scale
                m = omb1 * gi + b1 * widen(mu[i])
                v = omb2 * (gi * gi) + b2 * widen(nu[i])
                store(mu, i, m)
                store(nu, i, v)
                if reciprocal:
                    u = (m * bc1) / (np.sqrt(v * bc2) + eps)
                else:
                    u = (m / bc1) / (np.sqrt(v / bc2) + eps)
                if wd != 0:
                    u = u + wd * p[i]
                p[i] = p[i] + neg_lr * u

    return adamw


class HostAdamW:
    """`optax.adamw` (or `adam` with `weight_decay=0`) as an in-place host update.

    kernel: "auto" (numba when installed, else numpy), "numba" or "numpy".
    state_dtype: the moments' storage, "float32", "bfloat16" or "int8" (compact.py); only
    fp32 moments can be undone exactly (`can_undo`), so only they are updated speculatively.
    """

    def __init__(self, learning_rate: Callable | float, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0, mask: Callable | None = None,
                 kernel: str = "auto", threads: int | None = None,
                 state_dtype: str = "float32"):
        if not callable(learning_rate):
            learning_rate = optax.constant_schedule(learning_rate)
        self.learning_rate = learning_rate
        self.b1, self.b2, self.eps, self.weight_decay = b1, b2, eps, weight_decay
        self.mask, self.state_dtype = mask, state_dtype
        if kernel not in ("auto", "numba", "numpy"):
            raise ValueError(f"kernel must be 'auto', 'numba' or 'numpy', got {kernel!r}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, "
                             f"got {state_dtype!r}")
        numba_kernel = _numba_kernel() if kernel in ("auto", "numba") else None
        if kernel == "numba" and numba_kernel is None:
            raise ImportError("kernel='numba' needs numba, which did not import: pip install numba")
        self._numba = numba_kernel
        self._int8 = host_compact.numba_int8_kernel() if numba_kernel else None
        self._undo = (adamw_inverse.numba_undo() if numba_kernel else None) or \
            adamw_inverse.undo_numpy
        self.kernel = "numba" if numba_kernel else "numpy"
        self.can_undo = state_dtype == "float32"
        self._pool = None if numba_kernel else ThreadPoolExecutor(threads or os.cpu_count())
        self._lr_cache: tuple[int, np.float32] | None = None
        self._bc_cache: tuple[int, tuple] | None = None
        if state_dtype != "float32":
            self.optax = compact.compact_adam(learning_rate, b1, b2, eps, weight_decay, mask,
                                              state_dtype)
        elif weight_decay:
            self.optax = optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay,
                                     mask=mask)
        else:
            self.optax = optax.adam(learning_rate, b1, b2, eps)

    def _lr(self, count: int) -> np.float32:
        if self._lr_cache is None or self._lr_cache[0] != count:
            with on_host_cpu():
                self._lr_cache = (count, np.float32(self.learning_rate(count)))
        return self._lr_cache[1]

    def _bias_corrections(self, count: int) -> tuple[np.float32, np.float32]:
        """1 - b**count for b1 and b2 (fp32 moments: as NumPy computes them, which matches
        optax.adamw's programs closely). For compact moments, their reciprocals from XLA's
        power, exactly as compact.py computes them, since its update multiplies by them (an
        explicit product, where XLA may or may not turn a division by a scalar into one)."""
        if self._bc_cache is None or self._bc_cache[0] != count:
            f = np.float32
            if self.state_dtype != "float32":
                with on_host_cpu():
                    n = jnp.int32(count)
                    values = tuple(f(1 / (1 - jnp.asarray(b, jnp.float32) ** n))
                                   for b in (self.b1, self.b2))
            else:
                values = tuple(f(1) - f(b) ** f(count) for b in (self.b1, self.b2))
            self._bc_cache = (count, values)
        return self._bc_cache[1]

    def update(self, params, grads, opt_state, scale: float) -> None:
        """One AdamW step with gradients multiplied by `scale`, written into params/opt_state."""
        self._apply(params, grads, opt_state, scale, undo=False)

    def undo(self, params, grads, opt_state, scale: float) -> None:
        """Reverts the last `update(params, grads, opt_state, scale)` of these arrays, in place,
        to within fp32 rounding (optim/adamw_inverse.py states the bound)."""
        if not self.can_undo:
            raise ValueError(f"{self.state_dtype} moments are rounded when stored: an update "
                             "of them cannot be undone (use float32 moments to speculate)")
        self._apply(params, grads, opt_state, scale, undo=True)

    def _apply(self, params, grads, opt_state, scale: float, undo: bool) -> None:
        adam, schedule = opt_state[0], opt_state[-1]
        adam_counts, step_counts = shard_views(adam.count), shard_views(schedule.count)
        if undo:  # back to the counts the step started from: the same scalars follow
            for count in adam_counts + step_counts:
                count[0] -= 1
        step = int(step_counts[0][0])
        f = np.float32
        b1, b2 = f(self.b1), f(self.b2)
        t = int(adam_counts[0][0]) + 1
        compact_moments = self.state_dtype != "float32"
        args = (f(scale), b1, f(1 - self.b1), b2, f(1 - self.b2), f(self.eps),
                *self._bias_corrections(t), -self._lr(step))
        decays = (jax.tree.leaves(self.mask(params)) if self.mask and self.weight_decay
                  else [bool(self.weight_decay)] * len(jax.tree.leaves(params)))
        leaves = zip(jax.tree.leaves(params), jax.tree.leaves(grads),
                     jax.tree.leaves(adam.mu, is_leaf=compact.is_moment),
                     jax.tree.leaves(adam.nu, is_leaf=compact.is_moment), decays)
        for p, g, mu, nu, decay in leaves:
            wd = f(self.weight_decay if decay else 0.0)
            shards = _shards(p, g, mu, nu)
            if not undo and self._numba is not None and not isinstance(mu, Int8Moment):
                # fp32 or bf16 moments, every shard in one parallel loop: over a mesh, one
                # loop a leaf rather than one a shard (each waits for its slowest thread)
                for group in _equal_sizes(shards):
                    self._numba(*(tuple(view[i] for view in group) for i in range(4)), *args,
                                wd, compact_moments)
                continue
            for pv, gv, mv, nv, columns in shards:
                if undo:
                    self._undo(pv, gv, mv, nv, *args, wd)
                elif isinstance(mu, Int8Moment) and self._int8 is not None:
                    self._int8(pv, gv, *mv, *nv, columns, *args, wd, *host_compact.TABLES)
                elif compact_moments:  # fp32 vectors too: compact.py's arithmetic
                    self._compact_numpy(pv, gv, mv, nv, columns, args, wd)
                else:
                    _adamw_numpy(pv, gv, mv, nv, *args, wd, pool=self._pool)
        if not undo:
            for count in adam_counts:
                count[0] = min(t, np.iinfo(np.int32).max)
            for count in step_counts:
                count[0] = min(step + 1, np.iinfo(np.int32).max)

    def _compact_numpy(self, p, g, mu, nu, columns: int, args: tuple, wd) -> None:
        """compact.py's arithmetic over [rows, columns] views (no numba)."""
        scale, eps, rbc1, rbc2, neg_lr = args[0], args[5], args[6], args[7], args[8]
        rows = lambda a: a.reshape(-1, columns)  # noqa: E731
        if g.dtype == np.uint16:
            g = bf16_to_f32(g)
        if isinstance(mu, Int8Moment):
            mu, nu = (Int8Moment(rows(m.codes), m.scales.reshape(p.size // columns, -1))
                      for m in (mu, nu))
        else:  # bf16 bits as bf16 (fp32 moments of vectors as they are)
            as_values = lambda m: m.view(jnp.bfloat16) if m.dtype == np.uint16 else m  # noqa: E731
            mu, nu = rows(as_values(mu)), rows(as_values(nu))
        compact.host_moments(rows(p), rows(g), mu, nu, scale, self.b1, self.b2, eps, rbc1, rbc2,
                             neg_lr, wd)


def _equal_sizes(shards: list[tuple]) -> list[list[tuple]]:
    """`_shards`' tuples grouped by size (one group for an even split or a copy per device)."""
    groups: dict[int, list[tuple]] = {}
    for shard in shards:
        groups.setdefault(shard[0].size, []).append(shard)
    return list(groups.values())


def _shards(p, g, mu, nu) -> list[tuple]:
    """(p, g, mu, nu, columns) of each shard of one leaf: flat writable views (an Int8Moment's
    as a pair), and the shard's last dimension. Refuses moments split unlike the leaf."""
    whole = [shard_index(a) for a in (p, g)]
    if isinstance(mu, Int8Moment):
        whole += [shard_index(m.codes) for m in (mu, nu)]
        for m in (mu, nu):
            for p_shard, s_shard in zip(p.addressable_shards, m.scales.addressable_shards):
                block = s_shard.index[-1].start or 0
                if s_shard.index[:-1] != p_shard.index[:-1] or \
                        block * compact.BLOCK != (p_shard.index[-1].start or 0) or \
                        s_shard.data.shape[-1] != compact.blocks_of(p_shard.data.shape[-1]):
                    raise ValueError(f"8-bit moments' block scales are split unlike their "
                                     f"weights ({s_shard.index} against {p_shard.index})")
        views = [shard_views(a) for a in (p, g, mu.codes, mu.scales, nu.codes, nu.scales)]
        moments = [(Int8Moment(mc, ms), Int8Moment(nc, ns))
                   for mc, ms, nc, ns in zip(*views[2:])]
    else:
        whole += [shard_index(mu), shard_index(nu)]
        views = [shard_views(a) for a in (p, g, mu, nu)]
        moments = list(zip(views[2], views[3]))
    if any(index != whole[0] for index in whole):
        raise ValueError(f"a leaf's parameter, gradient and moments are split differently: "
                         f"{whole}")
    columns = [shard.data.shape[-1] if shard.data.ndim else 1 for shard in p.addressable_shards]
    return [(pv, gv, mv, nv, c)
            for pv, gv, (mv, nv), c in zip(views[0], views[1], moments, columns)]
