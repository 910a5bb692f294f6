"""Kept attention (`stream.keep_attention`): the forward keeps the attention's output and
statistics, the backward's recompute takes them instead of attending again. Same values and
gradients as attending again, fewer FLOPs; the planner's count of the layers that keep it,
and the refusals (CPU, fp32, blockwise attention). tests/test_keep_layers.py trains layers
keeping it beside saving ones against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_error, normal, tiny

from megatrain_jax import model
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.model import replay
from megatrain_jax.planning import memory, memory_lines, planner, presets
from megatrain_jax.train import trainers

GiB = 2**30


def _layer_case(packed: bool):
    """A layer of the tiny model at 200 tokens in chunks of 64 (the last one padded): its
    weights, input, output gradient and segment ids (three packed examples per row)."""
    cfg = tiny("model.max_seq_len=256", "model.attention=blockwise").model
    p = model.init(cfg, jax.random.key(0))["layers"][0]
    x, dy = normal(1, (2, 200, cfg.hidden)), normal(2, (2, 200, cfg.hidden))
    segments = None
    if packed:
        segments = jnp.tile(jnp.repeat(jnp.arange(3), jnp.array([70, 64, 66]),
                                       total_repeat_length=200), (2, 1))
    return cfg, p, x, dy, segments


@pytest.mark.parametrize("packed", [False, True])
def test_a_replayed_layer_has_the_layers_value_and_gradients(packed):
    cfg, p, x, dy, seg = _layer_case(packed)
    opts = {"attention_chunk": 64}

    def grads(fn):
        y, vjp = jax.vjp(fn, p, x)
        return y, vjp(dy)

    plain = jax.jit(lambda: grads(lambda p_, x_: model.layer(p_, x_, cfg, None, seg, **opts)))
    y, g = plain()
    y_kept, kept = jax.jit(lambda: model.layer_keeping_attention(p, x, cfg, None, seg,
                                                                 **opts))()
    y_again, g_again = jax.jit(lambda kept: grads(lambda p_, x_: model.layer_replaying_attention(
        p_, x_, kept, cfg, None, seg, **opts)))(kept)
    assert max_rel_error(y_kept, y) <= 1e-6 and max_rel_error(y_again, y) <= 1e-6
    assert max_rel_error(g_again, g) <= 1e-6


def test_the_replayed_backward_does_not_attend_again(monkeypatch):
    """Tracing the replaying layer's value-and-gradient never runs the attention's forward
    (the blockwise online softmax); the plain layer's does, once."""
    from megatrain_jax.model import blockwise

    cfg, p, x, dy, _ = _layer_case(False)
    opts = {"attention_chunk": 64}
    kept = jax.jit(lambda: model.layer_keeping_attention(p, x, cfg, **opts))()[1]
    calls, forward = [], blockwise._forward
    monkeypatch.setattr(blockwise, "_forward", lambda *a: calls.append(1) or forward(*a))

    def traced_forwards(layer, *args):
        calls.clear()
        jax.jit(lambda p_, x_, *k: jax.vjp(lambda a, b: layer(a, b, *k), p_, x_)[1](dy)).lower(
            p, x, *args)
        return len(calls)

    assert traced_forwards(lambda a, b: model.layer(a, b, cfg, **opts)) == 1
    assert traced_forwards(lambda a, b, k: model.layer_replaying_attention(a, b, k, cfg, **opts),
                           kept) == 0


def test_kept_attention_gives_the_gradients_of_attending_again():
    """Some layers keeping, or none: the same gradients (the backward's arithmetic is the
    attention's own either way)."""
    from megatrain_jax import optim
    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.stream import StreamEngine

    cfg = tiny("model.layers=3", "data.batch_size=4", "model.attention=blockwise",
               "stream.attention_chunk=16")
    params = model.init(cfg.model, jax.random.key(0))

    def grads(keep):
        engine = StreamEngine(trainers.llama_templates(cfg), optim.build_stream_optimizer(cfg),
                              keep_attention=keep)
        state = engine.state_from_params(params)
        loss, g, *_ = engine.forward_backward(state.params, TokenSource(cfg).batch_at(0))
        return float(loss), jax.tree.map(np.asarray, g)

    base = grads(0)
    for keep in (2, 3):
        loss, g = grads(keep)
        assert loss == base[0] and max_rel_error(g, base[1]) <= 1e-6


# ----- how many layers keep it, and the refusals ---------------------------------------------

def _planned(cfg, gpu, devices=1, host=None):
    """The planner's placement of cfg on GPUs of `gpu` bytes (None: unknown) and a host of
    `host` bytes (None: unbounded), at the H200's preset rates."""
    rates = presets.PRESETS["H200"].rates(cfg, devices)
    return planner.plan_placement(cfg, gpu, host, devices, rates)


