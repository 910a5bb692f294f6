"""The speculative update during the backward: its parts, validation, undo, exactness (CPU)."""

import dataclasses
import functools
import gc
import json
import subprocess
import sys
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import CLIPPED, max_rel_error, normal, stream_run, tiny

from megatrain_jax import model, optim
from megatrain_jax.io.data import TokenSource
from megatrain_jax.optim import HostAdamW, decay_mask
from megatrain_jax.optim.adamw_inverse import UNDO_ULPS
from megatrain_jax.stream import Placement, UpdateQueue, speculation
from megatrain_jax.stream.placement import map_parts
from megatrain_jax.train import StreamTrainer, train
from megatrain_jax.train.reference import ReferenceTrainer

EPS32 = 2.0**-24


@pytest.fixture(autouse=True)
def every_speculative_update_runs(monkeypatch):
    """The tests here count the speculated parts: every speculative update runs, none is dropped for
    being late, so the count depends on the gradients alone (the dropping has its own test)."""
    monkeypatch.setattr(speculation, "DROP_LATE_SPECULATION", False)


def _random_state(seed, shape=(64, 48)):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(0, 0.5, shape).astype(np.float32),
              "b": rng.normal(0, 0.5, shape[1:]).astype(np.float32)}
    grads = jax.tree.map(lambda a: rng.normal(0, 2.0, a.shape).astype(np.float32), params)
    return params, grads, rng


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
def test_undo_inverts_optax_adamw_on_random_states(kernel):
    """Optax's own AdamW step from random (p, mu, nu) at step 7, then the host undo: back to
    the start within the stated bound, rel <= 1e-6."""
    params, grads, rng = _random_state(0)
    host = HostAdamW(optax.cosine_decay_schedule(3e-3, 100), 0.9, 0.95, 1e-8,
                     weight_decay=0.1, mask=decay_mask, kernel=kernel)
    state = host.optax.init(params)
    adam = state[0]._replace(
        count=jnp.asarray(6, jnp.int32),
        mu=jax.tree.map(lambda a: rng.normal(0, 0.1, a.shape).astype(np.float32), params),
        nu=jax.tree.map(lambda a: rng.uniform(0.01, 4.0, a.shape).astype(np.float32), params))
    state = (adam, *state[1:-1], state[-1]._replace(count=jnp.asarray(6, jnp.int32)))
    scale = 0.7
    scaled = jax.tree.map(lambda g: g * np.float32(scale), grads)
    updates, after = host.optax.update(scaled, state, params)
    stepped = optax.apply_updates(params, updates)

    place = Placement()
    p, g, s = place.to_host((stepped, grads, after))
    host.undo(p, g, s, scale)
    assert int(s[0].count) == 6 and int(s[-1].count) == 6
    assert max_rel_error(p, params) <= 1e-6
    assert max_rel_error(s[0].mu, adam.mu) <= 1e-6
    assert max_rel_error(s[0].nu, adam.nu) <= 1e-6
    # Element by element, within the bound of optim/adamw_inverse.py.
    b1, b2 = 0.9, 0.95
    mu_bound = UNDO_ULPS * EPS32 * (np.abs(after[0].mu["w"]) + (1 - b1) * np.abs(scaled["w"]))
    assert np.all(np.abs(np.asarray(s[0].mu["w"]) - adam.mu["w"]) <= mu_bound / b1)
    nu_bound = UNDO_ULPS * EPS32 * (after[0].nu["w"] + (1 - b2) * scaled["w"] ** 2) / b2
    assert np.all(np.abs(np.asarray(s[0].nu["w"]) - adam.nu["w"]) <= nu_bound)


def _cfg(*more):
    """conftest.CLIPPED with the host update, which test_engine trains too."""
    return tiny(*CLIPPED, "stream.update=host", *more)


