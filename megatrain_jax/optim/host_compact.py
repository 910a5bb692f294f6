"""The host kernel for 8-bit Adam moments (compact.py's `int8`), in place on pinned views.

A block of BLOCK values of one row is one unit of work: the first pass widens the stored
moments, computes the fp32 moments and the update, writes the weights, keeps the new
moments in a scratch buffer and finds the block's largest magnitudes; the second stores
their codes against the new scales. Both passes stay in cache, so the memory moves each
byte once. The arithmetic is compact.py's, operation for operation, so the two agree bit
for bit.

    adamw_int8(p, g, mu_codes, mu_scales, nu_codes, nu_scales, columns, *scalars, wd, *tables)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from megatrain_jax.optim.compact import (
    BLOCK,
    SIGNED,
    SIGNED_MID,
    SIGNED_STARTS,
    SIGNED_ZERO,
    UNSIGNED,
    UNSIGNED_MID,
    UNSIGNED_STARTS,
)
from megatrain_jax.optim.grad_bits import numba_tools

# The midpoints end with +inf, so that the lookup's one comparison needs no bound check.
TABLES = (SIGNED, np.append(SIGNED_MID, np.float32(np.inf)), SIGNED_STARTS,
          UNSIGNED, np.append(UNSIGNED_MID, np.float32(np.inf)), UNSIGNED_STARTS)
CHUNK = 16  # blocks per parallel task, sharing one scratch buffer


def numba_int8_kernel() -> Callable | None:
    if (tools := numba_tools()) is None:
        return None
    numba, widen, _, bits = tools
    zero = np.uint8(SIGNED_ZERO)

    @numba.njit(inline="always")
    def code(mid, starts, x):
        """The count of midpoints below x (the nearest table entry, ties to the lower), as
        np.searchsorted finds it: the start of x's bucket by its top 16 bits, plus one where
        the bucket's midpoint is below x; no branch to mispredict."""
        c = starts[bits(x) >> numba.uint32(16)]
        return c + (mid[c] < x)

    @numba.njit(parallel=True, nogil=True, fastmath=False, cache=True)
    def adamw_int8(p, g, mq, ms, vq, vs, columns, scale, b1, omb1, b2, omb2, eps, rbc1, rbc2,
                   neg_lr, wd, signed, signed_mid, signed_starts, unsigned, unsigned_mid,
                   unsigned_starts):
        per_row = ms.size // (p.size // columns)
        for task in numba.prange((ms.size + CHUNK - 1) // CHUNK):
            m_new = np.empty(BLOCK, np.float32)
            r_new = np.empty(BLOCK, np.float32)
            for b in range(task * CHUNK, min(task * CHUNK + CHUNK, ms.size)):
                row = b // per_row
                start = row * columns + (b - row * per_row) * BLOCK
                stop = min(start + BLOCK, (row + 1) * columns)
                m_scale, v_scale = ms[b], vs[b]
                m_top, r_top = np.float32(0), np.float32(0)
                for i in range(start, stop):
                    gi = widen(g[i]) * scale
                    m = omb1 * gi + b1 * (signed[mq[i]] * m_scale)
                    r = unsigned[vq[i]] * v_scale
                    v = omb2 * (gi * gi) + b2 * (r * r)
                    u = (m * rbc1) / (np.sqrt(v * rbc2) + eps)
                    if wd != 0:
                        u = u + wd * p[i]
                    p[i] = p[i] + neg_lr * u
                    r = np.sqrt(v)
                    m_new[i - start], r_new[i - start] = m, r
                    m_top = max(m_top, abs(m))
                    r_top = max(r_top, r)
                m_inv = np.float32(1) / (m_top if m_top > 0 else np.float32(1))
                r_inv = np.float32(1) / (r_top if r_top > 0 else np.float32(1))
                for i in range(start, stop):
                    unit = m_new[i - start] * m_inv
                    mq[i] = code(signed_mid, signed_starts, unit) if m_top > 0 else zero
                    unit = r_new[i - start] * r_inv
                    c = code(unsigned_mid, unsigned_starts, unit)
                    vq[i] = max(c, np.uint8(unit > 0))  # a nonzero nu keeps a nonzero code
                ms[b], vs[b] = m_top, r_top

    return adamw_int8
