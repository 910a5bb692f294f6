"""Long sequences: rotary angles exact far out, the blockwise attention, the sequence-tiled
MLP, a streamed step with both against the plain reference, and the planner's activation
accounting (CPU, fp32, a width-32 model)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import integers, max_rel_error, normal, tiny

from megatrain_jax import model, streaming
from megatrain_jax.cli import main
from megatrain_jax.config import ConfigError, RopeScaling, auto, load_config
from megatrain_jax.model import ops
from megatrain_jax.planning import memory, memory_lines, planner, presets
from megatrain_jax.planning.memory import PlacementPlan
from megatrain_jax.tools import plan

GiB = 2**30
LLAMA31 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


# ----- rotary embeddings -------------------------------------------------------------------

def _reference_frequencies(head_dim, theta, s):
    """Llama 3.1's frequencies, written out element by element in float64."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / math.pow(theta, i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen > s.original_max_position / s.low_freq_factor:
            f = f / s.factor
        elif wavelen >= s.original_max_position / s.high_freq_factor:
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            f = (1 - smooth) * f / s.factor + smooth * f
        out.append(f)
    return np.array(out)


def test_rope_angles_are_exact_near_half_a_million_positions():
    inv = ops.rope_frequencies(128, 500000.0, LLAMA31)
    np.testing.assert_allclose(inv, _reference_frequencies(128, 500000.0, LLAMA31), rtol=1e-15)
    positions = np.concatenate([np.arange(524287 - 255, 524288), [2**24 - 1, -524287, 0, 1]])
    cos, sin = jax.jit(ops.rope_angles, static_argnums=1)(
        jnp.asarray(positions[None], jnp.int32), tuple(inv))
    angles = positions[None, :, None].astype(np.float64) * inv  # float64 throughout
    assert np.max(np.abs(np.asarray(cos) - np.cos(angles))) < 1e-6
    assert np.max(np.abs(np.asarray(sin) - np.sin(angles))) < 1e-6
    # The plain fp32 product misses by far more at these positions: the test can tell.
    naive = positions[None, :, None].astype(np.float32) * inv.astype(np.float32)
    assert np.max(np.abs(np.cos(naive.astype(np.float64)) - np.cos(angles))) > 1e-3
    # Rotating a vector: as float64 does it, to fp32 rounding.
    x = normal(0, (1, positions.size, 2, 128))
    x1, x2 = x[..., :64], x[..., 64:]
    c, s = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    expected = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    rotated = ops.apply_rope(jnp.asarray(x), jnp.asarray(positions[None]), inv)
    np.testing.assert_allclose(rotated, expected, atol=5e-6)


# ----- attention ---------------------------------------------------------------------------

def _qkv(b, s, h, k, e, seed=0):
    return tuple(normal(4 * seed + i, shape) for i, shape in
                 enumerate([(b, s, h, e), (b, s, k, e), (b, s, k, e), (b, s, h, e)]))


def _value_and_vjp(impl, chunk=64):
    def run(q, k, v, dout, segments):
        out, vjp = jax.vjp(lambda *a: ops.attention(*a, impl, segments, chunk), q, k, v)
        return out, vjp(dout)
    return jax.jit(run)


def test_blockwise_attention_equals_xla():
    """200 tokens in chunks of 64 (the last one padded), two query heads per kv head; row 0
    packs three segments that attend within themselves only, row 1 is one sequence."""
    q, k, v, dout = _qkv(2, 200, 4, 2, 16)
    segments = jnp.stack([jnp.repeat(jnp.arange(1, 4), jnp.array([70, 64, 66]),
                                     total_repeat_length=200), jnp.ones(200, jnp.int32)])
    want, want_grads = _value_and_vjp("xla")(q, k, v, dout, segments)
    got, grads = _value_and_vjp("blockwise")(q, k, v, dout, segments)
    assert max_rel_error(got, want) <= 1e-5
    assert max_rel_error(grads, want_grads) <= 1e-5