@functools.lru_cache(maxsize=4)
def _reference_run(cfg, steps):
    """(state, losses) of the whole-model trainer; shared by runs that differ only in how
    the streamed step speculates."""
    data, trainer = TokenSource(cfg), ReferenceTrainer(cfg)
    state = trainer.init(None, params=model.init(cfg.model, jax.random.key(0)))
    losses = []
    for step in range(steps):
        state, m = trainer.train_step(state, data.batch_at(step))
        losses.append(float(m["loss"]))
    return state, losses


def _train_both(cfg, steps):
    plain = dataclasses.replace(cfg, stream=dataclasses.replace(cfg.stream, speculate="off"))
    return (*_reference_run(plain, steps), *stream_run(cfg, steps))


def _speculation_counts(records):
    """(speculated, undone) parts of each step, from the next step's metrics."""
    return [(int(m["speculated_parts"]), int(m["undone_parts"]))
            for m in records if "speculated_parts" in m]


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_twenty_steps_with_speculative_updates_match_the_reference(mode):
    cfg = _cfg(f"stream.speculate={mode}")
    ref_state, ref_losses, state, losses, norms, records = _train_both(cfg, 20)
    assert any(n > 1.0 for n in norms) and any(n < 1.0 for n in norms), norms  # clip triggers
    counts = _speculation_counts(records)
    host_parts = cfg.model.layers + 1  # the head and the layers; the embedding comes last
    assert any(s == host_parts and r == 0 for s, r in counts), counts  # updates that stood
    if mode == "on":
        assert any(r > 0 for _, r in counts), counts  # updates undone and redone
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel_error(state.params, ref_state.params) <= 1e-5
    for moment in ("mu", "nu"):
        streamed = map_parts(lambda s, k=moment: optax.tree_utils.tree_get(s, k),
                             state.opt_state)
        whole = optax.tree_utils.tree_get(ref_state.opt_state, moment)
        assert max_rel_error(streamed, whole) <= 1e-4, moment


def test_a_share_speculates_the_first_parts_of_the_backward_only():
    """stream.speculate_share=0.5: the head and the last layers, up to half the host
    parameters, are updated during the backward; the rest after it. Exact all the same."""
    cfg = _cfg("stream.speculate=on", "stream.speculate_share=0.5")
    ref_state, ref_losses, state, losses, norms, records = _train_both(cfg, 4)
    engine = StreamTrainer(cfg).engine
    sizes = [sum(leaf.size for leaf in jax.tree.leaves(part)) for part in
             [state.params["embed"], *state.params["layers"], state.params["head"]]]
    speculated = engine.speculative_parts([np.zeros(n) for n in sizes])
    last = len(sizes) - 1
    assert speculated == set(range(min(speculated), last + 1)) and 0 < len(speculated) < last
    assert sum(sizes[k] for k in speculated) <= 0.5 * sum(sizes)
    assert sum(sizes[k] for k in speculated) + sizes[min(speculated) - 1] > 0.5 * sum(sizes)
    assert max(s for s, _ in _speculation_counts(records)) == len(speculated)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel_error(state.params, ref_state.params) <= 1e-5


def test_speculative_updates_in_bfloat16_match_the_reference():
    """bf16 compute: the streamed and whole-model runs sum in other orders, so they agree
    to bf16's precision, with speculative updates as without.

    An undo restores the fp32 weights to a unit or two in the last place (tested above),
    but such a unit can flip a weight's rounding to bf16, and the next step's gradients then
    move by a bf16 unit: runs with and without speculating part by up to 1.5e-4 over these
    five steps, or by 2e-7 where no rounding flips, as the batches fall. A missing undo
    moves the weights by a whole update: 1.2e-2 after one step."""
    params = {}
    for mode in ("off", "on"):
        cfg = _cfg(f"stream.speculate={mode}", "model.compute_dtype=bfloat16", "optim.lr=1e-3",
                   "data.micro_batches=1")  # bf16 layer gradients (two sum in fp32)
        ref_state, ref_losses, state, losses, _, records = _train_both(cfg, 5)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
        assert max_rel_error(state.params, ref_state.params) <= 5e-2
        params[mode] = state.params
    assert any(r > 0 for _, r in _speculation_counts(records))  # the "on" run undid some
    assert max_rel_error(params["on"], params["off"]) <= 1e-3


