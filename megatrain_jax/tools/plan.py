"""Memory plan: what a config needs on the host and on the GPU, computed without JAX.

    estimate(cfg)          -> {component: bytes} for host and device
    check_fits(cfg)        -> raises ConfigError with the numbers when it cannot fit
    largest_fitting(cfg)   -> the largest shipped shape this machine holds, with cfg's settings
    staging.checkpoint_disk(cfg) -> bytes per checkpoint, bytes its checkpoints need, free bytes

Runs before JAX starts, so that the pinned host pool can be sized from the model. The GPU's
memory is read from nvidia-smi, so that JAX need not start to know it.
"""

from __future__ import annotations

import dataclasses
import os

from megatrain_jax.config import (
    HOST_OPTIMIZERS,
    STATE_DTYPES,
    Config,
    ConfigError,
    auto,
    host_update,
    layer_grad_dtype,
    load_config,
    shipped_configs,
)
from megatrain_jax.planning import device_update, memory, planner, pool, presets, probe, staging
from megatrain_jax.planning.memory import GiB, replaced
from megatrain_jax.planning.probe import (
    gpu_memory_bytes,
    gpu_name,
    host_memory_available,
    planned_devices,
)
from megatrain_jax.planning.roofline import Rates, gradient_bytes, host_params, update_bytes
from megatrain_jax.planning.staging import checkpoint_bytes

RUNTIME, POOL_BOOKKEEPING, POOL_MARGIN = pool.RUNTIME, pool.POOL_BOOKKEEPING, pool.POOL_MARGIN
STATE = ("master_weights", "optimizer_state", "gradients", "saved_inputs")


def resolved(cfg: Config, gpu: int | None = None, host: int | None = None,
             rates: Rates | None = None) -> Config:
    """cfg with its placement decided (planning/planner.py) for GPUs of `gpu` usable bytes and
    `host` bytes of host memory (None: this machine's), at `rates` (None: the preset of
    this machine's GPU). A cfg already resolved, or trained by the reference, is returned
    as it is; refuses, with the numbers, where no placement fits."""
    if cfg.loop.trainer != "stream" or planner.is_resolved(cfg):
        return cfg
    n = planned_devices(cfg)
    gpu = usable_gpu_bytes(gpu_memory_bytes()) if gpu is None else gpu
    host = host_memory_available() if host is None else host
    rates = machine_rates(cfg, n) if rates is None else rates
    return planner.resolve(cfg, planner.gpu_budget(cfg, gpu), host, n, rates)


def placement_summary(cfg: Config) -> str:
    """One line on a resolved cfg's placement and the rates it was planned with."""
    plan, layers = memory.plan_of(cfg), cfg.model.layers
    parts = [f"{plan.resident_layers} of {layers} layers resident"]
    for n, what in ((plan.saving_layers, "saving activations"),
                    (plan.attention_layers, "keeping attention"),
                    (plan.weight_layers, "keeping fetched weights"),
                    (plan.host_inputs, "with inputs on host"),
                    (plan.recomputed_inputs, "recomputing their input")):
        if n:
            parts.append(f"{n} {what}")
    parts.append("embedding and head " + ("resident" if plan.resident_embeddings else
                                          "streamed"))
    budget = planner.gpu_budget(cfg, usable_gpu_bytes(gpu_memory_bytes()))
    room = "unknown GPU memory" if budget is None else f"a {budget / GiB:.1f} GiB GPU budget"
    return (", ".join(parts) + f" ({room}; rates: {preset_label()}; "
            "`megatrain-jax plan` explains)")


def machine() -> presets.Machine:
    """The preset of this machine's GPU (nvidia-smi's name; the H200's where unknown)."""
    return presets.preset_for(gpu_name())


def preset_label() -> str:
    """Which preset the plan's figures are of, said plainly where it is not this machine's:
    without a GPU (a CPU run) or with one no preset knows, they are the H200's."""
    name, preset = gpu_name(), machine().name
    if name is None:
        return f"preset {preset}: no GPU here, the figures are for an {preset}"
    if preset.upper() not in name.upper():
        return f"preset {preset}: none for {name}, the figures are for an {preset}"
    return f"preset {preset}"


def machine_rates(cfg: Config, devices: int | None = None) -> Rates:
    """The rates the planner assumes for cfg on this machine's GPUs: their preset."""
    n = planned_devices(cfg) if devices is None else devices
    return machine().rates(cfg, n)


