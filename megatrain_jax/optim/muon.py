"""Muon as optax.contrib.muon builds it, with its Newton–Schulz in optim.muon.ns_dtype.

    opt = muon(cfg, learning_rate(cfg))      # ns_dtype=float32: optax.contrib.muon, bit for bit

optax's Muon runs the Newton–Schulz iterations in the momentum's dtype, fp32 here. This one
casts each matrix's (Nesterov) momentum to `ns_dtype` before them, normalization included,
and their result back to fp32 before the width scaling, the weight decay and the learning
rate: in bfloat16 the matmuls take half the time on a GPU, as in Keller Jordan's Muon. The
momentum, the weights and the AdamW of the other parameters stay fp32. The pieces are
optax's (the state, the iterations, the shape scaling, the AdamW); only scale_by_muon's
update and muon's partition are written here, as optax 0.2.8 writes them
(tests/test_muon.py holds the float32 form to optax.contrib.muon bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.contrib import (
    MuonDimensionNumbers,
    _muon,  # its iterations and coefficient presets are not exported
)

from megatrain_jax import model


def muon_dimensions(params):
    """The leaves Muon orthogonalizes, as optax.contrib.muon's `muon_weight_dimension_numbers`:
    each 2-D leaf of a transformer layer, a matrix [in, out] of its own; None (AdamW) for the
    embedding, the head, norms and biases. The same leaves whether given the whole model (the
    reference) or one part (the engine), since a layer is a LayerParams in both."""
    def of(node):
        if not isinstance(node, model.LayerParams):
            return None
        return jax.tree.map(lambda a: MuonDimensionNumbers(0, 1) if a.ndim == 2 else None, node)

    return jax.tree.map(of, params, is_leaf=lambda x: isinstance(x, model.LayerParams))


def muon(cfg, lr: optax.Schedule, adam_lr: optax.Schedule | None = None
         ) -> optax.GradientTransformation:
    """optax.contrib.muon with cfg's settings (config/optimizers.py): Newton–Schulz in
    optim.muon.ns_dtype for the layers' matrices, AdamW (optim.b1, b2, eps) at `adam_lr`
    (default `lr`, as optax's) for the rest; the momentum stored in optim.state_dtype
    (float32 or bfloat16)."""
    o, m = cfg.optim, cfg.optim.muon
    mu_dtype = jnp.bfloat16 if o.state_dtype == "bfloat16" else None
    coeffs = _muon._NS_COEFFS_PRESET_DICT[m.ns_coeffs]
    matrices = lambda updates: jax.tree.map(lambda _: MuonDimensionNumbers(0, 1), updates)  # noqa: E731
    return optax.partition({
        "muon": optax.chain(
            scale_by_muon(coeffs, m.ns_steps, m.beta, o.eps, mu_dtype, m.nesterov,
                          jnp.dtype(m.ns_dtype)),
            _muon.scale_by_shape(matrices, m.consistent_rms or None),
            optax.add_decayed_weights(o.weight_decay),
            optax.scale_by_learning_rate(lr)),
        "adam": optax.adamw(lr if adam_lr is None else adam_lr, o.b1, o.b2, o.eps,
                            weight_decay=m.adam_weight_decay, mu_dtype=mu_dtype,
                            nesterov=m.nesterov),
    }, _labels)


def _labels(params):
    """'muon' for the leaves `muon_dimensions` names, 'adam' for the rest."""
    def label(dims, subtree):
        return jax.tree.map(lambda _: "adam" if dims is None else "muon", subtree)

    return jax.tree.map(label, muon_dimensions(params), params,
                        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))


def scale_by_muon(ns_coeffs, ns_steps: int, beta: float, eps: float, mu_dtype, nesterov: bool,
                  ns_dtype) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon (frobenius normalization, not adaptive) over 2-D leaves,
    the Newton–Schulz of each in `ns_dtype`; its state is optax's."""
    init = optax.contrib.scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype,
                                       nesterov=nesterov).init

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        updates = jax.tree.map(lambda x: _muon.orthogonalize_via_newton_schulz(
            x.astype(ns_dtype), state.ns_coeffs, ns_steps, "frobenius", eps).astype(x.dtype),
            mu_hat)
        return updates, state._replace(count=count, mu=optax.tree.cast(mu, mu_dtype))

    return optax.GradientTransformation(init, update)