def test_the_policy_stops_speculating_when_every_step_clips():
    _, _, norms, records = stream_run(_cfg("optim.clip_norm=0.01", "stream.speculate=auto"), 5)
    assert all(n > 0.01 for n in norms)
    assert [s for s, _ in _speculation_counts(records)] == [0] * 4
    assert [m["speculating"] for m in records] == [0.0] * 5  # each step's own choice
    # and speculates on every step, the first too, once clipping is off
    _, _, _, records = stream_run(_cfg("optim.clip_norm=0", "stream.speculate=auto"), 3)
    assert [s for s, _ in _speculation_counts(records)] == [4, 4]
    assert [m["speculating"] for m in records] == [1.0] * 3


def _held(release, part=None):
    """A save capturing every part until `release` is set."""
    release.wait()


def test_speculative_updates_not_started_by_the_backward_end_are_dropped_changing_no_bit(
        monkeypatch):
    """The worker held until the backward's end (a `before_write` that waits): every
    speculative update
    of that step is still queued, so none runs, and each part is updated once, after the
    backward, bit for bit as without speculating; a clipping step drops none."""
    monkeypatch.setattr(speculation, "DROP_LATE_SPECULATION", True)
    runs = {}
    for mode in ("on", "off"):
        cfg = _cfg(f"stream.speculate={mode}", "optim.clip_norm=0")
        data, trainer = TokenSource(cfg), StreamTrainer(cfg)
        state = trainer.init(None, params=model.init(cfg.model, jax.random.key(0)))
        for step in range(3):
            release = threading.Event()
            state, _ = trainer.train_step(state, data.batch_at(step),
                                          before_write=functools.partial(_held, release))
            release.set()
            state.wait()
            if mode == "on":  # speculative updates were submitted, and all came too late
                assert state.pending.speculate and state.pending.speculated == set()
        runs[mode] = jax.tree.map(np.array, (state.params, state.opt_state))
    for x, y in zip(*map(jax.tree.leaves, runs.values())):
        np.testing.assert_array_equal(x, y)

    # Step 0's norm is 1.08: with 0.8 the step clips after the head and layers 2 and 1 are
    # speculated. Held, those speculative updates run late all the same, and are undone.
    cfg = _cfg("stream.speculate=on", "optim.clip_norm=0.8")
    data, trainer = TokenSource(cfg), StreamTrainer(cfg)
    state = trainer.init(None, params=model.init(cfg.model, jax.random.key(0)))
    release = threading.Event()
    held = lambda part=None: release.wait()  # a save capturing every part
    state, m = trainer.train_step(state, data.batch_at(0), before_write=held)
    release.set()
    update = state.wait().pending
    assert float(m["grad_norm"]) > 0.8
    assert update.speculated == {"head", "layer 2", "layer 1"} and update.undone == 3


def test_a_speculative_update_reads_the_sum_of_squares_copied_beside_its_gradient(monkeypatch):
    """The worker reads each part's sum of squares from host memory, where its copy follows
    the gradient's: a device scalar would need a transfer of its own, queued behind every
    copy issued since."""
    seen, ready = [], speculation.StepUpdate.gradient_ready

    def watched(self, part, params, grads, opt_state, part_sq):
        seen.append(Placement().in_host_memory(part_sq))
        return ready(self, part, params, grads, opt_state, part_sq)

    monkeypatch.setattr(speculation.StepUpdate, "gradient_ready", watched)
    _, _, _, records = stream_run(_cfg("stream.speculate=on", "optim.clip_norm=0"), 2)
    assert len(seen) == 2 * 4 and all(seen)  # the head and 3 layers, each step
    assert int(records[-1]["speculated_parts"]) == 4


