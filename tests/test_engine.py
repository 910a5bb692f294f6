"""The streaming engine against its twin, the whole-model reference (CPU, fp32)."""

import time

import jax
import numpy as np
import optax
import pytest
from conftest import CLIPPED, aligned, max_rel_error, side_by_side, tiny

from megatrain_jax import model
from megatrain_jax.config import ConfigError
from megatrain_jax.io.data import TokenSource
from megatrain_jax.stream import Tracer
from megatrain_jax.stream import engine as engine_module
from megatrain_jax.stream.placement import map_parts, memory_kinds, parts
from megatrain_jax.train import StreamTrainer
from megatrain_jax.train.reference import ReferenceTrainer


class Visits(Tracer):
    """Calls fn(phase, layer) at every layer visit of the schedule."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def visit(self, phase, index):
        self.fn(phase, index)


# Each feature once; "everything" combines those whose programs it shares (tied embeddings,
# one kv head, micro-batches, the deepest prefetch, inputs saved on the host, a loss chunk
# that does not divide the tokens), so none of those needs a case of its own.
CASES = {
    "depth1": ["stream.prefetch_depth=1"],
    "depth2": ["stream.prefetch_depth=2"],
    "micro4": ["data.micro_batches=4"],
    "mha": ["model.kv_heads=4"],
    # the sequence tiled in the layer (MLP tiles, blockwise attention), as at long lengths
    "tiled": ["stream.mlp_tile=16", "stream.attention_chunk=8", "model.attention=blockwise"],
    "everything": ["model.tie_embeddings=true", "model.qk_norm=true", "model.qkv_bias=true",
                   "model.kv_heads=1", "data.micro_batches=2", "stream.prefetch_depth=3",
                   "stream.saved_inputs=pinned_host", "stream.loss_chunk=24"],
}


def _grads_both(cfg, seed=0):
    params = model.init(cfg.model, jax.random.key(seed))
    batch = TokenSource(cfg).batch_at(seed)
    ref_loss, ref_grads = jax.jit(ReferenceTrainer(cfg).grads)(params, batch)
    engine = StreamTrainer(cfg).engine
    state = engine.state_from_params(params)
    loss, grads, sq, _, _ = engine.forward_backward(state.params, batch)
    return (ref_loss, ref_grads), (loss, grads, sq)


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_gradients_equal_reference(case):
    cfg = tiny("model.layers=3", "data.batch_size=4", *CASES[case])
    (ref_loss, ref_grads), (loss, grads, sq) = _grads_both(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert max_rel_error(grads, ref_grads) <= 1e-5
    assert memory_kinds(grads) == {"pinned_host"}
    ref_sq = sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(ref_grads))
    np.testing.assert_allclose(float(sq), ref_sq, rtol=1e-5)


UPDATES = {"host": ["stream.update=host"], "device": ["stream.update=device"],
           "host_adam": ["stream.update=host", "optim.name=adam"],
           "device_lion": ["stream.update=auto", "optim.name=lion"],
           "host_resident": ["stream.update=host", "stream.resident_layers=2"],
           "device_resident": ["stream.update=device", "stream.resident_layers=1"]}


@pytest.mark.parametrize("update", sorted(UPDATES))
def test_twenty_steps_match_reference_with_clipping(update):
    cfg = tiny(*CLIPPED, *UPDATES[update])
    ref_state, state, stream, records = side_by_side(cfg, 20)
    ref_losses, losses, norms = ([r[k] for r in records] for k in ("ref_loss", "loss",
                                                                   "grad_norm"))
    np.testing.assert_allclose([r["lr"] for r in records], [r["ref_lr"] for r in records],
                               rtol=1e-6)
    clip = cfg.optim.clip_norm
    assert any(n > clip for n in norms) and any(n < clip for n in norms), norms  # clip triggers
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel_error(state.params, ref_state.params) <= 1e-5
    host = update.startswith("host")
    assert (stream.engine.host_optimizer is not None) == host
    if update == "device_lion":
        return  # lion keeps one moment
    for moment in ("mu", "nu"):  # the engine keeps Optax state per part, the reference whole
        streamed = map_parts(lambda s, k=moment: optax.tree_utils.tree_get(s, k),
                             state.opt_state)
        whole = optax.tree_utils.tree_get(ref_state.opt_state, moment)
        assert max_rel_error(streamed, whole) <= 1e-4, moment


def test_renewed_host_weights_train_on_exactly(monkeypatch):
    """Every RENEW_EVERY steps the host weights move to new buffers (XLA keeps a record per
    copy of a long-lived buffer): same values, the old buffers freed, and the run goes on
    as the reference does. A resident layer among streamed ones keeps its buffers."""
    monkeypatch.setattr(engine_module, "RENEW_EVERY", 3)
    cfg = tiny(*CLIPPED, *UPDATES["host_resident"])
    ref_state, state, stream, records = side_by_side(cfg, 7)
    np.testing.assert_allclose([r["loss"] for r in records], [r["ref_loss"] for r in records],
                               rtol=1e-5)
    assert max_rel_error(state.params, ref_state.params) <= 1e-5

    trainer, data = StreamTrainer(cfg), TokenSource(cfg)
    state = trainer.init(jax.random.key(0))
    for step in range(3):
        state, _ = trainer.train_step(state, data.batch_at(step))
    old = state.params
    state, _ = trainer.train_step(state, data.batch_at(3))  # renews, then trains
    placement = trainer.engine.placement
    for k, (before, after) in enumerate(zip(parts(old), parts(state.params))):
        if not placement.is_resident(k):  # (a resident part's update donates its buffers)
            assert all(a.is_deleted() and not b.is_deleted() for a, b in
                       zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    head = state.params["head"]
    values = jax.tree.map(np.array, head)
    renewed = placement.renew(head)
    assert memory_kinds(renewed) == {"pinned_host"}
    for a, b, v in zip(jax.tree.leaves(head), jax.tree.leaves(renewed), jax.tree.leaves(values)):
        assert a.is_deleted() and not b.is_deleted()
        np.testing.assert_array_equal(np.asarray(b), v)


@pytest.mark.parametrize("update", ["host", "device", "host_resident"])
def test_nan_gradient_skips_exactly_that_step(update):
    cfg = tiny("model.layers=2", *UPDATES[update])
    data = TokenSource(cfg)
    trainer = StreamTrainer(cfg)
    state = trainer.init(jax.random.key(0))
    state, m0 = trainer.train_step(state, data.batch_at(0))
    assert not bool(m0["skipped"])
    params_before = jax.tree.map(np.array, state.params)
    opt_before = jax.tree.map(np.array, state.opt_state)
    poisoned = data.batch_at(1)
    poisoned["mask"][1, 3] = np.nan
    state, m1 = trainer.train_step(state, poisoned)
    assert bool(m1["skipped"]) and not np.isfinite(float(m1["grad_norm"]))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params_before)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(opt_before)):
        np.testing.assert_array_equal(a, b)
    state, m2 = trainer.train_step(state, data.batch_at(2))
    assert not bool(m2["skipped"]) and np.isfinite(float(m2["loss"]))
    changed = [not np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params_before))]
    assert all(changed)


@pytest.mark.parametrize("update", ["host", "device"])
def test_host_state_is_pinned_after_init_and_step(update):
    """Weights pinned (the GPU copies them); the optimizer state pinned where the GPU updates
    it, else in plain host memory, outside XLA's pinned pool: only the host update reads it."""
    cfg = tiny("model.tie_embeddings=true", "model.qkv_bias=true", f"stream.update={update}")
    trainer = StreamTrainer(cfg)
    state = trainer.init(jax.random.key(0))
    moments = {"host": {"unpinned_host"}, "device": {"pinned_host"}}[update]
    assert memory_kinds(state.params) == {"pinned_host"}
    assert memory_kinds(state.opt_state) == moments
    state, _ = trainer.train_step(state, TokenSource(cfg).batch_at(0))
    assert memory_kinds(state.params) == {"pinned_host"}
    assert memory_kinds(state.opt_state) == moments


