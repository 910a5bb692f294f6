"""The model: the Llama family as pure functions over pytrees (`llama`), the operations
its layers are made of (`ops`, `blockwise`), and the attention a backward replays instead of
recomputing (`replay`). Nothing here places memory.

    params = model.init(cfg.model, jax.random.key(0))
    loss = model.loss(params, batch, cfg.model, denom)
"""

from megatrain_jax.model.llama import (
    EmbedParams,
    HeadParams,
    LayerParams,
    abstract,
    abstract_embed,
    abstract_head,
    abstract_layer,
    attention_path,
    embed,
    head_loss,
    head_out_weight,
    init,
    init_embed,
    init_head,
    init_layer,
    layer,
    layer_keeping_attention,
    layer_key,
    layer_replaying_attention,
    logits,
    loss,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "EmbedParams", "HeadParams", "LayerParams", "abstract", "abstract_embed", "abstract_head",
    "abstract_layer", "embed", "head_loss", "head_out_weight", "init", "init_embed",
    "init_head", "init_layer", "layer", "layer_key", "logits", "loss", "stack_layers",
    "unstack_layers", "attention_path", "layer_keeping_attention", "layer_replaying_attention",
]
