"""The step's compiled programs: pure functions of their arguments, built once per engine.

`build_programs(templates, optimizer, clip_norm, placement)` returns a frozen `Programs` of
jitted functions. Each closes over those values only, never over an object whose attributes
may change later, so an engine with another clip norm builds other programs. Every layer
uses the same two layer programs: they compile once whatever the depth.

Shapes: M micro-batches of b rows, S tokens, D hidden; `xs` is [M, b, S, D].
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from megatrain_jax import optim
from megatrain_jax.model import fp8
from megatrain_jax.stream.gemm_fallback import jit_with_fallback
from megatrain_jax.stream.placement import Placement


@dataclasses.dataclass(frozen=True)
class Templates:
    """What the engine streams: pure functions over per-part pytrees.

    embed(embed_params, batch) -> x
    layer(layer_params, x, batch) -> x           (x keeps its shape and dtype)
    head_loss(head_params, embed_params_or_None, x, batch, denom) -> scalar loss
    `batch` is one micro-batch (a dict of [b, S, ...] arrays). With `tied`, the head also
    receives the embedding parameters and the gradient of both reaches the embedding.
    `normalizer(batch) -> denom` sees the whole batch; the default is the sum of its mask.
    `layer_grad_dtype`: a dtype (e.g. bfloat16) in which the layer's weight gradients are
    exact because the layer casts every weight to it before use (the gradient of an fp32
    weight is then a cast of the cast's gradient). With one micro-batch those gradients travel
    to the host and rest there in it, half the bytes of fp32; several micro-batches sum in
    fp32 on the device, which is not exact in it, so they stay fp32. None: always fp32.
    `layer_keeping(layer_params, x, batch) -> (x, kept)` and
    `layer_replaying(layer_params, x, batch, kept) -> x`, optional: the layer whose forward
    keeps what its backward's recompute then takes instead of computing it again (the
    attention's output and statistics, model/replay.py); same value, same gradients.
    `saving_dtype`: a dtype (e.g. bfloat16) the layer casts every weight to before its first
    use and uses each weight once (no loop inside it sums a weight's gradient): a saving
    layer (`layer_saving`) then keeps its weights cast, half the bytes of fp32, with the same
    values and gradients. None: it keeps them as they are.
    `layer_index`: the layer takes its index in the stack, layer(layer_params, x, batch, i)
    with i an int32 scalar (a traced value: one program serves every layer), e.g. to draw
    per-layer random keys. The index is not given to layer_keeping and layer_replaying.
    """

    embed: Callable
    layer: Callable
    head_loss: Callable
    tied: bool = False
    normalizer: Callable | None = None
    layer_grad_dtype: object = None
    layer_keeping: Callable | None = None
    layer_replaying: Callable | None = None
    saving_dtype: object = None
    layer_index: bool = False


@dataclasses.dataclass(frozen=True)
class Programs:
    embed_forward: Callable    # (embed, batch) -> xs
    layer_forward: Callable    # (layer, xs, batch[, index]) -> xs
    layer_keeping: Callable    # (layer, xs, batch) -> xs, kept (for layer_backward)
    head: Callable             # (head, embed, xs, batch, denom) -> loss, dxs, dhead, dembed, sq
    head_eval: Callable        # (head, embed, xs, batch, denom) -> loss
    layer_backward: Callable   # (layer, xs, dxs, batch, sq, kept=None[, index]) -> dxs_in,
                               # dlayer, sq (dxs donated)
    layer_saving: Callable     # (layer, xs, batch[, index]) -> xs, saved (for
                               # layer_backward_saved)
    layer_backward_saved: Callable  # (saved, dxs, sq) -> as layer_backward (dxs donated)
    embed_backward: Callable   # (embed, batch, dxs, dembed, sq) -> dembed, sq, skip, scale
    update_host: Callable      # (params, grads, opt_state, scale, skip) on host state, donated
    update_device: Callable    # the same on device-resident state, donated
    layer_index: bool = False  # the layer programs take the layer's index (Templates)


def _dots_in_compute_dtype(prim, *avals, **params) -> bool:
    """The outputs of the layer's matmuls with the weights, but an FP8 dot's (fp32, twice a
    bf16 one's bytes): its projection's output in bf16 is kept instead, by name."""
    if fp8.is_fp8_dot(prim, *avals):
        return False
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


# What a saving layer's forward keeps for its backward (`layer_saving`): the outputs of its
# matmuls with the weights, in the compute dtype; the rest (norms, rotations, activations, the
# attention itself, FP8 operands' quantization) is computed again from them in the backward,
# for a fraction of the layer's FLOPs.
SAVED_BY_SAVING_LAYERS = jax.checkpoint_policies.save_from_both_policies(
    _dots_in_compute_dtype, jax.checkpoint_policies.save_only_these_names(fp8.OUTPUT_NAME))

# Every value keeps the dtype the program gives it: XLA may not skip the rounding of a bf16
# value on its way back to fp32 (its default allows that "excess precision"). The weight
# gradient of a layer that casts its fp32 weights to bf16 is such a value, so it is a bf16
# value by the compiler's contract, not by its fusion choices of the day, and travels in bf16
# exactly (stream.grad_dtype=auto). Measured at 7b width on an H100 (jax 0.11.2), the
# gradients are bf16 values either way, and the layer's forward and backward take the same
# time within 4% (benchmarks/investigations/excess_precision.py).
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def jit(fn: Callable, **kwargs) -> Callable:
    """`jax.jit` with COMPILER_OPTIONS: for the step's programs and the reference's. A
    program XLA's GEMM autotuner cannot compile is compiled without Triton GEMM kernels
    (gemm_fallback.py)."""
    return jit_with_fallback(fn, COMPILER_OPTIONS, **kwargs)


def build_programs(templates: Templates, optimizer: optax.GradientTransformation,
                   clip_norm: float, placement: Placement) -> Programs:
    """The step's programs, jitted: forward, head, backward (recomputing or from what the
    forward kept), embedding backward with the clip scale, and the update."""
    forward, keeping, saving = _forward_functions(templates)
    head, head_eval = _head_functions(templates, placement)
    gradient = _layer_gradient(templates, placement)
    backward, backward_saved = _backward_functions(templates, gradient)
    return Programs(
        embed_forward=jit(_embed_forward(templates)),
        layer_forward=jit(forward),
        layer_keeping=jit(keeping),
        head=jit(head),
        head_eval=jit(head_eval),
        layer_backward=jit(backward, donate_argnums=2),
        layer_saving=jit(saving),
        layer_backward_saved=jit(backward_saved, donate_argnums=1),
        embed_backward=jit(_embed_backward(templates, placement, clip_norm)),
        update_host=placement.host_jit(_update(optimizer, placement), donate_argnums=(0, 2)),
        update_device=placement.device_jit(_update(optimizer, placement),
                                           donate_argnums=(0, 2)),
        layer_index=templates.layer_index,
    )


def _embed_forward(t: Templates) -> Callable:
    def embed_forward(embed_params, batch):
        return jax.lax.map(lambda mb: t.embed(embed_params, mb), batch)  # M b S D

    return embed_forward


def _layer_call(t: Templates) -> Callable:
    """The layer as every layer program calls it, (params, x, batch, index): `index` is
    passed on when the template takes it (Templates.layer_index), else dropped."""
    if t.layer_index:
        return t.layer
    return lambda params, x, batch, index: t.layer(params, x, batch)


def _forward_functions(t: Templates) -> tuple[Callable, Callable, Callable]:
    """A layer's three forwards: plain, keeping (what its backward's recompute takes), and
    saving (what its backward needs, so that the backward recomputes only the rest)."""
    call_layer = _layer_call(t)

    def layer_forward(params, xs, batch, index=None):
        return jax.lax.map(lambda args: call_layer(params, *args, index), (xs, batch))

    def layer_keeping(params, xs, batch):
        return jax.lax.map(lambda args: t.layer_keeping(params, *args), (xs, batch))

    def layer_saving(params, xs, batch, index=None):
        """The layer's forward that keeps on the device what its backward needs
        (SAVED_BY_SAVING_LAYERS), so that layer_backward_saved neither fetches the weights
        nor recomputes the matmuls: (xs, saved)."""
        layer = jax.checkpoint(call_layer, policy=SAVED_BY_SAVING_LAYERS)  # per micro-batch

        def kept(w):  # the weights the checkpoint keeps: cast as the layer casts them, if it may
            if t.saving_dtype is None:
                return w
            return jax.tree.map(lambda a: a.astype(t.saving_dtype), w)

        def forward(w, xs_):
            # The micro-batches run last to first, so that the backward, which takes them in
            # the opposite order, sums their weight gradients first to last in fp32, as
            # layer_backward's scan does: the same sums, bit for bit. The cast is the same
            # for every micro-batch: JAX keeps it once, and the fp32 weights not at all.
            return _flipped(jax.lax.map(lambda args: layer(kept(w), *args, index),
                                        _flipped((xs_, batch))))

        return jax.vjp(forward, params, xs)

    return layer_forward, layer_keeping, layer_saving


def _head_functions(t: Templates, placement: Placement) -> tuple[Callable, Callable]:
    """The head + loss with its gradients, and its loss alone (evaluation)."""

    def head(head_params, embed_params, xs, batch, denom):
        """Loss, dL/dx for every micro-batch, and the head's (and tied embedding's) grads."""
        tied = embed_params if t.tied else None

        def one(acc, args):
            x, mb = args
            loss_fn = lambda h, e, x_: t.head_loss(h, e, x_, mb, denom)  # noqa: E731
            loss, (dh, de, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
                head_params, tied, x)
            total, dh_acc, de_acc = acc
            return (total + loss, _add(dh_acc, dh), _add(de_acc, de)), dx

        zeros = (jnp.zeros((), jnp.float32), _zeros_like(head_params), _zeros_like(tied))
        (loss, dhead, dembed), dxs = jax.lax.scan(one, zeros, (xs, batch))
        dhead, dembed = placement.constrain((dhead, dembed))
        return loss, dxs, dhead, dembed, optim.sum_of_squares(dhead)

    def head_eval(head_params, embed_params, xs, batch, denom):
        tied = embed_params if t.tied else None
        losses = jax.lax.map(lambda args: t.head_loss(head_params, tied, *args, denom),
                             (xs, batch))
        return jnp.sum(losses)

    return head, head_eval


def _layer_gradient(t: Templates, placement: Placement) -> Callable:
    def layer_gradient(dw, dxs_in, sq, micro_batches: int):
        """dL/dx_in, dL/dw split as state is (in the layer's gradient dtype where exact) and
        the running sum of squares."""
        dw = placement.constrain(dw)
        sq = sq + optim.sum_of_squares(dw)
        exact_in_grad_dtype = t.layer_grad_dtype is not None and micro_batches == 1
        if exact_in_grad_dtype:  # see Templates
            dw = jax.tree.map(lambda g: g.astype(t.layer_grad_dtype), dw)
        return dxs_in, dw, sq

    return layer_gradient


def _backward_functions(t: Templates, layer_gradient: Callable) -> tuple[Callable, Callable]:
    """A layer's backward recomputing from its saved input (taking what a keeping forward
    kept), and a saving layer's from what its forward saved."""
    call_layer = _layer_call(t)

    def layer_backward(params, xs, dxs, batch, sq, kept=None, index=None):
        """Recomputes the layer from its saved inputs (taking what `kept` holds, when the
        forward was layer_keeping's); returns dL/dx_in, dL/dw and the running sum of squares."""

        def one(dw_acc, args):
            x, dx, mb, kept_mb = args
            if kept_mb is None:
                _, vjp = jax.vjp(lambda w, x_: call_layer(w, x_, mb, index), params, x)
            else:
                _, vjp = jax.vjp(lambda w, x_: t.layer_replaying(w, x_, mb, kept_mb), params, x)
            dw, dx_in = vjp(dx)
            return _add(dw_acc, dw), dx_in

        dw, dxs_in = jax.lax.scan(one, _zeros_like(params), (xs, dxs, batch, kept))
        return layer_gradient(dw, dxs_in, sq, xs.shape[0])

    def layer_backward_saved(saved, dxs, sq):
        dw, dxs_in = saved(dxs)
        return layer_gradient(dw, dxs_in, sq, dxs.shape[0])

    return layer_backward, layer_backward_saved