def test_numpy_parameters_are_copied_and_never_written_into():
    """The host update writes the state in place: parameters given as NumPy arrays (an
    import, a restore) must become buffers of the state's own, or training would change the
    caller's arrays (and, over a mesh, update a leaf given whole to every device once per
    device: tests/mesh_runs.py's kernel bits)."""
    cfg = tiny()
    given = jax.tree.map(aligned, model.init(cfg.model, jax.random.key(0)))
    before = [np.copy(a) for a in jax.tree.leaves(given)]
    trainer = StreamTrainer(cfg)
    state = trainer.init(None, params=given)
    for step in range(2):  # the first step's learning rate is 0 (warmup)
        state, _ = trainer.train_step(state, TokenSource(cfg).batch_at(step))
    state.wait()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(given), before))
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params), before))


@pytest.mark.parametrize("update", ["host", "device"])
def test_resident_layers_stay_on_the_device_and_their_gradients_too(update):
    cfg = tiny("model.layers=3", "stream.resident_layers=2", f"stream.update={update}")
    trainer = StreamTrainer(cfg)
    engine = trainer.engine

    def kinds(state):
        return [memory_kinds((state.params["layers"][i], state.opt_state["layers"][i]))
                for i in range(3)]

    moments = {"host": {"unpinned_host"}, "device": {"pinned_host"}}[update]
    streamed = {"pinned_host"} | moments  # weights pinned, moments as the update needs
    state = trainer.init(jax.random.key(0))
    assert kinds(state) == [{"device"}, {"device"}, streamed]
    rest = {k: state.params[k] for k in ("embed", "head")}
    assert memory_kinds((rest, state.opt_state["embed"], state.opt_state["head"])) == streamed
    batch = TokenSource(cfg).batch_at(0)
    _, grads, _, _, _ = engine.forward_backward(state.params, batch)
    assert [memory_kinds(g) for g in grads["layers"]] == [{"device"}, {"device"},
                                                          {"pinned_host"}]
    before = jax.tree.map(np.array, state.params["layers"][0])
    for step in range(2):
        state, _ = trainer.train_step(state, TokenSource(cfg).batch_at(step))
    assert kinds(state) == [{"device"}, {"device"}, streamed]
    after = jax.tree.leaves(state.params["layers"][0])
    assert all(not np.array_equal(a, b) for a, b in zip(after, jax.tree.leaves(before)))
    # A restore target places each part where the engine keeps it.
    target = trainer.abstract_state()
    assert [leaf.sharding.memory_kind for leaf in jax.tree.leaves(target["params"]["layers"][1])
            ][0] == "device"
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(
        target["opt_state"]["layers"][2])} == moments


