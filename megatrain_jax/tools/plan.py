"""Memory plan: what a config needs on the host and on the GPU, computed without JAX.

    estimate(cfg)          -> {component: bytes} for host and device
    check_fits(cfg)        -> raises ConfigError with the numbers when it cannot fit
    largest_fitting(cfg)   -> the largest shipped shape this machine holds, with cfg's settings
    checkpoint_disk(cfg)   -> bytes per checkpoint, bytes the run's checkpoints need, free bytes

Runs before JAX starts, so that the pinned host pool can be sized from the model. The GPU's
memory is read from nvidia-smi, so that JAX need not start to know it.
"""

from __future__ import annotations

import dataclasses
import os

from megatrain_jax.config import (
    CHOICES,
    HOST_OPTIMIZERS,
    STATE_DTYPES,
    Config,
    ConfigError,
    auto,
    host_update,
    load_config,
    memory,
    shipped_configs,
)
from megatrain_jax.config.memory import optimizer_bytes, replaced
from megatrain_jax.io import array_files, checkpoint
from megatrain_jax.tools.probe import gpu_memory_bytes, host_memory_available, planned_devices
from megatrain_jax.tools.roofline import gradient_bytes, host_params, update_bytes  # no JAX

GiB = 2**30
# Host memory of a streamed run beyond its pinned pool (measured on an H100 machine, 1b and 7b,
# benchmarks/host_heap.py: 1.7 and 2.2 GiB with the peak's transients): the JAX, CUDA and
# XLA runtimes, their libraries' mapped files, the trainer's own arrays. A fixed amount.
RUNTIME = 2.5 * GiB
# XLA's pinned host allocator (a BFC allocator) keeps one 8-byte chunk handle for every 256
# bytes of its regions, in the process's heap: 1/32 of the pool (3.2 GiB beside 7b's 103 GiB,
# measured 3.7 GiB of glibc's large mappings).
POOL_BOOKKEEPING = 1 / 32
PINNED = ("master_weights", "optimizer_state", "gradients", "saved_inputs")


def estimate(cfg: Config, gpu: int | None = None) -> dict:
    """Bytes per component on the host and the device. `gpu` (bytes) is the GPU room that
    the automatic choices fit (where saved inputs wait, the kept attention and weights, the
    embedding's and head's home; None: nvidia-smi's)."""
    m = cfg.model
    params = m.num_params
    state = 4 + optimizer_bytes(cfg)  # weights and optimizer state, bytes per parameter
    n = planned_devices(cfg) if cfg.loop.trainer == "stream" else 1
    gpu = usable_gpu_bytes(gpu_memory_bytes()) if gpu is None else gpu
    device, saved_on_host = memory.step_bytes(cfg, n, gpu)
    run = memory.with_resident_embeddings(cfg, device["resident_embeddings"] > 0)
    held = host_params(run)  # parameters whose state is on the host
    resident = params - held
    host = {
        "master_weights": 4 * held,
        "optimizer_state": int(optimizer_bytes(cfg) * held),
        "gradients": int(gradient_bytes(run, n) * held),
        "saved_inputs": saved_on_host,
    }
    # Beyond the pinned state: the pool's unfilled margin (the pool is resident once the
    # state fills most of it), its allocator's bookkeeping, and the runtimes. The pool is
    # sized before JAX starts, and the trainer settles stream.resident_embeddings=auto from
    # XLA's view of the GPU, not nvidia-smi's: it keeps room for them unless they are `on`.
    pinned = sum(host[name] for name in PINNED)
    auto_on = cfg.stream.resident_embeddings == "auto" and device["resident_embeddings"] > 0
    spare = memory.resident_embedding_bytes(cfg) if auto_on else 0
    pool = n * pool_limit_gib(cfg, pinned + spare) * GiB  # one allocator a GPU
    held = n * _share(cfg, pinned, n)
    if held > pinned:
        host["replicas"] = held - pinned
    host["pool_margin"] = max(0, pool - held)
    host["pool_bookkeeping"] = int(pool * POOL_BOOKKEEPING)
    host["runtime"] = int(RUNTIME)
    if cfg.loop.trainer == "reference":
        saved = m.layers * memory.saved_per_layer(cfg)
        device = {"whole_model_state": 16 * params,
                  "workspace": memory.activations(cfg)["working_set_total"],
                  "saved": saved}
        host = {}
    if cfg.loop.checkpoint_every:
        # A save copies the state held in GPU memory to the host (host state is written from
        # its own buffers) and reads back through one chunk buffer per thread.
        on_device = params if cfg.loop.trainer == "reference" else resident
        host["checkpoint_copies"] = int(state * on_device) + checkpoint.THREADS * array_files.CHUNK
    return {"host": host, "device": device, "host_total": sum(host.values()),
            "device_total": sum(device.values()), "devices": n, "pool_state": pinned + spare}


