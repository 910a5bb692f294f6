"""Causal attention over sequence chunks with an online softmax (flash-style), in plain JAX.

For sequences beyond what the fused attention takes: it never holds the [S, S] scores, only
one [chunk, chunk] block per head at a time. The arithmetic follows
jax.nn.dot_product_attention's XLA path (fp32 scores scaled after the product, softmax in
fp32, probabilities cast to the value dtype for the product with v), so the two agree to
fp32 rounding. A custom VJP keeps only q, k, v, the output and the log-sum-exp per row for
the backward, which recomputes each block's probabilities.

    out = attention(q, k, v, segment_ids, chunk=1024)    # q [B, S, H, E], k, v [B, S, K, E]

Dims: B batch, S sequence, H query heads, K kv heads, G = H / K, E head dim, c chunk.
Query heads are grouped as [K, G]: head h reads kv head h // G, as in XLA's path.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def attention(q, k, v, segment_ids, chunk: int):
    """Causal attention of q [B, S, H, E] over k, v [B, S, K, E]; with segment_ids [B, S],
    a token attends only within its segment (packed sequences)."""
    q5, k, v, segments, chunk = _padded(q, k, v, segment_ids, chunk)
    return _unpadded(_attention(q5, k, v, segments, chunk), q.shape)


def attention_and_stats(q, k, v, segment_ids, chunk: int):
    """attention(...) and its rows' log-sum-exp [n, B, K, G, c] (over the padded rows): what
    `backward` needs besides the inputs, so that it runs without the forward."""
    q5, k, v, segments, chunk = _padded(q, k, v, segment_ids, chunk)
    out, lse = _forward(q5, k, v, segments, chunk)
    return _unpadded(out, q.shape), lse


def backward(q, k, v, segment_ids, chunk: int, out, lse, dout):
    """(dq, dk, dv) of attention(q, k, v, segment_ids, chunk) for its output's gradient
    `dout`, from the output and log-sum-exp that attention_and_stats returned. The padded
    rows' output and gradient are zeros: those rows see only padding, so they add nothing."""
    q5, k5, v5, segments, chunk = _padded(q, k, v, segment_ids, chunk)
    out5, dout5 = (_padded(t, k, v, None, chunk)[0] for t in (out, dout))
    dq, dk, dv, _ = _attention_bwd(chunk, (q5, k5, v5, segments, out5, lse), dout5)
    s = q.shape[1]
    return _unpadded(dq, q.shape), dk[:, :s], dv[:, :s]


