"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) as pure functions over pytrees.

A model is three kinds of pytree: `EmbedParams`, one `LayerParams` per transformer layer
(all of identical structure and shapes, so one compiled template serves every layer), and
`HeadParams`. Everything derives from `abstract(cfg)`, shapes and dtypes without memory:

    params = init(cfg, jax.random.key(0))         # {"embed", "layers": [...], "head"}
    x = embed(params["embed"], tokens, cfg)       # B S D
    for p in params["layers"]:
        x = layer(p, x, cfg)
    loss = head_loss(params["head"], params["embed"], x, targets, mask, cfg, denom)

Master parameters are fp32; each function casts to `cfg.compute_dtype` itself. Nothing here
places memory: that is the host store's and the engine's job.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.config import ModelConfig, auto
from megatrain_jax.model import ops, replay


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(cls))


@_pytree
class LayerParams:
    attn_norm: jax.Array  # D
    wq: jax.Array  # D, H*E
    wk: jax.Array  # D, K*E
    wv: jax.Array  # D, K*E
    wo: jax.Array  # H*E, D
    mlp_norm: jax.Array  # D
    w_gate: jax.Array  # D, F
    w_up: jax.Array  # D, F
    w_down: jax.Array  # F, D
    bq: Optional[jax.Array] = None  # H*E (Qwen2 family)
    bk: Optional[jax.Array] = None  # K*E
    bv: Optional[jax.Array] = None  # K*E
    q_norm: Optional[jax.Array] = None  # E (Qwen3 family)
    k_norm: Optional[jax.Array] = None  # E


@_pytree
class EmbedParams:
    table: jax.Array  # V, D


@_pytree
class HeadParams:
    norm: jax.Array  # D
    out: Optional[jax.Array] = None  # D, V; None when tied to the embedding table


def _spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def abstract_layer(cfg: ModelConfig) -> LayerParams:
    d, e, h, k, f = cfg.hidden, cfg.dh, cfg.heads, cfg.kv_heads, cfg.ffn
    bias = cfg.qkv_bias
    return LayerParams(
        attn_norm=_spec(d), wq=_spec(d, h * e), wk=_spec(d, k * e), wv=_spec(d, k * e),
        wo=_spec(h * e, d), mlp_norm=_spec(d),
        w_gate=_spec(d, f), w_up=_spec(d, f), w_down=_spec(f, d),
        bq=_spec(h * e) if bias else None, bk=_spec(k * e) if bias else None,
        bv=_spec(k * e) if bias else None,
        q_norm=_spec(e) if cfg.qk_norm else None, k_norm=_spec(e) if cfg.qk_norm else None,
    )


def abstract_embed(cfg: ModelConfig) -> EmbedParams:
    return EmbedParams(table=_spec(cfg.vocab_size, cfg.hidden))


def abstract_head(cfg: ModelConfig) -> HeadParams:
    out = None if cfg.tie_embeddings else _spec(cfg.hidden, cfg.vocab_size)
    return HeadParams(norm=_spec(cfg.hidden), out=out)


def abstract(cfg: ModelConfig) -> dict:
    """Shapes and dtypes of the whole model; allocates nothing."""
    return {
        "embed": abstract_embed(cfg),
        "layers": [abstract_layer(cfg)] * cfg.layers,
        "head": abstract_head(cfg),
    }


def _init_like(spec_tree, key, std: float, scaled: tuple[str, ...] = (), scale: float = 1.0):
    """Norm weights start at one, biases at zero, matrices normal(0, std), each field's
    from its own of the keys split from `key`."""
    names = [f.name for f in dataclasses.fields(spec_tree)]
    keys = jax.random.split(key, len(names))
    values = {}
    for name, k in zip(names, keys):
        spec = getattr(spec_tree, name)
        if spec is None:
            values[name] = None
        elif name.endswith("norm"):
            values[name] = jnp.ones(spec.shape, spec.dtype)
        elif len(spec.shape) == 1:
            values[name] = jnp.zeros(spec.shape, spec.dtype)
        else:
            deviation = np.float32(std * (scale if name in scaled else 1.0))
            values[name] = _normal(k, deviation, tuple(spec.shape),
                                   jnp.dtype(spec.dtype).name)
    return type(spec_tree)(**values)


@partial(jax.jit, static_argnums=(2, 3))
def _normal(key, std, shape: tuple, dtype: str):
    """std * normal(key, shape): one program a shape, shared by every model that has it (the
    deviation is an argument)."""
    return std * jax.random.normal(key, shape, dtype)