class _Recording:
    """A host optimizer that notes the parts it updates, by their params' "name" leaf."""

    can_undo = True

    def __init__(self):
        self.updated = []

    def update(self, params, grads, opt_state, scale):
        self.updated.append(params["name"])


def _held_speculation(sums, clip_norm):
    """A StepUpdate given parts whose running sums of squares are `sums` (in the backward's
    order) while its worker is held: (the parts it updated, in order; those it speculated)."""
    host, release, place = _Recording(), threading.Event(), Placement()
    held = lambda part=None: release.wait()  # a save capturing every part
    update = speculation.StepUpdate(host, clip_norm, speculate=True,
                                    before_write=held)
    landed = [jax.block_until_ready(place.to_host(jnp.float32(sq))) for sq in sums]
    for k, sq in enumerate(landed):
        update.gradient_ready(f"part {k}", {"name": f"part {k}"}, None, None, sq)
    release.set()
    update.close()
    update.wait()
    return host.updated, update.speculated


def test_the_worker_takes_the_newest_speculative_update_first():
    """Gradients handed over faster than the host updates them are taken newest first: what
    the backward leaves undone is then not all among the first layers, which the next
    forward needs first."""
    updated, _ = _held_speculation([0.01] * 4, clip_norm=1.0)
    assert updated == ["part 3", "part 2", "part 1", "part 0"]


def test_with_no_gradients_landed_the_worker_takes_the_oldest():
    """The newest landed part first; when none has landed, the oldest, which lands first:
    taking the newest would leave the worker idle while an older part could be updated."""
    assert speculation.next_part([0, 1, 2, 3], [True, True, False, False]) == 1
    assert speculation.next_part([2, 5, 7], [False, False, False]) == 2
    assert speculation.next_part([4], [False]) == 4
    assert speculation.next_part([1, 3], [False, True]) == 3


def test_the_parts_speculated_do_not_depend_on_the_order_they_are_taken_in():
    """A part is speculated while the sum over it and every part before it in the backward
    stays
    within the threshold (from the third part here, 0.75 > 0.7 ** 2): the parts of a step
    that clips are the same however the worker's timing falls, and a non-finite sum stops
    every later speculative update."""
    updated, speculated = _held_speculation([0.25, 0.45, 0.75, 0.85], clip_norm=0.7 ** 0.5)
    assert speculated == {"part 0", "part 1"} and updated == ["part 1", "part 0"]
    _, speculated = _held_speculation([0.1, float("nan"), float("nan")], clip_norm=0.0)
    assert speculated == {"part 0"}


def test_a_speculative_update_lets_its_gradients_go_once_taken():
    """The step's update lives on as the next step's `pending`, while the next step's
    gradients fill the pinned pool: it must hold none of its own by then."""
    class Gradients:
        pass

    host, place, grads = _Recording(), Placement(), Gradients()
    update = speculation.StepUpdate(host, 1.0, speculate=True)
    update.gradient_ready("part 0", {"name": "part 0"}, grads,
                          None, place.to_host(jnp.float32(0.1)))
    update.close()
    update.wait()
    gone = weakref.ref(grads)
    del grads
    gc.collect()
    assert host.updated == ["part 0"] and gone() is None


