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

import jax

from megatrain_jax import model, optim
from megatrain_jax.config import Config, ConfigError, layer_grad_dtype
from megatrain_jax.config.schema import pinned
from megatrain_jax.io import hf
from megatrain_jax.io.progress import Progress
from megatrain_jax.model import fp8, replay
from megatrain_jax.planning import memory, planner, presets
from megatrain_jax.planning.probe import host_memory_available
from megatrain_jax.stream import StreamEngine, StreamState, Templates
from megatrain_jax.stream.mesh import make_mesh
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
    """The Llama-family model on the streaming engine, placed as its config's placement keys
    say (resolved by the planner here where some are `auto`: planning/planner.py)."""

    def __init__(self, cfg: Config):
        mesh = mesh_for(cfg)
        n = mesh.size if mesh else 1
        check_pins(cfg, mesh)
        self.cfg = cfg = placed(cfg, n)
        plan = memory.plan_of(cfg)
        self.engine = StreamEngine(
            llama_templates(cfg, n), optim.build_stream_optimizer(cfg),
            clip_norm=cfg.optim.clip_norm, prefetch_depth=cfg.stream.prefetch_depth,
            saved_inputs=plan.host_inputs, micro_batches=cfg.data.micro_batches,
            learning_rate=optim.learning_rate(cfg), resident_layers=plan.resident_layers,
            speculate=cfg.stream.speculate, speculate_share=cfg.stream.speculate_share,
            mesh=mesh, keep_attention=plan.attention_layers, keep_layers=plan.saving_layers,
            keep_weights=plan.weight_layers, resident_embeddings=plan.resident_embeddings,
            recompute_inputs=plan.recomputed_inputs,
            plain_state=cfg.stream.plain_optimizer_state,
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
        return self.engine.init_state(
            lambda: model.init_embed(m, model.layer_key(key, -1)),
            lambda i: model.init_layer(m, model.layer_key(key, i)),
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


def placed(cfg: Config, devices: int) -> Config:
    """cfg with its placement decided for `devices` of these GPUs, where the planner has not
    decided it yet (`megatrain-jax train` has, before JAX started): within
    stream.gpu_budget_gb of what XLA may allocate on each (nothing placed on a device whose
    memory is unknown, such as the CPU, without a budget), the host memory available, at the
    rates of this GPU's preset."""
    if planner.is_resolved(cfg):
        return cfg
    rates = presets.preset_for(jax.local_devices()[0].device_kind).rates(cfg, devices)
    return planner.resolve(cfg, planner.gpu_budget(cfg, device_memory_bytes()),
                           host_memory_available(), devices, rates)


def check_pins(cfg: Config, mesh) -> None:
    """Refuses, with the fix, placement pins the engine cannot run: kept attention where the
    attention cannot keep it or over several GPUs, saving layers over several GPUs."""
    s = cfg.stream
    attention = s.keep_attention == "on" or (pinned(s.keep_attention) or 0) > 0
    if attention:
        path = model.attention_path(cfg.model, cfg.data.seq_len)
        why = ("several GPUs (mesh.data)" if mesh is not None else
               None if replay.keeps(path) else
               f"the {path} attention of {cfg.data.seq_len:,}-token rows")
        if why:
            raise ConfigError(f"stream.keep_attention={s.keep_attention} cannot keep the "
                              f"attention with {why}: it keeps cuDNN's or the blockwise "
                              f"attention's, on one GPU; set stream.keep_attention=auto or off")
    if (pinned(s.keep_layers) or 0) > 0 and mesh is not None:
        raise ConfigError(f"stream.keep_layers={s.keep_layers} runs on one GPU; over several "
                          f"(mesh.data) set stream.keep_layers=0 or auto")


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
    if cfg.model.fp8_matmuls:
        fp8.check_devices(jax.local_devices())
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
