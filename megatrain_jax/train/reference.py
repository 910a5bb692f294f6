"""The reference trainer: whole-model `jax.grad` + Optax, everything on one device.

It is the oracle every streaming test compares against, and a plain trainer for models that
fit on the GPU. Gradient accumulation splits the batch into `micro_batches` and sums their
gradients; the loss of each is normalized by the whole batch's token count, so the sum is the
large batch's gradient.

    trainer = ReferenceTrainer(cfg)
    state = trainer.init(jax.random.key(0))
    state, metrics = trainer.train_step(state, batch)
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from megatrain_jax import model, optim
from megatrain_jax.config import Config
from megatrain_jax.stream import programs
from megatrain_jax.stream.placement import placed_shapes


@partial(jax.tree_util.register_dataclass, data_fields=["params", "opt_state", "step"],
         meta_fields=[])
@dataclasses.dataclass
class TrainState:
    params: dict
    opt_state: object
    step: jax.Array

    def wait(self) -> "TrainState":
        """Nothing runs behind a reference step's back: the state is complete as it is."""
        return self


def split_micro_batches(batch: dict, micro_batches: int) -> dict:
    """[B, ...] -> [M, B/M, ...] for every array of the batch."""
    return jax.tree.map(lambda a: a.reshape(micro_batches, -1, *a.shape[1:]), batch)


class ReferenceTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.opt = optim.build_optimizer(cfg)
        self.lr = optim.learning_rate(cfg)
        self._train_step_jit = programs.jit(self._train_step, donate_argnums=0)
        self.put_params = jax.device_put  # where imported parameters go
        self.devices = 1  # the whole model on the first device
        self._eval_loss = programs.jit(self._eval_loss_impl)

    def init(self, key, params: dict | None = None, on_part=None) -> TrainState:
        """The whole model at once (`on_part`, the streamed trainer's progress hook, is not
        called: there are no parts)."""
        params = model.init(self.cfg.model, key) if params is None else params
        return self._placed(TrainState(params, self.opt.init(params), jnp.zeros((), jnp.int32)))

    def _placed(self, state: TrainState) -> TrainState:
        """The state committed to the first device, as a restored one and every step's are:
        a run and its resumption call one compiled step."""
        return jax.device_put(state, jax.devices()[0])

    def train_step(self, state: TrainState, batch: dict, *, tracer=None,
                   before_write=None) -> tuple[TrainState, dict]:
        """One step, jitted, the state donated once a checkpoint under way has read it
        (`before_write`). `tracer` is accepted for the trainers' common protocol."""
        if before_write is not None:
            before_write()
        return self._train_step_jit(state, batch)

    def abstract_state(self) -> dict:
        """{"params", "opt_state"}: shapes and placement (on the device), a restore target."""
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        state = jax.eval_shape(lambda: self.init(jax.random.key(0)))
        tree = self.state_tree(state)
        return placed_shapes(tree, jax.tree.map(lambda _: sharding, tree))

    def state_tree(self, state: TrainState) -> dict:
        """What a checkpoint holds, the same for both trainers."""
        return {"params": state.params, "opt_state": state.opt_state}

    def state_record(self, state: TrainState) -> dict:
        """What a checkpoint's record keeps of the state beyond its arrays: nothing."""
        return {}

    def from_tree(self, tree: dict, step: int, record: dict | None = None) -> TrainState:
        return self._placed(TrainState(tree["params"], tree["opt_state"],
                                       jnp.asarray(step, jnp.int32)))

    def grads(self, params: dict, batch: dict):
        """(loss, gradients) of the whole batch, accumulated over micro-batches."""
        cfg = self.cfg
        denom = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
        micro = split_micro_batches(batch, cfg.data.micro_batches)
        grad_fn = jax.value_and_grad(
            lambda p, mb: model.loss(p, mb, cfg.model, denom, cfg.stream.loss_chunk,
                                     **_tiles(cfg))
        )

        def accumulate(carry, mb):
            loss, grads = grad_fn(params, mb)
            total_loss, total_grads = carry
            return (total_loss + loss, jax.tree.map(jnp.add, total_grads, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros(()), zeros), micro)
        return loss, grads

    def _eval_loss_impl(self, params: dict, batch: dict):
        denom = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
        return model.loss(params, batch, self.cfg.model, denom, self.cfg.stream.loss_chunk,
                          **_tiles(self.cfg))

    def eval_loss(self, state: TrainState, batch: dict):
        """The loss of `batch` without a gradient or an update."""
        return self._eval_loss(state.params, batch)

    def _train_step(self, state: TrainState, batch: dict):
        loss, grads = self.grads(state.params, batch)
        sq = optim.sum_of_squares(grads)
        skip = ~jnp.isfinite(sq)
        scale = optim.clip_scale(sq, self.cfg.optim.clip_norm)
        params, opt_state = optim.apply_update(
            self.opt, state.params, grads, state.opt_state, scale, skip
        )
        metrics = {
            "loss": loss, "grad_norm": jnp.sqrt(sq), "lr": self.lr(state.step),
            "skipped": skip,
        }
        return TrainState(params, opt_state, state.step + 1), metrics


def _tiles(cfg) -> dict:
    """The sequence tiling of the layer's MLP and attention, as the streamed layer uses it."""
    return {"mlp_tile": cfg.stream.mlp_tile, "attention_chunk": cfg.stream.attention_chunk}
