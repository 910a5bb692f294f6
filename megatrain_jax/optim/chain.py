"""The optimizer, shared by the reference trainer and the streaming engine.

Clipping is not inside the Optax chain: the engine sees a model's gradients one layer at a
time, so the global norm is computed first and `apply_update` takes the resulting scale.
Both trainers call `apply_update`, the reference on the whole tree, the engine per layer;
for elementwise transforms the two are the same arithmetic, leaf for leaf, and for Muon
too: its Newton–Schulz orthogonalizes each layer matrix on its own (optim/muon.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from megatrain_jax.config import Config, host_update
from megatrain_jax.optim.compact import compact_adam
from megatrain_jax.optim.muon import muon


def learning_rate(cfg: Config, peak: float | None = None) -> optax.Schedule:
    """Linear warmup from 0, then cosine or linear decay to `min_lr_ratio * lr`, or constant;
    `peak` in place of optim.lr (Muon's AdamW rate)."""
    lr, s = cfg.optim.lr if peak is None else peak, cfg.schedule
    decay_steps = max((s.decay_steps or cfg.loop.steps) - s.warmup_steps, 1)
    end = lr * s.min_lr_ratio
    if s.kind == "cosine":
        decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=s.min_lr_ratio)
    elif s.kind == "linear":
        decay = optax.linear_schedule(lr, end, decay_steps)
    else:
        decay = optax.constant_schedule(lr)
    if s.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, lr, s.warmup_steps)
    return optax.join_schedules([warmup, decay], [s.warmup_steps])


def decay_mask(params):
    """Weight decay applies to matrices only; norms and biases (1-D leaves) are spared."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    lr = learning_rate(cfg)
    if o.name == "muon":
        adam_lr = learning_rate(cfg, o.muon.adam_lr) if o.muon.adam_lr else lr
        return muon(cfg, lr, adam_lr)
    if o.state_dtype != "float32":  # validate() allowed it for adamw and adam (and muon)
        wd = o.weight_decay if o.name == "adamw" else 0.0
        return compact_adam(lr, o.b1, o.b2, o.eps, wd, decay_mask, o.state_dtype)
    if o.name == "adamw":
        return optax.adamw(lr, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    if o.name == "adam":
        return optax.adam(lr, o.b1, o.b2, o.eps)
    if o.name == "lion":
        return optax.lion(lr, o.b1, o.b2, weight_decay=o.weight_decay, mask=decay_mask)
    return optax.sgd(lr, momentum=o.momentum or None)


def build_stream_optimizer(cfg: Config):
    """The optimizer for the streaming engine, placed by `stream.update`.

    `host`: AdamW/Adam in place on the host, overlapping the next step (HostAdamW);
    `device`: the Optax transformation compiled over host state streamed through the GPU;
    `auto`: host where the optimizer has a host kernel, else device.
    """
    from megatrain_jax.optim.host_adamw import HostAdamW

    o = cfg.optim  # validate() refused stream.update=host without a kernel
    if not host_update(cfg):
        return build_optimizer(cfg)
    wd = o.weight_decay if o.name == "adamw" else 0.0
    return HostAdamW(learning_rate(cfg), o.b1, o.b2, o.eps, weight_decay=wd, mask=decay_mask,
                     state_dtype=o.state_dtype)


def sum_of_squares(tree):
    """fp32 sum of squares over every leaf: the pieces of a global norm."""
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


def clip_scale(sq_norm, clip_norm: float):
    """The factor gradients are multiplied by, from the squared global norm."""
    norm = jnp.sqrt(sq_norm)
    if clip_norm <= 0:
        return jnp.ones((), jnp.float32)
    return jnp.where(norm > clip_norm, clip_norm / norm, 1.0).astype(jnp.float32)


def apply_update(opt: optax.GradientTransformation, params, grads, opt_state, scale, skip):
    """One optimizer update with gradients scaled by `scale`; a no-op where `skip` is true.

    `skip` (a traced bool) guards against a non-finite global norm: parameters and state are
    returned unchanged, bit for bit, so a NaN never reaches the master weights.
    """
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads)
    updates, new_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state)
