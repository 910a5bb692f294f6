"""Attention whose backward does not run its forward again.

A streamed layer's backward recomputes the layer from its saved input. At long sequences the
attention is most of that recompute (7b at 131072 tokens: about 34 of the forward's 47 GFLOP
a token), and its backward needs only q, k, v, its output and one softmax
statistic per row. So the forward program keeps the output and the statistics (`keep`), and
the backward program's recompute takes them instead of attending (`replayed`): q, k and v
are recomputed (cheap projections), the attention is not, and its backward reads the kept
tensors. The arithmetic is the attention's own: its forward made them, its backward reads them.

    out, kept = keep(q, k, v, "cudnn", segment_ids, chunk)        # forward program
    out = replayed(q, k, v, kept, "cudnn", segment_ids, chunk)    # backward program: == kept[0]

Paths (`keeps` says which): `cudnn` (its fused kernels, through jax's cuDNN module;
`cudnn_available` says whether this jax has the entry points used) for rows without segment
ids, and `blockwise` (model/blockwise.py). XLA's attention keeps [S, S] probabilities for its
backward: no gain to be had, so it does not replay.
Dims: B batch, S sequence, H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

import inspect
import math
from functools import partial

import jax
import jax.numpy as jnp

from megatrain_jax.model import blockwise


def _cudnn_module():
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return None
    return fa


def cudnn_available() -> bool:
    """Whether this jax has the cuDNN attention's forward with statistics and its backward
    rule in the form used here (jax 0.10 and 0.11 do)."""
    fa = _cudnn_module()
    try:
        rule = inspect.signature(fa._dot_product_attention_bwd_rule).parameters
        fwd = inspect.signature(fa.dot_product_attention).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return len(rule) == 11 and "return_residual" in fwd and hasattr(fa, "MaskType")


def keeps(implementation: str, packed: bool = False) -> bool:
    """Whether attention by `implementation` can be kept and replayed here; cuDNN's only
    for rows without segment ids (packed rows reach it as a dense mask)."""
    if implementation == "blockwise":
        return True
    return implementation == "cudnn" and not packed and cudnn_available()


def keep(q, k, v, implementation: str, segment_ids, chunk: int):
    """(causal attention's output [B, S, H, E], what `replayed` needs: (output, statistics))."""
    if implementation == "blockwise":
        out, lse = blockwise.attention_and_stats(q, k, v, segment_ids, chunk)
        return out, (out, lse)
    if not keeps(implementation, segment_ids is not None):
        raise ValueError(f"attention by {implementation!r}"
                         f"{' with segment ids' if segment_ids is not None else ''} "
                         f"cannot be kept for its backward (replay.keeps)")
    fa = _cudnn_module()
    out, stats = fa.dot_product_attention(q, k, v, scale=_scale(q),
                                          mask_type=fa.MaskType.CAUSAL, return_residual=True)
    return out, (out, stats)


@partial(jax.custom_vjp, nondiff_argnums=(4, 6))
def replayed(q, k, v, kept, implementation: str, segment_ids, chunk: int):
    """The kept output, whose gradient with respect to q, k and v is the attention's."""
    return kept[0]


def _replayed_fwd(q, k, v, kept, implementation, segment_ids, chunk):
    return kept[0], (q, k, v, kept, segment_ids)


def _replayed_bwd(implementation, chunk, residuals, dout):
    q, k, v, (out, stats), segment_ids = residuals
    if implementation == "blockwise":
        dq, dk, dv = blockwise.backward(q, k, v, segment_ids, chunk, out, stats, dout)
    else:
        dq, dk, dv = _cudnn_backward(q, k, v, out, stats, dout)
    return dq, dk, dv, None, None


replayed.defvjp(_replayed_fwd, _replayed_bwd)


def _cudnn_backward(q, k, v, out, stats, dout):
    """cuDNN's attention backward from its forward's output and statistics: the arguments
    jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn") passes."""
    fa = _cudnn_module()
    unused = jnp.zeros(0, q.dtype)  # bias, sequence lengths, offsets and page tables: none
    residuals = (q, k, v, *(unused,) * 7, stats, out)
    grads = fa._dot_product_attention_bwd_rule(
        _scale(q), 42, 0.0, (False, False), fa.MaskType.CAUSAL,
        fa.AttentionLayout.BTNH.value, None, None, False, residuals, dout)
    return grads[0], grads[1], grads[2]


def _scale(q) -> float:
    return 1.0 / math.sqrt(q.shape[-1])  # jax.nn.dot_product_attention's default
