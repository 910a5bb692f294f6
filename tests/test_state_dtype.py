"""optim.state_dtype, the form of Adam's moments (float32, bfloat16, int8): the int8 tables
and their round trip, the host kernels against the Optax transformation bit for bit, streamed
against the reference over 20 clipped steps, resume bit for bit, refusals, the plan's bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import CLIPPED, max_rel_error, side_by_side, tiny

from megatrain_jax.config import ConfigError
from megatrain_jax.io.checkpoint import CheckpointError
from megatrain_jax.optim import HostAdamW, compact, decay_mask
from megatrain_jax.optim.compact import BLOCK, SIGNED, UNSIGNED
from megatrain_jax.stream.placement import Placement, map_parts, memory_kinds
from megatrain_jax.tools import plan
from megatrain_jax.train import train

COMPACT = ["bfloat16", "int8"]


def test_tables_are_sorted_with_zero_and_one():
    for table in (SIGNED, UNSIGNED):
        assert table.dtype == np.float32 and len(table) == 255
        assert np.all(np.diff(table) > 0) and table[-1] == 1.0 and 0.0 in table
    np.testing.assert_array_equal(SIGNED, -SIGNED[::-1])


@pytest.mark.parametrize("signed", [True, False])
def test_int8_storage_keeps_each_value_to_its_nearest_table_entry(signed):
    """A stored block's values come back within half a table gap (times the block's scale)
    of what was stored, and a nonzero nu never comes back zero."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 3 * BLOCK + 40)).astype(np.float32)  # a partial last block
    x *= 10.0 ** rng.uniform(-8, 0, x.shape).astype(np.float32)        # many decades
    x[0, :BLOCK] = 0.0                                                  # an all-zero block
    if not signed:
        x = x * x
    zero = compact.zeros(jnp.asarray(x), "int8", signed)
    stored = compact.store(jnp, jnp.asarray(x), zero, signed)
    assert stored.codes.dtype == jnp.uint8 and stored.scales.shape == (6, 4)
    back = np.asarray(compact.widen(jnp, stored, signed))
    table = SIGNED if signed else UNSIGNED
    kept = x if signed else np.sqrt(x)  # what the codes stand for
    blocks = np.pad(kept, [(0, 0), (0, 4 * BLOCK - kept.shape[-1])]).reshape(6, 4, BLOCK)
    np.testing.assert_array_equal(np.asarray(stored.scales), np.abs(blocks).max(-1))
    scale = np.repeat(np.asarray(stored.scales), BLOCK, axis=-1)[:, :x.shape[-1]]
    unit = (kept / np.where(scale > 0, scale, 1)).astype(np.float64)
    distance = np.abs(unit[..., None] - table.astype(np.float64))
    codes = np.asarray(stored.codes)
    best = np.sort(distance, axis=-1)
    chosen = np.take_along_axis(distance, codes[..., None].astype(np.int64), -1)[..., 0]
    nearest = chosen <= best[..., 0] + 1e-7  # the nearest entry, up to fp32 rounding
    if not signed:  # a nonzero nu whose nearest entry is zero takes the smallest nonzero
        nearest |= (codes == 1) & (x > 0) & (np.argmin(distance, -1) == 0)
        assert not np.any((back == 0) & (x > 0))
    assert np.all(nearest)
    np.testing.assert_allclose(back, (table[codes] * scale) ** (1 if signed else 2), rtol=1e-6)
    assert np.all(back[0, :BLOCK] == 0)