def _padded(q, k, v, segment_ids, chunk: int):
    """q as [B, S', K, G, E], k and v [B, S', K, E], segments [B, S'] (int32) and the chunk,
    S' the sequence padded to a multiple of the chunk."""
    b, s, h, e = q.shape
    kv = k.shape[2]
    chunk = min(chunk, s)
    pad = (-s) % chunk
    segments = jnp.zeros((b, s), jnp.int32) if segment_ids is None else segment_ids
    segments = segments.astype(jnp.int32)
    if pad:  # padded keys come after every real query: the causal mask hides them
        q, k, v = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (q, k, v))
        segments = jnp.pad(segments, ((0, 0), (0, pad)), constant_values=-1)
    return q.reshape(b, s + pad, kv, h // kv, e), k, v, segments, chunk


def _unpadded(t, shape):
    """[B, S', K, G, E] -> [B, S, H, E] of `shape`."""
    b, s, h, e = shape
    return t.reshape(b, -1, h, e)[:, :s]


def _slice(t, i, chunk: int):
    return jax.lax.dynamic_slice_in_dim(t, i * chunk, chunk, axis=1)


def _scores(qi, kj, si, sj, i, j, chunk: int):
    """Scaled fp32 scores [B, K, G, c, c] of query chunk i against key chunk j, masked -inf."""
    e = qi.shape[-1]
    s = jnp.einsum("bqkge,bske->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    s = s * jnp.float32(e**-0.5)
    rows = i * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = j * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    visible = (cols <= rows)[None] & (si[:, :, None] == sj[:, None, :])  # B c c
    return jnp.where(visible[:, None, None], s, -jnp.inf)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, chunk):
    return _forward(q, k, v, segments, chunk)[0]


def _forward(q, k, v, segments, chunk):
    """Output [B, S, K, G, E] and log-sum-exp [n, B, K, G, c] of each query row."""
    n = q.shape[1] // chunk

    def query_chunk(i):
        qi, si = _slice(q, i, chunk), _slice(segments, i, chunk)

        def step(t, carry):
            # Diagonal block first: every row sees itself there, so the running maximum is
            # finite from the first step and a block a row cannot see adds exp(-inf) = 0.
            j = i - t
            out, top, total = carry
            s = _scores(qi, _slice(k, j, chunk), si, _slice(segments, j, chunk), i, j, chunk)
            new_top = jnp.maximum(top, jnp.max(s, axis=-1))
            p = jnp.exp(s - new_top[..., None])
            fade = jnp.exp(top - new_top)
            pv = jnp.einsum("bkgqs,bske->bqkge", p.astype(v.dtype), _slice(v, j, chunk),
                            preferred_element_type=jnp.float32)
            out = out * _rows_last(fade) + pv
            return out, new_top, total * fade + jnp.sum(p, axis=-1)

        b, c, kv, g, e = qi.shape
        start = (jnp.zeros((b, c, kv, g, e), jnp.float32),
                 jnp.full((b, kv, g, c), -jnp.inf, jnp.float32),
                 jnp.zeros((b, kv, g, c), jnp.float32))
        out, top, total = jax.lax.fori_loop(0, i + 1, step, start)
        return (out / _rows_last(total)).astype(q.dtype), top + jnp.log(total)

    outs, lse = jax.lax.map(query_chunk, jnp.arange(n))  # n B c K G E, n B K G c
    return _unchunk(outs), lse


def _rows_last(stat):
    """[B, K, G, c] -> [B, c, K, G, 1], to scale the rows of a [B, c, K, G, E] block."""
    return jnp.moveaxis(stat, -1, 1)[..., None]


def _unchunk(t):
    """[n, B, c, ...] -> [B, n * c, ...]."""
    t = jnp.moveaxis(t, 0, 1)
    return t.reshape(t.shape[0], -1, *t.shape[3:])


def _attention_fwd(q, k, v, segments, chunk):
    out, lse = _forward(q, k, v, segments, chunk)
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(chunk, residuals, dout):
    """Two passes over the blocks, each writing its outputs once: dq by query chunk, then dk
    and dv by key chunk. No [S, ...] fp32 accumulator exists; each block is recomputed."""
    q, k, v, segments, out, lse = residuals
    n = q.shape[1] // chunk
    # D = rowsum(dout * out): the softmax's correction term, [B, S, K, G] -> per chunk.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    scale = jnp.float32(q.shape[-1] ** -0.5)

    def block(i, j):
        """Probabilities and d(scores) [B, K, G, c, c] of block (i, j), and its pieces."""
        qi, doi = _slice(q, i, chunk), _slice(dout, i, chunk)
        kj, vj = _slice(k, j, chunk), _slice(v, j, chunk)
        s = _scores(qi, kj, _slice(segments, i, chunk), _slice(segments, j, chunk), i, j, chunk)
        p = jnp.exp(s - lse[i][..., None])
        dp = jnp.einsum("bqkge,bske->bkgqs", doi, vj, preferred_element_type=jnp.float32)
        di = jnp.moveaxis(_slice(delta, i, chunk), 1, -1)  # B K G c
        return p, p * (dp - di[..., None]), qi, doi, kj

    def dq_chunk(i):
        def step(t, dq):
            _, ds, _, _, kj = block(i, i - t)
            return dq + jnp.einsum("bkgqs,bske->bqkge", ds.astype(k.dtype), kj,
                                   preferred_element_type=jnp.float32)

        b, c, kv, g, e = _slice(q, i, chunk).shape
        dq = jax.lax.fori_loop(0, i + 1, step, jnp.zeros((b, c, kv, g, e), jnp.float32))
        return (dq * scale).astype(q.dtype)

    def dkv_chunk(j):
        def step(t, carry):
            dk, dv = carry
            p, ds, qi, doi, _ = block(j + t, j)
            dv = dv + jnp.einsum("bkgqs,bqkge->bske", p.astype(dout.dtype), doi,
                                 preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgqs,bqkge->bske", ds.astype(q.dtype), qi,
                                 preferred_element_type=jnp.float32)
            return dk, dv

        shape = _slice(k, j, chunk).shape
        zeros = jnp.zeros(shape, jnp.float32)
        dk, dv = jax.lax.fori_loop(0, n - j, step, (zeros, zeros))
        return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

    dq = _unchunk(jax.lax.map(dq_chunk, jnp.arange(n)))
    dk, dv = jax.lax.map(dkv_chunk, jnp.arange(n))
    return dq, _unchunk(dk), _unchunk(dv), None


_attention.defvjp(_attention_fwd, _attention_bwd)
