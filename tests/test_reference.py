import jax
import numpy as np
from conftest import max_rel_error, tiny

from megatrain_jax import model
from megatrain_jax.io.data import TokenSource
from megatrain_jax.train.reference import ReferenceTrainer


def test_loss_decreases_on_tiny():
    cfg = tiny("loop.steps=30", "optim.lr=1e-2", "schedule.kind=constant")
    trainer = ReferenceTrainer(cfg)
    state = trainer.init(jax.random.key(0))
    batch = TokenSource(cfg).batch_at(0)
    losses = []
    for _ in range(30):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.6 * losses[0], losses


def test_accumulating_four_micro_batches_equals_one_batch():
    one = tiny("data.batch_size=8")
    four = tiny("data.batch_size=8", "data.micro_batches=4")
    params = model.init(one.model, jax.random.key(0))
    batch = TokenSource(one).batch_at(0)
    batch["mask"][:, :5] = 0.0  # unequal token counts per row: the normalization must hold
    batch["mask"][3] = 0.0
    loss1, g1 = jax.jit(ReferenceTrainer(one).grads)(params, batch)
    loss4, g4 = jax.jit(ReferenceTrainer(four).grads)(params, batch)
    np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
    assert max_rel_error(g4, g1) <= 1e-5


def test_nan_gradient_is_skipped():
    cfg = tiny()
    trainer = ReferenceTrainer(cfg)
    state = trainer.init(jax.random.key(0))
    before = jax.tree.map(np.asarray, state.params)
    batch = TokenSource(cfg).batch_at(0)
    batch["mask"][0, 0] = np.nan
    state, metrics = trainer.train_step(state, batch)
    assert bool(metrics["skipped"])
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