def test_more_resident_layers_than_layers_is_refused():
    with pytest.raises(ConfigError, match=r"stream.resident_layers \(4\) must be within "
                                          r"\[0, model.layers = 3\]"):
        tiny("model.layers=3", "stream.resident_layers=4")


def _compilations(num_layers):
    """Programs lowered during two steps of a fresh model, its state already built: those
    the step compiles, or loads from the compilation cache."""
    events = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        cfg = tiny(f"model.layers={num_layers}")
        trainer = StreamTrainer(cfg)
        state = trainer.init(jax.random.key(0))
        data = TokenSource(cfg)
        before = len(events)
        for step in range(2):
            state, metrics = trainer.train_step(state, data.batch_at(step))
        float(metrics["loss"])
        state.wait()
        return len(events) - before
    finally:
        jax.monitoring.clear_event_listeners()


def test_compile_count_does_not_depend_on_depth():
    # A first model lowers what every model's steps share (the batch's and the scalars' small
    # operations, cached for the process); each later trainer lowers its own programs.
    _compilations(2)
    shallow, deep = _compilations(2), _compilations(8)
    # embed/layer/head forward, layer/embed backward: the same programs at any depth.
    assert 5 <= shallow == deep < 5 + 10, (shallow, deep)


@pytest.mark.parametrize("depth", [1, 2])
def test_device_residency_is_bounded(depth):
    """Layer-shaped arrays on the device never exceed (depth + 2) weights + (depth + 2) grads."""

    def peak(num_layers):
        cfg = tiny(f"model.layers={num_layers}", f"stream.prefetch_depth={depth}")
        trainer = StreamTrainer(cfg)
        state = trainer.init(jax.random.key(0))
        shape = state.params["layers"][0].w_gate.shape
        seen = []

        def observe(phase, index):
            seen.append(sum(
                1 for a in jax.live_arrays()
                if a.shape == shape and a.sharding.memory_kind == "device" and not a.is_deleted()
            ))

        state, metrics = trainer.train_step(state, TokenSource(cfg).batch_at(0),
                                            tracer=Visits(observe))
        float(metrics["loss"])
        return max(seen)

    shallow, deep = peak(depth + 3), peak(12)
    assert deep <= 2 * (depth + 2)
    assert deep == shallow  # does not grow with the number of layers


