"""The step's programs compile again without Triton GEMM kernels when XLA's autotuner finds
none it can compile (stream/gemm_fallback.py). The GPU's failure is stood in for on the CPU
by a first compile that raises its message; benchmarks/gemm_fallback_gpu.py runs the real
case on an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax.stream import gemm_fallback, programs

FAILURE = ("INTERNAL: No candidates could be compiled. Fusion: __triton_gemm (in "
           "layer_backward_saved)")


def _failing_first(program, message):
    """`program` whose next compile fails with `message`, as XLA's would."""
    def compile_fails(*args, **kwargs):
        raise RuntimeError(message)
    program._jitted = compile_fails
    return program


def layer_backward_saved(a, b):
    return a @ b


def test_a_program_the_autotuner_cannot_compile_compiles_without_triton_gemms():
    program = _failing_first(programs.jit(layer_backward_saved), FAILURE)
    a, b = jnp.ones((2, 3)), np.arange(6.0).reshape(3, 2)
    with pytest.warns(RuntimeWarning, match=r"layer_backward_saved did not compile: XLA's GEMM "
                      r"autotuner found no Triton kernel.*No candidates could be compiled.*"
                      r"xla_gpu_enable_triton_gemm=false"):
        out = program(a, b)
    np.testing.assert_allclose(out, np.ones((2, 3)) @ b)
    assert program.fell_back and program.lower(a, b) is not None  # the jitted's attributes


def test_other_compile_failures_are_raised_as_they_are():
    program = _failing_first(programs.jit(layer_backward_saved), "INTERNAL: out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        program(jnp.ones((2, 3)), jnp.ones((3, 2)))
    assert not program.fell_back
    assert gemm_fallback.autotuner_failure(RuntimeError(FAILURE))


def test_inside_another_trace_the_program_is_its_function():
    """jax.eval_shape of a program (the planner's tests do) traces its function: a jit with
    compiler options may only be the outermost."""
    out = jax.eval_shape(programs.jit(layer_backward_saved), jnp.ones((2, 3)), jnp.ones((3, 2)))
    assert out.shape == (2, 2)
