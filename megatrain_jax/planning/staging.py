"""The save's staging area, without JAX: a save captures the state into host memory, then
writes it to the disk in the background. How much host memory it takes is a placement
decision, made by the planner within the host budget (`stream.save_staging`):

    parts = part_bytes(cfg)              # checkpoint bytes of the embedding, each layer, head
    decide(cfg, room=40 * GiB)           # "whole" where the room holds them all, else "K" (0..)
    staging_pinned_bytes(cfg, devices)   # its share in the pinned pool, on each GPU
    cost = save_cost(cfg, machine)       # the stall a save costs the run, the write's time

A part's checkpoint bytes are its parameters and its optimizer state as stored (fp32
weights, the moments in optim.state_dtype, Muon's one momentum). The staging area counts
in the host total; the share of it that captures the GPU's state lies in XLA's pinned pool,
whose cap `train` raises by it (`staging_pinned_bytes`).
"""

from __future__ import annotations

from megatrain_jax.config import Config
from megatrain_jax.config.schema import pinned
from megatrain_jax.io import checkpoint
from megatrain_jax.planning.memory import PlacementPlan, plan_of
from megatrain_jax.planning.optimizer_state import optimizer_bytes

GiB = 2**30


def saves(cfg: Config) -> bool:
    """Whether the run may save: its last step (loop.final_checkpoint), on a signal
    (loop.stop_save) or every loop.checkpoint_every steps."""
    loop = cfg.loop
    return loop.final_checkpoint or loop.stop_save or loop.checkpoint_every > 0


def part_bytes(cfg: Config) -> list[int]:
    """Checkpoint bytes of each part in the order the state holds them: the embedding, the
    layers, the head (its weight, unless tied, and the final norm)."""
    m = cfg.model
    embed = m.vocab_size * m.hidden
    edge, layer = 4 + optimizer_bytes(cfg, "edges"), 4 + optimizer_bytes(cfg)
    return ([int(edge * embed)] + [int(layer * m.params_per_layer)] * m.layers
            + [int(edge * (m.embedding_params - embed))])


def checkpoint_bytes(cfg: Config) -> int:
    """Bytes of one checkpoint: every part's (`part_bytes`)."""
    return sum(part_bytes(cfg))


def staged_bytes(cfg: Config, setting: str | None = None) -> int:
    """Host bytes of the staging area at `setting` (cfg's stream.save_staging by default):
    `whole`, or the K largest parts (none at 0: each part is written from the live state);
    none where the run never saves. `auto` counts the least the planner may choose: none."""
    setting = cfg.stream.save_staging if setting is None else setting
    if not saves(cfg):
        return 0
    parts = sorted(part_bytes(cfg), reverse=True)
    if setting == "whole":
        return sum(parts)
    return sum(parts[:pinned(setting) or 0])


def decide(cfg: Config, room: int | None) -> str:
    """stream.save_staging for `room` bytes of host memory left by everything else the plan
    puts there (None: unknown, unbounded): `whole` where they hold a copy of every part,
    else the digits of as many of the largest parts as fit: 0 where not even one does (each
    part's update then waits for its write, io/staging.py). A setting other than `auto` is
    kept."""
    setting = cfg.stream.save_staging
    if setting != "auto":
        return setting
    parts = sorted(part_bytes(cfg), reverse=True)
    if not saves(cfg) or room is None or sum(parts) <= room:
        return "whole"
    held, k = 0, 0
    while k < len(parts) and held + parts[k] <= room:
        held, k = held + parts[k], k + 1
    return str(k)


def refusal_note(cfg: Config, short: int) -> str:
    """Where the save's staging area is what is missing (`short` bytes): says so."""
    staged = staged_bytes(cfg)
    if not staged or short > staged:
        return ""
    return (f", and it is the save's staging area ({staged / GiB:.1f} GiB, "
            f"stream.save_staging={cfg.stream.save_staging}) that does not fit: the rest "
            "does (no saves, loop.final_checkpoint=false loop.stop_save=false "
            "loop.checkpoint_every=0, need none)")