def test_blockwise_attention_never_holds_the_score_matrix():
    q, k, v, _ = _qkv(1, 2048, 2, 1, 8)

    def temp_bytes(impl):
        fn = jax.jit(lambda q, k, v: jax.vjp(
            lambda *a: ops.attention(*a, impl, None, 128), q, k, v)[1](q))
        return fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    one_score_matrix = 2 * 2048 * 2048 * 4  # H S S fp32
    assert temp_bytes("xla") > one_score_matrix
    assert temp_bytes("blockwise") < one_score_matrix / 16


def test_auto_attention_path_by_length():
    assert auto.attention_path("auto", auto.CUDNN_MAX_SEQ, True, 2) == "cudnn"
    assert auto.attention_path("auto", auto.CUDNN_MAX_SEQ + 1, True, 2) == "blockwise"
    assert auto.attention_path("auto", auto.XLA_MAX_SEQ, False, 4) == "xla"
    assert auto.attention_path("auto", auto.XLA_MAX_SEQ + 1, True, 4) == "blockwise"
    assert auto.attention_path("xla", 10**6, True, 2) == "xla"
    # Packed rows: a dense [S, S] mask for cuDNN and XLA, so blockwise past XLA_MAX_SEQ.
    assert auto.attention_path("auto", auto.XLA_MAX_SEQ, True, 2, packed=True) == "cudnn"
    assert auto.attention_path("auto", auto.XLA_MAX_SEQ + 1, True, 2, packed=True) == \
        "blockwise"
    assert auto.attention_path("cudnn", 10**5, True, 2, packed=True) == "cudnn"


# ----- the tiled MLP -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_case():
    p = model.init_layer(tiny().model, jax.random.key(0))
    x = normal(1, (2, 192, 32))
    weights = (p.mlp_norm, p.w_gate, p.w_up, p.w_down)

    def run(tile):
        def f(x, *w):
            return ops.residual_mlp(x, *w, 1e-5, jnp.float32, tile)
        out, vjp = jax.vjp(f, x, *weights)
        return out, vjp(jnp.cos(out))

    return jax.jit(run, static_argnums=0), weights, x


def test_tiled_mlp_equals_untiled(mlp_case):
    run, weights, x = mlp_case
    want, want_grads = run(0)
    # 384 tokens in three tiles: a token's arithmetic is the same, but XLA:CPU's matmul may
    # sum its products in another order for another row count, and weight gradients sum by
    # tile: equal to fp32 rounding, not bit for bit.
    exact, exact_grads = run(128)
    assert max_rel_error(exact, want) <= 1e-6
    assert max_rel_error(exact_grads, want_grads) <= 1e-6
    padded, padded_grads = run(80)  # the last of five tiles padded
    assert max_rel_error(padded, want) <= 1e-6
    assert max_rel_error(padded_grads, want_grads) <= 1e-6
    # Tiled means a loop over checkpointed tiles, recomputed in the backward.
    jaxpr = jax.make_jaxpr(lambda x, *w: ops.residual_mlp(x, *w, 1e-5, jnp.float32, 128))(
        x, *weights)
    assert "scan" in {e.primitive.name for e in jaxpr.jaxpr.eqns}
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def test_automatic_mlp_tile():
    assert auto.mlp_tile(0, auto.MLP_TILE_FROM) == 0
    assert auto.mlp_tile(0, auto.MLP_TILE_FROM + 1) == auto.MLP_TILE
    assert auto.mlp_tile(256, 2048) == 256
    assert auto.mlp_tile(2048, 2048) == 0  # one tile of everything: untiled


# ----- a streamed step with both, against the plain reference ------------------------------

def _packed_batch(b, s, vocab):
    tokens = integers(3, (b, s + 1), vocab)
    segments = np.ones((b, s), np.int32)
    segments[0, 150:400], segments[0, 400:] = 2, 3
    positions = np.stack([np.arange(s)] * b).astype(np.int32)
    for start, end in ((150, 400), (400, s)):
        positions[0, start:end] = np.arange(end - start)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "mask": np.ones((b, s), np.float32), "segment_ids": segments,
            "positions": positions}


