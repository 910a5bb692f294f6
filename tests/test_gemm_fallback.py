"""The step's programs compile again without Triton GEMM kernels when XLA's autotuner finds
none it can compile (stream/gemm_fallback.py). The GPU's failure is stood in for on the CPU
by a first compile that raises its message; benchmarks/gemm_fallback_gpu.py runs the real
case on an H200."""

import os
import shutil

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


# The suite runs JAX on the CPU (conftest.py); the runs this test starts use the GPU.
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="the real case needs a GPU")
def test_the_small_hf_finetune_trains_through_the_cli_on_a_gpu(tmp_path, monkeypatch):
    """The fine-tune that failed to compile on an H200 (a 3-layer HF Llama at HIGHEST
    precision, every layer resident, activations saved) trains through the command line and
    equals jax.grad + optax, whether or not XLA's autotuner fails on this machine."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gemm_fallback_gpu as case

    # The runs compile as a user's do, not with the suite's fast CPU compile.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "").replace(
        "--xla_backend_optimization_level=0", ""))
    folder, tokens = tmp_path / "llama", tmp_path / "tokens.npy"
    case.hf_folder(folder)
    np.save(tokens, np.random.default_rng(0).integers(0, case.SHAPE["vocab_size"], 50_000)
            .astype(np.int32))
    spec = case.variants(tmp_path, folder, tokens)["cli"]
    trained = case.run_variant("cli", spec, tmp_path)
    assert trained["rc"] == 0, trained["stderr_tail"]
    equal = case.parity(spec, tmp_path)
    assert equal["rc"] == 0, equal.get("stderr_tail")
    assert equal["max_rel_loss_diff"] <= 1e-5