def host_traffic(cfg: Config, gpu: int | None = None) -> dict[str, float]:
    """Host memory bytes a step per host-held parameter, host update on GPUs of `gpu` bytes:
    the weights read for the forward and for the backward of the layers that keep none
    (stream.keep_weights, keep_layers; once however many GPUs, each reading its shard), the
    gradients written, the update's reads and writes (over a mesh the gradients are fp32)."""
    kept = memory.unfetched_layers(cfg, gpu, planned_devices(cfg))
    run = memory.resolved(cfg, gpu, planned_devices(cfg))
    weights = 8.0 - 4 * kept * cfg.model.params_per_layer / host_params(run)
    return {"weights": weights, "gradients": gradient_bytes(run), "update": update_bytes(run)}


def traffic_lines(cfg: Config, gpu: int | None = None) -> list[str]:
    """`plan`'s line on `host_traffic`, for runs that update on the host."""
    if cfg.loop.trainer != "stream" or not host_update(cfg):
        return []
    moved = host_traffic(cfg, gpu)
    held = host_params(memory.resolved(cfg, gpu, planned_devices(cfg)))
    parts, total = ", ".join(f"{name} {n:.1f}" for name, n in moved.items()), sum(moved.values())
    lines = [f"host memory traffic a step: {total:.1f} bytes a host-held parameter ({parts}), "
             f"{total * held / 1e9:.0f} GB"]
    if (n := planned_devices(cfg)) > 1:  # the host's share of a step does not divide by n
        rows = cfg.data.batch_size // cfg.data.micro_batches // n
        lines.append(f"  one state, the same bytes for any number of GPUs; each of the {n} "
                     f"computes {rows} x {cfg.data.seq_len:,} tokens a micro-batch (give each "
                     f"as many as one GPU alone takes, or the host's update paces the step)")
    return lines


def host_bytes_per_param(cfg: Config, gpu: int | None = None) -> dict[str, float]:
    """{optim.state_dtype: host bytes per parameter} of cfg's run (on a GPU of `gpu` bytes)
    in each form of the optimizer state it may take (float32 only without compact moments)."""
    modes = STATE_DTYPES if cfg.optim.name in HOST_OPTIMIZERS else ("float32",)
    return {mode: estimate(replaced(cfg, "optim", state_dtype=mode), gpu)["host_total"]
            / cfg.model.num_params for mode in modes}


# Pinned bytes beyond the state: transfers' staging and the allocator's rounding.
POOL_MARGIN = 2 * GiB


def pinned_pool_bytes(cfg: Config, measuring: bool = False) -> int:
    """The pinned host pool over all the run's GPUs: the host state, a margin, and with
    `measuring` room for the rate measurement's copies (plan --measure, bench_step).

    XLA gives each GPU its own pinned host allocator, capped at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
    (`pool_limit_gib`); each grows its regions by doubling up to the cap, and pinned memory
    is resident once allocated: the process holds about every cap once the state fills most
    of them. A tight cap is host memory kept for everything else."""
    return planned_devices(cfg) * _pool_bytes(cfg, pinned_bytes(cfg), measuring)


