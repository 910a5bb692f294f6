"""The host kernel for 8-bit Adam moments (compact.py's `int8`), in place on pinned views.

A block of BLOCK values of one row is one unit of work, in four passes over it that stay in
cache, so the memory moves each byte once: the stored moments' table entries are looked up;
the fp32 moments, the update and the weights are computed; the block's largest magnitudes
are found; the new moments' codes are stored against the new scales. The lookups are apart
from the arithmetic because a table lookup keeps numba (LLVM) from vectorizing a loop: so
apart, the arithmetic runs in SIMD lanes (IEEE square roots and divisions, no fused
multiply-adds: the same bits). The largest magnitudes are found as the largest fp32 bit
patterns, which order as the values do for values that are not negative, and which a vector
loop can reduce. The arithmetic is compact.py's, operation for operation, so the two agree
bit for bit.

    adamw_int8(p, g, mu_codes, mu_scales, nu_codes, nu_scales, columns, *scalars, wd, *tables)
"""

from __future__ import annotations

import functools
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


@functools.cache  # one per process: numba compiles a new closure again (about 2 s)
def numba_int8_kernel() -> Callable | None:
    if (tools := numba_tools()) is None:
        return None
    numba, widen, _, bits, from_bits = tools
    zero = np.uint8(SIGNED_ZERO)
    magnitude = numba.uint32(0x7FFFFFFF)

    @numba.njit(inline="always")
    def code(mid, starts, x):
        """The count of midpoints below x (the nearest table entry, ties to the lower), as
        np.searchsorted finds it: the start of x's bucket by its top 16 bits, plus one where
        the bucket's midpoint is below x; no branch to mispredict."""
        c = starts[bits(x) >> numba.uint32(16)]
        return c + (mid[c] < x)

    # error_model="numpy": a division is IEEE's, with no Python zero check to branch on (the
    # divisors here are never zero), so the arithmetic loop vectorizes.
    @numba.njit(parallel=True, nogil=True, fastmath=False, cache=True, error_model="numpy")
    def adamw_int8(p, g, mq, ms, vq, vs, columns, scale, b1, omb1, b2, omb2, eps, rbc1, rbc2,
                   neg_lr, wd, signed, signed_mid, signed_starts, unsigned, unsigned_mid,
                   unsigned_starts):
        per_row = ms.size // (p.size // columns)
        for task in numba.prange((ms.size + CHUNK - 1) // CHUNK):
            m = np.empty(BLOCK, np.float32)  # the block's moments: stored, then new
            r = np.empty(BLOCK, np.float32)  # nu's square roots, likewise
            for b in range(task * CHUNK, min(task * CHUNK + CHUNK, ms.size)):
                row = b // per_row
                start = row * columns + (b - row * per_row) * BLOCK
                n = min(start + BLOCK, (row + 1) * columns) - start
                pb, gb = p[start:start + n], g[start:start + n]
                mqb, vqb = mq[start:start + n], vq[start:start + n]
                for j in range(n):
                    m[j], r[j] = signed[mqb[j]], unsigned[vqb[j]]
                m_scale, v_scale = ms[b], vs[b]
                for j in range(n):
                    gi = widen(gb[j]) * scale
                    mj = omb1 * gi + b1 * (m[j] * m_scale)
                    rj = r[j] * v_scale
                    v = omb2 * (gi * gi) + b2 * (rj * rj)
                    u = (mj * rbc1) / (np.sqrt(v * rbc2) + eps)
                    if wd != 0:
                        u = u + wd * pb[j]
                    pb[j] = pb[j] + neg_lr * u
                    m[j], r[j] = mj, np.sqrt(v)
                m_top, r_top = numba.uint32(0), numba.uint32(0)
                for j in range(n):
                    m_top = max(m_top, bits(m[j]) & magnitude)
                    r_top = max(r_top, bits(r[j]))
                m_max, r_max = from_bits(m_top), from_bits(r_top)
                m_inv = np.float32(1) / (m_max if m_max > 0 else np.float32(1))
                r_inv = np.float32(1) / (r_max if r_max > 0 else np.float32(1))
                if m_max > 0:
                    for j in range(n):
                        mqb[j] = code(signed_mid, signed_starts, m[j] * m_inv)
                else:
                    mqb[:] = zero
                for j in range(n):
                    unit = r[j] * r_inv
                    vqb[j] = max(code(unsigned_mid, unsigned_starts, unit),
                                 np.uint8(unit > 0))  # a nonzero nu keeps a nonzero code
                ms[b], vs[b] = m_max, r_max

    return adamw_int8
