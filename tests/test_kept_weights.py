"""Kept weights (`stream.keep_weights`): the last layers keep the weights their forward
fetched, and their backward takes them instead of fetching them again. The same arrays, so
the same training bit for bit, with half the weight transfers of those layers; the
planner's count of the layers that keep them."""

import jax
import numpy as np
from conftest import tiny

from megatrain_jax import model
from megatrain_jax.config import memory
from megatrain_jax.io.data import TokenSource
from megatrain_jax.stream import Tracer
from megatrain_jax.train import StreamTrainer

GiB = 2**30


class _Transfers(Tracer):
    """Names of the host -> device copies a step issues."""

    def __init__(self):
        super().__init__()
        self.h2d: list[str] = []

    def issued(self, lane, name, tree):
        if lane == "h2d":
            self.h2d.append(name)
        return tree


def _run(*overrides, steps=3):
    cfg = tiny("model.layers=3", "data.batch_size=4", "optim.lr=1e-2", *overrides)
    trainer, data = StreamTrainer(cfg), TokenSource(cfg)
    state = trainer.init(None, params=model.init(cfg.model, jax.random.key(0)))
    transfers = _Transfers()
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


def test_the_planner_keeps_what_the_gpu_room_holds():
    cfg = memory.replaced(memory.replaced(tiny(), "model", layers=4), "stream",
                          keep_weights="auto")
    per = memory.weights_per_layer(cfg)
    assert per == 4 * cfg.model.params_per_layer
    room_for = {}
    for gpu in (1 * GiB, 4 * GiB):
        device, _ = memory.step_bytes(cfg, 1, gpu)
        room_for[gpu] = memory.keep_weights_layers(cfg, gpu)
        assert device["kept_weights"] == room_for[gpu] * per
    base, _ = memory.step_bytes(memory.replaced(cfg, "stream", keep_weights="off"), 1, 1 * GiB)
    left = 1 * GiB - sum(base.values()) - memory.SPLIT_HEADROOM
    assert room_for[1 * GiB] == max(0, min(4, left // per))
    assert room_for[4 * GiB] == 4  # every layer
    assert memory.keep_weights_layers(cfg, None) == 0  # the room unknown (a CPU)
    on = memory.replaced(cfg, "stream", keep_weights="on", resident_layers=1)
    assert memory.keep_weights_layers(on, None) == 3  # the streamed layers only
    assert memory.keep_weights_layers(memory.replaced(cfg, "stream", keep_weights="off"),
                                      4 * GiB) == 0
    # Over two GPUs each keeps its half of every layer.
    assert memory.weights_per_layer(cfg, 2) == per // 2
