"""The configuration's shape: nested frozen dataclasses, the allowed choices, and the checks
of relations between values that types alone cannot express.

    cfg = Config(model=ModelConfig(hidden=512, layers=8))
    validate(cfg)                  # raises ConfigError naming the value and the fix

Reading files and overrides is `load.py`'s job; Hugging Face config.json is `hf.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrain_jax.config.auto import grad_dtype
from megatrain_jax.config.errors import ConfigError
from megatrain_jax.config.optimizers import NS_COEFFS, NS_DTYPES, MuonConfig, optimizer_checks
from megatrain_jax.config.placement_checks import layers_fetched_twice as layers_fetched_twice
from megatrain_jax.config.placement_checks import pinned as pinned
from megatrain_jax.config.placement_checks import placement_checks
from megatrain_jax.config.ranges import check_ranges


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. `llama3` is Llama-3.1's band-wise scaling; `linear` divides."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. `head_dim=0` means hidden // heads.

    `attention`: `auto` picks cuDNN, XLA or the blockwise attention by device, dtype and
    sequence length (config/auto.py); `blockwise` runs over sequence chunks in any case.

    `hf_path`: a local Hugging Face model folder to start from; its config.json fixes the
    architecture fields (setting one of them to another value is an error) and its weights
    replace the random init.
    """

    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 0
    ffn: int = 176
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_seq_len: int = 4096
    compute_dtype: str = "bfloat16"
    # The layers' projections as FP8 dots (model/fp8.py); the rest stays bfloat16.
    fp8_matmuls: bool = False
    attention: str = "auto"
    init_std: float = 0.02
    hf_path: str = ""

    @property
    def dh(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def params_per_layer(self) -> int:
        d, dh, h, k, f = self.hidden, self.dh, self.heads, self.kv_heads, self.ffn
        attn = d * dh * (h + 2 * k) + h * dh * d
        bias = dh * (h + 2 * k) if self.qkv_bias else 0
        qk_norm = 2 * dh if self.qk_norm else 0
        return attn + bias + qk_norm + 3 * d * f + 2 * d

    @property
    def embedding_params(self) -> int:
        """Parameters outside the layers: the embedding and the head with the final norm."""
        embed = self.vocab_size * self.hidden
        return embed + self.hidden + (0 if self.tie_embeddings else embed)

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.layers * self.params_per_layer


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer. Weight decay spares norms and biases; `clip_norm=0` turns clipping off.
    Muon's own settings are `muon` (config/optimizers.py)."""

    name: str = "adamw"
    lr: float = 3e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9
    clip_norm: float = 1.0
    # Adam's moments (Muon's momentum) as stored: float32 (8 B/param), bfloat16 (4) or int8
    # (8-bit codes, a scale per block of 256: about 2.03). Arithmetic stays fp32.
    state_dtype: str = "float32"
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then `kind` down to `min_lr_ratio * lr`."""

    kind: str = "cosine"
    warmup_steps: int = 0
    decay_steps: int = 0  # 0: until loop.steps
    min_lr_ratio: float = 0.1


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. `source`: `bundled` text, `random` ids, a folder made by
    `megatrain-jax prepare`, or a token file. `val_fraction` of the data is held out for
    evaluation (the end of a text, or that share of instruction examples)."""

    source: str = "bundled"
    batch_size: int = 8
    seq_len: int = 128
    micro_batches: int = 1
    seed: int = 0
    val_fraction: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class StreamConfig:
    """The streaming engine and where the state lives.

    Placement is one decision (planning/planner.py): within `gpu_budget_gb` of each GPU and the
    host's memory, the planner chooses which layers' state lives on the GPU, which layers
    save their activations, keep their fetched weights or their attention, and where saved
    inputs wait, to make the step's bound shortest (`megatrain-jax plan` shows it). The
    placement keys below are `auto` by default; a value set pins that choice and the planner
    places the rest around it.
    """

    # Each GPU's memory the placement may fill, in GiB; 0: what XLA may allocate on it.
    gpu_budget_gb: float = 0.0
    prefetch_depth: int = 2
    loss_chunk: int = 1024  # tokens of the sequence per cross-entropy chunk
    host_memory_gb: float = 0.0  # each GPU's pinned pool; 0: sized from the model
    update: str = "auto"  # host: in place on the host, overlapped; device: any Optax; auto
    # Speculative update: the host update during the backward, as if the step will not clip
    # (undone and redone when it does): off, auto (when the last step did not clip), on. A
    # part not started by the backward's end is updated after it (docs/guide.md).
    speculate: str = "auto"
    # The share of the host parameters, from the head down in the backward's order, whose
    # update a speculating step may start during the backward; the rest are updated after
    # it, beside the next forward. Below 1 speculates less: less to undo when a step clips.
    speculate_share: float = 1.0
    # Layer weight gradients D2H and on the host: auto (bfloat16 where they are bf16 values:
    # bf16 compute, one micro-batch, one device; else float32), float32, or bfloat16 (also
    # where it rounds them). Half their bytes in bf16 (docs/guide.md).
    grad_dtype: str = "auto"
    mlp_tile: int = 0  # tokens per MLP tile, recomputed in the backward; 0: auto (config/auto.py)
    attention_chunk: int = 0  # tokens per blockwise attention chunk; 0: auto
    # Advanced pins of the placement (auto: the planner's choice).
    # The first K layers' weights and optimizer state live on the GPU and update there.
    resident_layers: str = "auto"
    # The embedding and the head, with their optimizer state, live on the GPU: on, off.
    resident_embeddings: str = "auto"
    # The last K layers' forward saves its activations on the GPU; their backward fetches no
    # weights and recomputes none of their matmuls (one GPU).
    keep_layers: str = "auto"
    # The K layers before those keep their attention's output and statistics on the GPU, and
    # their backward does not attend again (cuDNN or blockwise attention, one GPU): on (every
    # such layer), off, or a number.
    keep_attention: str = "auto"
    # The K streamed layers before those keep the weights their forward fetched for their
    # backward (1/N a GPU of a mesh): on (every streamed layer), off, or a number.
    keep_weights: str = "auto"
    # Where each layer's input waits for the backward: device, pinned_host, a number (the
    # first K layers' on pinned host), or auto (on the GPU as far as the placement leaves
    # room, the first layers' on pinned host beyond).
    saved_inputs: str = "auto"
    # K layers, spread over those before the layers that keep anything, save no input: the
    # backward runs the forward again from the last input saved before them. off, a number.
    recompute_inputs: str = "auto"
    # Host memory a checkpoint's capture copies the state into before training goes on (the
    # disk write follows in the background): whole (a copy of all of it), a number of parts
    # (embedding, layers, head) at a time, each part's update waiting for its own capture
    # only, or auto (the planner: whole where the host has room).
    save_staging: str = "auto"
    # The optimizer state of the parts the host updates (AdamW's kernel alone reads it) in
    # plain host memory, outside XLA's pinned pool and its bookkeeping; false: in the pool.
    plain_optimizer_state: bool = True


@dataclass(frozen=True)
class MeshConfig:
    """Data parallelism over several devices (docs/guide.md, "Several GPUs"): each
    micro-batch's rows split over `data` devices, the host state kept once and sharded over
    them. 0: every device of every process; 1: one device, as without a mesh."""

    data: int = 0


@dataclass(frozen=True)
class LoopConfig:
    """The training loop around `train_step`."""

    steps: int = 100
    trainer: str = "stream"
    seed: int = 0
    log_every: int = 10
    run_dir: str = "runs/latest"
    progress: str = "auto"
    checkpoint_every: int = 0  # steps between checkpoints in RUN_DIR/checkpoints; 0: none
    keep_checkpoints: int = 3
    resume: bool = True  # continue from the latest checkpoint in RUN_DIR when there is one
    # Resume although the optimizer, data or learning rates of steps already planned differ
    # from the checkpoint's run (refused otherwise, naming what changed).
    accept_changes: bool = False
    max_skipped_steps: int = 3  # consecutive steps with non-finite gradients that stop the run
    # This step's per-layer timeline goes to RUN_DIR/timeline.json (steps counted from 1, as
    # metrics.jsonl and `report` count them); -1: none.
    timeline_step: int = 3
    tensorboard: str = "auto"  # event files in RUN_DIR/tensorboard: auto (when installed), on, off
    eval_every: int = 0  # steps between evaluations on the validation split; 0: none
    eval_batches: int = 4  # batches per evaluation (the same ones every time)
    export_dir: str = ""  # a new folder: the final weights as a Hugging Face model; "": none
    # On SIGTERM or SIGINT the run stops after the step in flight; with stop_save it writes a
    # checkpoint of that step first (where the run writes checkpoints: loop.checkpoint_every).
    stop_save: bool = True
    # The run's last step is saved when it ends (so that `export` and a requeue find it), even
    # where loop.checkpoint_every=0 and stop_save=true saves on a signal alike.
    final_checkpoint: bool = True
    # Bit-for-bit repeatable runs: XLA's deterministic GPU ops, set before JAX starts (slower).
    deterministic: bool = False


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)


