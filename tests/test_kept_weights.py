"""Kept weights (`stream.keep_weights`): the last layers keep the weights their forward
fetched, and their backward takes them instead of fetching them again. The same arrays, so
the same training bit for bit, with half the weight transfers of those layers; the
planner's count of the layers that keep them."""

import json

import jax
import numpy as np
import pytest
from conftest import Transfers, tiny

from megatrain_jax import model
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.io.data import TokenSource
from megatrain_jax.planning import memory, planner, presets, roofline
from megatrain_jax.planning.memory import PlacementPlan
from megatrain_jax.tools import plan
from megatrain_jax.train import StreamTrainer, trainers

GiB = 2**30


def _planned(cfg, gpu, devices=1):
    """The planner's placement of cfg for GPUs of `gpu` bytes (None: unknown), at the H200's
    preset rates, the host unbounded."""
    rates = presets.PRESETS["H200"].rates(cfg, devices)
    return planner.plan_placement(cfg, gpu, None, devices, rates).plan


def _run(*overrides, steps=3):
    cfg = tiny("model.layers=3", "data.batch_size=4", "optim.lr=1e-2", *overrides)
    trainer, data = StreamTrainer(cfg), TokenSource(cfg)
    state = trainer.init(None, params=model.init(cfg.model, jax.random.key(0)))
    transfers = Transfers()
    for step in range(steps):
        state, _ = trainer.train_step(state, data.batch_at(step),
                                      tracer=transfers if step == steps - 1 else None)
    state.wait()
    return trainer, jax.tree.map(np.array, (state.params, state.opt_state)), transfers.h2d


def test_kept_weights_travel_once_a_step_and_train_the_same_bits():
    plain, fetched_twice, twice = _run("stream.keep_weights=off")
    kept, fetched_once, once = _run("stream.keep_weights=on")
    assert plain.engine.schedule.keep_weights == 0 and kept.engine.schedule.keep_weights == 3
    layers = [f"layer {i}" for i in range(3)]
    assert [twice.count(name) for name in layers] == [2, 2, 2]  # forward and backward
    assert [once.count(name) for name in layers] == [1, 1, 1]  # the forward only
    for x, y in zip(jax.tree.leaves(fetched_twice), jax.tree.leaves(fetched_once)):
        np.testing.assert_array_equal(x, y)
    # Inputs saved on the host still come back for the kept layers' backward.
    _, on_host, moved = _run("stream.keep_weights=on", "stream.saved_inputs=pinned_host")
    assert [moved.count(f"input {i}") for i in range(3)] == [1, 1, 1]
    for x, y in zip(jax.tree.leaves(fetched_twice), jax.tree.leaves(on_host)):
        np.testing.assert_array_equal(x, y)


def test_a_number_keeps_that_many_of_the_last_layers_whatever_the_room(tmp_path):
    """`stream.keep_weights=2` (a GPU memory budget): the last two layers keep theirs, the
    first is fetched again for its backward; the same bits as fetching every layer twice."""
    _, fetched_twice, _ = _run("stream.keep_weights=off")
    two, fetched, moved = _run("stream.keep_weights=2")
    assert two.cfg.stream.keep_weights == "2" and two.engine.schedule.keep_weights == 2
    assert [moved.count(f"layer {i}") for i in range(3)] == [2, 1, 1]
    for x, y in zip(jax.tree.leaves(fetched_twice), jax.tree.leaves(fetched)):
        np.testing.assert_array_equal(x, y)
    cfg = two.cfg
    assert memory.plan_of(cfg).weight_layers == 2
    device = memory.device_bytes(cfg, memory.plan_of(cfg))
    assert device["kept_weights"] == 2 * memory.weights_per_layer(cfg)
    # The room does not decide it: the planner keeps two where it would keep every streamed
    # layer's (4 GiB), or none (the room unknown).
    streamed = ("stream.resident_layers=0", "stream.keep_layers=0",
                "stream.resident_embeddings=off")
    for keep, layers in (("2", 2), ("auto", 3)):
        given = tiny("model.layers=3", *streamed, f"stream.keep_weights={keep}")
        assert _planned(given, 4 * GiB).weight_layers == layers
    assert _planned(tiny("model.layers=3", "stream.keep_weights=2"), None).weight_layers == 2
    # A JSON config's whole number, as a string's digits; more than the layers fetched twice,
    # or another word, refused with what it takes.
    path = tmp_path / "kept.json"
    path.write_text(json.dumps({"model": {"layers": 2}, "stream": {"keep_weights": 1}}))
    assert load_config(str(path)).stream.keep_weights == "1"
    with pytest.raises(ConfigError, match=r"keep_weights \(3\) exceeds the 2 layers fetched"):
        tiny("model.layers=3", "stream.resident_layers=1", "stream.keep_weights=3")
    with pytest.raises(ConfigError, match="not one of auto, on, off or a number of layers"):
        tiny("stream.keep_weights=most")


