"""FP8 projections (model.fp8_matmuls, model/fp8.py): the scaled dot against bf16's, the
streamed step against the reference under the same recipe, and the settings refused."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_error, side_by_side, tiny

from megatrain_jax import model
from megatrain_jax.config import ConfigError
from megatrain_jax.model import fp8

FP8 = ("model.compute_dtype=bfloat16", "model.fp8_matmuls=true")
# The least that streams layers and clips: FP8's programs are compiled for this file alone.
SMALL = ("model.layers=2", "data.batch_size=2", "data.seq_len=16", "optim.lr=1e-2",
         "optim.clip_norm=0.5", "loop.steps=3")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_scaled_dot_is_an_fp8_dot_within_fp8_precision_of_bf16():
    """Forward: exactly the fp32 dot of the E4M3-rounded scaled operands, unscaled; it and
    both gradients within E4M3's and E5M2's rounding (3 and 2 mantissa bits: a few percent)
    of the bf16 dot's, and not equal to them (FP8 did run)."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = (3.0 * jax.random.normal(kx, (2, 8, 64))).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (64, 32))).astype(jnp.bfloat16)
    (qx, sx), (qw, sw) = fp8.quantize(x, fp8.E4M3), fp8.quantize(w, fp8.E4M3)
    assert float(jnp.max(jnp.abs(qx.astype(jnp.float32)))) == 448.0
    dequantized = jnp.einsum("bsk,kn->bsn", qx.astype(jnp.float32) * sx,
                             qw.astype(jnp.float32) * sw)
    y = jax.jit(fp8.scaled_dot)(x, w)
    assert y.dtype == jnp.bfloat16
    assert _rel(y, dequantized) <= 5e-3  # y's own rounding to bf16
    exact = jnp.einsum("bsk,kn->bsn", x, w, preferred_element_type=jnp.float32)
    assert 5e-3 < _rel(y, exact) <= 0.08

    def loss(dot):
        return lambda x, w: jnp.sum(jnp.sin(dot(x, w).astype(jnp.float32)))

    grads = jax.jit(jax.grad(loss(fp8.scaled_dot), (0, 1)))(x, w)
    bf16 = jax.grad(loss(lambda x, w: jnp.einsum("bsk,kn->bsn", x, w)), (0, 1))(x, w)
    for got, want in zip(grads, bf16):
        assert got.dtype == want.dtype == jnp.bfloat16
        assert 5e-3 < _rel(got, want) <= 0.12


def test_quantize_keeps_zeros_and_the_largest_value_finite():
    q, inverse = fp8.quantize(jnp.zeros((4,), jnp.bfloat16), fp8.E4M3)
    assert float(inverse) == 1.0 and not np.any(np.isnan(np.asarray(q, np.float32)))
    big = jnp.array([1e4, -3e4, 7.0], jnp.float32)  # amax * scale rounds past 448 in fp32
    q, _ = fp8.quantize(big, fp8.E4M3)
    assert np.all(np.isfinite(np.asarray(q, np.float32)))


def test_fp8_streamed_steps_equal_the_fp8_reference():
    """The streamed step and the whole-model reference under the same FP8 recipe: losses
    rel <= 1e-5 over clipped steps, and those losses are not bf16's (the layers ran FP8)."""
    cfg = tiny(*FP8, *SMALL)
    ref_state, state, _, records = side_by_side(cfg, 3)
    losses = [r["loss"] for r in records]
    np.testing.assert_allclose(losses, [r["ref_loss"] for r in records], rtol=1e-5)
    assert any(r["grad_norm"] > cfg.optim.clip_norm for r in records)
    assert max_rel_error(state.params, ref_state.params) <= 1e-5
    # One layer, FP8 against bf16: close, not equal.
    bf16 = tiny("model.compute_dtype=bfloat16", *SMALL).model
    p = model.init_layer(cfg.model, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 16, cfg.model.hidden), jnp.bfloat16)
    ours, theirs = model.layer(p, x, cfg.model), model.layer(p, x, bf16)
    assert 0 < _rel(ours, theirs) <= 0.05


def test_fp8_with_fp32_compute_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"model.fp8_matmuls=true .* "
                                          r"model.compute_dtype=float32: set "
                                          r"model.compute_dtype=bfloat16"):
        tiny("model.fp8_matmuls=true")


def _device(capability, kind="NVIDIA A100-SXM4-80GB", platform="gpu"):
    return SimpleNamespace(platform=platform, compute_capability=capability, device_kind=kind)


def test_a_gpu_without_fp8_tensor_cores_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"A100-SXM4-80GB has compute capability 8\.0: "
                                          r"set model.fp8_matmuls=false"):
        fp8.check_devices([_device("8.0")])
    fp8.check_devices([_device("9.0", "NVIDIA H200"), _device("8.9", "NVIDIA L4"),
                       _device(None, "cpu", "cpu")])


def test_a_saving_layer_keeps_as_many_bytes_with_fp8_as_with_bf16():
    """A layer that keeps its matmuls' outputs for its backward (stream.keep_layers) keeps
    an FP8 projection's output in bf16, as a bf16 dot's, not the FP8 dot's fp32 result: the
    planner's count of its bytes holds for both."""
    from megatrain_jax.stream.programs import SAVED_BY_SAVING_LAYERS

    def kept_bytes(model_cfg):
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                         model.init_layer(model_cfg, jax.random.key(0)))
        x = jnp.ones((2, 16, model_cfg.hidden), jnp.bfloat16)
        layer = jax.checkpoint(lambda p, x: model.layer(p, x, model_cfg),
                               policy=SAVED_BY_SAVING_LAYERS)
        # The leaves of the VJP's function: what the backward keeps (shapes only, no compute).
        kept = jax.eval_shape(lambda p, x: jax.tree.leaves(jax.vjp(layer, p, x)[1]), p, x)
        return sorted((a.dtype.name, a.shape) for a in kept), \
            sum(a.size * a.dtype.itemsize for a in kept)

    bf16, fp8_ = (tiny("model.compute_dtype=bfloat16", *SMALL).model,
                  tiny(*FP8, *SMALL).model)
    assert kept_bytes(fp8_) == kept_bytes(bf16)


def test_the_planner_expects_fp8_layers_at_the_measured_speedup():
    """The H200 preset's FP8 layer rate: the matmuls at fp8_speedup times bf16's, the
    attention as it was; 7b's expected step at 16 x 1024 faster by about that."""
    from megatrain_jax.config import load_config
    from megatrain_jax.planning.presets import PRESETS, attention_flops, layer_flops

    h200 = PRESETS["H200"]
    bf16, fp8_ = load_config("7b", []), load_config("7b", list(FP8))
    matmuls = layer_flops(bf16) - attention_flops(bf16)
    saved = matmuls / (h200.layer_tflops * 1e12) * (1 - 1 / h200.fp8_speedup)
    assert h200.rates(bf16).layer_forward_s - h200.rates(fp8_).layer_forward_s == \
        pytest.approx(saved, rel=1e-9)
    assert 1.2 < h200.fp8_speedup < 2.0


def test_plan_expects_fp8_steps_faster_and_says_so(capsys):
    from megatrain_jax.cli import main

    def expected(*keys):
        assert main(["plan", "7b", *keys, "--host-gb", "125", "--gpu-gb", "141"]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("expected: "))
        return float(line.split()[1].replace(",", "")), out

    bf16, _ = expected()
    fp8_, out = expected(*FP8)
    assert "ms with FP8 projections" in out
    assert 1.2 < fp8_ / bf16 < 1.35  # 16,980 against 13,498 on the H200's preset