def test_the_planner_keeps_it_where_the_gpu_room_holds_it():
    def cfg_at(seq, *overrides):
        return load_config("7b", ["data.batch_size=1", f"data.seq_len={seq}",
                                  "model.max_seq_len=262144", *overrides])

    cfg = cfg_at(131072)
    per = memory.kept_per_layer(cfg)
    assert per == 131072 * 32 * (128 * 2 + 4)  # bf16 output and an fp32 statistic a row
    # The H200 holds every layer's at 131072.
    h200 = _planned(cfg, 141 * 10**9)
    assert h200.plan.attention_layers == 32 and h200.device["kept_attention"] == 32 * per
    # At 262144 on the H200 box (125 GiB host), some: what they take fits the budget beside
    # the rest.
    long, gpu = cfg_at(262144), 141 * 10**9
    planned = _planned(long, gpu, host=125 * GiB)
    n = planned.plan.attention_layers
    assert 0 < n < 32 and planned.device["kept_attention"] == n * memory.kept_per_layer(long)
    assert sum(planned.device.values()) <= gpu - memory.HEADROOM
    # Unknown room (the CPU), several GPUs, XLA's attention: none; on: every layer.
    assert _planned(cfg, None).plan.attention_layers == 0
    two = cfg_at(131072, "data.batch_size=2", "mesh.data=2")
    assert _planned(two, 141 * 10**9, devices=2).plan.attention_layers == 0
    xla = cfg_at(8192, "model.attention=xla", "stream.keep_layers=0")
    assert _planned(xla, 141 * 10**9).plan.attention_layers == 0
    # Rows of auto.KEEP_ATTENTION_FROM tokens or more (the saving layers pinned off, which
    # would take the place of keeping ones).
    for seq, layers in ((4096, 0), (8192, 32)):
        rows = cfg_at(seq, "stream.keep_layers=0")
        assert _planned(rows, 141 * 10**9).plan.attention_layers == layers
    on = load_config("7b", ["stream.keep_attention=on"])
    assert _planned(on, None).plan.attention_layers == 32


def test_the_plan_prints_the_layers_that_keep_it():
    cfg = load_config("7b", ["data.batch_size=1", "data.seq_len=131072",
                             "model.max_seq_len=131072"])
    placed = planner.pinned_config(cfg, _planned(cfg, 141 * 10**9).plan)
    rows = memory_lines.placement_lines(placed)[1:-1]  # a row per range of layers
    keeping = [r for r in rows if "recompute, attention kept" in r]
    assert keeping == rows and sum(int(r.split("(")[1].split(")")[0]) for r in rows) == 32
    unknown = planner.pinned_config(cfg, _planned(cfg, None).plan)  # the room unknown
    assert not [r for r in memory_lines.placement_lines(unknown) if "attention kept" in r]


def test_keeping_is_refused_where_the_attention_cannot_be_kept():
    cfg = tiny("stream.keep_attention=on")  # 32 tokens on the CPU: XLA's attention
    with pytest.raises(ConfigError, match="stream.keep_attention=on cannot keep the attention "
                                          "with the xla attention of 32-token rows"):
        trainers.check_pins(cfg, None)
    trainers.check_pins(tiny(), None)  # auto: no error, and none kept
    assert memory.plan_of(trainers.placed(tiny(), 1)).attention_layers == 0
    blockwise = tiny("stream.keep_attention=on", "model.attention=blockwise")
    trainers.check_pins(blockwise, None)
    assert memory.plan_of(trainers.placed(blockwise, 1)).attention_layers == \
        blockwise.model.layers
    with pytest.raises(ConfigError, match="several GPUs"):
        trainers.check_pins(blockwise, object())
    assert replay.keeps("blockwise", packed=True) and not replay.keeps("xla")
    assert not replay.keeps("cudnn", packed=True)


def test_a_plan_that_keeps_every_layer_beyond_the_gpu_names_the_setting_that_fits():
    """7b at 131072 keeping all 32 layers needs at least 74.2 GiB of GPU memory (their 32.5
    GiB, two layer working sets of 16.2 GiB, the inputs on the host, the headroom): a
    55 GiB GPU refuses it and names stream.keep_attention=auto (which keeps some)."""
    from megatrain_jax.tools import plan

    cfg = load_config("7b", ["data.batch_size=1", "data.seq_len=131072",
                             "model.max_seq_len=131072", "stream.keep_attention=on"])
    with pytest.raises(ConfigError, match="needs at least 74.2 GiB of GPU memory.*Changes that "
                                          "fit: stream.keep_attention=auto;"):
        plan.check_fits(cfg, host=500 * GiB, gpu=55 * GiB)
    auto = memory.replaced(cfg, "stream", keep_attention="auto")
    kept = memory.plan_of(plan.estimate(auto, 55 * GiB, 500 * GiB)["config"]).attention_layers
    assert 0 < kept < 32
    plan.check_fits(cfg, host=125 * GiB, gpu=133 * GiB)  # the H200's share holds them all
