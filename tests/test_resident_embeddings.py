"""The embedding and the head on the GPU (`stream.resident_embeddings`): their weights and
optimizer state live there and update there, the host and its update lane carry the layers
only; the same training as the reference, guesses and clipping included; a NaN in the head
stops every guess; `auto` places them by the GPU's room, and the plan follows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Transfers, agrees_with_reference_while_clipping, tiny

from megatrain_jax import model
from megatrain_jax.config import load_config, memory
from megatrain_jax.io.data import TokenSource
from megatrain_jax.planning import roofline
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
                for name in EDGES} | {"layers": memory_kinds((state.params["layers"],
                                                              state.opt_state["layers"]))}

    assert homes(state) == {"embed": {"device"}, "head": {"device"}, "layers": {"pinned_host"}}
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
    assert homes(state) == {"embed": {"device"}, "head": {"device"}, "layers": {"pinned_host"}}
    assert transfers.h2d and not any(name in EDGES for name in transfers.h2d)
    for name in EDGES:  # learned, where they live
        assert all(not np.array_equal(a, np.asarray(b)) for a, b in zip(
            jax.tree.leaves(before[name]), jax.tree.leaves(state.params[name])))
    # A restore target places them where the engine keeps them; the layers stay on the host.
    target = trainer.abstract_state()
    assert {leaf.sharding.memory_kind for name in EDGES for leaf in jax.tree.leaves(
        (target["params"][name], target["opt_state"][name]))} == {"device"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(
        target["opt_state"]["layers"])} == {"pinned_host"}


def test_steps_match_the_reference_with_guesses_undone_and_standing():
    """Every step guesses the layers' updates during the backward (stream.speculate=on): the
    first steps clip, after their guesses ran, and undo and redo them; later ones do not, and
    their guesses stand. The embedding and head update on the device."""
    cfg = tiny("model.layers=3", "data.batch_size=4", "data.micro_batches=2", "loop.steps=20",
               "optim.lr=1e-2", "optim.clip_norm=1.0", "schedule.warmup_steps=3",
               "stream.speculate=on", "stream.resident_embeddings=on")
    stream, records = agrees_with_reference_while_clipping(cfg, 14)
    assert stream.engine.placement.resident_embeddings
    # Each record tells of the update of the step before it.
    undone = [r["rolled_back"] for r in records[1:]]
    stood = [r["speculated"] - r["rolled_back"] for r in records[1:]]
    assert any(undone) and any(stood), (undone, stood)


def test_a_nan_in_the_resident_head_stops_every_guess_and_writes_nothing():
    """The guesses follow the step's running sum of squares, which starts with the head's
    even where the head's gradient stays on the GPU: a NaN there leaves every layer unguessed,
    and the skipped step leaves every weight and moment as it was, bit for bit."""
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
    assert update.speculated == set() and update.rolled_back == 0
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(np.asarray(y), x)


def test_auto_places_them_where_the_gpu_room_holds_them(monkeypatch):
    cfg = memory.replaced(tiny("model.layers=4"), "stream", keep_weights="off")
    assert cfg.stream.resident_embeddings == "auto"  # the default
    need = memory.resident_embedding_bytes(cfg)
    assert need == 16 * cfg.model.embedding_params  # weights, two moments, gradients
    assert cfg.model.embedding_params == 2 * cfg.model.vocab_size * cfg.model.hidden + \
        cfg.model.hidden
    off = memory.replaced(cfg, "stream", resident_embeddings="off")
    base, _ = memory.step_bytes(off, 1, None)
    # Room for them beside the rest, the headroom and one working set free, less the fetched
    # embedding they replace: just enough, and a byte short.
    fits = (sum(base.values()) + memory.SPLIT_HEADROOM + need - base["embedding"]
            + memory.activations(cfg)["working_set_total"])
    for gpu, on in ((fits, True), (fits - 1, False), (None, False)):
        assert memory.embeddings_resident(cfg, gpu) is on
        device, _ = memory.step_bytes(cfg, 1, gpu)
        assert device["resident_embeddings"] == (need if on else 0)
        assert device["embedding"] == (0 if on else base["embedding"])
    assert memory.resolved(cfg, fits).stream.resident_embeddings == "on"
    assert memory.embeddings_resident(memory.replaced(cfg, "stream", resident_embeddings="on"),
                                      None)
    assert not StreamTrainer(cfg).engine.placement.resident_embeddings  # a CPU: room unknown
    monkeypatch.setattr(trainers, "device_memory_bytes", lambda: fits)
    assert StreamTrainer(cfg).engine.placement.resident_embeddings


def test_the_plan_takes_them_off_the_host_but_the_pool_keeps_their_room():
    """At 7b on an H200 auto places them on the GPU: the host holds and moves the layers'
    state only, but the pinned pool, sized before JAX settles auto, keeps room for them."""
    cfg = load_config("7b", ["mesh.data=1"])
    m, gpu = cfg.model, plan.usable_gpu_bytes(141 * GiB)
    streamed = memory.replaced(cfg, "stream", resident_embeddings="off")
    est, off = plan.estimate(cfg, gpu), plan.estimate(streamed, gpu)
    layers = m.layers * m.params_per_layer
    assert est["host"]["master_weights"] == 4 * layers
    assert off["host"]["master_weights"] == 4 * m.num_params
    assert est["device"]["resident_embeddings"] == memory.resident_embedding_bytes(cfg)
    assert est["pool_state"] == pytest.approx(off["pool_state"], abs=8)  # auto: room for them
    on = memory.replaced(cfg, "stream", resident_embeddings="on")
    assert plan.estimate(on, gpu)["pool_state"] < off["pool_state"]
    assert roofline.host_params(memory.resolved(cfg, gpu)) == layers
    # The bound's host terms carry the layers only.
    rates = roofline.Rates(h2d_gbps=50.0, d2h_gbps=50.0, layer_forward_s=0.01,
                           layer_backward_s=0.03, head_s=0.05, optimizer_gparams=4.0,
                           host_memory_gbps=130.0)
    there = roofline.bound_for(memory.resolved(cfg, gpu), rates)
    here = roofline.bound_for(streamed, rates)
    assert there["optimizer_s"] == pytest.approx(layers / 4e9)
    assert here["optimizer_s"] == pytest.approx(m.num_params / 4e9)
    assert there["step_s"] < here["step_s"]
    assert plan.host_traffic(cfg, gpu)["gradients"] == 2.0  # bf16 layer gradients alone
    lines = "\n".join(memory_lines_for(cfg, gpu))
    assert "stream.resident_embeddings=auto): there, updated there" in lines
    assert "found at the start" in "\n".join(memory_lines_for(cfg, None))


def memory_lines_for(cfg, gpu):
    from megatrain_jax.config import memory_lines

    return memory_lines.describe(cfg, gpu)