def test_streamed_long_sequence_tiled_equals_reference():
    """2 x 512 packed tokens: the streamed layers run the blockwise attention in chunks of
    128 and the MLP in tiles of 128; the reference runs XLA's attention, untiled."""
    cfg = tiny("model.max_seq_len=512", "data.seq_len=512", "data.batch_size=2",
               "model.attention=blockwise", "stream.mlp_tile=128",
               "stream.attention_chunk=128")
    m, s = cfg.model, cfg.stream
    params = model.init(m, jax.random.key(0))
    batch = _packed_batch(2, 512, m.vocab_size)

    def layer(p, x, mb):
        return model.layer(p, x, m, mb["positions"], mb["segment_ids"], mlp_tile=s.mlp_tile,
                           attention_chunk=s.attention_chunk)

    step = streaming.from_functions(
        embed=lambda p, mb: model.embed(p, mb["inputs"], m), layer=layer,
        head_loss=lambda p, x, mb: model.head_loss(p, None, x, mb["targets"], mb["mask"], m,
                                                   1.0, s.loss_chunk),
        params=params, optimizer=optax.sgd(1e-3))
    state = step.init_state()
    loss, grads, *_ = step.engine.forward_backward(state.params, batch)

    plain = dataclasses.replace(m, attention="xla")
    denom = float(np.sum(batch["mask"]))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: model.loss(p, batch, plain, denom, s.loss_chunk)))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_rel_error(grads, ref_grads) <= 1e-5


# ----- config and planner ------------------------------------------------------------------

def test_config_takes_long_context_keys():
    cfg = load_config("7b", ["model.max_seq_len=524288", "data.seq_len=524288",
                             "model.attention=blockwise", "stream.mlp_tile=4096"])
    assert cfg.stream.mlp_tile == 4096
    for bad in ("model.max_seq_len=16777217", "stream.mlp_tile=-1",
                "stream.attention_chunk=-8"):
        with pytest.raises(ConfigError):
            load_config("7b", [bad])


def _long(seq, *more):
    return load_config("7b", ["data.batch_size=1", f"data.seq_len={seq}",
                              "model.max_seq_len=524288", *more])


def test_working_set_grows_with_the_tile_not_the_sequence():
    half, full = memory.activations(_long(262144)), memory.activations(_long(524288))
    assert half["mlp_tile"] == full["mlp_tile"] == auto.MLP_TILE
    assert half["attention"] == full["attention"] == "cudnn"  # up to auto.CUDNN_MAX_SEQ
    beyond = memory.activations(load_config("7b", ["data.batch_size=1", "data.seq_len=1048576",
                                                   "model.max_seq_len=1048576"]))
    assert beyond["attention"] == "blockwise"
    assert half["working_set"]["mlp_activations"] == full["working_set"]["mlp_activations"]
    untiled = memory.activations(_long(524288, "stream.mlp_tile=524288"))
    assert untiled["mlp_tile"] == 0
    assert untiled["working_set"]["mlp_activations"] == 64 * full["working_set"]["mlp_activations"]


def test_working_set_counts_the_attention_gradients_at_long_sequences():
    """With the MLP tiled, the attention's gradients set the layer's peak at 1 x 524288;
    short of that length the MLP's activations, the larger, are counted instead of them, not
    beside them."""
    cfg = _long(524288, "model.layers=2")
    acts = memory.activations(cfg)["working_set"]
    assert acts["attention_gradients"] > acts["mlp_activations"]
    short = memory.activations(load_config("7b", ["data.batch_size=1", "data.seq_len=131072",
                                                  "model.max_seq_len=131072"]))
    ws = short["working_set"]
    assert ws["mlp_activations"] > ws["attention_gradients"]
    assert short["working_set_total"] == sum(ws.values()) - ws["attention_gradients"]


@pytest.mark.xfail(strict=True, reason="planned 54.5 GiB: 5.3 GiB under the measured 59.8 "
                   "(older engine), beyond HEADROOM; the fixed bytes now count the layer-sized "
                   "parts in flight (planning/memory.py: fixed_bytes)")