def test_the_count_is_read_each_step():
    """benchmarks/ab_step.py switches the count between steps of one process (its arms'
    KEPT): the next step's backward fetches accordingly."""
    cfg = tiny("model.layers=3", "data.batch_size=4", "stream.keep_weights=off")
    trainer, data = StreamTrainer(cfg), TokenSource(cfg)
    state = trainer.init(None, params=model.init(cfg.model, jax.random.key(0)))
    fetches = []
    for step, kept in enumerate((0, 2, 0)):
        trainer.engine.schedule.keep_weights = kept
        transfers = Transfers()
        state, _ = trainer.train_step(state, data.batch_at(step), tracer=transfers)
        fetches.append([transfers.h2d.count(f"layer {i}") for i in range(3)])
    state.wait()
    assert fetches == [[2, 2, 2], [2, 1, 1], [2, 2, 2]]


def test_the_trainer_plans_them_in_the_room_the_device_reports(monkeypatch):
    """The trainer places an unplanned config within what the device says XLA may allocate:
    nothing kept where that is unknown (a CPU); with 4 GiB, every streamed layer keeps its
    weights (the layers pinned to stream)."""
    cfg = tiny("model.layers=3", "stream.resident_layers=0", "stream.keep_layers=0",
               "stream.resident_embeddings=off")
    assert cfg.stream.keep_weights == "auto"  # the default
    assert StreamTrainer(cfg).engine.schedule.keep_weights == 0  # the room unknown (a CPU)
    monkeypatch.setattr(trainers, "device_memory_bytes", lambda: 4 * GiB)
    trainer = StreamTrainer(cfg)
    assert trainer.engine.schedule.keep_weights == 3  # room for every layer
    assert trainer.cfg.stream.keep_weights == "3"  # the run's config says what it was given


def test_the_planner_keeps_what_the_gpu_room_holds():
    """Where the placement leaves room (the layers pinned to stream, the inputs on the GPU),
    the planner fills it with kept weights, one more layer's working set left free for the
    backward's temporaries; never beyond the budget."""
    cfg = memory.replaced(memory.replaced(tiny(), "model", layers=4), "stream",
                          keep_weights="auto", resident_layers="0", keep_layers="0",
                          resident_embeddings="off")
    per = memory.weights_per_layer(cfg)
    assert per == 4 * cfg.model.params_per_layer
    # Room for two and a half layers' weights beside the rest, the headroom and one more
    # layer's working set free for the backward: two keep them.
    base = memory.device_bytes(cfg, PlacementPlan())  # every input on the GPU
    free = memory.activations(cfg)["working_set_total"]
    assert free > 4 * per  # without it free, all four would keep them
    gpu = sum(base.values()) + memory.HEADROOM + free + 2 * per + per // 2
    for room, layers in ((gpu, 2), (gpu - per, 1), (gpu - 3 * per, 0), (4 * GiB, 4)):
        placement = _planned(cfg, room)
        assert placement == PlacementPlan(weight_layers=layers)
        device = memory.device_bytes(cfg, placement)
        assert device["kept_weights"] == layers * per
        assert sum(device.values()) <= room - memory.HEADROOM
    assert _planned(cfg, None).weight_layers == 0  # the room unknown (a CPU)
    on = memory.replaced(cfg, "stream", keep_weights="on", resident_layers="1")
    assert _planned(on, None).weight_layers == 3  # the streamed layers only
    off = memory.replaced(cfg, "stream", keep_weights="off")
    assert _planned(off, 4 * GiB).weight_layers == 0
    # Over two GPUs each keeps its half of every layer.
    assert memory.weights_per_layer(cfg, 2) == per // 2


