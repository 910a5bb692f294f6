"""A jitted program that compiles again without Triton GEMM kernels when XLA's autotuner
finds none it can compile.

On the GPU, XLA fuses a dot with its neighbours (a transpose, a slice of the saved
activations, an elementwise prologue) into a Triton GEMM fusion (`__triton_gemm`), compiles
that fusion with each candidate tiling and keeps the fastest. When not one candidate
compiles, the whole program fails: "INTERNAL: No candidates could be compiled". It was
reported once on an H200 (jax 0.11.2), with every fp32 dot at HIGHEST precision
(`JAX_DEFAULT_MATMUL_PRECISION=highest`), in a small fine-tune's layer backward from saved
activations (`layer_backward_saved`, the program of `stream.keep_layers`); a rebuilt model
of the same shapes and settings compiled there without it
(`benchmarks/gemm_fallback_gpu.py`), so the cause is not known.

    update = jit_with_fallback(fn, {"xla_allow_excess_precision": False}, donate_argnums=0)

`update(...)` is `jax.jit(fn, compiler_options=options)(...)`; where that fails for this
reason, it compiles `fn` once more with `xla_gpu_enable_triton_gemm=false` (cuBLAS computes
the dots, at the precision asked; XLA fuses the rest), warns once naming the program, and
keeps that program. A compile failure raises before any argument is donated, so the call
is made again with the same arguments. Any other failure is raised as it is. Called inside
another trace (`jax.eval_shape(update, ...)`), it is `fn` itself.
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax

try:
    from jax.core import Tracer
except ImportError:  # where jax.core no longer exports it
    from jax._src.core import Tracer

# What XLA's GEMM autotuner says when no kernel of a fusion compiles (its message, and the
# older one of the cuBLAS/cuDNN candidates' search).
AUTOTUNER_FAILURES = ("No candidates could be compiled", "no algorithm candidates")
WITHOUT_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def autotuner_failure(error: BaseException) -> bool:
    """Whether `error` is XLA's GEMM autotuner finding no kernel it can compile."""
    return any(text in str(error) for text in AUTOTUNER_FAILURES)


class FallbackJit:
    """`jax.jit(fn, compiler_options=options, **kwargs)`, compiled without Triton GEMM
    fusions where the autotuner fails (module docstring). Other attributes (`lower`,
    `trace`) are the jitted function's."""

    def __init__(self, fn: Callable, options: dict, **kwargs):
        self._fn, self._options, self._kwargs = fn, dict(options), kwargs
        self._jitted = jax.jit(fn, compiler_options=self._options, **kwargs)
        self.fell_back = False

    def __call__(self, *args, **kwargs):
        if any(isinstance(a, Tracer) for a in jax.tree.leaves((args, kwargs))):
            # Inside another trace (jax.eval_shape, an outer jit): the function itself, as a
            # jit with compiler options may only be the outermost.
            return self._fn(*args, **kwargs)
        try:
            return self._jitted(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - only the autotuner's failure is handled
            if self.fell_back or not autotuner_failure(error):
                raise
            cause = str(error).strip().splitlines()[0][:300]
        self._fall_back(cause)
        return self._jitted(*args, **kwargs)

    def _fall_back(self, cause: str) -> None:
        name = getattr(self._fn, "__name__", "a program")
        warnings.warn(f"{name} did not compile: XLA's GEMM autotuner found no Triton kernel "
                      f"it could compile ({cause}). It is compiled with "
                      "xla_gpu_enable_triton_gemm=false instead: cuBLAS computes its dots, "
                      "at the same precision.", RuntimeWarning, stacklevel=3)
        options = {**self._options, **WITHOUT_TRITON_GEMM}
        self._jitted = jax.jit(self._fn, compiler_options=options, **self._kwargs)
        self.fell_back = True

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not set yet (an object being built or copied)
            raise AttributeError(name)
        return getattr(self._jitted, name)


def jit_with_fallback(fn: Callable, options: dict, **kwargs) -> FallbackJit:
    return FallbackJit(fn, options, **kwargs)