def test_the_planned_gpu_total_covers_the_peak_measured_at_524288():
    """The planned GPU total of a 7b-width step at 1 x 524288 (2 layers streamed, nothing kept,
    the inputs on the GPU) with the headroom covers the 59.8 GiB the H200 measured
    (benchmarks/RESULTS.md, 2026-11-25), and is within 5% of it."""
    cfg = planner.pinned_config(_long(524288, "model.layers=2"), PlacementPlan())  # as measured
    planned = sum(memory.device_bytes(cfg, memory.plan_of(cfg)).values())
    assert planned + memory.HEADROOM >= 59.8 * GiB and planned <= 59.8 * GiB * 1.05


# The placement keys but saved_inputs pinned to stream every part and keep nothing.
STREAMED = ("stream.resident_layers=0", "stream.keep_layers=0",
            "stream.resident_embeddings=off", "stream.keep_attention=off",
            "stream.keep_weights=off")


@pytest.mark.parametrize("gpu_gib", [40, 90, 120, 140, 200])
def test_saved_inputs_split_by_gpu_room(gpu_gib):
    """The planner keeps as many layers' inputs on the GPU as fit beside the step's other
    bytes and the headroom, with room for two coming back from the host; the host holds the
    rest; where not even those two fit beside the layer's work, it refuses."""
    cfg = _long(524288, *STREAMED)  # stream.saved_inputs=auto, the default
    gpu, per = gpu_gib * GiB, memory.saved_per_layer(cfg)
    rates = presets.PRESETS["H200"].rates(cfg)
    assert per == 4 * GiB
    budget = gpu - memory.HEADROOM
    if gpu_gib == 40:  # 46.5 GiB beside the two inputs coming back
        with pytest.raises(ConfigError, match="needs at least 57.5 GiB of GPU memory"):
            planner.plan_placement(cfg, gpu, None, 1, rates)
        return
    planned = planner.plan_placement(cfg, gpu, None, 1, rates)
    on_host, device = planned.plan.host_inputs, planned.device
    assert memory.host_state_bytes(cfg, planned.plan)["saved_inputs"] == on_host * per
    total = sum(device.values())
    if on_host:  # as many as fit: one more layer's inputs on the GPU would not
        assert device["saved_inputs"] == (32 - on_host + 2) * per
        assert total <= budget < total + per
    else:
        assert device["saved_inputs"] == 32 * per and total <= budget
    for fixed, expected in (("device", 0), ("pinned_host", 32)):
        pinned = memory.replaced(cfg, "stream", saved_inputs=fixed)
        assert planner.plan_placement(pinned, 200 * GiB, None, 1, rates).plan.host_inputs == \
            expected


def test_the_trainer_places_saved_inputs_by_the_planners_split(monkeypatch):
    """StreamTrainer plans an unplanned config in what XLA may allocate on the device: the
    planner's split; all on the device where the device does not say (the CPU)."""
    from megatrain_jax.train import trainers

    cfg = tiny("model.layers=6", "data.batch_size=2", "data.seq_len=64", *STREAMED)
    assert cfg.stream.saved_inputs == "auto"
    assert trainers.StreamTrainer(cfg).engine.placement.host_inputs == 0  # CPU: no limit
    held = memory.device_bytes(cfg, PlacementPlan())
    other = sum(held.values()) - held["saved_inputs"]
    per = memory.saved_per_layer(cfg)
    for keep in (0, 1, 3, 6):  # layers' inputs that fit on the GPU
        gpu = other + memory.HEADROOM + (keep + (2 if keep < 6 else 0)) * per
        monkeypatch.setattr(trainers, "device_memory_bytes", lambda gpu=gpu: gpu)
        trainer = trainers.StreamTrainer(cfg)
        assert trainer.engine.placement.host_inputs == 6 - keep
        assert memory.plan_of(trainer.cfg).host_inputs == 6 - keep