def pinned_bytes(cfg: Config) -> int:
    """Bytes of the host state the pool holds (PINNED: weights, optimizer state, gradients,
    saved inputs on the host), with room for the embeddings unless they are set on the GPU
    (`estimate` says why)."""
    return estimate(cfg)["pool_state"]


def _pool_bytes(cfg: Config, pinned: int, measuring: bool = False) -> int:
    """One GPU's allocator: its share of the state, the margin, and the measurement's room."""
    if cfg.stream.host_memory_gb:
        return int(cfg.stream.host_memory_gb * GiB)
    share = _share(cfg, pinned, planned_devices(cfg))
    return share + POOL_MARGIN + (measurement_bytes(cfg) if measuring else 0)


def _share(cfg: Config, pinned: int, n: int) -> int:
    """The bytes of `pinned` bytes of host state that each of n GPUs holds: 1/n where the
    state's leaves split over them (stream/mesh.py splits a leaf along a dimension n divides,
    and every weight matrix has the model's width as one; leaves too small to split fit in
    the margin), else the whole (a replica each)."""
    return pinned // n if cfg.model.hidden % n == 0 else pinned


def pool_limit_gib(cfg: Config, pinned: int, measuring: bool = False) -> int:
    """Each GPU's pool cap in whole GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) for `pinned`
    bytes of host state over the run's GPUs: its share and margin, rounded up."""
    return _pool_bytes(cfg, pinned, measuring) // GiB + 1


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
    """Refuses, with the numbers and the changes that would fit, a config whose state or
    step will not fit this machine (or one of `host` and `gpu` bytes)."""
    host = host_memory_available() if host is None else host
    gpu = usable_gpu_bytes(gpu_memory_bytes()) if gpu is None else gpu
    est = estimate(cfg, gpu)
    if host is not None and est["host_total"] > host:
        saved = est["host"]["saved_inputs"]
        inputs = f"; {saved / GiB:.1f} GiB of it saved layer inputs" if saved else ""
        message = (
            f"The model needs {est['host_total'] / GiB:.1f} GiB of host memory for its state "
            f"({cfg.model.num_params / 1e9:.2f}B params: fp32 weights, optimizer state and "
            f"gradients{inputs}) but only "
            f"{host / GiB:.1f} GiB is available. Use a smaller model or a machine with more "
            "RAM (`megatrain-jax plan` shows the largest shape that fits).")
    elif gpu is not None and est["device_total"] > gpu:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in est["device"].items() if v)
        message = (
            f"A step needs about {est['device_total'] / GiB:.1f} GiB of GPU memory ({parts} "
            f"GiB) but XLA may use {gpu / GiB:.1f} GiB of the GPU's memory."
            f"{_split_note(cfg, host, gpu)}")
    else:
        return
    changes = fitting_changes(cfg, host, gpu)
    if changes:
        message += " Changes that fit: " + "; ".join(changes) + "."
    elif est["device_total"] > (gpu or est["device_total"]):
        message += (" No single change fits; what lowers the GPU's share: data.micro_batches, "
                    "saved inputs on pinned host (stream.saved_inputs), a lower "
                    "stream.prefetch_depth, fewer stream.resident_layers or "
                    "stream.keep_layers, fewer tokens per step.")
    raise ConfigError(message)


def _fits(cfg: Config, host: int | None, gpu: int | None) -> bool:
    est = estimate(cfg, gpu)
    return (host is None or est["host_total"] <= host) and \
        (gpu is None or est["device_total"] <= gpu)


