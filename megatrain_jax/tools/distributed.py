"""Several processes, one run: JAX's own multi-process runtime (`jax.distributed`).

Each process drives the GPUs of its node; together their devices form one mesh (stream/mesh.py)
and the processes run the same program on it. Start one process per node with the same
coordinator (the first node's address and a free port) and the process count, and each its id:

    megatrain-jax train 7b --coordinator node0:1234 --processes 2 --process-id 0   # on node0
    megatrain-jax train 7b --coordinator node0:1234 --processes 2 --process-id 1   # on node1

Without flags, JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID are read from the
environment; under SLURM or Open MPI, `--processes 0` (or JAX_NUM_PROCESSES=0) leaves all
three to JAX's detection of the cluster. The run's folder must be on a disk every node sees:
each process writes its shards of a checkpoint there (io/checkpoint.py).
"""

from __future__ import annotations

import os

import jax


def settings(coordinator: str | None = None, processes: int | None = None,
             process_id: int | None = None) -> tuple[str | None, int | None, int | None] | None:
    """(coordinator, processes, process id) from the flags, else the environment; None for a
    run of one process. A None inside is left to JAX's cluster detection."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None and processes is None:
        return None
    if processes == 0:  # a cluster's launcher knows all three
        return coordinator, None, None
    if processes is not None and processes < 1:
        raise ValueError(f"--processes must be >= 1 (0: detect the cluster), got {processes}")
    if coordinator is None or processes is None or process_id is None:
        raise ValueError("a run of several processes needs the coordinator (host:port), the "
                         "process count and this process's id: --coordinator, --processes and "
                         "--process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                         "JAX_PROCESS_ID)")
    if not 0 <= process_id < processes:
        raise ValueError(f"--process-id must be within [0, {processes}), got {process_id}")
    return coordinator, processes, process_id


def initialize(coordinator: str | None = None, processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Joins the run of several processes that the arguments (or the environment) name, before
    anything else uses JAX; False when there is none to join."""
    found = settings(coordinator, processes, process_id)
    if found is None:
        return False
    try:  # CPU devices talk through gloo; GPUs through NCCL, whatever this says
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass
    jax.distributed.initialize(*found)
    return True


def is_main() -> bool:
    """Whether this process writes the run's files (logs, metrics, the config): the first."""
    return jax.process_index() == 0


def check_config(cfg) -> None:
    """Refuses what a run of several processes does not do (before anything starts)."""
    from megatrain_jax.config import ConfigError

    if cfg.loop.export_dir and not cfg.loop.checkpoint_every:
        raise ConfigError(
            f"loop.export_dir={cfg.loop.export_dir} in a run of several processes is written "
            "from the final checkpoint (no process holds the whole model): set "
            "loop.checkpoint_every too, or export later with `megatrain-jax export RUN_DIR OUT`")


def process_config(cfg):
    """The config this process of a several-process run follows (after `initialize`): the
    first writes the run's folder as one process would; the others log into RUN_DIR/process-I
    and write nothing else."""
    from dataclasses import replace

    if is_main():
        return cfg
    loop = cfg.loop
    return replace(cfg, loop=replace(loop, run_dir=f"{loop.run_dir}/process-{jax.process_index()}",
                                     progress="none", tensorboard="off", timeline_step=-1))