class _Watched:
    """Wraps a HostAdamW: after each write, every array it wrote must be finite. Before each
    undo it notes, per leaf, the bound of optim/adamw_inverse.py on the undo's error."""

    def __init__(self, host):
        self.host, self.writes, self.bounds = host, 0, {}
        self.can_undo = host.can_undo

    def _check(self, params, opt_state):
        self.writes += 1
        for leaf in jax.tree.leaves((params, opt_state)):
            assert np.all(np.isfinite(np.asarray(leaf))), "a non-finite value was written"

    def update(self, params, grads, opt_state, scale):
        self.host.update(params, grads, opt_state, scale)
        self._check(params, opt_state)

    def undo(self, params, grads, opt_state, scale):
        self._note_bounds(params, grads, opt_state, scale)
        self.host.undo(params, grads, opt_state, scale)
        self._check(params, opt_state)

    def _note_bounds(self, params, grads, opt_state, scale):
        """|undone - original| <= UNDO_ULPS eps32 (the terms the old value is solved from)."""
        host, (adam, schedule) = self.host, (opt_state[0], opt_state[-1])
        t, step = int(adam.count), int(schedule.count) - 1  # the step being undone
        b1, b2, lr = host.b1, host.b2, float(host.learning_rate(step))
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        leaves = zip(jax.tree.leaves(params), jax.tree.leaves(grads),
                     jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu),
                     jax.tree.leaves(optim.decay_mask(params)))
        for p, g, mu, nu, decays in leaves:
            g = np.asarray(g, np.float64) * scale
            m, v = np.asarray(mu, np.float64), np.asarray(nu, np.float64)
            u = (m / bc1) / (np.sqrt(v / bc2) + host.eps)
            wd = host.weight_decay if decays else 0.0
            ulps = UNDO_ULPS * EPS32
            self.bounds[id(p)] = ulps * (np.abs(np.asarray(p)) + lr * np.abs(u)) / (1 - lr * wd)
            self.bounds[id(mu)] = ulps * (np.abs(m) + (1 - b1) * np.abs(g)) / b1
            self.bounds[id(nu)] = ulps * (v + (1 - b2) * g**2) / b2


def _poison_layer0_gradients(engine, at_call):
    """The layer backward's `at_call`-th call (counting from 0) returns NaN in its weight
    gradient: layer 0, the last part of a backward, when `at_call` is a multiple of L."""
    import dataclasses

    original, calls = engine.programs.layer_backward, [0]

    def poisoned(*args):
        dxs, dw, sq = original(*args)
        if calls[0] == at_call:
            dw = jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), dw)
            sq = sq + jnp.nan
        calls[0] += 1
        return dxs, dw, sq

    engine.schedule.programs = dataclasses.replace(engine.programs, layer_backward=poisoned)


def test_nan_in_the_last_part_undoes_every_speculative_update_and_skips():
    cfg = _cfg("stream.speculate=on", "optim.clip_norm=100")
    trainer = StreamTrainer(cfg)
    engine, data = trainer.engine, TokenSource(cfg)
    watched = _Watched(engine.host_optimizer)
    engine.host_optimizer = watched
    layers = cfg.model.layers
    _poison_layer0_gradients(engine, at_call=2 * layers + layers - 1)  # step 2, layer 0
    state = trainer.init(jax.random.key(0))
    for step in range(2):
        state, m = trainer.train_step(state, data.batch_at(step))
    assert int(m["speculated_parts"]) == layers + 1  # step 0's stood (head, layers)
    before = jax.tree.map(np.array, (state.params, state.opt_state))
    state, m = trainer.train_step(state, data.batch_at(2))
    assert bool(m["skipped"])
    update = state.wait().pending
    # head and layers L-1..1 speculated and undone; layer 0 not speculated: its gradient is NaN
    assert update.speculated == {"head", *(f"layer {i}" for i in range(1, layers))}
    assert update.undone == layers
    leaves = jax.tree.leaves((state.params, state.opt_state))
    after = [np.asarray(leaf) for leaf in leaves]
    for leaf, x, y in zip(leaves, jax.tree.leaves(before), after):
        if id(leaf) in watched.bounds:  # undone: within the undo's fp32 rounding
            assert np.all(np.abs(y.astype(np.float64) - x) <= watched.bounds[id(leaf)])
        else:
            np.testing.assert_array_equal(y, x)  # never written: bit for bit
    assert len(watched.bounds) == 3 * len(jax.tree.leaves(
        [state.params["head"], *state.params["layers"][1:]]))