def fitting_changes(cfg: Config, host: int | None, gpu: int | None) -> list[str]:
    """Changes of the optimizer state's form, of where activations live, how they are tiled,
    or of the batch's shape, under which cfg fits `host` and `gpu` bytes; each as the
    overrides to give."""
    d, s = cfg.data, cfg.stream
    tokens = d.batch_size // d.micro_batches * d.seq_len
    candidates = _state_modes(cfg, host, gpu)
    for other in CHOICES["stream.saved_inputs"]:
        if other != s.saved_inputs:
            candidates[f"stream.saved_inputs={other}"] = replaced(cfg, "stream", saved_inputs=other)
    if not memory.activations(cfg)["mlp_tile"] and tokens > auto.MLP_TILE:
        candidates[f"stream.mlp_tile={auto.MLP_TILE}"] = replaced(cfg, "stream",
                                                              mlp_tile=auto.MLP_TILE)
    if memory.activations(cfg)["attention"] == "xla":
        candidates["model.attention=blockwise"] = replaced(cfg, "model", attention="blockwise")
    for other in ("auto", "off") if s.keep_attention == "on" else ():
        candidates[f"stream.keep_attention={other}"] = replaced(cfg, "stream", keep_attention=other)
    keep = next((k for k in range(s.keep_layers - 1, -1, -1)  # the most saving layers
                 if _fits(replaced(cfg, "stream", keep_layers=k), host, gpu)), None)
    candidates.update({f"stream.keep_layers={keep}": None} if keep is not None else {})
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
    bf16 = replaced(cfg, "stream", grad_dtype="bfloat16")
    halves = gradient_bytes(bf16, n) < gradient_bytes(cfg, n)  # only where they are sent so
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


def _split_note(cfg: Config, host: int | None, gpu: int) -> str:
    """Where stream.saved_inputs=auto would put the inputs, and whether the host holds its
    share."""
    if cfg.stream.saved_inputs != "device":
        return ""
    split_cfg = replaced(cfg, "stream", saved_inputs="auto")
    on_host = memory.saved_on_host(split_cfg, gpu, planned_devices(cfg))
    if not on_host or on_host == cfg.model.layers:
        return ""
    split = estimate(split_cfg, gpu)
    verdict = "" if host is None else f" of the host's {host / GiB:.1f}"
    return (f" With stream.saved_inputs=auto, {cfg.model.layers - on_host} layers' inputs "
            f"stay on the GPU and {on_host} ({split['host']['saved_inputs'] / GiB:.1f} GiB) "
            f"go to pinned host: host memory {split['host_total'] / GiB:.1f} GiB{verdict}.")


def largest_fitting(cfg: Config, host: int | None, gpu: int | None):
    """(name, config) of the largest shipped shape whose state fits `host` bytes (and whose
    step fits `gpu` bytes, when known), trained with cfg's other settings; None if none."""
    best = None
    for name, path in shipped_configs().items():
        shape = load_config(str(path)).model
        candidate = dataclasses.replace(cfg, model=shape)  # inputs split by the same GPU
        if _fits(candidate, host, gpu) and (best is None or
                                            shape.num_params > best[1].model.num_params):
            best = (name, candidate)
    return best


def set_pool_env(cfg: Config, measuring: bool = False) -> None:
    """Sizes XLA's pinned host pool and its share of the GPU before JAX starts; a value
    already in the environment wins."""
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                          str(pool_limit_gib(cfg, pinned_bytes(cfg), measuring)))
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(GPU_FRACTION))


def checkpoint_bytes(cfg: Config) -> int:
    """Bytes of one checkpoint: the fp32 weights and the optimizer state (as stored) of
    every parameter."""
    return int((4 + optimizer_bytes(cfg)) * cfg.model.num_params)


def checkpoint_disk(cfg: Config) -> dict:
    """What the run's checkpoints need on the disk of RUN_DIR/checkpoints: `each` checkpoint,
    `needed` free (keep_checkpoints + 1 at once, less those already there) and `free`."""
    folder, each = f"{cfg.loop.run_dir}/checkpoints", checkpoint_bytes(cfg)
    return {"folder": folder, "each": each, "free": checkpoint.free_bytes(folder),
            "needed": checkpoint.room_needed(folder, cfg.loop.keep_checkpoints, each)}
