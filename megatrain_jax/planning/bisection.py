"""Bisection over arrays: for each of many placements at once, the least or the most count
(of layers) for which a monotone condition holds. The planner fills each candidate's room
with these (planner.py: saved inputs on the host, kept weights, recomputed inputs).

    least(lambda h: fits(h), lo, hi)     # element by element; fits takes whole arrays
"""

from __future__ import annotations

import numpy as np


def least(fits, lo, hi):
    """Element by element, the least x in [lo, hi] with fits(x), else hi, where fits is
    monotone (false, then true, as x grows): by bisection, fits called on whole arrays."""
    lo, hi = lo.copy(), hi.copy()
    while (open_ := lo < hi).any():
        mid = (lo + hi) // 2
        ok = fits(mid)
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid + 1, lo)
    return lo


def most(fits, lo, hi):
    """Element by element, the most x in [lo, hi] with fits(x), else lo, where fits is
    monotone (true, then false, as x grows): by bisection, fits called on whole arrays."""
    lo, hi = lo.copy(), hi.copy()
    while (open_ := lo < hi).any():
        mid = (lo + hi + 1) // 2
        ok = fits(mid)
        lo = np.where(open_ & ok, mid, lo)
        hi = np.where(open_ & ~ok, mid - 1, hi)
    return lo