def test_kept_weights_leave_the_backward_pass_out_of_the_bound_and_the_host_traffic():
    """Four GPUs of 140 GiB: the planner keeps the weights of every layer it streams. Kept,
    every 7b layer's shard: the plan's host traffic and the roofline's backward lose one
    pass of those layers' weights, not more."""
    cfg = load_config("7b", ["mesh.data=4", "data.batch_size=64"])
    gpu, m = plan.usable_gpu_bytes(141 * GiB), cfg.model
    assert cfg.stream.keep_weights == "auto"
    placement = _planned(cfg, gpu, 4)
    assert placement.weight_layers == m.layers - placement.resident_layers
    assert _planned(cfg, None, 4).weight_layers == 0  # the room unknown: none kept
    fetched = planner.pinned_config(cfg, PlacementPlan(resident_embeddings=True))
    kept_cfg = planner.pinned_config(cfg, PlacementPlan(resident_embeddings=True,
                                                        weight_layers=m.layers))
    kept = m.layers
    held = roofline.host_params(kept_cfg)  # the layers' alone here
    assert held == m.layers * m.params_per_layer
    share = kept * m.params_per_layer / held  # of the host-held parameters
    assert plan.host_traffic(kept_cfg)["weights"] == pytest.approx(8 - 4 * share)
    assert plan.host_traffic(fetched)["weights"] == 8.0
    rates = roofline.Rates(h2d_gbps=50.0, d2h_gbps=50.0, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=6.0,
                           host_memory_gbps=150.0)

    def serial(c):  # the same share of the update
        return memory.replaced(c, "stream", speculate="off")

    every, kept_ = roofline.bound_for(serial(fetched), rates), roofline.bound_for(
        serial(kept_cfg), rates)
    pass_s = kept * m.params_per_layer * 4 / 150e9  # their weights' read in the host memory
    assert kept_["host_memory_forward_s"] == pytest.approx(every["host_memory_forward_s"])
    assert kept_["host_memory_backward_s"] == pytest.approx(
        every["host_memory_backward_s"] - pass_s)
    assert roofline.bound_for(kept_cfg, rates)["step_s"] < roofline.bound_for(fetched, rates)[
        "step_s"]
    lines = "\n".join(plan.traffic_lines(kept_cfg))
    assert f"weights {8 - 4 * share:.1f}" in lines
    # Saving layers (stream.keep_layers) fetch none for their backward either.
    one = load_config("7b", ["mesh.data=1"])
    saving = planner.pinned_config(one, PlacementPlan(resident_embeddings=True,
                                                      saving_layers=2))
    assert plan.host_traffic(saving)["weights"] == pytest.approx(8 - 8 / m.layers)
    off = planner.pinned_config(one, PlacementPlan(resident_embeddings=True))
    keeping = planner.pinned_config(one, PlacementPlan(resident_embeddings=True,
                                                       weight_layers=2))
    assert memory.plan_of(saving).unfetched(m.layers) == 2
    assert memory.plan_of(off).unfetched(m.layers) == 0
    assert roofline.bound_for(saving, rates)["host_memory_backward_s"] == pytest.approx(
        roofline.bound_for(keeping, rates)["host_memory_backward_s"])
    assert roofline.bound_for(keeping, rates)["host_memory_backward_s"] < \
        roofline.bound_for(off, rates)["host_memory_backward_s"]