def estimate(cfg: Config, gpu: int | None = None, host: int | None = None,
             rates: Rates | None = None) -> dict:
    """Bytes per component on the host and the device of cfg's run, its placement decided
    for GPUs of `gpu` usable bytes and `host` bytes (None: this machine's). Where no
    placement fits, the one that needs the least host memory, and the planner's reason
    (`refused`)."""
    m = cfg.model
    params = m.num_params
    n = planned_devices(cfg) if cfg.loop.trainer == "stream" else 1
    if cfg.loop.trainer == "reference":
        device = {"whole_model_state": 16 * params,
                  "workspace": memory.activations(cfg)["working_set_total"],
                  "saved": m.layers * memory.saved_per_layer(cfg)}
        host = {"save_staging": staging.staged_bytes(cfg, "whole")}
        return {"host": host, "device": device, "host_total": sum(host.values()),
                "device_total": sum(device.values()), "devices": n, "pool_state": 0,
                "config": cfg, "refused": None}
    refused = None
    try:
        run = resolved(cfg, gpu, host, rates)
    except ConfigError as e:  # the numbers of the placement closest to fitting
        refused = str(e)
        gpu = usable_gpu_bytes(gpu_memory_bytes()) if gpu is None else gpu
        closest = planner.closest(cfg, planner.gpu_budget(cfg, gpu), n)
        run = planner.pinned_config(cfg, closest, "0")  # the least staging area, as refused
    plan = memory.plan_of(run)
    device = memory.device_bytes(run, plan, n)
    host = memory.host_state_bytes(run, plan, n)
    pinned = pool.pooled(run, host)
    overhead = pool.host_overhead(run, pinned, n, sum(host.values()) - pinned)
    if overhead["replicas"] <= 0:
        del overhead["replicas"]
    host.update(overhead)
    host["save_staging"] = staging.staged_bytes(run)
    host, device = ({k: int(v) for k, v in d.items()} for d in (host, device))
    return {"host": host, "device": device, "host_total": sum(host.values()),
            "device_total": sum(device.values()), "devices": n, "pool_state": int(pinned),
            "config": run, "refused": refused}


def host_traffic(cfg: Config) -> dict[str, float]:
    """Host memory bytes a step per host-held parameter of a resolved cfg, host update: the
    weights read for the forward and for the backward of the layers that keep none
    (stream.keep_weights, keep_layers; once however many GPUs, each reading its shard), the
    gradients written, the update's reads and writes (over a mesh the gradients are fp32)."""
    kept = memory.plan_of(cfg).unfetched(cfg.model.layers)
    weights = 8.0 - 4 * kept * cfg.model.params_per_layer / max(host_params(cfg), 1)
    return {"weights": weights, "gradients": gradient_bytes(cfg), "update": update_bytes(cfg)}


def traffic_lines(cfg: Config) -> list[str]:
    """`plan`'s line on `host_traffic` of a resolved cfg where it updates on the host, or on
    the link bytes and FLOPs of its update on the GPU."""
    if cfg.loop.trainer != "stream":
        return []
    if not host_update(cfg):
        return device_update.update_lines(cfg, host_params(cfg), planned_devices(cfg))
    moved = host_traffic(cfg)
    held = host_params(cfg)
    parts, total = ", ".join(f"{name} {n:.1f}" for name, n in moved.items()), sum(moved.values())
    lines = [f"host memory traffic a step: {total:.1f} bytes a host-held parameter ({parts}), "
             f"{total * held / 1e9:.0f} GB"]
    if (n := planned_devices(cfg)) > 1:  # the host's share of a step does not divide by n
        rows = cfg.data.batch_size // cfg.data.micro_batches // n
        lines.append(f"  one state, the same bytes for any number of GPUs; each of the {n} "
                     f"computes {rows} x {cfg.data.seq_len:,} tokens a micro-batch (give each "
                     f"as many as one GPU alone takes, or the host's update paces the step)")
    return lines


def host_bytes_per_param(cfg: Config, gpu: int | None = None,
                         host: int | None = None) -> dict[str, float]:
    """{optim.state_dtype: host bytes per parameter} of cfg's run (on GPUs of `gpu` bytes, a
    host of `host`) in each form of the optimizer state it may take (float32 only without
    compact moments), each placed anew."""
    modes = (STATE_DTYPES if cfg.optim.name in HOST_OPTIMIZERS else
             ("float32", "bfloat16") if cfg.optim.name == "muon" else ("float32",))
    return {mode: _least_host(replaced(cfg, "optim", state_dtype=mode), gpu, host)
            / cfg.model.num_params for mode in modes}


