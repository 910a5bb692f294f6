"""The algebraic inverse of one in-place AdamW step: the undo of a speculative update.

A step with gradient g (times `scale`), bias corrections bc1, bc2 and learning rate lr writes

    mu' = b1 mu + (1 - b1) g          nu' = b2 nu + (1 - b2) g^2
    p'  = p - lr (u + wd p),   u = (mu' / bc1) / (sqrt(nu' / bc2) + eps)

and every right-hand side can be solved for the old value from the new ones and g:

    p  = (p' + lr u) / (1 - lr wd)    (u from mu', nu': what the step used)
    mu = (mu' - (1 - b1) g) / b1      nu = max((nu' - (1 - b2) g^2) / b2, 0)

In fp32 the undo is exact up to rounding, not bit for bit: each restored value is within a
few units in the last place of the larger terms it was computed from,

    |p_undone - p|   <= 4 eps32 (|p'| + lr |u|) / (1 - lr wd)
    |mu_undone - mu| <= 4 eps32 (|mu'| + (1 - b1) |g|) / b1
    |nu_undone - nu| <= 4 eps32 (nu' + (1 - b2) g^2) / b2

(eps32 = 2^-24), which tests/test_overlap.py checks. The step's scalars come from the same
arguments as the update's, so the undo uses the very lr, bias corrections and scale the
update used. Kernels: numba over flat fp32 views (the host update's own layout), or NumPy.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from megatrain_jax.optim.grad_bits import bf16_to_f32, numba_tools

# Relative bound of the undo, in units of fp32's unit roundoff (see the module docstring).
UNDO_ULPS = 4


def undo_numpy(p, g, mu, nu, scale, b1, omb1, b2, omb2, eps, bc1, bc2, neg_lr, wd,
               chunk: int = 1 << 16) -> None:
    """The inverse in chunks, in place (no thread pool: undos are rare)."""
    for start in range(0, p.size, chunk):
        stop = min(start + chunk, p.size)
        ps, gs, ms, vs = p[start:stop], g[start:stop], mu[start:stop], nu[start:stop]
        if gs.dtype == np.uint16:
            gs = bf16_to_f32(gs)
        u = (ms / bc1) / (np.sqrt(vs / bc2) + eps)
        if wd:
            ps[:] = (ps - neg_lr * u) / (np.float32(1) + neg_lr * wd)
        else:
            ps[:] = ps - neg_lr * u
        gi = gs * scale
        ms[:] = (ms - omb1 * gi) / b1
        vs[:] = np.maximum((vs - omb2 * (gi * gi)) / b2, np.float32(0))


@functools.cache  # one per process: numba compiles a new closure again
def numba_undo() -> Callable | None:
    if (tools := numba_tools()) is None:
        return None
    numba, widen, _, _, _ = tools

    @numba.njit(parallel=True, nogil=True, fastmath=False, cache=True)
    def undo(p, g, mu, nu, scale, b1, omb1, b2, omb2, eps, bc1, bc2, neg_lr, wd):
        one, zero = np.float32(1), np.float32(0)
        for i in numba.prange(p.size):
            m, v = mu[i], nu[i]
            u = (m / bc1) / (np.sqrt(v / bc2) + eps)
            if wd != 0:
                p[i] = (p[i] - neg_lr * u) / (one + neg_lr * wd)
            else:
                p[i] = p[i] - neg_lr * u
            gi = widen(g[i]) * scale
            mu[i] = (m - omb1 * gi) / b1
            nu[i] = max((v - omb2 * (gi * gi)) / b2, zero)

    return undo
