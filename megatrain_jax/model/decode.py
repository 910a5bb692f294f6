"""Generating text with a KV cache: the prompt in one pass, then one token per fixed-shape step.

    layers = stack_layers(params["layers"])              # one program serves every layer
    params = {"embed": ..., "layers": layers, "head": ...}
    cache = empty_cache(cfg, batch=1, length=T)
    logits, cache = prefill(params, prompt, n, cache, cfg)          # prompt [B, P], n <= P
    token = choose(logits, key, temperature, top_p)
    logits, cache = decode(params, token, n, cache, cfg)            # the token at position n

The cache holds every layer's rotated keys and values, {"k", "v"} [L, B, T, K, E] in the
compute dtype; a position's are written when its token goes through, and a token attends to
positions 0 … its own, so a prompt padded at its end to a bucket size gives the same values
(its padding is overwritten before anything attends to it). Each layer is `llama.layer` with
only the attention replaced (`layer_attending`), applied by `lax.scan` over the stacked layers:
compiling does not depend on depth, and a decode step's shape never changes. Pure functions:
nothing here places memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megatrain_jax.config import ModelConfig
from megatrain_jax.model import llama, ops


def empty_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """Zeros for `length` positions of every layer's keys and values."""
    shape = (cfg.layers, batch, length, cfg.kv_heads, cfg.dh)
    zeros = jnp.zeros(shape, cfg.compute_dtype)
    return {"k": zeros, "v": zeros}


def _logits_at(params: dict, x, index, cfg: ModelConfig):
    """fp32 logits [B, V] of x [B, S, D] at position `index` (traced)."""
    dtype = jnp.dtype(cfg.compute_dtype)
    h = jax.lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False)  # B D
    h = ops.rms_norm(h, params["head"].norm.astype(dtype), cfg.norm_eps)
    w = llama.head_out_weight(params["head"], params["embed"]).astype(dtype)
    return jnp.einsum("bd,dv->bv", h, w, preferred_element_type=jnp.float32)


def prefill(params: dict, tokens, length, cache: dict, cfg: ModelConfig):
    """(logits [B, V] after the first `length` tokens of tokens [B, P], the cache holding
    positions 0 … P-1). Tokens past `length` are padding: causal attention keeps them out of
    what comes before, and decode overwrites their cache entries."""

    def attend(q, k, v, implementation, chunk):
        return ops.attention(q, k, v, implementation, None, chunk), (k, v)

    def one_layer(x, p):
        return llama.layer_attending(p, x, cfg, None, attend)

    x = llama.embed(params["embed"], tokens, cfg)
    x, (keys, values) = jax.lax.scan(one_layer, x, params["layers"])  # L B P K E
    cache = {"k": jax.lax.dynamic_update_slice(cache["k"], keys.astype(cache["k"].dtype),
                                               (0, 0, 0, 0, 0)),
             "v": jax.lax.dynamic_update_slice(cache["v"], values.astype(cache["v"].dtype),
                                               (0, 0, 0, 0, 0))}
    return _logits_at(params, x, length - 1, cfg), cache


def decode(params: dict, token, position, cache: dict, cfg: ModelConfig):
    """(logits [B, V] after token [B] at `position` (traced), the cache with its keys and
    values written there)."""
    b, positions_cached = token.shape[0], cache["k"].shape[2]
    positions = jnp.full((b, 1), position, jnp.int32)
    visible = (jnp.arange(positions_cached) <= position)[None, None, None, :]  # B H 1 T

    def one_layer(carry, xs):
        x, keys, values = carry
        p, index = xs

        def attend(q, k, v, implementation, chunk):
            at = (index, 0, position, 0, 0)
            new_keys = jax.lax.dynamic_update_slice(keys, k[None].astype(keys.dtype), at)
            new_values = jax.lax.dynamic_update_slice(values, v[None].astype(values.dtype), at)
            out = jax.nn.dot_product_attention(
                q, new_keys[index].astype(q.dtype), new_values[index].astype(q.dtype),
                mask=visible, implementation="xla")
            return out, (new_keys, new_values)

        x, (keys, values) = llama.layer_attending(p, x, cfg, positions, attend)
        return (x, keys, values), None

    x = llama.embed(params["embed"], token[:, None], cfg)
    layers = jnp.arange(cfg.layers)
    (x, keys, values), _ = jax.lax.scan(one_layer, (x, cache["k"], cache["v"]),
                                        (params["layers"], layers))
    return _logits_at(params, x, 0, cfg), {"k": keys, "v": values}


def choose(logits, key, temperature, top_p):
    """The next token [B] int32 of logits [B, V]: the most likely where `temperature` is 0,
    else a draw from softmax(logits / temperature) over the fewest most likely tokens whose
    probability reaches `top_p` (nucleus sampling; 1 keeps every token)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above
    ranked = jnp.where(before < top_p, ranked, -jnp.inf)  # the first is always kept
    pick = jax.random.categorical(key, ranked, axis=-1)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
