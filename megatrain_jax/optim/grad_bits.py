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
    """(numba, widen, store, bits, from_bits) for the host kernels, or None where numba does
    not import."""
    try:
        import numba
    except ImportError:
        return None
    return numba, *numba_widen_store()


def numba_widen_store() -> tuple[Callable, Callable, Callable, Callable]:
    """Numba functions for the kernels' reads and writes of fp32 or bf16 arrays, an fp32
    value's bits (uint32) for kernels that look values up by them, and the fp32 of given bits.

    widen(x): an fp32 value as it is, bf16 bits (uint16) widened to the fp32 of the same
    value (a bit cast of bits << 16). store(a, i, x): a[i] = x, an fp32 `x` rounded to the
    nearest bf16 (ties to even, as XLA's and ml_dtypes' casts round) where `a` holds bf16 bits.
    """
    import numba
    from llvmlite import ir
    from numba.extending import intrinsic, overload

    @intrinsic
    def f32_from_bits(typingctx, bits):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return numba.types.float32(numba.types.uint32), codegen

    @intrinsic
    def bits_from_f32(typingctx, value):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return numba.types.uint32(numba.types.float32), codegen

    def widen(x):
        return x

    @overload(widen, inline="always")
    def _widen(x):
        if isinstance(x, numba.types.Integer):
            return lambda x: f32_from_bits(numba.uint32(x) << numba.uint32(16))
        return lambda x: x

    def store(a, i, x):
        a[i] = x

    @overload(store, inline="always")
    def _store(a, i, x):
        if isinstance(a.dtype, numba.types.Integer):
            def to_bf16(a, i, x):
                bits = bits_from_f32(numba.float32(x))
                odd = (bits >> numba.uint32(16)) & numba.uint32(1)
                a[i] = numba.uint16((bits + (numba.uint32(0x7FFF) + odd)) >> numba.uint32(16))
            return to_bf16

        def plain(a, i, x):
            a[i] = x
        return plain

    return widen, store, bits_from_f32, f32_from_bits