def test_resume_is_bit_exact_across_an_undone_step(tmp_path):
    """Checkpoint at step 6, whose update (auto: the last norm was within the threshold)
    speculates and is undone: the resumed run must take that path too, which needs the last
    gradient norm from the checkpoint's record."""
    def cfg(run, steps):
        return _cfg("stream.speculate=auto", "optim.clip_norm=1.4", "loop.log_every=1",
                    "loop.progress=none", "loop.checkpoint_every=3", "loop.tensorboard=off",
                    "loop.timeline_step=-1", "schedule.decay_steps=8",
                    f"loop.run_dir={tmp_path / run}", f"loop.steps={steps}")

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    straight = train(cfg("a", 8))
    train(cfg("b", 6))
    resumed = train(cfg("b", 8))
    # the record of the 8th step reports the 7th's update, the first after the resume
    assert records("a")[8]["undone_parts"] > 0
    assert records("b")[8]["undone_parts"] == records("a")[8]["undone_parts"]
    for x, y in zip(jax.tree.leaves(straight["state"].params),
                    jax.tree.leaves(resumed["state"].params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
def test_host_kernels_read_bf16_gradients_as_their_fp32_values(kernel):
    """Update then undo with bf16 gradients: bit for bit what the same values in fp32 give."""
    params, grads, _ = _random_state(1)
    bf16 = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
    widened = jax.tree.map(lambda g: g.astype(np.float32), bf16)
    host = HostAdamW(3e-3, 0.9, 0.95, 1e-8, weight_decay=0.1, mask=decay_mask, kernel=kernel)
    place, results = Placement(), []
    for g in (bf16, widened):
        # fresh copies: on the CPU a host put may alias a NumPy array's own buffer
        fresh = jax.tree.map(np.copy, params)
        p, g, s = place.to_host((fresh, g, host.optax.init(fresh)))
        host.update(p, g, s, 0.5)
        stepped = jax.tree.map(np.array, (p, s))
        host.undo(p, g, s, 0.5)
        results.append((stepped, jax.tree.map(np.array, (p, s))))
    for x, y in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_array_equal(x, y)


def _dtypes(tree):
    return {str(leaf.dtype) for leaf in jax.tree.leaves(tree)}


def test_the_step_programs_keep_every_bf16_value_as_the_program_writes_it():
    """programs.jit (the step's programs and the reference's) compiles without excess
    precision: a bf16 product is rounded to bf16 before the next one, as written, where XLA's
    default skips that rounding. So a bf16-typed gradient is a bf16 value on any backend."""
    from megatrain_jax.stream import programs

    a, b, c = (jnp.asarray(normal(seed, (4096,)), jnp.bfloat16) for seed in range(3))

    def product(a, b, c):
        return ((a * b) * c).astype(jnp.float32)

    def rounded(x):
        return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32)

    as_written = rounded(rounded(np.asarray(a, np.float32) * np.asarray(b, np.float32))
                         * np.asarray(c, np.float32))
    np.testing.assert_array_equal(np.asarray(programs.jit(product)(a, b, c)), as_written)
    assert not np.array_equal(np.asarray(jax.jit(product)(a, b, c)), as_written)


def test_bf16_layer_gradients_are_exact():
    """stream.grad_dtype=auto (the default), bf16 compute, one micro-batch: layer gradients
    reach the host as bf16 (embedding and head stay fp32), and training is bit for bit the
    fp32-gradient run's, speculative updates included; with two micro-batches (summed in fp32 on the
    device), or over several devices, they stay fp32."""
    from megatrain_jax.config import auto

    assert auto.grad_dtype("auto", "bfloat16", 1, 1) == "bfloat16"
    assert auto.grad_dtype("auto", "bfloat16", 1, 2) == "float32"  # summed over a mesh
    assert auto.grad_dtype("auto", "float32", 1, 1) == "float32"
    assert auto.grad_dtype("bfloat16", "bfloat16", 1, 2) == "bfloat16"  # asked: rounded
    assert auto.grad_dtype("bfloat16", "bfloat16", 2, 1) == "float32"  # summed on the device
    base = ("model.compute_dtype=bfloat16", "optim.lr=1e-3", "stream.speculate=on",
            "data.micro_batches=1")
    trainer = StreamTrainer(_cfg(*base))
    batch = TokenSource(trainer.cfg).batch_at(0)
    _, grads, *_ = trainer.engine.forward_backward(trainer.init(None, model.init(
        trainer.cfg.model, jax.random.key(0))).params, batch)
    assert _dtypes(grads["layers"]) == {"bfloat16"}
    assert _dtypes((grads["embed"], grads["head"])) == {"float32"}
    two = StreamTrainer(_cfg(*base, "data.micro_batches=2"))
    _, grads, *_ = two.engine.forward_backward(two.init(None, model.init(
        two.cfg.model, jax.random.key(0))).params, batch)
    assert _dtypes(grads["layers"]) == {"float32"}
    halves, _, _, _ = stream_run(_cfg(*base), 6)
    full, _, _, _ = stream_run(_cfg(*base, "stream.grad_dtype=float32"), 6)
    for x, y in zip(jax.tree.leaves((halves.params, halves.opt_state)),
                    jax.tree.leaves((full.params, full.opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_exit_right_after_a_step_lets_its_host_update_finish(tmp_path):
    """The worker is a daemon thread; a process that ends while it still writes must wait
    for it (an exit mid-update once aborted the process inside XLA)."""
    done = tmp_path / "done"
    script = (
        "import time, pathlib\n"
        "from megatrain_jax.stream import UpdateQueue\n"
        "q = UpdateQueue()\n"
        f"q.submit('layer 0', lambda: (time.sleep(1.0), pathlib.Path({str(done)!r}).touch()))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert done.exists()


def test_every_step_update_runs_on_one_worker_in_submission_order():
    """Queues of successive steps share one long-lived thread: a step's work runs after the
    last step's, and no thread is started per step."""
    ran = []
    first, second = UpdateQueue(), UpdateQueue()
    release = threading.Event()
    first.submit("layer 0", lambda: (release.wait(), ran.append(("first", threading.get_ident()))))
    second.submit("layer 0", lambda: ran.append(("second", threading.get_ident())))
    assert not second.done("layer 0")  # queued behind the first step's work
    release.set()
    second.wait()
    first.close()
    assert [name for name, _ in ran] == ["first", "second"]
    assert len({ident for _, ident in ran}) == 1
    assert threading.get_ident() not in {ident for _, ident in ran}
    with pytest.raises(RuntimeError, match="closed"):
        first.submit("layer 1", lambda: None)


def test_the_worker_trims_the_heap_every_so_many_steps(monkeypatch):
    """After every TRIM_EVERY closed queues (steps), once their work is done, the worker
    returns the heap's free pages (glibc keeps what its threads' arenas freed)."""
    from megatrain_jax.stream import updates

    trims, order = [], []
    monkeypatch.setattr(updates, "TRIM_EVERY", 3)
    monkeypatch.setattr(updates._shared_worker(), "_closed_queues", 0)  # other tests' steps
    monkeypatch.setattr(updates, "release_free_heap",
                        lambda: (trims.append(threading.get_ident()), order.append("trim")))
    queues = []
    for k in range(7):
        queues.append(UpdateQueue())
        queues[-1].submit("layer 0", lambda k=k: order.append(k))
        queues[-1].close()
    queues[-1].wait()
    done = threading.Event()
    queues.append(UpdateQueue())
    queues[-1].submit("layer 0", done.set)
    done.wait()
    assert order[:8] == [0, 1, 2, "trim", 3, 4, 5, "trim"]
    assert len(set(trims)) == 1 and threading.get_ident() not in trims