def _resident_bytes(plan: PlacementPlan, parts: list[int]) -> int:
    """Checkpoint bytes of the parts `plan` keeps on the GPU (`parts`: part_bytes)."""
    layer = parts[1] if len(parts) > 2 else 0
    return plan.resident_embeddings * (parts[0] + parts[-1]) + plan.resident_layers * layer


def save_cost(cfg: Config, machine, plan: PlacementPlan | None = None) -> dict:
    """What one save of a resolved cfg costs on `machine` (a presets.Machine), in seconds:
    `stall`, the run's wait while the state is captured (the GPU-resident parts over the
    link, the host-resident ones at the host's copy rate; where the staging area holds K
    parts, the rest wait for the disk to free their room), and `write`, the background's
    write and read-back of every part."""
    plan = plan_of(cfg) if plan is None else plan
    parts = part_bytes(cfg)
    resident = _resident_bytes(plan, parts)
    total = sum(parts)
    disk_s = 1 / (machine.disk_write_gbps * 1e9) + 1 / (machine.disk_read_gbps * 1e9)
    capture = (cfg.stream.save_staging != "0") * (  # at 0, nothing: the write is the capture
        resident / (machine.d2h_gbps * 1e9) + (total - resident) / (machine.host_copy_gbps * 1e9))
    waiting = max(0, total - staged_bytes(cfg))  # parts beyond the staging area's room
    return {"staged": staged_bytes(cfg), "checkpoint": total, "stall": capture + waiting * disk_s,
            "write": total * disk_s}


def save_line(cfg: Config, machine, step_s: float) -> str:
    """`plan`'s line on the save of a resolved cfg whose step takes `step_s` seconds."""
    if not saves(cfg):
        return ("save: none (loop.final_checkpoint=false, loop.stop_save=false, "
                "loop.checkpoint_every=0): no staging area")
    cost, setting = save_cost(cfg, machine), cfg.stream.save_staging
    what = {"whole": "a copy of every part", "0": "none: each part is written from the live "
            "state, its update waiting for the write"}.get(setting, f"the {setting} largest parts")
    line = (f"save: staging {cost['staged'] / GiB:.2f} GiB of host memory "
            f"(stream.save_staging={setting}: {what}; the checkpoint "
            f"{cost['checkpoint'] / GiB:.2f} GiB); "
            f"a save stalls the run {cost['stall']:.1f} s, then writes and reads back in "
            f"{cost['write']:.0f} s in the background ({machine.name}: disk "
            f"{machine.disk_write_gbps:g} GB/s write, {machine.disk_read_gbps:g} read, host "
            f"copies {machine.host_copy_gbps:g} GB/s)")
    every = cfg.loop.checkpoint_every
    if every:
        between = every * step_s
        line += (f"; every {every} steps the saves cost {cost['stall'] / between:.1%} of the "
                 "run's time")
        if cost["write"] > between:
            line += (f", and a write ({cost['write']:.0f} s) outlasts the {between:.0f} s "
                     "between two saves: the next save waits for it")
    return line


def checkpoint_disk(cfg: Config) -> dict:
    """What the run's checkpoints need on the disk of RUN_DIR/checkpoints: `each` checkpoint,
    `needed` free (keep_checkpoints + 1 at once, less those already there) and `free`."""
    folder, each = f"{cfg.loop.run_dir}/checkpoints", checkpoint_bytes(cfg)
    return {"folder": folder, "each": each, "free": checkpoint.free_bytes(folder),
            "needed": checkpoint.room_needed(folder, cfg.loop.keep_checkpoints, each)}


def staging_pinned_bytes(cfg: Config, devices: int) -> int:
    """Pinned bytes a save's capture of the GPU's state takes on each GPU of a resolved cfg
    (io/staging.py copies the GPU's arrays into XLA's pinned pool, at the link's speed; a copy
    to pageable memory runs at about 1 GB/s): the resident parts', or the K largest parts' at
    most where the save stages K parts at a time."""
    if not saves(cfg):
        return 0
    parts = part_bytes(cfg)
    resident = _resident_bytes(plan_of(cfg), parts)
    setting = cfg.stream.save_staging
    if setting not in ("whole", "auto"):
        resident = min(resident, sum(sorted(parts, reverse=True)[:pinned(setting)]))
    return resident // devices
