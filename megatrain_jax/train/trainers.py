"""The two trainers of the Llama-family model, behind one protocol.

    trainer = make_trainer(cfg)                     # loop.trainer: stream or reference
    state = trainer.init(jax.random.key(0))         # or trainer.init(None, params)
    state = initial_state(cfg, trainer)             # cfg's: random or model.hf_path, a bar
    state, metrics = trainer.train_step(state, batch, tracer=None, before_write=None)
    tree = trainer.state_tree(state)                # {"params", "opt_state"}: a checkpoint
    record = trainer.state_record(state)            # JSON facts the checkpoint keeps beside
    state = trainer.from_tree(restored, step, record)  # into trainer.abstract_state()

A state has `params`, `opt_state`, `step` and `wait()` (which returns once nothing writes it
any more). `stream` keeps the state at home on the host and streams layers through the GPU;
`reference` holds the whole model on the device and is the streamed step's exact twin.
"""

from __future__ import annotations

from functools import partial

import jax

from megatrain_jax import model, optim
from megatrain_jax.config import Config, ConfigError, layer_grad_dtype, memory
from megatrain_jax.io import hf
from megatrain_jax.model import replay
from megatrain_jax.stream import StreamEngine, StreamState, Templates
from megatrain_jax.stream.mesh import make_mesh
from megatrain_jax.tools.progress import Progress
from megatrain_jax.train.reference import ReferenceTrainer


def llama_templates(config: Config, devices: int = 1) -> Templates:
    """The built-in Llama-family model as engine templates, from a full `Config`, for an
    engine over `devices` devices."""
    cfg, chunk = config.model, config.stream.loss_chunk
    tile, chunk_attention = config.stream.mlp_tile, config.stream.attention_chunk

    def embed(p, batch):
        return model.embed(p, batch["inputs"], cfg)

    def layer(p, x, batch):
        return model.layer(p, x, cfg, batch.get("positions"), batch.get("segment_ids"),
                           mlp_tile=tile, attention_chunk=chunk_attention)

    def layer_keeping(p, x, batch):
        return model.layer_keeping_attention(p, x, cfg, batch.get("positions"),
                                             batch.get("segment_ids"), mlp_tile=tile,
                                             attention_chunk=chunk_attention)

    def layer_replaying(p, x, batch, kept):
        return model.layer_replaying_attention(p, x, kept, cfg, batch.get("positions"),
                                               batch.get("segment_ids"), mlp_tile=tile,
                                               attention_chunk=chunk_attention)

    def head_loss(p, embed_params, x, batch, denom):
        return model.head_loss(p, embed_params, x, batch["targets"], batch["mask"], cfg,
                               denom, chunk)

    # With bf16 compute the layer casts every weight to bf16, so the gradients of its weights
    # are bf16 values: stream.grad_dtype (config/auto.py) says whether they travel in bf16.
    # Embedding and head gradients sum over tokens in fp32 and stay fp32.
    halves = layer_grad_dtype(config, devices) == "bfloat16"
    return Templates(embed, layer, head_loss, tied=cfg.tie_embeddings,
                     layer_grad_dtype="bfloat16" if halves else None,
                     layer_keeping=layer_keeping, layer_replaying=layer_replaying,
                     saving_dtype=cfg.compute_dtype if memory.saves_cast_weights(config)
                     else None)  # saving layers run on one device


class StreamTrainer:
    """The Llama-family model on the streaming engine."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        mesh = mesh_for(cfg)
        gpu, n = device_memory_bytes(), mesh.size if mesh else 1
        self.engine = StreamEngine(
            llama_templates(cfg, mesh.size if mesh else 1), optim.build_stream_optimizer(cfg),
            clip_norm=cfg.optim.clip_norm, prefetch_depth=cfg.stream.prefetch_depth,
            saved_inputs=saved_inputs(cfg, mesh), micro_batches=cfg.data.micro_batches,
            learning_rate=optim.learning_rate(cfg), resident_layers=cfg.stream.resident_layers,
            speculate=cfg.stream.speculate, speculate_share=cfg.stream.speculate_share,
            mesh=mesh, keep_attention=keep_attention(cfg, mesh), keep_layers=keep_layers(cfg, mesh),
            keep_weights=memory.keep_weights_layers(cfg, gpu, n),
            resident_embeddings=memory.embeddings_resident(cfg, gpu, n),
        )
        self.train_step = self.engine.train_step
        self.put_params = self.engine.placement.place  # where imported parameters go
        self.devices = self.engine.placement.devices  # the mesh's size (1: one device)

    def init(self, key, params: dict | None = None, on_part=None) -> StreamState:
        """Random parameters from `key`, or `params`, and their optimizer state, part by part;
        `on_part(what)` follows each part's weights and optimizer state once home."""
        if params is not None:
            return self.engine.state_from_params(params, on_part=on_part)
        m = self.cfg.model
        init_layer = jax.jit(partial(model.init_layer, m))  # compiled once for all layers
        return self.engine.init_state(
            lambda: model.init_embed(m, model.layer_key(key, -1)),
            lambda i: init_layer(model.layer_key(key, i)),
            lambda: model.init_head(m, model.layer_key(key, -2)),
            m.layers, on_part,
        )

    def eval_loss(self, state: StreamState, batch: dict):
        """The loss of `batch` from a streamed forward pass (waits for a pending update)."""
        return self.engine.eval_loss(state.params, batch)

    def abstract_state(self) -> dict:
        return self.engine.abstract_state(model.abstract(self.cfg.model))

    def state_tree(self, state: StreamState) -> dict:
        return {"params": state.params, "opt_state": state.opt_state}

    def state_record(self, state: StreamState) -> dict:
        """The last gradient norm, which decides whether the next step speculates: kept so
        that a resumed run takes the same path, bit for bit, as an unbroken one."""
        return {"last_grad_norm": state.last_grad_norm}

    def from_tree(self, tree: dict, step: int, record: dict | None = None) -> StreamState:
        return StreamState(tree["params"], tree["opt_state"], step,
                           last_grad_norm=(record or {}).get("last_grad_norm"))