# Fields whose string values come from a fixed set.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.rope_scaling.kind": ("none", "llama3", "linear"),
    "model.compute_dtype": ("bfloat16", "float32"),
    "model.attention": ("auto", "xla", "cudnn", "blockwise"),
    "optim.name": ("adamw", "adam", "lion", "sgd", "muon"),
    "optim.state_dtype": ("float32", "bfloat16", "int8"),
    "optim.muon.ns_coeffs": NS_COEFFS,
    "optim.muon.ns_dtype": NS_DTYPES,
    "schedule.kind": ("cosine", "linear", "constant"),
    "stream.saved_inputs": ("auto", "device", "pinned_host"),
    "stream.update": ("auto", "host", "device"),
    "stream.speculate": ("off", "auto", "on"),
    "stream.grad_dtype": ("auto", "float32", "bfloat16"),
    "stream.keep_attention": ("auto", "on", "off"),
    "stream.keep_weights": ("auto", "on", "off"),
    "stream.recompute_inputs": ("auto", "off"),
    "stream.resident_layers": ("auto",),
    "stream.keep_layers": ("auto",),
    "stream.resident_embeddings": ("auto", "on", "off"),
    "stream.save_staging": ("auto", "whole"),
    "loop.trainer": ("stream", "reference"),
    "loop.progress": ("auto", "bar", "plain", "none"),
    "loop.tensorboard": ("auto", "on", "off"),
}
# Choices that also take a number of layers instead (given as a whole number, kept as its
# digits).
COUNTS = ("stream.keep_weights", "stream.keep_attention", "stream.resident_layers",
          "stream.keep_layers", "stream.saved_inputs", "stream.save_staging",
          "stream.recompute_inputs")