def _trees(rng, scale):
    shapes = {"w": (24, 600), "norm": (600,), "e": (8, 256)}
    return {k: jnp.asarray(rng.normal(size=s).astype(np.float32) * scale)
            for k, s in shapes.items()}


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
@pytest.mark.parametrize("state_dtype", COMPACT)
def test_host_kernels_match_the_optax_transformation_bit_for_bit(state_dtype, kernel):
    """The host update and the Optax transformation (the reference's and the device
    update's) write the same weights and the same stored moments, bit for bit, over steps
    with weight decay on matrices only, a clip scale, a vector leaf (fp32 moments) and a
    row that is not a whole number of blocks."""
    rng = np.random.default_rng(0)
    host = HostAdamW(optax.linear_schedule(1e-2, 1e-3, 10), 0.9, 0.95, 1e-8,
                     weight_decay=0.1, mask=decay_mask, kernel=kernel, state_dtype=state_dtype)
    params = _trees(rng, 1.0)
    ref_params, ref_state = params, host.optax.init(params)
    placement = Placement()
    params = placement.place(jax.tree.map(np.array, params))       # copies of their own
    state = placement.place(jax.tree.map(np.array, ref_state))
    scale = np.float32(0.7)
    for step in range(4):
        grads = _trees(rng, 0.1 * (step + 1))
        host.update(params, placement.place(jax.tree.map(np.array, grads)), state, scale)
        updates, ref_state = host.optax.update(jax.tree.map(lambda g: g * scale, grads),
                                               ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    for ours, theirs in zip(jax.tree.leaves((params, state)),
                            jax.tree.leaves((ref_params, ref_state))):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    mu = state[0].mu
    kinds = {"bfloat16": jnp.bfloat16, "int8": jnp.uint8}
    assert (mu["w"].codes if state_dtype == "int8" else mu["w"]).dtype == kinds[state_dtype]
    assert mu["norm"].dtype == jnp.float32  # vectors keep fp32 moments


def _moment_bytes(tree):
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def _int8_bytes(p):  # two moments: a byte per value and an fp32 scale per block of a row
    rows = int(np.prod(p.shape[:-1]))
    return 2 * (p.size + 4 * rows * -(-p.shape[-1] // BLOCK))


_expected_moment_bytes = {  # vectors keep fp32 moments
    "float32": lambda p: 8 * p.size,
    "bfloat16": lambda p: 4 * p.size if p.ndim >= 2 else 8 * p.size,
    "int8": lambda p: _int8_bytes(p) if p.ndim >= 2 else 8 * p.size,
}


@pytest.mark.parametrize("state_dtype", ["float32", *COMPACT])
def test_streamed_matches_the_reference_in_each_state_dtype(state_dtype):
    """Twenty clipped steps of the tiny model: the streamed host update and the whole-model
    Optax reference with the same moments agree; the moments take the bytes the mode
    promises. fp32 moments train conftest.CLIPPED (which test_engine trains too, so the
    reference's step is compiled once); the compact ones a smaller rate, for the bounds
    below."""
    resident = "stream.resident_layers=1"  # a resident layer: the device update too
    if state_dtype == "float32":
        cfg = tiny(*CLIPPED, resident)
    else:
        cfg = tiny(f"optim.state_dtype={state_dtype}", "optim.lr=3e-3", "optim.clip_norm=0.5",
                   resident)
    ref_state, state, _, records = side_by_side(cfg, 20)
    assert all(r["grad_norm"] > cfg.optim.clip_norm for r in records[:3])  # clipping acts
    np.testing.assert_allclose([r["loss"] for r in records], [r["ref_loss"] for r in records],
                               rtol=1e-5)
    # The two trainers' gradients differ in the last bits (other programs, other sums); a
    # stored moment rounds them to its own grid, so now and then one lands a grid step
    # apart, which moves that weight by about lr times that step's share of Adam's update
    # (at most about 1): bounded here by one bf16 grid step (2^-7) of lr per step, which
    # int8's rarer code differences stay within too. fp32 moments agree to rounding.
    if state_dtype == "float32":
        assert max_rel_error(state.params, ref_state.params) <= 1e-5
    else:
        drift = max(jax.tree.leaves(jax.tree.map(
            lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
            state.params, ref_state.params)))
        assert drift <= len(records) * cfg.optim.lr * 2.0**-7
    assert memory_kinds(state.opt_state["layers"][1]) == {"unpinned_host"}  # no pinned pool
    moments = _moment_bytes(map_parts(lambda s: (s[0].mu, s[0].nu), state.opt_state))
    assert moments == sum(map(_expected_moment_bytes[state_dtype],
                              jax.tree.leaves(state.params)))
    streamed = map_parts(lambda s: s[0].mu, state.opt_state)
    for ours, theirs in zip(jax.tree.leaves(streamed),
                            jax.tree.leaves(ref_state.opt_state[0].mu)):
        if ours.dtype == jnp.float32:  # vectors keep fp32 moments
            assert max_rel_error(ours, theirs) <= 1e-3
            continue
        ours, theirs = np.asarray(ours), np.asarray(theirs)
        differ = ours != theirs  # a rare neighbour on the grid, from rounding upstream
        if ours.dtype == np.uint8:  # int8 codes index a sorted table: the next code up or down
            # One in a thousand, or a single code in a leaf of fewer (a 32 x 16 leaf: 1/512).
            assert np.count_nonzero(differ) <= max(1, 1e-3 * ours.size)
            assert np.all(np.abs(ours[differ].astype(int) - theirs[differ].astype(int)) == 1)
        else:  # bf16: within one ulp of the leaf's largest values
            assert np.mean(differ) <= 1e-2
            assert max_rel_error(ours, theirs) <= 2.0**-7


def _checkpointed(run_dir, state_dtype, *more):
    """A 2-layer tiny run checkpointed every 3 steps, its schedule fixed at 6 steps."""
    return tiny("model.layers=2", "loop.progress=none", "loop.checkpoint_every=3",
                "loop.tensorboard=off", "loop.timeline_step=-1", "schedule.decay_steps=6",
                f"loop.run_dir={run_dir}", f"optim.state_dtype={state_dtype}", *more)


@pytest.mark.parametrize("state_dtype", COMPACT)
def test_resume_with_compact_moments_is_bit_exact(tmp_path, state_dtype):
    def cfg(run, steps):
        return _checkpointed(tmp_path / run, state_dtype, "loop.log_every=1",
                             f"loop.steps={steps}")

    straight = train(cfg("a", 6))
    train(cfg("b", 3))
    resumed = train(cfg("b", 6))
    for x, y in zip(jax.tree.leaves((straight["state"].params, straight["state"].opt_state)),
                    jax.tree.leaves((resumed["state"].params, resumed["state"].opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_other_moments_are_refused_unless_the_change_is_accepted(tmp_path):
    train(_checkpointed(tmp_path, "float32", "loop.steps=3"))
    with pytest.raises(CheckpointError, match="holds float32 .* optim.state_dtype=int8. "
                       "Resume with optim.state_dtype=float32, or convert .* "
                       "loop.accept_changes=true"):
        train(_checkpointed(tmp_path, "int8", "loop.steps=6"))


@pytest.mark.parametrize("stored, wanted", [("float32", "int8"), ("int8", "float32"),
                                            ("float32", "bfloat16")])
def test_moments_change_form_on_resume_when_accepted(tmp_path, stored, wanted):
    """The checkpoint's moments come back in the run's form: compact.store of their fp32
    values (widened first where they were compact), in the trainer's places; the weights as
    they were; and the run goes on from there."""
    from megatrain_jax.io.checkpoint import Checkpointer
    from megatrain_jax.train import make_trainer
    from megatrain_jax.train.resume import restore

    train(_checkpointed(tmp_path, stored, "loop.steps=3"))
    cfg = _checkpointed(tmp_path, wanted, "loop.steps=6", "loop.accept_changes=true")
    ckpt = Checkpointer(tmp_path / "checkpoints")
    try:
        before = ckpt.restore(3, make_trainer(_checkpointed(tmp_path, stored)).abstract_state())[0]
        after, meta = restore(ckpt, 3, make_trainer(cfg), cfg)
    finally:
        ckpt.close()
    assert meta["step"] == 3
    for x, y in zip(jax.tree.leaves(before["params"]), jax.tree.leaves(after["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert memory_kinds(after["opt_state"]["layers"][1]) == {"unpinned_host"}
    for name, signed in (("mu", True), ("nu", False)):
        old = map_parts(lambda s, name=name: getattr(s[0], name), before["opt_state"])
        new = map_parts(lambda s, name=name: getattr(s[0], name), after["opt_state"])
        olds, news = (jax.tree.leaves(t, is_leaf=compact.is_moment) for t in (old, new))
        assert len(olds) == len(news)
        for o, n in zip(olds, news):
            held = compact.Int8Moment(*map(np.asarray, o)) if isinstance(o, compact.Int8Moment) \
                else np.asarray(o)
            expected = compact.store(np, compact.widen(np, held, signed), n, signed)
            for e, got in zip(jax.tree.leaves(expected), jax.tree.leaves(n)):
                np.testing.assert_array_equal(np.asarray(got), e)
    summary = train(cfg)
    assert np.isfinite(summary["last_loss"]) and summary["state"].step == 6


def test_what_compact_moments_cannot_do_is_refused():
    with pytest.raises(ConfigError, match="adamw, adam or muon"):
        tiny("optim.state_dtype=int8", "optim.name=lion")
    with pytest.raises(ConfigError, match="speculate"):
        tiny("optim.state_dtype=bfloat16", "stream.speculate=on")
    with pytest.raises(ConfigError, match="float32, bfloat16, int8"):
        tiny("optim.state_dtype=fp8")


def test_auto_never_speculates_with_compact_moments():
    """No step clips, which would make `auto` speculate every step with fp32 moments; rounded
    moments cannot be undone, so it never does."""
    from megatrain_jax.io.data import TokenSource
    from megatrain_jax.train import StreamTrainer

    cfg = tiny("optim.state_dtype=int8", "stream.speculate=auto", "optim.clip_norm=0")
    trainer, data = StreamTrainer(cfg), TokenSource(cfg)
    state = trainer.init(jax.random.key(0))
    for step in range(3):
        state, metrics = trainer.train_step(state, data.batch_at(step))
        assert metrics.get("speculated_parts", 0) == 0
    assert not trainer.engine.host_optimizer.can_undo
    with pytest.raises(ValueError, match="undone"):
        trainer.engine.host_optimizer.undo(None, None, None, 1.0)


def test_plan_counts_the_moment_bytes_of_each_mode():
    per_param = {}
    for dtype in ("float32", "bfloat16", "int8"):
        cfg = tiny("model.hidden=1024", "model.ffn=2816", "model.heads=8", "model.kv_heads=8",
                   "model.layers=4", f"optim.state_dtype={dtype}")
        per_param[dtype] = plan.estimate(cfg)["host"]["optimizer_state"] / cfg.model.num_params
    assert per_param["float32"] == pytest.approx(8)
    assert per_param["bfloat16"] == pytest.approx(4, rel=0.01)
    assert per_param["int8"] == pytest.approx(2 + 8 / BLOCK, rel=0.01)