class Events(Tracer):
    """Records the forward's fetches (by part name) and its waits for layer outputs."""

    def __init__(self):
        super().__init__()
        self.log, self.phase = [], None

    def visit(self, phase, index):
        self.phase = phase

    def issued(self, lane, name, tree):
        if lane == "h2d" and self.phase in (None, "forward"):
            self.log.append(name)
        return tree

    def waited(self, what, start):
        super().waited(what, start)
        if what == "compute":
            self.log.append("computed")


@pytest.mark.parametrize("depth", [1, 2])
def test_a_forward_nothing_paces_stays_within_depth_of_the_gpu(depth):
    """In a first step (and after a checkpoint, or over speculated parts) no update paces the
    forward: before fetching layer j it has still waited for the outputs of the layers below
    j - 2 * depth, so at most 2 * depth + 1 layers' weights are on the GPU ahead of their
    compute, whatever the depth of the model."""
    cfg = tiny("model.layers=8", f"stream.prefetch_depth={depth}")
    trainer = StreamTrainer(cfg)
    state = trainer.init(jax.random.key(0))
    events = Events()
    state, metrics = trainer.train_step(state, TokenSource(cfg).batch_at(0), tracer=events)
    float(metrics["loss"])
    for j in range(cfg.model.layers):
        before = events.log[:events.log.index(f"layer {j}")]
        assert before.count("computed") >= j - 2 * depth, (j, events.log)
    assert events.log.count("computed") == cfg.model.layers - depth
    assert "time_wait_compute_s" in metrics


def test_host_update_overlaps_the_next_forward():
    """The next step's forward starts while the host still updates the last layers."""
    cfg = tiny("model.layers=6", "stream.update=host", "stream.prefetch_depth=1")
    trainer = StreamTrainer(cfg)
    engine, log = trainer.engine, []
    update = engine.host_optimizer.update

    def slow_update(params, grads, opt_state, scale):
        time.sleep(0.05)
        update(params, grads, opt_state, scale)
        log.append("update")

    engine.host_optimizer.update = slow_update
    visits = Visits(lambda phase, i: log.append(f"{phase} {i}"))
    data = TokenSource(cfg)
    state = trainer.init(jax.random.key(0))
    state, _ = trainer.train_step(state, data.batch_at(0))
    assert state.pending is not None and not state.pending.done("head")
    del log[:]
    state, _ = trainer.train_step(state, data.batch_at(1), tracer=visits)
    first_forward = log.index("forward 0")
    assert log[first_forward:].count("update") >= 3, log  # head and last layers still pending
    # The forward never runs ahead of the update of the layer it computes, and never lags:
    # layer i computes while layer i + 1 is still being updated (embed, layers 0..i done).
    for i in range(cfg.model.layers):
        assert log[:log.index(f"forward {i}")].count("update") == i + 2, (i, log)


def test_a_failed_host_update_surfaces_in_the_next_step():
    cfg = tiny("model.layers=2", "stream.update=host")
    trainer = StreamTrainer(cfg)

    def broken(params, grads, opt_state, scale):
        raise MemoryError("no room")

    data = TokenSource(cfg)
    state = trainer.init(jax.random.key(0))
    trainer.engine.host_optimizer.update = broken
    state, _ = trainer.train_step(state, data.batch_at(0))
    with pytest.raises(RuntimeError, match="host optimizer update failed") as info:
        trainer.train_step(state, data.batch_at(1))
    assert isinstance(info.value.__cause__, MemoryError)