def _least_host(cfg: Config, gpu: int | None, host: int | None) -> int:
    """The host bytes cfg's run needs: its estimate with the least staging area the planner
    may choose (the rest of the host it fills with more of it, where it has room)."""
    est = estimate(cfg, gpu, host)
    return est["host_total"] - est["host"]["save_staging"] + staging.staged_bytes(cfg)


def pinned_pool_bytes(cfg: Config, measuring: bool = False) -> int:
    """The pinned host pool over all the run's GPUs: the host state, a margin, and with
    `measuring` room for the rate measurement's copies (plan --measure, bench_step).

    XLA gives each GPU its own pinned host allocator, capped at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
    (`pool_limit_gib`); each grows its regions by doubling up to the cap, and pinned memory
    is resident once allocated: the process holds about every cap once the state fills most."""
    return planned_devices(cfg) * pool_limit_gib(cfg, pinned_bytes(cfg), measuring) * GiB


def pinned_bytes(cfg: Config) -> int:
    """Bytes of the host state the pool holds (pool.pooled: weights, gradients, saved inputs
    on the host, and the optimizer state where the GPU updates it) for a resolved cfg."""
    return estimate(cfg)["pool_state"]


def pool_limit_gib(cfg: Config, pinned: int, measuring: bool = False) -> int:
    """Each GPU's pool cap in whole GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) for `pinned`
    bytes of host state over the run's GPUs: its share and margin, rounded up."""
    extra = measurement_bytes(cfg) if measuring else 0
    return pool.pool_gib(cfg, pinned, planned_devices(cfg), extra)


# The roofline's measurement (`plan --measure`, bench_step) times the link on pinned copies of
# `MEASURED_LAYERS` layers and the host optimizer on a sample of `OPTIMIZER_SAMPLE` parameters
# (weights, gradients and two moments), whatever the run keeps on the GPU.
MEASURED_LAYERS = 2
OPTIMIZER_SAMPLE = 64 * 2**20


def measurement_bytes(cfg: Config) -> int:
    """Pinned bytes the rate measurement allocates beside the state."""
    layers = min(MEASURED_LAYERS, cfg.model.layers)
    return 4 * layers * cfg.model.params_per_layer + 16 * OPTIMIZER_SAMPLE


# The share of a GPU's memory that XLA's allocator may use: `train` sets
# XLA_PYTHON_CLIENT_MEM_FRACTION to this unless it is given (JAX's own default is 0.75); the
# rest holds the CUDA context and the libraries' handles.
GPU_FRACTION = 0.95


def usable_gpu_bytes(total: int | None) -> int | None:
    """Of a GPU of `total` bytes, what XLA may allocate (XLA_PYTHON_CLIENT_MEM_FRACTION)."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_FRACTION))
    return None if total is None else int(total * fraction)


def check_fits(cfg: Config, host: int | None = None, gpu: int | None = None) -> None:
    """Refuses, with the numbers and the changes that would fit, a config that no placement
    fits on this machine (or on one of `host` and `gpu` usable bytes)."""
    host = host_memory_available() if host is None else host
    gpu = usable_gpu_bytes(gpu_memory_bytes()) if gpu is None else gpu
    est = estimate(cfg, gpu, host)
    if est["refused"] is None:
        return
    message = est["refused"]
    changes = fitting_changes(cfg, host, gpu)
    if changes:
        message += " Changes that fit: " + "; ".join(changes) + "."
    raise ConfigError(message)


def _fits(cfg: Config, host: int | None, gpu: int | None) -> bool:
    """estimate's verdict, without the closest placement a refusal then computes."""
    try:
        resolved(cfg, gpu, host)
    except ConfigError:
        return False
    return True


PLACEMENT_KEYS = ("resident_layers", "resident_embeddings", "keep_layers", "keep_attention",
                  "keep_weights", "saved_inputs", "recompute_inputs")