def _embed_backward(t: Templates, placement: Placement, clip_norm: float) -> Callable:
    def embed_backward(embed_params, batch, dxs, dembed_from_head, sq):
        """The embedding's gradient, then the step's: sum of squares, skip flag, clip scale."""

        def one(acc, args):
            mb, dx = args
            _, vjp = jax.vjp(lambda e: t.embed(e, mb), embed_params)
            return _add(acc, vjp(dx)[0]), None

        start = dembed_from_head if t.tied else _zeros_like(embed_params)
        dembed, _ = jax.lax.scan(one, start, (batch, dxs))
        dembed = placement.constrain(dembed)
        sq = sq + optim.sum_of_squares(dembed)
        return dembed, sq, ~jnp.isfinite(sq), optim.clip_scale(sq, clip_norm)

    return embed_backward


def _update(optimizer: optax.GradientTransformation, placement: Placement) -> Callable:
    def update(params, grads, opt_state, scale, skip):
        # Over a mesh every device gathers the part's leaves and computes its update whole:
        # a transformation that is not elementwise (Muon's Newton–Schulz takes a whole
        # matrix) is then the same arithmetic as on one device. Results go home split.
        params, grads, opt_state = placement.gathered((params, grads, opt_state))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return optim.apply_update(optimizer, params, grads, opt_state, scale, skip)

    return update


def _flipped(tree):
    """Micro-batched arrays [M, ...] in the reverse order of their micro-batches."""
    return jax.tree.map(lambda a: jnp.flip(a, 0), tree)


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)
