"""The embedding and the head on the GPU (`stream.resident_embeddings`): their weights and optimizer
state live there and update there, the host and its update lane carry the layers only; the same
training as the reference, speculative updates and clipping included; a NaN in the head stops every
speculative update; `auto` places them by the GPU's room, and the plan follows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CLIPPED, Transfers, agrees_with_reference_while_clipping, tiny

from megatrain_jax import model
from megatrain_jax.config import load_config
from megatrain_jax.io.data import TokenSource
from megatrain_jax.planning import memory, memory_lines, planner, presets, roofline
from megatrain_jax.planning.memory import PlacementPlan
from megatrain_jax.stream.placement import memory_kinds
from megatrain_jax.tools import plan
from megatrain_jax.train import StreamTrainer, trainers

GiB = 2**30
EDGES = ("embed", "head")


def _trainer(*overrides):
    cfg = tiny("model.layers=3", "data.batch_size=4", "optim.lr=1e-2",
               "stream.resident_embeddings=on", *overrides)
    trainer = StreamTrainer(cfg)
    return trainer, trainer.init(None, params=model.init(cfg.model, jax.random.key(0))), \
        TokenSource(cfg)


def test_they_live_travel_never_and_update_on_the_device():
    trainer, state, data = _trainer()
    engine = trainer.engine

    def homes(state):
        return {name: memory_kinds((state.params[name], state.opt_state[name]))
                for name in EDGES} | {"layers": memory_kinds(state.params["layers"]),
                                      "layer moments": memory_kinds(state.opt_state["layers"])}

    at_home = {"embed": {"device"}, "head": {"device"}, "layers": {"pinned_host"},
               "layer moments": {"unpinned_host"}}
    assert homes(state) == at_home
    _, grads, _, _, _ = engine.forward_backward(state.params, data.batch_at(0))
    assert {name: memory_kinds(grads[name]) for name in EDGES} == \
        {"embed": {"device"}, "head": {"device"}}
    assert memory_kinds(grads["layers"]) == {"pinned_host"}
    before = jax.tree.map(np.array, {name: state.params[name] for name in EDGES})
    transfers = Transfers()
    for step in range(3):
        state, _ = trainer.train_step(state, data.batch_at(step),
                                      tracer=transfers if step == 2 else None)
    state.wait()
    assert homes(state) == at_home
    assert transfers.h2d and not any(name in EDGES for name in transfers.h2d)
    for name in EDGES:  # learned, where they live
        assert all(not np.array_equal(a, np.asarray(b)) for a, b in zip(
            jax.tree.leaves(before[name]), jax.tree.leaves(state.params[name])))
    # A restore target places them where the engine keeps them; the layers stay on the host.
    target = trainer.abstract_state()
    assert {leaf.sharding.memory_kind for name in EDGES for leaf in jax.tree.leaves(
        (target["params"][name], target["opt_state"][name]))} == {"device"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(
        target["opt_state"]["layers"])} == {"unpinned_host"}


def test_steps_match_the_reference_with_speculative_updates_undone_and_standing():
    """Every step speculates the layers' updates during the backward (stream.speculate=on): the
    first steps clip, after their speculative updates ran, and undo and redo them; later ones do
    not, and their speculative updates stand. The embedding and head update on the device."""
    cfg = tiny(*CLIPPED, "stream.speculate=on", "stream.resident_embeddings=on")
    stream, records = agrees_with_reference_while_clipping(cfg, 14)
    assert stream.engine.placement.resident_embeddings
    # Each record tells of the update of the step before it.
    undone = [r["undone"] for r in records[1:]]
    stood = [r["speculated"] - r["undone"] for r in records[1:]]
    assert any(undone) and any(stood), (undone, stood)


def test_a_nan_in_the_resident_head_stops_every_speculative_update_and_writes_nothing():
    """The speculative updates follow the step's running sum of squares, which starts with the
    head's even where the head's gradient stays on the GPU: a NaN there leaves every layer
    unspeculated, and the skipped step leaves every weight and moment as it was, bit for bit."""
    trainer, state, data = _trainer("stream.speculate=on", "optim.clip_norm=100")
    engine = trainer.engine
    original = engine.programs.head

    def poisoned(*args):
        loss, dxs, dhead, dembed, sq = original(*args)
        dhead = jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), dhead)
        return loss, dxs, dhead, dembed, sq + jnp.nan

    state, _ = trainer.train_step(state, data.batch_at(0))
    before = jax.tree.map(np.array, (state.wait().params, state.opt_state))
    engine.schedule.programs = dataclasses.replace(engine.programs, head=poisoned)
    state, m = trainer.train_step(state, data.batch_at(1))
    assert bool(m["skipped"])
    update = state.wait().pending
    assert update.speculated == set() and update.undone == 0
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(np.asarray(y), x)


def test_the_planner_places_them_where_the_gpu_room_holds_them(monkeypatch):
    """The layers pinned to stream: the planner puts the embedding and the head on the GPU
    where they fit beside the rest and the headroom (the host's update and the link lose
    their share, which the bound counts), not where they are a byte short or the room is
    unknown; the trainer plans them in the room the device reports."""
    cfg = tiny("model.layers=4", "stream.resident_layers=0", "stream.keep_layers=0",
               "stream.keep_weights=off", "stream.saved_inputs=device")
    assert cfg.stream.resident_embeddings == "auto"  # the default
    need = memory.resident_embedding_bytes(cfg)
    assert need == 16 * cfg.model.embedding_params  # weights, two moments, gradients
    assert cfg.model.embedding_params == 2 * cfg.model.vocab_size * cfg.model.hidden + \
        cfg.model.hidden
    base = memory.device_bytes(cfg, PlacementPlan())
    there = memory.device_bytes(cfg, PlacementPlan(resident_embeddings=True))
    assert there["resident_embeddings"] == need and there["embedding"] == 0  # used in place
    assert base["resident_embeddings"] == 0 and base["embedding"] > 0
    fits = sum(there.values()) + memory.HEADROOM  # just enough, and a byte short
    rates = presets.PRESETS["H200"].rates(cfg)
    for gpu, on in ((fits, True), (fits - 1, False), (None, False)):
        planned = planner.plan_placement(cfg, gpu, None, 1, rates)
        assert planned.plan.resident_embeddings is on
        assert planned.device == (there if on else base)
    assert planner.resolve(cfg, fits, None, 1, rates).stream.resident_embeddings == "on"
    pinned = memory.replaced(cfg, "stream", resident_embeddings="on")
    assert planner.plan_placement(pinned, None, None, 1, rates).plan.resident_embeddings
    assert not StreamTrainer(cfg).engine.placement.resident_embeddings  # a CPU: room unknown
    monkeypatch.setattr(trainers, "device_memory_bytes", lambda: fits)
    assert StreamTrainer(cfg).engine.placement.resident_embeddings


def test_the_plan_takes_them_off_the_host():
    """At 7b on the H200 box the planner places them on the GPU: the host holds, moves and
    updates the streamed layers' state only, and its pinned pool leaves their room out."""
    cfg = load_config("7b", ["mesh.data=1", "stream.resident_layers=24"])  # some streamed
    m, gpu, host = cfg.model, plan.usable_gpu_bytes(141 * GiB), 125 * GiB
    est = plan.estimate(cfg, gpu, host)
    run, placement = est["config"], memory.plan_of(est["config"])
    assert placement.resident_embeddings
    streamed_layers = (m.layers - placement.resident_layers) * m.params_per_layer
    assert est["host"]["master_weights"] == 4 * streamed_layers
    assert est["device"]["resident_embeddings"] == memory.resident_embedding_bytes(cfg)
    assert est["device"]["embedding"] == 0
    streamed = planner.pinned_config(run, dataclasses.replace(placement,
                                                              resident_embeddings=False))
    off = plan.estimate(streamed, gpu, host)
    assert off["host"]["master_weights"] == 4 * (streamed_layers + m.embedding_params)
    # Weights and fp32 gradients: none of them in the pool (their moments are beside it).
    assert off["pool_state"] - est["pool_state"] == 8 * m.embedding_params
    assert roofline.host_params(run) == streamed_layers
    # The bound's host terms carry the streamed layers only.
    rates = roofline.Rates(h2d_gbps=50.0, d2h_gbps=50.0, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0,
                           host_memory_gbps=130.0)
    there, here = roofline.bound_for(run, rates), roofline.bound_for(streamed, rates)
    assert there["optimizer_s"] == pytest.approx(streamed_layers / 4e9)
    assert here["optimizer_s"] == pytest.approx((streamed_layers + m.embedding_params) / 4e9)
    # Where the host paces the step (every layer streamed), the embedding and head on the GPU
    # shorten it.
    every = planner.pinned_config(cfg, memory.PlacementPlan(resident_embeddings=True))
    none = planner.pinned_config(cfg, memory.PlacementPlan())
    assert roofline.bound_for(every, rates)["step_s"] < roofline.bound_for(none, rates)["step_s"]
    assert plan.host_traffic(run)["gradients"] == 2.0  # bf16 layer gradients alone
    assert "  embedding and head: GPU, updated there" in memory_lines.placement_lines(run)
    unknown = planner.resolve(cfg, None, host, 1, rates)  # the room unknown
    assert "  embedding and head: host, streamed" in memory_lines.placement_lines(unknown)