def fitting_changes(cfg: Config, host: int | None, gpu: int | None) -> list[str]:
    """Changes of the optimizer state's form, of placement pins, of how activations are tiled,
    or of the batch's shape, under which cfg fits `host` and `gpu` bytes; each as the
    overrides to give."""
    d = cfg.data
    tokens = d.batch_size // d.micro_batches * d.seq_len
    candidates = _state_modes(cfg, host, gpu)
    for key in PLACEMENT_KEYS:
        if getattr(cfg.stream, key) != "auto":
            candidates[f"stream.{key}=auto"] = replaced(cfg, "stream", **{key: "auto"})
    if not memory.activations(cfg)["mlp_tile"] and tokens > auto.MLP_TILE:
        candidates[f"stream.mlp_tile={auto.MLP_TILE}"] = replaced(cfg, "stream",
                                                              mlp_tile=auto.MLP_TILE)
    if memory.activations(cfg)["attention"] == "xla":
        candidates["model.attention=blockwise"] = replaced(cfg, "model", attention="blockwise")
    for k in range(d.micro_batches + 1, d.batch_size + 1):
        if d.batch_size % k == 0 and _fits(replaced(cfg, "data", micro_batches=k), host, gpu):
            candidates[f"data.micro_batches={k}"] = None
            break
    fitting = [name for name, c in candidates.items() if c is None or _fits(c, host, gpu)]
    # The longest sequence (a multiple of 1024) that fits with everything else as it is.
    low, high = 0, (d.seq_len - 1) // 1024
    while low < high:
        mid = (low + high + 1) // 2
        if _fits(replaced(cfg, "data", seq_len=mid * 1024), host, gpu):
            low = mid
        else:
            high = mid - 1
    if low:
        fitting.append(f"data.seq_len={low * 1024}")
    return fitting


def _state_modes(cfg: Config, host: int | None, gpu: int | None) -> dict:
    """The first of the smaller forms of the optimizer state and gradients that fits:
    a compact optim.state_dtype, and bf16 layer gradients where that alone is not enough."""
    o, s, n = cfg.optim, cfg.stream, planned_devices(cfg)
    halves = (layer_grad_dtype(replaced(cfg, "stream", grad_dtype="bfloat16"), n)
              != layer_grad_dtype(cfg, n))  # only where they are sent so
    dtypes = STATE_DTYPES[STATE_DTYPES.index(o.state_dtype):]
    if o.name not in HOST_OPTIMIZERS or s.speculate == "on":  # no compact moments there
        dtypes = dtypes[:1]
    for dtype in dtypes:
        option, words = replaced(cfg, "optim", state_dtype=dtype), [f"optim.state_dtype={dtype}"]
        if dtype != o.state_dtype and _fits(option, host, gpu):
            return {words[0]: None}
        if halves and _fits(replaced(option, "stream", grad_dtype="bfloat16"), host, gpu):
            words = words[1:] if dtype == o.state_dtype else words
            return {" ".join([*words, "stream.grad_dtype=bfloat16"]): None}
    return {}


def largest_fitting(cfg: Config, host: int | None, gpu: int | None):
    """(name, config) of the largest shipped shape whose state fits `host` bytes (and whose
    step fits `gpu` bytes, when known), trained with cfg's other settings; None if none."""
    best = None
    for name, path in shipped_configs().items():
        shape = load_config(str(path)).model
        candidate = dataclasses.replace(cfg, model=shape)  # placed anew for this shape
        larger = best is None or shape.num_params > best[1].model.num_params
        if larger and not _state_overflows(candidate, host, gpu) and _fits(candidate, host, gpu):
            best = (name, candidate)
    return best


def _state_overflows(cfg: Config, host: int | None, gpu: int | None) -> bool:
    """Whether a streamed run's weights and optimizer state alone exceed the host and the
    GPUs together: no placement fits, and the planner need not be asked."""
    if cfg.loop.trainer != "stream" or host is None or gpu is None:
        return False
    return checkpoint_bytes(cfg) > planned_devices(cfg) * (host + gpu)


def set_pool_env(cfg: Config, measuring: bool = False, several_processes: bool = False) -> None:
    """Sizes XLA's pinned host pool (the host state and a save's capture of the GPU's) and the
    GPU's share for a resolved cfg before JAX starts; a value in the environment wins. The
    optimizer state only the host update reads lives beside the pool, on a CPU device a GPU
    (stream/placement.py): one process makes a CPU device for each; several keep it pinned."""
    devices, est = planned_devices(cfg), estimate(cfg)
    held = pool.holds(cfg, est["pool_state"], devices, planner.is_resolved(cfg))
    if several_processes:
        held += sum(est["host"][k] for k in STATE) - est["pool_state"]
    probe.set_cpu_devices(1 if several_processes else devices)
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                          str(pool_limit_gib(cfg, held, measuring)))
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(GPU_FRACTION))

