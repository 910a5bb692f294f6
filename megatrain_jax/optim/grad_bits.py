"""Gradients as the host kernels read them: fp32 values, or bf16 values given as their bits.

A bf16 gradient lands in pinned host memory as 2-byte words; NumPy has no bf16 arithmetic,
so the kernels see the words as uint16 and widen each to the fp32 of the same value (the
word shifted into the high half of an fp32's bits: exact).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 values given as their uint16 bits, widened to fp32 (exact: the high half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def numba_tools() -> tuple | None:
    """(numba, widen) for the host kernels, or None where numba does not import."""
    try:
        import numba
    except ImportError:
        return None
    return numba, numba_widen()


def numba_widen() -> Callable:
    """A numba function for the kernels' gradient reads: an fp32 value as it is, bf16 bits
    (uint16) widened to the fp32 of the same value (a bit cast of bits << 16)."""
    import numba
    from llvmlite import ir
    from numba.extending import intrinsic, overload

    @intrinsic
    def f32_from_bits(typingctx, bits):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return numba.types.float32(numba.types.uint32), codegen

    def widen(x):
        return x

    @overload(widen, inline="always")
    def _widen(x):
        if isinstance(x, numba.types.Integer):
            return lambda x: f32_from_bits(numba.uint32(x) << numba.uint32(16))
        return lambda x: x

    return widen