def layer_grad_dtype(cfg: "Config", devices: int = 1) -> str:
    """The dtype cfg's layer weight gradients travel to the host in over `devices` devices:
    stream.grad_dtype resolved by config/auto.py's rule."""
    return grad_dtype(cfg.stream.grad_dtype, cfg.model.compute_dtype, cfg.data.micro_batches,
                      devices)

# How Adam's moments may be stored (megatrain_jax.optim.compact), and the values of a row that
# share one scale in int8.
STATE_DTYPES = CHOICES["optim.state_dtype"]
MOMENT_BLOCK = 256


def validate(cfg: Config) -> Config:
    """Checks every setting's range (ranges.py), then the relations between values that types
    alone cannot express."""
    check_ranges(cfg)
    m, d = cfg.model, cfg.data
    checks = [
        (m.heads % m.kv_heads == 0,
         f"model.heads ({m.heads}) must be a multiple of model.kv_heads ({m.kv_heads})"),
        (m.head_dim > 0 or m.hidden % m.heads == 0,
         f"model.hidden ({m.hidden}) is not divisible by model.heads ({m.heads}); "
         "set model.head_dim"),
        (m.dh % 2 == 0, f"head dim {m.dh} must be even for rotary embeddings"),
        (d.seq_len <= m.max_seq_len,
         f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})"),
        (d.batch_size % d.micro_batches == 0,
         f"data.batch_size ({d.batch_size}) must be divisible by data.micro_batches "
         f"({d.micro_batches})"),
        (cfg.loop.eval_every == 0 or d.val_fraction > 0,
         "loop.eval_every needs a validation split: set data.val_fraction (e.g. 0.05)"),
        *placement_checks(cfg),
        *optimizer_checks(cfg),
        (cfg.loop.run_dir.strip() != "", "loop.run_dir must name a folder"),
        (not m.fp8_matmuls or m.compute_dtype == "bfloat16",
         f"model.fp8_matmuls=true runs the rest of the layer in bfloat16, not "
         f"model.compute_dtype={m.compute_dtype}: set model.compute_dtype=bfloat16 or "
         "model.fp8_matmuls=false"),
        (m.rope_scaling.kind != "llama3" or
         m.rope_scaling.high_freq_factor > m.rope_scaling.low_freq_factor,
         f"model.rope_scaling.high_freq_factor ({m.rope_scaling.high_freq_factor}) must be "
         f"above model.rope_scaling.low_freq_factor ({m.rope_scaling.low_freq_factor}) for "
         "llama3 scaling"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message + ".")
    return cfg

