"""The host kernel for 8-bit Adam moments (compact.py's `int8`), in place on pinned views.

A block of BLOCK values of one row is one unit of work: the first pass widens the stored
moments, computes the fp32 moments and the update, writes the weights and finds the
block's new largest magnitudes; the second recomputes the same fp32 moments (the old codes
are still there, and the arithmetic is the same) and stores their codes against the new
scales. Both passes stay in cache, so the memory moves each byte once. The arithmetic is
compact.py's, operation for operation, so the two agree bit for bit.

    adamw_int8(p, g, mu_codes, mu_scales, nu_codes, nu_scales, columns, *scalars, wd, *tables)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from megatrain_jax.optim.compact import (
    BLOCK,
    SIGNED,
    SIGNED_MID,
    SIGNED_ZERO,
    UNSIGNED,
    UNSIGNED_MID,
)
from megatrain_jax.optim.grad_bits import numba_tools

TABLES = (SIGNED, SIGNED_MID, UNSIGNED, UNSIGNED_MID)


def numba_int8_kernel() -> Callable | None:
    if (tools := numba_tools()) is None:
        return None
    numba, widen, _ = tools
    zero = np.uint8(SIGNED_ZERO)

    @numba.njit(inline="always")
    def code(mid, x):
        """The count of midpoints below x: the nearest table entry, ties to the lower."""
        lo, hi = 0, mid.size
        while lo < hi:
            k = (lo + hi) >> 1
            if mid[k] < x:
                lo = k + 1
            else:
                hi = k
        return lo

    @numba.njit(parallel=True, nogil=True, fastmath=False, cache=True)
    def adamw_int8(p, g, mq, ms, vq, vs, columns, scale, b1, omb1, b2, omb2, eps, rbc1, rbc2,
                   neg_lr, wd, signed, signed_mid, unsigned, unsigned_mid):
        per_row = ms.size // (p.size // columns)
        for b in numba.prange(ms.size):
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
                m_top = max(m_top, abs(m))
                r_top = max(r_top, np.sqrt(v))
            for i in range(start, stop):
                gi = widen(g[i]) * scale
                m = omb1 * gi + b1 * (signed[mq[i]] * m_scale)
                r = unsigned[vq[i]] * v_scale
                v = omb2 * (gi * gi) + b2 * (r * r)
                mq[i] = np.uint8(code(signed_mid, m / m_top)) if m_top > 0 else zero
                unit = np.sqrt(v) / r_top if r_top > 0 else np.float32(0)
                c = code(unsigned_mid, unit)
                vq[i] = np.uint8(1 if c == 0 and unit > 0 else c)
            ms[b], vs[b] = m_top, r_top

    return adamw_int8