def init_layer(cfg: ModelConfig, key) -> LayerParams:
    # Output projections shrink with depth so the residual stream keeps its scale.
    depth_scale = (2 * cfg.layers) ** -0.5
    return _init_like(abstract_layer(cfg), key, cfg.init_std, ("wo", "w_down"), depth_scale)


def init_embed(cfg: ModelConfig, key) -> EmbedParams:
    return _init_like(abstract_embed(cfg), key, cfg.init_std)


def init_head(cfg: ModelConfig, key) -> HeadParams:
    return _init_like(abstract_head(cfg), key, cfg.init_std)


def layer_key(key, index: int):
    """The key of layer `index`; the embed and head use indices -1 and -2."""
    return jax.random.fold_in(key, index + 2)


def init(cfg: ModelConfig, key) -> dict:
    """The whole model at once (for models that fit); the host store inits layer by layer."""
    return {
        "embed": init_embed(cfg, layer_key(key, -1)),
        "layers": [init_layer(cfg, layer_key(key, i)) for i in range(cfg.layers)],
        "head": init_head(cfg, layer_key(key, -2)),
    }


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def embed(p: EmbedParams, tokens, cfg: ModelConfig):
    """tokens [B, S] int -> x [B, S, D] in the compute dtype."""
    return jnp.take(p.table, tokens, axis=0).astype(cfg.compute_dtype)


def layer(p: LayerParams, x, cfg: ModelConfig, positions=None, segment_ids=None, *,
          mlp_tile: int = 0, attention_chunk: int = 0):
    """One pre-norm transformer layer: x [B, S, D] -> x [B, S, D].

    `mlp_tile` (tokens; `stream.mlp_tile`) runs the MLP and its norm in sequence tiles,
    recomputed in the backward; `attention_chunk` is the blockwise attention's chunk. Both 0:
    the automatic rule of config/auto.py for these B*S tokens. Neither changes the result
    beyond fp32 rounding.
    """
    def attend(q, k, v, impl, chunk):
        return ops.attention(q, k, v, impl, segment_ids, chunk), None

    return _layer(p, x, cfg, positions, segment_ids, mlp_tile, attention_chunk, attend)[0]


def layer_keeping_attention(p: LayerParams, x, cfg: ModelConfig, positions=None,
                            segment_ids=None, *, mlp_tile: int = 0, attention_chunk: int = 0):
    """(layer(...), what its attention keeps for `layer_replaying_attention`): the forward
    of a layer whose backward will not attend again (model/replay.py). Where the attention
    cannot keep it (XLA's; cuDNN's with segment ids), it keeps None and the backward attends."""
    def attend(q, k, v, impl, chunk):
        if replay.keeps(impl, packed=segment_ids is not None):
            return replay.keep(q, k, v, impl, segment_ids, chunk)
        return ops.attention(q, k, v, impl, segment_ids, chunk), None

    return _layer(p, x, cfg, positions, segment_ids, mlp_tile, attention_chunk, attend)


def layer_replaying_attention(p: LayerParams, x, kept, cfg: ModelConfig, positions=None,
                              segment_ids=None, *, mlp_tile: int = 0,
                              attention_chunk: int = 0):
    """layer(...) with the attention's output taken from `kept` and its gradient from the
    attention's backward on it: the same value and gradients, without the attention's
    forward. `kept` None: layer(...)."""
    def attend(q, k, v, impl, chunk):
        if kept is None:
            return ops.attention(q, k, v, impl, segment_ids, chunk), None
        return replay.replayed(q, k, v, kept, impl, segment_ids, chunk), None

    return _layer(p, x, cfg, positions, segment_ids, mlp_tile, attention_chunk, attend)[0]


def layer_attending(p: LayerParams, x, cfg: ModelConfig, positions, attend):
    """(x, what `attend` returns beside its output): the layer with its attention given by
    `attend(q, k, v, implementation, chunk) -> (out, extra)`, q k v rotated [B, S, N, E]. The
    decoder's KV cache (model/decode.py) attends this way; the rest of the layer is layer's."""
    return _layer(p, x, cfg, positions, None, 0, 0, attend)


def attention_path(cfg: ModelConfig, seq_len: int, packed: bool = False) -> str:
    """The attention the layer runs at `seq_len` (config/auto.py's rule, on this backend)."""
    return ops.pick_attention(cfg.attention, cfg.compute_dtype, seq_len, packed)