def test_plan_accepts_7b_at_262144_on_the_h200_box(capsys):
    args = ["data.batch_size=1", "data.seq_len=262144", "model.max_seq_len=524288"]
    code = main(["plan", "7b", *args, "--host-gb", "125", "--gpu-gb", "140"])
    out = capsys.readouterr().out
    assert code == 0, out
    est = plan.estimate(load_config("7b", args), 133 * GiB, 125 * GiB)
    placement = memory.plan_of(est["config"])
    # Inputs (2 GiB a layer) wait on the host, where the GPU's room buys more as resident
    # state and kept attention than as inputs kept there.
    assert 0 < placement.host_inputs <= 32 and placement.attention_layers > 0
    assert est["host"]["saved_inputs"] == placement.host_inputs * 2 * GiB
    for part in ("attention             cudnn", "tiles of 8,192 tokens",
                 f"saved_inputs          {placement.host_inputs * 2:8.2f} GiB",
                 f"host memory: 125.00 GiB, {est['host_total'] / GiB:.2f} GiB needed -> fits",
                 f"GPU memory: 133.00 GiB of 140.00 GiB (XLA's share), "
                 f"{est['device_total'] / GiB:.2f} GiB needed -> fits",
                 *memory_lines.placement_lines(est["config"])):
        assert part in out, part


def test_plan_refuses_7b_at_524288_with_the_numbers(capsys):
    """Every layer's input saved (stream.recompute_inputs=off; the default fits:
    tests/test_recompute_inputs.py)."""
    args = ["7b", "data.batch_size=1", "data.seq_len=524288", "model.max_seq_len=524288",
            "stream.recompute_inputs=off"]
    box = ["--host-gb", "125", "--gpu-gb", "140"]
    code = main(["plan", *args, *box])
    out, err = capsys.readouterr()
    assert code == 1
    # 4 GiB of saved input a layer: with 31 layers resident (the placement that needs the
    # least host memory, whose table plan shows), the inputs that wait on the host overfill it;
    # smaller moments make room for them.
    assert "host memory: 125.00 GiB, 138.91 GiB needed -> does NOT fit" in out
    assert "needs 138.9 GiB of host memory" in err and "the GPU holds 31 of its 32" in err
    assert ("Changes that fit: optim.state_dtype=bfloat16; stream.recompute_inputs=auto; "
            "data.seq_len=484352") in err
    plan.check_fits(_long(484352, "stream.recompute_inputs=off"), host=125 * GiB,
                    gpu=133 * GiB)
    assert main(["plan", *args, "optim.state_dtype=int8", *box]) == 0
    # All on the GPU, it overflows the GPU instead.
    capsys.readouterr()
    code = main(["plan", *args, "stream.saved_inputs=device", *box])
    out, err = capsys.readouterr()
    assert code == 1 and "needs at least 177.5 GiB of GPU memory" in err
    assert "saved_inputs            128.00 GiB" in out
    assert "Changes that fit: data.seq_len=385024" in err


def test_saved_inputs_split_between_device_and_host_give_the_same_gradients():
    """The first k layers' inputs on pinned host, the rest on the device: the gradients are
    those of all on one side, bit for bit (the inputs only travel)."""
    from megatrain_jax import optim
    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.stream import StreamEngine
    from megatrain_jax.stream.placement import memory_kinds
    from megatrain_jax.train.trainers import llama_templates

    cfg = tiny("model.layers=4", "data.batch_size=4", "data.micro_batches=2")
    params = model.init(cfg.model, jax.random.key(0))

    def step(saved):
        engine = StreamEngine(llama_templates(cfg), optim.build_stream_optimizer(cfg),
                              micro_batches=2, saved_inputs=saved)
        state = engine.state_from_params(params)
        seen = []
        original = engine.placement.to_host

        def to_host(tree):  # records each saved input's trip to the host
            moved = original(tree)
            if not isinstance(tree, dict) and getattr(tree, "ndim", 0) == 4:
                seen.append(memory_kinds(moved))
            return moved

        engine.placement.to_host = to_host
        loss, grads, sq, _, _ = engine.forward_backward(state.params,
                                                        TokenSource(cfg).batch_at(0))
        return float(loss), jax.tree.map(np.asarray, grads), float(sq), len(seen)

    device, host, split = step("device"), step("pinned_host"), step(2)
    assert (device[3], host[3], split[3]) == (0, 4, 2)  # inputs sent to the host
    for other in (host, split):
        assert other[0] == device[0] and other[2] == device[2]
        assert max_rel_error(other[1], device[1]) == 0.0
