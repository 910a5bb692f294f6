"""Saving layers (`stream.keep_layers`): the last layers' forward keeps its matmuls' outputs on
the device, and their backward fetches no weights and recomputes only the rest (CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Transfers, agrees_with_reference_while_clipping, max_rel_error, tiny

from megatrain_jax import model, optim
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.io.data import TokenSource
from megatrain_jax.planning import memory, planner, presets
from megatrain_jax.planning.memory import PlacementPlan
from megatrain_jax.stream import StreamEngine
from megatrain_jax.train import trainers


def _forward_backward(cfg, params, keep_layers: int):
    engine = StreamEngine(trainers.llama_templates(cfg), optim.build_stream_optimizer(cfg),
                          keep_layers=keep_layers)
    state = engine.state_from_params(params)
    tracer = Transfers()
    loss, grads, *_ = engine.forward_backward(state.params, TokenSource(cfg).batch_at(0),
                                              tracer=tracer)
    return float(loss), jax.tree.map(np.asarray, grads), tracer.h2d


@pytest.mark.parametrize("dtype,micro_batches", [("float32", 2), ("bfloat16", 1),
                                                  ("bfloat16", 2)])
def test_saving_layers_give_the_gradients_of_recomputing_and_fetch_no_weights_back(
        dtype, micro_batches):
    """Keeping or recomputing, the same loss and the same gradients, bit for bit here (the
    backward's arithmetic is the same; XLA:CPU fuses it alike); the saving layers' weights
    travel to the device once, in the forward."""
    cfg = tiny("model.layers=3", "data.batch_size=4", f"model.compute_dtype={dtype}",
               f"data.micro_batches={micro_batches}")
    params = model.init(cfg.model, jax.random.key(0))
    loss, grads, h2d = _forward_backward(cfg, params, 0)
    assert [h2d.count(f"layer {i}") for i in range(3)] == [2, 2, 2]
    for keep in (1, 3):
        kept_loss, kept_grads, kept_h2d = _forward_backward(cfg, params, keep)
        assert kept_loss == loss
        assert max_rel_error(kept_grads, grads) == 0.0
        assert [kept_h2d.count(f"layer {i}") for i in range(3)] == \
            [1 if i >= 3 - keep else 2 for i in range(3)]


def test_saving_layers_sum_the_micro_batches_gradients_in_the_recomputing_order():
    """fp32 sums depend on their order: contributions 1e8, 1, -1e8, 1 make 1 summed first to
    last and 0 last to first. A saving layer's backward must sum them as layer_backward
    does, so that keeping changes no bit of the gradients."""
    from megatrain_jax.stream import Placement
    from megatrain_jax.stream.programs import Templates, build_programs

    templates = Templates(embed=None, layer=lambda p, x, batch: x * p["w"], head_loss=None)
    run = build_programs(templates, optim.build_stream_optimizer(tiny()).optax, 0.0,
                         Placement())
    params = {"w": jnp.ones((1,), jnp.float32)}
    xs = jnp.array([[1e8], [1.0], [-1e8], [1.0]], jnp.float32)  # dL/dw of each micro-batch
    batch = {"mask": jnp.ones((4, 1), jnp.float32)}
    sq = jnp.zeros((), jnp.float32)
    _, recomputed, *_ = run.layer_backward(params, xs, jnp.ones_like(xs), batch, sq)
    _, saved = run.layer_saving(params, xs, batch)
    _, kept, *_ = run.layer_backward_saved(saved, jnp.ones_like(xs), sq)
    assert float(recomputed["w"][0]) == 1.0
    assert float(kept["w"][0]) == 1.0


@pytest.mark.parametrize("overrides", [[], ["model.compute_dtype=bfloat16",
                                             "data.micro_batches=2"], ["model.qkv_bias=true"],
                                       ["model.compute_dtype=bfloat16", "stream.mlp_tile=16"]])
def test_saved_bytes_as_planned(overrides):
    """memory.saved_by_keeping against what the saving forward returns for its backward
    (within the few bytes of the batch's own index arrays): with bf16 compute the weights
    are kept cast, once for all micro-batches, unless the MLP runs in tiles (whose loop
    sums the weights' gradients, which must be fp32)."""
    cfg = tiny("stream.keep_layers=1", *overrides)
    engine = trainers.StreamTrainer(cfg).engine
    layer = jax.eval_shape(lambda: model.init_layer(cfg.model, jax.random.key(0)))
    d = cfg.data
    m = d.micro_batches
    xs = jax.ShapeDtypeStruct((m, d.batch_size // m, d.seq_len, cfg.model.hidden),
                              jnp.dtype(cfg.model.compute_dtype))
    batch, _ = engine.device_batch(TokenSource(cfg).batch_at(0))
    _, saved = jax.eval_shape(engine.programs.layer_saving, layer, xs, batch)
    kept = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(saved))
    planned = memory.saved_by_keeping(cfg)
    assert planned <= kept <= planned + 4 * d.batch_size * d.seq_len
    weights = {leaf.dtype for leaf in jax.tree.leaves(saved) if leaf.shape in
               {a.shape for a in jax.tree.leaves(layer) if a.ndim == 2}}
    assert weights == {jnp.dtype("bfloat16") if memory.saves_cast_weights(cfg) else
                       jnp.dtype("float32")}


def test_saving_layers_take_the_place_of_saved_inputs_in_the_plan():
    cfg = load_config("7b", ["data.batch_size=64", "data.micro_batches=4"])
    base = memory.device_bytes(cfg, PlacementPlan())  # every input on the GPU
    with_kept = memory.device_bytes(cfg, PlacementPlan(saving_layers=12))
    assert base["kept_layers"] == 0
    assert with_kept["kept_layers"] == 12 * memory.saved_by_keeping(cfg)
    assert with_kept["saved_inputs"] == 20 * memory.saved_per_layer(cfg)
    assert base["saved_inputs"] == 32 * memory.saved_per_layer(cfg)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_saving_and_attention_keeping_layers_train_as_the_reference_with_clipping(
        micro_batches, monkeypatch):
    """The last layer saves (stream.keep_layers=1); saving layers keep more than the
    attention, so the attention is kept by the layers just before them. The plan counts
    those, and six steps, clipped on some and not on others, equal the reference's."""
    cfg = tiny("model.layers=3", "data.batch_size=4", f"data.micro_batches={micro_batches}",
               "optim.lr=1e-2", "optim.clip_norm=1.5", "model.attention=blockwise",
               "stream.attention_chunk=16", "stream.keep_attention=on", "stream.keep_layers=1")
    assert memory.plan_of(trainers.placed(cfg, 1)).attention_layers == 2
    cfg7b = load_config("7b", ["stream.keep_attention=on", "stream.keep_layers=12"])
    rates = presets.PRESETS["H200"].rates(cfg7b)
    planned = planner.plan_placement(cfg7b, None, None, 1, rates)  # the room unknown
    assert planned.plan.attention_layers == 20 and planned.plan.saving_layers == 12
    assert planned.device["kept_attention"] == 20 * memory.kept_per_layer(cfg7b)
    calls = []
    from megatrain_jax.stream import programs
    build = programs.build_programs

    def counting(*args, **kwargs):  # which layers' forwards keep the attention
        built = build(*args, **kwargs)
        keeping = built.layer_keeping
        return dataclasses.replace(built, layer_keeping=lambda *a: calls.append(1) or keeping(*a))

    monkeypatch.setattr("megatrain_jax.stream.engine.build_programs", counting)
    stream, _ = agrees_with_reference_while_clipping(cfg, 6)
    assert stream.engine.schedule.keep_attention == 2 and stream.engine.schedule.keep_layers == 1
    assert len(calls) == 2 * 6  # layers 0 and 1 in each of the 6 steps


def test_keep_layers_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"stream.keep_layers \(5\) must be within \[0, "
                                          r"model.layers = 2\]"):
        tiny("stream.keep_layers=5")
    with pytest.raises(ConfigError, match="set stream.keep_layers=0"):
        trainers.check_pins(tiny("stream.keep_layers=1"), mesh=object())
    with pytest.raises(ValueError, match="keep_layers must be >= 0"):
        StreamEngine(trainers.llama_templates(tiny()), optim.build_stream_optimizer(tiny()),
                     keep_layers=-1)


def test_plan_refuses_too_many_saving_layers_and_the_planner_places_fewer():
    """30 saving layers of 64 x 1024 tokens beyond the H200's share: the refusal names
    stream.keep_layers=auto, whose placement saves no more layers than fit."""
    from megatrain_jax.tools import plan

    cfg = load_config("7b", ["data.batch_size=64", "data.micro_batches=4",
                             "stream.keep_layers=30"])
    host, gpu = 125 * 2**30, 133 * 2**30
    fits = [k for k in range(31)
            if plan._fits(memory.replaced(cfg, "stream", keep_layers=str(k)), host, gpu)]
    assert 0 < max(fits) < 30
    with pytest.raises(ConfigError, match=r"Changes that fit: stream.keep_layers=auto\."):
        plan.check_fits(cfg, host, gpu)
    auto = plan.estimate(memory.replaced(cfg, "stream", keep_layers="auto"), gpu, host)
    assert auto["refused"] is None
    assert 0 < memory.plan_of(auto["config"]).saving_layers <= max(fits)