def _layer(p, x, cfg, positions, segment_ids, mlp_tile, attention_chunk, attend):
    dtype = jnp.dtype(cfg.compute_dtype)
    w = _cast(p, dtype)  # the MLP's weights are cast in residual_mlp; these casts go unused
    b, s, _ = x.shape
    e = cfg.dh
    if positions is None:
        positions = jax.lax.broadcasted_iota(jnp.int32, (b, s), 1)

    h = ops.rms_norm(x, w.attn_norm, cfg.norm_eps)
    # FP8 operands are quantized from the compute-dtype weights, so that a layer given weights
    # already cast (a saving layer's) quantizes exactly as one given the fp32 masters.
    float8 = cfg.fp8_matmuls
    q = ops.project(h, w.wq, float8)
    k = ops.project(h, w.wk, float8)
    v = ops.project(h, w.wv, float8)
    if cfg.qkv_bias:
        q, k, v = q + w.bq, k + w.bk, v + w.bv
    q = q.reshape(b, s, cfg.heads, e)
    k = k.reshape(b, s, cfg.kv_heads, e)
    v = v.reshape(b, s, cfg.kv_heads, e)
    if cfg.qk_norm:
        q = ops.rms_norm(q, w.q_norm, cfg.norm_eps)
        k = ops.rms_norm(k, w.k_norm, cfg.norm_eps)
    cos, sin = ops.rope_angles(positions, rope_frequencies(cfg))
    q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
    impl = attention_path(cfg, s, packed=segment_ids is not None)
    attn, kept = attend(q, k, v, impl, auto.attention_chunk(attention_chunk, s))
    x = x + ops.project(attn.reshape(b, s, cfg.heads * e), w.wo, float8)

    tile = auto.mlp_tile(mlp_tile, b * s)
    x = ops.residual_mlp(x, p.mlp_norm, p.w_gate, p.w_up, p.w_down, cfg.norm_eps, dtype, tile,
                         float8)
    return x, kept


def rope_frequencies(cfg: ModelConfig):
    """The model's rotary inverse frequencies [E/2], float64 (host, from the config alone)."""
    return ops.rope_frequencies(cfg.dh, cfg.rope_theta, cfg.rope_scaling)


def head_out_weight(head: HeadParams, embed_params: EmbedParams | None):
    """The output projection [D, V]: its own, or the embedding table's transpose when tied."""
    return head.out if head.out is not None else embed_params.table.T


def head_loss(head: HeadParams, embed_params, x, targets, mask, cfg: ModelConfig, denom,
              chunk: int = 1024):
    """Mean-over-`denom` masked cross-entropy of x [B, S, D] against targets [B, S].

    Returns sum(mask * ce) / denom, so micro-batch losses and gradients simply add up.
    """
    dtype = jnp.dtype(cfg.compute_dtype)
    h = ops.rms_norm(x, head.norm.astype(dtype), cfg.norm_eps)
    w = head_out_weight(head, embed_params).astype(dtype)
    d = h.shape[-1]
    total = ops.chunked_cross_entropy(
        h.reshape(-1, d), w, targets.reshape(-1), mask.reshape(-1), chunk
    )
    return total / denom


def logits(params: dict, tokens, cfg: ModelConfig):
    """Full logits [B, S, V] in fp32, for evaluation and parity checks on small inputs."""
    x = embed(params["embed"], tokens, cfg)
    for p in params["layers"]:
        x = layer(p, x, cfg)
    dtype = jnp.dtype(cfg.compute_dtype)
    h = ops.rms_norm(x, params["head"].norm.astype(dtype), cfg.norm_eps)
    w = head_out_weight(params["head"], params["embed"]).astype(dtype)
    return jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32)


def loss(params: dict, batch: dict, cfg: ModelConfig, denom, chunk: int = 1024, *,
         mlp_tile: int = 0, attention_chunk: int = 0):
    """Whole-model loss: the plain, unstreamed twin of the engine's schedule."""
    x = embed(params["embed"], batch["inputs"], cfg)
    for p in params["layers"]:
        x = layer(p, x, cfg, batch.get("positions"), batch.get("segment_ids"),
                  mlp_tile=mlp_tile, attention_chunk=attention_chunk)
    embed_params = params["embed"] if cfg.tie_embeddings else None
    return head_loss(params["head"], embed_params, x, batch["targets"], batch["mask"], cfg,
                     denom, chunk)


def stack_layers(layers: list):
    """Per-layer list -> one pytree with a leading layer axis (the nn.scan layout)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def unstack_layers(stacked) -> list:
    n = jax.tree.leaves(stacked)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]