def saved_inputs(cfg: Config, mesh) -> str | int:
    """`stream.saved_inputs` for the engine: `auto` becomes the count of layers whose inputs
    wait on pinned host, from what XLA may allocate on the first device (config/memory.py's
    arithmetic, the planner's); all on the device where that is not known (the CPU)."""
    if cfg.stream.saved_inputs != "auto":
        return cfg.stream.saved_inputs
    return memory.saved_on_host(cfg, device_memory_bytes(), mesh.size if mesh else 1)


def keep_attention(cfg: Config, mesh) -> int:
    """`stream.keep_attention` for the engine: how many of the last layers keep their
    attention for the backward (config/memory.py's arithmetic, the planner's). `on` is refused
    with the fix where it cannot be kept; `auto` keeps none there."""
    path = model.attention_path(cfg.model, cfg.data.seq_len)
    keeps = replay.keeps(path)
    if cfg.stream.keep_attention == "on":
        why = ("several GPUs (mesh.data)" if mesh is not None else
               None if keeps else f"the {path} attention of {cfg.data.seq_len:,}-token rows")
        if why:
            raise ConfigError(f"stream.keep_attention=on cannot keep the attention with {why}: "
                              f"it keeps cuDNN's or the blockwise attention's, on one GPU; "
                              f"set stream.keep_attention=auto or off")
    if not keeps or mesh is not None:
        return 0
    return memory.keep_attention_layers(cfg, device_memory_bytes())


def keep_layers(cfg: Config, mesh) -> int:
    """`stream.keep_layers` for the engine, refused with the fix over several GPUs."""
    if cfg.stream.keep_layers and mesh is not None:
        raise ConfigError(f"stream.keep_layers={cfg.stream.keep_layers} runs on one GPU; over "
                          f"several (mesh.data) set stream.keep_layers=0")
    return cfg.stream.keep_layers


def device_memory_bytes() -> int | None:
    """The bytes XLA may allocate on the first local device; None where it does not say."""
    stats = jax.local_devices()[0].memory_stats()
    return (stats or {}).get("bytes_limit")


def mesh_for(cfg: Config):
    """The mesh of `cfg.mesh` (None for one device), refused with the fix when the batch's
    micro-batches do not split over it."""
    try:
        mesh = make_mesh(cfg.mesh.data)
    except ValueError as e:
        raise ConfigError(str(e) + ".") from None
    n, rows = (mesh.size if mesh is not None else 1), cfg.data.batch_size // cfg.data.micro_batches
    if rows % n:
        raise ConfigError(
            f"each micro-batch's {rows} rows (data.batch_size {cfg.data.batch_size} / "
            f"data.micro_batches {cfg.data.micro_batches}) do not split over {n} devices: make "
            f"data.batch_size a multiple of {n * cfg.data.micro_batches}, or set mesh.data to a "
            f"divisor of {rows} (mesh.data=1: one device).")
    return mesh


def make_trainer(cfg: Config):
    return StreamTrainer(cfg) if cfg.loop.trainer == "stream" else ReferenceTrainer(cfg)


def initial_state(cfg: Config, trainer):
    """Random parameters, or those of model.hf_path read part by part into their place, and
    the optimizer state, with a progress bar (a 30B model takes minutes)."""
    parts = cfg.model.layers + 2
    params = None
    if cfg.model.hf_path:
        bar = Progress(len(hf.tensor_names(cfg.model)), cfg.loop.progress, label="import")
        params = hf.load_params(cfg.model.hf_path, cfg.model, put=trainer.put_params,
                                progress=bar)
        bar.close()
    total = parts if params is not None else 2 * parts  # the optimizer state; the weights too
    bar = Progress(total, cfg.loop.progress, label="init", plain_every=max(total // 4, 1))
    state = trainer.init(None if params is not None else jax.random.key(cfg.loop.seed), params,
                         on_part=lambda what: bar.update(bar.done + 1, {"part": what}))
    bar.close()
    return state
